"""Generation backends behind one small interface (model and tokenizer loading: common/models.py).

    backend.submit(req_id, prompt_ids, max_new_tokens=..., temperature=..., seed=None, want_logprobs=None,
                   loop_stop=None, context=None)      queue one request; returns at once
    backend.poll() -> [(req_id, Generation)]   advance the engine and hand back the requests that finished
    backend.generate(prompts, max_new_tokens=..., temperature=..., contexts=None, seeds=None,
                     want_logprobs=None) -> [Generation]   one batch, in order (submit all, poll until done)

The rollout loop (common/rollout.py) submits each episode's request the moment its prompt is ready and polls;
vLLM batches whatever is in flight token by token, so a long response holds up no other episode. prompts are
lists of token ids (already chat-templated); a seed (one int per request) makes each sample depend only on
its own seed, not on which other requests share the engine or the batch, so a run is reproducible whatever
the arrival order, the number of ranks or the batch split (and a resumed run replays the same samples). A
Generation holds the response token ids (the stop token included when the model stopped by itself, so a
trainer learns to stop), the decoded text, the sampled tokens' log-probs where the backend gives them and
they were asked for (`want_logprobs`, per backend and per request: they cost speed in vLLM and memory in
HF), and why it stopped: 'stop', 'length', or 'repetition' (loop_stop=window: its last `window` tokens were one
block written over and over, see `LoopStop`). context is the live episode record (the scripted backends read it;
the engines ignore it).

  VLLMBackend  GPU; vLLM's in-process engine, request by request (`add_request` / `step`: continuous
               batching); sampled-token log-probs; sleep/wake and per-parameter weight loading so it can live
               on the trainer's GPUs (one engine per torchrun rank, `external_launcher`).
  HFBackend    Hugging Face `generate`; CPU and tests; each poll runs one batched `generate` over every
               request it holds; the same weight-loading interface.
  ExpertPolicy answers with the env's scripted expert (ALFWorld: each game's stored walkthrough) in the
               agent's own format, so the whole chain (prompt -> parse -> env -> records) runs with wins on CPU.
  ScriptedAnalyzer  a rule-based stand-in for the self-analysis (CPU demos and tests).

backend.mark() -> a point on the engine's own timeline (rollout.py `WallMark`, `CudaMark`): the rollout loop
takes one at the end of a poll and one at the start of the next, and the time between them that the engine had
nothing to run is how long the loop's own work held it up (rollout.py `Clock`, loop_idle).
"""
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from common.models import stop_token_ids
from common.rollout import CudaMark, WallMark



@dataclass
class Generation:
    token_ids: list
    text: str
    finish_reason: str  # 'stop' | 'length' | 'repetition'
    logprobs: list = field(default=None)  # per response token, or None


class LoopStop:
    """loop_stop=window: a response ends at its first token where its last `window` tokens are one block of at
    most window // 2 tokens written over and over (a loop: a greedy answer that loops never ends by itself).
    Fed token by token, O(window) each: run[p - 1] counts the latest tokens that equal the token p places before
    them, so the last `window` tokens have period p exactly when run[p - 1] >= window - p. vLLM's own repetition
    detection (one block size range, one fixed repeat count) cannot say "the last `window` tokens", which is what
    tells a loop from a faithful list that repeats one action many times (seed_rl.py --analysis-loop-stop)."""

    def __init__(self, window):
        if window < 2:
            raise ValueError(f"loop_stop={window}: a loop needs a window of at least 2 tokens (two blocks of 1)")
        self.window, self.n, self.end = window, 0, None
        self.periods = np.arange(1, window // 2 + 1)  # [P]
        self.run = np.zeros(len(self.periods), dtype=np.int64)  # [P]
        self.ids = np.zeros(max(window, 64), dtype=np.int64)  # the response so far, grown by doubling

    def push(self, tokens):
        """Feeds the response's next tokens; returns the length at which it first ended in a loop, or None."""
        for t in tokens:
            if self.end is not None:
                break
            n, m = self.n, min(self.n, len(self.periods))
            same = np.zeros(len(self.periods), dtype=bool)
            same[:m] = self.ids[n - m:n][::-1] == t  # same[p - 1]: the new token equals the one p places before
            self.run = np.where(same, self.run + 1, 0)
            if n == len(self.ids):
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.ids[n], self.n = t, n + 1
            if (self.run + self.periods >= self.window).any():
                self.end = self.n
        return self.end


def loop_end(ids, window):
    """The length at which a response under loop_stop=window ends (LoopStop), or None."""
    return LoopStop(window).push(ids)


def cut_at_loop(n, reason, end, max_new_tokens):
    """A response of n tokens that ended for `reason`, whose loop (if any) completed at token `end`: (length,
    reason) after the loop stop, in vLLM's order on each new token: a stop token, then the cap, then the loop."""
    if end is not None and (end < n or reason == "length" and end < max_new_tokens):
        return end, "repetition"
    return n, reason


class LoopCriterion:
    """HF `generate` stopping criterion for loop_stop: a row is done once its response (the tokens after the
    prompt's `width`) ends in a loop."""

    def __init__(self, width, window, rows):
        self.width, self.seen, self.loops = width, 0, [LoopStop(window) for _ in range(rows)]

    def __call__(self, input_ids, scores, **kwargs):
        new = input_ids[:, self.width + self.seen:].tolist()  # [B, tokens since the last call]
        self.seen += len(new[0])
        return torch.tensor([loop.push(r) is not None for loop, r in zip(self.loops, new)], device=input_ids.device)


# ----------------------------------------------------------------------------------------------------
# Backends

class BatchBackend:
    """submit/poll for a backend whose work is one batched call, `generate`: submit holds the request; poll
    runs `generate` once over every request held (one call per distinct setting: max tokens, temperature,
    log-probs, loop stop, seeded or not) and returns them all. Each sample depends only on its own seed, so which
    requests share a call changes nothing."""

    def submit(self, req_id, prompt_ids, *, max_new_tokens, temperature, seed=None, want_logprobs=None,
               loop_stop=None, context=None):
        if not hasattr(self, "_held"):
            self._held = []
        self._held.append((req_id, list(prompt_ids),
                           (max_new_tokens, temperature, want_logprobs, loop_stop, seed is None),
                           seed, context))

    def poll(self):
        held, self._held = getattr(self, "_held", []), []
        groups = {}
        for r in held:
            groups.setdefault(r[2], []).append(r)
        out = []
        for (max_new_tokens, temperature, want_logprobs, loop_stop, unseeded), reqs in groups.items():
            gens = self.generate([r[1] for r in reqs], max_new_tokens=max_new_tokens, temperature=temperature,
                                 contexts=[r[4] for r in reqs], seeds=None if unseeded else [r[3] for r in reqs],
                                 want_logprobs=want_logprobs, loop_stop=loop_stop)
            out += [(r[0], g) for r, g in zip(reqs, gens)]
        return out

    def in_flight(self):
        return len(getattr(self, "_held", []))

    def mark(self):
        return WallMark()  # `generate` has finished its work (GPU included) by the time it returns


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


class HFBackend(BatchBackend):
    """Hugging Face `generate`, batched with left padding. Holds its own unsharded copy of the weights
    (like a vLLM engine would), refreshed with `load_weights` after each update."""

    def __init__(self, model, tokenizer, batch_size=16, want_logprobs=False):
        self.model, self.tok, self.batch_size, self.want_logprobs = model.eval(), tokenizer, batch_size, want_logprobs
        self.stop_ids = stop_token_ids(tokenizer)
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts, *, max_new_tokens, temperature, contexts=None, seeds=None, want_logprobs=None,
                 loop_stop=None):
        """want_logprobs: this call's choice (None: the backend's). With log-probs, `generate` keeps every
        step's [B, V] logits, so long generations (the 4,096-token analysis) should not ask for them."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
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
            stops = StoppingCriteriaList([LoopCriterion(width, loop_stop, len(chunk))] if loop_stop else [])
            res = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=cfg, logits_processor=procs, stopping_criteria=stops)
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
                if loop_stop:
                    n, reason = cut_at_loop(n, reason, loop_end(toks[:n], loop_stop), max_new_tokens)
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
    driver worker's `model_runner.model.load_weights` are the same in both.

    Requests go straight into `LLM.llm_engine` (vLLM's synchronous `LLMEngine`, the loop `LLM.generate` runs
    itself): `add_request(id, prompt, params)` and `step()`, which runs one forward and returns the requests
    that finished. The engine core stays in this process, so sleep/wake and loading weights through the
    driver worker's model runner work as before. vLLM's AsyncLLM would run the core in another process,
    where the co-located trainer could not reach the weights."""

    def __init__(self, model_path, tokenizer, *, max_model_len, gpu_memory_utilization=0.35, seed=0,
                 enable_sleep_mode=True, dtype="bfloat16", tensor_parallel_size=1, want_logprobs=False,
                 kv_cache_gib=0.0):
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
        if kv_cache_gib > 0:
            # A fixed KV cache: vLLM then skips its memory profiling, which infers the KV size from how the
            # device's free memory changes and fails when another process on the GPU allocates or frees meanwhile.
            # So several small jobs can share one GPU and start their engines side by side (benchmarks/remote:
            # lanes); gpu_memory_utilization is then only vLLM's check that this much memory is free at start.
            kw["kv_cache_memory_bytes"] = int(kv_cache_gib * 2 ** 30)
        self.tok, self.want_logprobs = tokenizer, want_logprobs
        self.llm = LLM(model=model_path, tokenizer=getattr(tokenizer, "name_or_path", None) or model_path,
                       dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                       enable_sleep_mode=enable_sleep_mode, enable_prefix_caching=True, seed=seed,
                       tensor_parallel_size=tensor_parallel_size, **kw)  # >1: evaluate.py --tp, no torchrun
        self.sleeping, self.pending = False, set()
        self.growing = {}  # loop_stop requests: the response so far (DELTA outputs), its LoopStop, its cap
        self.sleep_check_failures = 0  # vLLM's free-memory check of a sleep, failed by another process (sleep)

    def submit(self, req_id, prompt_ids, *, max_new_tokens, temperature, seed=None, want_logprobs=None,
               loop_stop=None, context=None):
        """One request into the engine (`LLMEngine.add_request`); it is scheduled at the next `poll`."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        want_logprobs = self.want_logprobs if want_logprobs is None else want_logprobs
        # Explicit sampling: no model-default top_p/top_k/repetition penalty; logprobs=0 returns the sampled
        # token's log-prob under the raw (unprocessed) distribution, comparable with the trainer's. Only
        # seed_rl.py asks for them (its engine-vs-trainer check).
        # detokenize=False: vLLM would decode every new token, and every log-prob token, in Python as it goes;
        # one batch_decode of the finished responses gives their text. Log-probs cost 25% of the throughput
        # with vLLM's detokenizer and 4% without it (README, Performance).
        # FINAL_ONLY: `step` returns a request once, when it has finished (as `LLM.generate` asks for), not a
        # cumulative output for every running request at every step. With loop_stop, DELTA: each step's new
        # tokens, which `poll` checks for a loop itself (LoopStop) and aborts the request on one.
        sp = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, repetition_penalty=1.0,
                            max_tokens=max_new_tokens, logprobs=0 if want_logprobs else None, detokenize=False,
                            seed=None if seed is None else int(seed) % (2 ** 31),
                            output_kind=RequestOutputKind.DELTA if loop_stop else RequestOutputKind.FINAL_ONLY)
        self.llm.llm_engine.add_request(str(req_id), _token_prompt(prompt_ids), sp)
        self.pending.add(str(req_id))
        if loop_stop:
            self.growing[str(req_id)] = dict(loop=LoopStop(loop_stop), ids=[], lps=[], cap=max_new_tokens)

    def poll(self):
        """One engine step (a forward over every request in flight: prefill chunks and one decode token each);
        returns the requests that finished in it (often none)."""
        if not self.pending:
            return []
        engine = self.llm.llm_engine
        done = []  # (request id, token ids, log-probs or None, finish reason)
        for o in engine.step():
            if o.request_id not in self.pending:
                continue
            c = o.outputs[0]
            lps = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs is not None else None
            reason = "length" if c.finish_reason == "length" else "stop"
            g = self.growing.get(o.request_id)
            if g is None:  # FINAL_ONLY: the whole response, once
                if o.finished:
                    done.append((o.request_id, list(c.token_ids), lps, reason))
                continue
            # DELTA: this step's new tokens (one, without speculative decoding), checked for a loop
            g["ids"] += c.token_ids
            g["lps"] = None if lps is None else g["lps"] + lps
            end = g["loop"].push(c.token_ids)
            if o.finished:
                n, reason = cut_at_loop(len(g["ids"]), reason, end, g["cap"])
            elif end is not None:  # looped before its end: stop it here
                engine.abort_request([o.request_id])  # frees its KV cache now; the engine sends nothing more
                n, reason = end, "repetition"
            else:
                continue
            done.append((o.request_id, g["ids"][:n], None if g["lps"] is None else g["lps"][:n], reason))
            del self.growing[o.request_id]
        for rid, *_ in done:
            self.pending.discard(rid)
        if self.pending and not engine.has_unfinished_requests():  # never spin on lost requests
            raise RuntimeError(f"vLLM dropped {len(self.pending)} requests (aborted or rejected)")
        texts = self.tok.batch_decode([ids for _, ids, _, _ in done], skip_special_tokens=True) if done else []
        return [(rid, Generation(ids, text, reason, lps)) for (rid, ids, lps, reason), text in zip(done, texts)]

    def in_flight(self):
        return len(self.pending)

    def mark(self):
        return CudaMark() if torch.cuda.is_available() else WallMark()  # WallMark: the tests' CPU stand-in

    def generate(self, prompts, *, max_new_tokens, temperature, contexts=None, seeds=None, want_logprobs=None,
                 loop_stop=None):
        """One batch through the same engine path as the rollout loop (annotate.py, the benchmarks)."""
        if self.pending:
            raise RuntimeError("generate() while requests of the rollout loop are in flight")
        for k, p in enumerate(prompts):
            self.submit(f"generate-{k}", p, max_new_tokens=max_new_tokens, temperature=temperature,
                        seed=None if seeds is None else seeds[k], want_logprobs=want_logprobs,
                        loop_stop=loop_stop)
        got = {}
        while self.pending:
            got.update(self.poll())
        return [got[f"generate-{k}"] for k in range(len(prompts))]

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
        if self.sleeping:
            return
        try:
            self.llm.sleep(level=1)  # weights to CPU, KV cache freed
        except AssertionError as e:
            # vLLM checks its sleep by the device's free memory before and after (gpu_worker.py: "Memory usage
            # increased after sleeping"), so another process on the same GPU allocating meanwhile (two runs side
            # by side, benchmarks/remote/; seen on the H200) fails the check after the sleep itself is done.
            # Mark the executor asleep as vLLM would have: its wake_up does nothing unless is_sleeping is set.
            if "Memory usage increased after sleeping" not in str(e):
                raise
            executor = self.llm.llm_engine.model_executor
            executor.sleeping_tags, executor.is_sleeping = {"weights", "kv_cache"}, True
            self.sleep_check_failures += 1
            print(f"vLLM's sleep check failed (another process allocated GPU memory meanwhile); the engine is "
                  f"asleep, continuing ({self.sleep_check_failures} so far)", file=sys.stderr, flush=True)
        self.sleeping = True

    def wake_up(self, tags=None):
        if self.sleeping:
            self.llm.wake_up(tags=tags)
            self.sleeping = tags is not None and "kv_cache" not in tags


def _token_prompt(ids):
    """A prompt of token ids for `LLMEngine.add_request`: vLLM 0.24's rendered-input form when it has one
    (taken as is), else the `TokensPrompt` that older releases preprocess."""
    try:
        from vllm.inputs import tokens_input
        return tokens_input(list(ids))
    except ImportError:
        from vllm.inputs import TokensPrompt
        return TokensPrompt(prompt_token_ids=list(ids))


class ExpertPolicy(BatchBackend):
    """Scripted expert: each step's response is the episode's env's `expert_response(episode)` (ALFWorld: the
    next command of the game's stored walkthrough), in the agent's own format, so the whole chain (prompt ->
    parse -> env -> records) runs with wins on CPU. contexts[i] is the live episode record."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, *, max_new_tokens=None, temperature=None, contexts=None, seeds=None,
                 want_logprobs=None, loop_stop=None):  # scripted: never any log-probs or loops
        from envs import load_env
        if contexts is None:
            raise ValueError("ExpertPolicy needs the episodes as contexts")
        out = []
        for ep in contexts:
            text = load_env(ep.get("env", "alfworld")).expert_response(ep)
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]
            out.append(Generation(ids, text, "stop", None))
        return out


def make_policy(model, tokenizer, *, backend="hf", max_model_len, gpu_memory_utilization=0.85, kv_cache_gib=0.0, seed=0,
                **vllm_kw):
    """The generation policy of collect.py, evaluate.py and annotate.py: `expert` (scripted, ExpertPolicy), a
    vLLM engine (no sleep mode: nothing else shares the GPU), or HF generate (bf16 on GPU, fp32 on CPU)."""
    if model == "expert":
        return ExpertPolicy(tokenizer)
    if backend == "vllm":
        return VLLMBackend(model, tokenizer, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                           kv_cache_gib=kv_cache_gib, seed=seed, enable_sleep_mode=False, **vllm_kw)
    from common.models import load_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return HFBackend(load_model(model, dtype=dtype, device=device, seed=seed), tokenizer)


# The scripted analyzer's rule for each invalid_reason (prompts/agent.py and envs/search.py parse_action,
# common/rollout.py's strict rule): what the agent must never do again.
NEVER_AGAIN = {
    "no_action_tags": "reply without one action inside <action> </action> tags",
    "no_think_tags": "act without reasoning inside <think> </think> tags first",
    "cjk": "write Chinese characters (use English only)",
    "not_admissible": "pick an action that is not in the admissible list",
    "no_block": "reply without exactly one <search> query </search> or <answer> answer </answer> block",
    "both_kinds": "put a search and an answer in the same turn",
    "several_blocks": "write more than one block in a turn",
    "empty_block": "leave a search or answer block empty",
}
NOTHING_HAPPENS = ("nothing happens.",)  # an env's answer to an action that did nothing (ALFWorld's)


def _norm(text):
    return " ".join(str(text).split())  # whitespace folded, so that equal observations compare equal


def _quote(text, limit=60):
    text = _norm(text)
    return "'" + (text if len(text) <= limit else text[:limit - 3].rstrip() + "...") + "'"


def scripted_analysis(ep):
    """(summary, skill) of an episode record, from what its analysis prompt shows: the task, each step's
    observation, action and validity (an invalid step's reason is visible in its response), the length and
    the outcome. So a policy trained on these answers (the warm start's skill examples) can learn to write them
    from the prompt. A step's effect is the next step's observation; the last step's effect is not shown.

    Success: the order of actions that worked. Failure: up to three rules addressed to the agent, each only
    where the episode shows it: its invalid steps' format mistakes; the actions it repeated or that changed
    nothing (the next observation equal to the one before, or "Nothing happens."); and how far its valid
    steps got when the steps ended (else that no valid step changed anything)."""
    steps, n = ep["steps"], ep["length"]
    if ep["success"]:
        acts = [s["action"] for s in steps if s["valid"]]
        return (f"The agent completed the task in {n} steps.",
                "Follow this order of actions: " + ", then ".join(acts) + ".")
    norm = _norm
    task = _quote(norm(ep.get("task") or "the task").rstrip("."), 80)
    after = [s["observation"] for s in steps[1:]] + [None]
    noop = [a is not None and (norm(a) == norm(s["observation"]) or norm(a).lower() in NOTHING_HAPPENS)
            for s, a in zip(steps, after)]
    invalid = [s for s in steps if not s["valid"]]
    reasons = Counter(s["invalid_reason"] or "invalid" for s in invalid)  # in order of first appearance
    counts = Counter(norm(s["action"]) for s in steps if norm(s["action"]))
    idle = {norm(s["action"]) for s, z in zip(steps, noop) if z and norm(s["action"])}
    rules = []
    if invalid:
        rules.append("Never " + ", and never ".join(NEVER_AGAIN.get(r, f"repeat the {r!r} mistake") for r in reasons)
                     + f": {len(invalid)} of {n} steps {'was' if len(invalid) == 1 else 'were'} invalid.")
    loops = sorted((a for a in counts if counts[a] > 1 or a in idle), key=lambda a: -counts[a])[:2]
    if loops:
        said = [_quote(a) + (f" ({counts[a]} times" + (", nothing changed)" if a in idle else ")")
                             if counts[a] > 1 else " (it changed nothing)") for a in loops]
        rules.append("Never repeat " + " or ".join(said) + (": when an action changes nothing, try one you have "
                     "not tried yet." if idle & set(loops) else ": going back over the same action wastes steps."))
    progress = [norm(s["action"]) for s, z in zip(steps, noop) if s["valid"] and norm(s["action"]) and not z
                and norm(s["action"]) not in idle and norm(s["action"]) not in loops]
    progress = [a for i, a in enumerate(progress) if a not in progress[i + 1:]]  # each at its last time
    n_steps = f"{n} step" + ("s" if n != 1 else "")
    if not steps:
        rules.append(f"Act at once on {task}: the episode ended before any step.")
    elif progress:
        rules.append(f"Never leave {task} unfinished: the {n_steps} ended after "
                     + ", then ".join(map(_quote, progress[-3:])) + "; get that far without detours, then go "
                     "straight on to finish the task.")
    else:
        rules.append(f"Make every step a valid action that changes something: none of the {n_steps} on {task} did.")
    last = norm(steps[-1]["action"]) if steps else ""
    summary = (f"The agent did not complete {task} in {n_steps}: {len(invalid)} invalid"
               + (" (" + ", ".join(f"{r} {c}" for r, c in reasons.items()) + ")" if reasons else "")
               + f", {sum(noop)} that changed nothing; its last action was "
               + (_quote(last) if last else "none (no action parsed)") + ".")
    return summary, " ".join(rules)


class ScriptedAnalyzer(BatchBackend):
    """A rule-based stand-in for the analyzer (CPU demos and tests, where a tiny random model cannot write
    JSON; and the behaviour-cloning warm start's skill examples, annotate.py --analyzer scripted): answers the
    analysis prompt with a JSON skill derived from the episode itself (`scripted_analysis`). Its answers go
    through the same parser as a model's. contexts[i] is the episode record."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, prompts, *, max_new_tokens=None, temperature=None, contexts=None, seeds=None,
                 want_logprobs=None, loop_stop=None):  # scripted: never any log-probs or loops
        out = []
        for ep in contexts:
            summary, skill = scripted_analysis(ep)
            text = json.dumps({"episode_summary": summary, "episode_skill": skill})
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(Generation(ids, text, "stop", None))
        return out
