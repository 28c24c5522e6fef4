"""Generation backends behind one small interface, plus model/tokenizer loading.

    backend.generate(prompts, max_new_tokens=..., temperature=..., contexts=None, seeds=None,
                     want_logprobs=None) -> [Generation]

prompts are lists of token ids (already chat-templated); seeds (one int per prompt) make each sample depend
only on its own seed, not on which other prompts share the batch, so a run is reproducible whatever the
number of ranks or the batch split (and a resumed run replays the same samples). A Generation holds the response token ids (the
stop token included when the model stopped by itself, so a trainer learns to stop), the decoded text, the
sampled tokens' log-probs where the backend gives them and they were asked for (`want_logprobs`, per
backend and per call: they cost speed in vLLM and memory in HF), and why it stopped ('stop' or 'length').

  VLLMBackend  GPU; batched; sampled-token log-probs; sleep/wake and per-parameter weight loading so it
               can live on the trainer's GPUs (one engine per torchrun rank, `external_launcher`).
  HFBackend    Hugging Face `generate`; CPU and tests; the same weight-loading interface.
  ExpertPolicy plays each ALFWorld game's stored walkthrough inside the same <think>/<action> format, so
               the whole chain (prompt -> parse -> env -> records) runs with wins on CPU.
"""
import json
import os
from dataclasses import dataclass, field

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUB_TOKENIZER = "Qwen/Qwen2.5-0.5B-Instruct"  # same tokenizer files as every Qwen2.5 instruct size


@dataclass
class Generation:
    token_ids: list
    text: str
    finish_reason: str  # 'stop' | 'length'
    logprobs: list = field(default=None)  # per response token, or None


# ----------------------------------------------------------------------------------------------------
# Models and tokenizers

def shared_dir():
    """../shared (or $SHARED): the offline Qwen2.5 tokenizer/configs and the ALFWorld archive."""
    return os.environ.get("SHARED", os.path.join(os.path.dirname(REPO), "shared"))


def default_tokenizer_path():
    """$SEED_TOKENIZER, else the real Qwen2.5 tokenizer in ../shared/assets, else the hub id."""
    for path in (os.environ.get("SEED_TOKENIZER"), os.path.join(shared_dir(), "assets", "qwen2.5-tokenizer")):
        if path and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            return path
    return HUB_TOKENIZER


def load_tokenizer(model):
    """`tiny` and `expert` use the real Qwen2.5 tokenizer; a model path/hub id uses its own."""
    from transformers import AutoTokenizer
    path = default_tokenizer_path() if model in ("tiny", "expert") else model
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def stop_token_ids(tokenizer):
    """Tokens that end a response: <|im_end|> (Qwen's eos) and <|endoftext|>."""
    ids = {tokenizer.eos_token_id}
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


def tiny_config():
    """A tiny random Qwen2 with the real Qwen2.5 vocabulary (CPU demos and tests)."""
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True, rope_theta=1e6, bos_token_id=151643, eos_token_id=151645)


def attn_implementation(device):
    """flash-attention 2 when installed (GPU), else PyTorch SDPA."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_model(model, *, dtype=torch.float32, device="cpu", seed=0, attn=None):
    """`tiny` -> a random tiny Qwen2 (seeded); otherwise from_pretrained(path or hub id). attn: the attention
    implementation (default: `attn_implementation`; the tiny model: sdpa); trainers pass the packed one
    (envs/training.py `packed_attention`)."""
    from transformers import AutoModelForCausalLM
    device = torch.device(device)
    if model == "tiny":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=attn or "sdpa", dtype=dtype)
        return m.to(device)
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype,
                                                attn_implementation=attn or attn_implementation(device)).to(device)


def clean_param_name(name):
    """Parameter names as the HF checkpoint has them: drop wrapper prefixes (activation checkpointing,
    torch.compile) so the same names work for vLLM's load_weights and for saving."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name


# ----------------------------------------------------------------------------------------------------
# Backends

class SeededSampler:
    """A logits processor for greedy decoding that turns it into exact per-row seeded sampling (Gumbel-max:
    argmax(logits / T + Gumbel noise) is a sample of softmax(logits / T)); row i's noise comes from its own
    generator, so its sample does not depend on the other rows of the batch."""

    def __init__(self, seeds, temperature):
        self.seeds, self.temperature, self.gens = [int(s) % (2 ** 63) for s in seeds], temperature, None

    def __call__(self, input_ids, scores):
        if self.gens is None:  # generators on the logits' device: no host round trip per token on GPU
            self.gens = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device, dtype=torch.float64)
                         for g in self.gens])
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))  # [B, V]
        return scores.float() / self.temperature + gumbel.float()


def sample_seed(*parts):
    """A stable 63-bit seed from (run seed, episode id, step, ...)."""
    import hashlib
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


class HFBackend:
    """Hugging Face `generate`, batched with left padding. Holds its own unsharded copy of the weights
    (like a vLLM engine would), refreshed with `load_weights` after each update."""

    def __init__(self, model, tokenizer, batch_size=16, want_logprobs=False):
        self.model, self.tok, self.batch_size, self.want_logprobs = model.eval(), tokenizer, batch_size, want_logprobs
        self.stop_ids = stop_token_ids(tokenizer)
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts, *, max_new_tokens, temperature, contexts=None, seeds=None, want_logprobs=None):
        """want_logprobs: this call's choice (None: the backend's). With log-probs, `generate` keeps every
        step's [B, V] logits, so long generations (the 4,096-token analysis) should not ask for them."""
        from transformers import GenerationConfig, LogitsProcessorList
        want_logprobs = self.want_logprobs if want_logprobs is None else want_logprobs
        seeded = temperature > 0 and seeds is not None
        # plain multinomial sampling only when unseeded; seeded sampling and greedy decode run as greedy
        sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) \
            if temperature > 0 and not seeded else dict(do_sample=False)
        cfg = GenerationConfig(**sampling, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                               pad_token_id=self.tok.pad_token_id, eos_token_id=self.stop_ids,
                               output_logits=want_logprobs, return_dict_in_generate=True)
        out = []
        for b in range(0, len(prompts), self.batch_size):
            chunk = prompts[b:b + self.batch_size]
            procs = LogitsProcessorList([SeededSampler(seeds[b:b + self.batch_size], temperature)] if seeded else [])
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # left padding: generation continues right after the prompt
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            res = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=cfg, logits_processor=procs)
            new = res.sequences[:, width:].tolist()  # [B, T_new]
            lps = None
            if want_logprobs:  # log-softmax of the raw logits (like vLLM's raw_logprobs)
                logits = torch.stack(res.logits, 1).float()  # [B, T_new, V]
                lps = logits.log_softmax(-1).gather(-1, res.sequences[:, width:, None].to(logits.device))[..., 0]
            for i, toks in enumerate(new):
                n, reason = len(toks), "length"
                for j, t in enumerate(toks):
                    if t in self.stop_ids:
                        n, reason = j + 1, "stop"
                        break
                toks = toks[:n]
                out.append(Generation(toks, self.tok.decode(toks, skip_special_tokens=True), reason,
                                      lps[i, :n].tolist() if lps is not None else None))
        return out

    @torch.no_grad()
    def load_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name in params:  # a tied lm_head arrives as embed_tokens only
                params[name].copy_(tensor.to(params[name].dtype))

    def sleep(self):
        pass

    def wake_up(self, tags=None):
        pass


class VLLMBackend:
    """A vLLM engine in this process. Under torchrun every rank holds its own engine and generates for
    its own prompts (`external_launcher` with tensor_parallel_size=1: vLLM treats the other ranks as
    independent data-parallel replicas). Written against vLLM 0.32 (pinned in requirements-gpu.txt), run
    on the device with 0.24: `LLM`, `SamplingParams`, `sleep/wake_up`, `reset_prefix_cache` and the
    driver worker's `model_runner.model.load_weights` are the same in both."""

    def __init__(self, model_path, tokenizer, *, max_model_len, gpu_memory_utilization=0.35, seed=0,
                 enable_sleep_mode=True, dtype="bfloat16", tensor_parallel_size=1, want_logprobs=False):
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        # Per-request seeds keep each sample independent of the batch it shares. vLLM's V1 model runner (0.24's
        # default for Qwen2) draws seeded noise one request at a time ("This can be slow because we handle each
        # request one by one", its sampler says); the V2 runner draws every request's noise in one kernel from
        # (its seed, its position). Measured on an H200 (README, Performance): at 128 requests with seeds and
        # log-probs, V2 ran at 1.05x unseeded standalone vLLM and V1 at 0.66x; at seed_rl.py's 16 per engine
        # the two were equal. VLLM_USE_V2_MODEL_RUNNER=0 overrides.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        from vllm import LLM
        import torch.distributed as dist
        kw = {}
        if dist.is_available() and dist.is_initialized():
            kw["distributed_executor_backend"] = "external_launcher"  # vLLM then runs in this process
        else:
            # Run the engine core in this process too: otherwise vLLM starts it with multiprocessing `spawn`
            # (CUDA is initialized by then), which re-runs a top-level script such as collect.py and fails
            # (seen on the H200 with vLLM 0.24).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.tok, self.want_logprobs = tokenizer, want_logprobs
        self.llm = LLM(model=model_path, tokenizer=getattr(tokenizer, "name_or_path", None) or model_path,
                       dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                       enable_sleep_mode=enable_sleep_mode, enable_prefix_caching=True, seed=seed,
                       tensor_parallel_size=tensor_parallel_size, **kw)  # >1: evaluate.py --tp, no torchrun
        self.sleeping = False

    def generate(self, prompts, *, max_new_tokens, temperature, contexts=None, seeds=None, want_logprobs=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        want_logprobs = self.want_logprobs if want_logprobs is None else want_logprobs
        # Explicit sampling: no model-default top_p/top_k/repetition penalty; logprobs=0 returns the sampled
        # token's log-prob under the raw (unprocessed) distribution, comparable with the trainer's. Only
        # seed_rl.py asks for them (its engine-vs-trainer check).
        # detokenize=False: vLLM would decode every new token, and every log-prob token, in Python as it goes;
        # one batch_decode of the finished responses gives their text. Log-probs cost 25% of the throughput
        # with vLLM's detokenizer and 4% without it (README, Performance).
        sps = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0, repetition_penalty=1.0,
                              max_tokens=max_new_tokens, logprobs=0 if want_logprobs else None, detokenize=False,
                              seed=None if seeds is None else int(seeds[i]) % (2 ** 31))
               for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps, use_tqdm=False)
        outs = [o.outputs[0] for o in outs]
        texts = self.tok.batch_decode([list(c.token_ids) for c in outs], skip_special_tokens=True)
        gens = []
        for c, text in zip(outs, texts):
            lps = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs is not None else None
            gens.append(Generation(list(c.token_ids), text, "length" if c.finish_reason == "length" else "stop", lps))
        return gens

    def _model(self):
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def load_weights(self, named_tensors):
        """Per-parameter push (HF names; vLLM fuses q/k/v and gate/up itself). The prefix cache holds KV
        of the old weights, so it is dropped."""
        model = self._model()
        for name, tensor in named_tensors:
            model.load_weights(weights=[(name, tensor)])
        self.llm.reset_prefix_cache()

    def sleep(self):
        if not self.sleeping:
            self.llm.sleep(level=1)  # weights to CPU, KV cache freed
            self.sleeping = True

    def wake_up(self, tags=None):
        if self.sleeping:
            self.llm.wake_up(tags=tags)
            self.sleeping = tags is not None and "kv_cache" not in tags


class ExpertPolicy:
    """Scripted expert: answers each step with the next command of the game's stored walkthrough, in the
    agent's <think>/<action> format. contexts[i] is the episode record (needs 'game_file' and 'steps')."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.plans = {}

    def plan(self, game_file):
        if game_file not in self.plans:
            with open(game_file) as f:
                self.plans[game_file] = list(json.load(f).get("walkthrough", []))
        return self.plans[game_file]

    def generate(self, prompts, *, max_new_tokens=None, temperature=None, contexts=None, seeds=None,
                 want_logprobs=None):  # scripted: never any log-probs
        if contexts is None:
            raise ValueError("ExpertPolicy needs the episodes as contexts")
        out = []
        for ep in contexts:
            plan, t = self.plan(ep["game_file"]), len(ep["steps"])
            action = plan[t] if t < len(plan) else "look"
            text = (f"<think>Following the expert plan: step {t + 1} of {len(plan)} is '{action}'.</think>\n"
                    f"<action>{action}</action>")
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]
            out.append(Generation(ids, text, "stop", None))
        return out


class ScriptedAnalyzer:
    """A rule-based stand-in for the analyzer (CPU demos and tests, where a tiny random model cannot write
    JSON): answers the analysis prompt with a JSON skill derived from the episode itself. Success -> the
    action sequence that worked; failure -> an avoidance rule naming the mistakes seen. Its answers go
    through the same parser as a model's. contexts[i] is the episode record."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, prompts, *, max_new_tokens=None, temperature=None, contexts=None, seeds=None,
                 want_logprobs=None):  # scripted: never any log-probs
        out = []
        for ep in contexts:
            acts = [s["action"] for s in ep["steps"] if s["valid"]]
            if ep["success"]:
                skill = "Follow this order of actions: " + ", then ".join(acts) + "."
                summary = f"The agent completed the task in {ep['length']} steps."
            else:
                bad = sorted({s["invalid_reason"] for s in ep["steps"] if not s["valid"]})
                skill = ("Always reason inside <think> </think> tags, then give exactly one admissible action "
                         "inside <action> </action> tags; never repeat an action that changed nothing.")
                summary = f"The agent failed after {ep['length']} steps; invalid steps: {', '.join(bad) or 'none'}."
            text = json.dumps({"episode_summary": summary, "episode_skill": skill})
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(Generation(ids, text, "stop", None))
        return out
