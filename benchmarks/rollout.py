"""Rollout throughput: the project's vLLM backend vs vLLM used directly, and HF `generate`, same prompts.

    python benchmarks/rollout.py                  # Qwen2.5-1.5B shape (random weights), 128 x (1,200 + 256)
    VLLM_USE_V2_MODEL_RUNNER=0 python benchmarks/rollout.py --skip-hf   # vLLM's V1 model runner instead
    python benchmarks/rollout.py --skip-hf --prompts 16 --new-tokens 512 --repeats 3   # seed_rl.py's batch per engine
    python benchmarks/rollout.py --config tiny --prompts 4 --prompt-len 32 --new-tokens 8 --hf-prompts 4 --skip-vllm  # CPU
    # the 3B shape (the paper's main backbone): its published sizes on the 1.5B config, see QWEN25_3B below
    python benchmarks/rollout.py --config Qwen2.5-3B-Instruct --skip-hf --gpu-memory-utilization 0.5

  standalone        vllm.LLM.generate on the 128 prompts (token ids), SamplingParams(temperature 1, max 256
                    tokens, ignore_eos): the reference
  project           common.backends.VLLMBackend.generate on the same engine and prompts, as collect.py and
                    evaluate.py call it: per-request seeds, vLLM's detokenizer off and one batch_decode at
                    the end, Generation records
  project_logprobs  the same + the sampled tokens' log-probs, as seed_rl.py calls it (its engine check)
  project_unseeded  without per-request seeds: the cost of the wrapper alone
  hf                common.backends.HFBackend (transformers `generate`, bf16, SDPA) on the first --hf-prompts
  sync              the weight sync of seed_rl.py's every update (sync_engine without the sleep/wake): an
                    FSDP2-sharded fp32 policy of the same weights gathered parameter by parameter in bf16 into the
                    engine (vLLM's, else the HF one); seconds and GB/s of the weights sent (bf16; fp32 on
                    CPU). The fp32 policy sits
                    beside the engine: 4 bytes per parameter (the 3B shape: --gpu-memory-utilization 0.5)
vLLM variants run --repeats times, interleaved; the fastest of each is reported. All of them share one engine,
with the model runner the project's backend picks (V2, unless VLLM_USE_V2_MODEL_RUNNER says otherwise).
Random weights rarely emit EOS, so nearly every request runs the full 256 tokens; tokens/s counts the
tokens actually generated. Not a test: timings are reported, never asserted.
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.backends import HFBackend, VLLMBackend  # noqa: E402
from common.models import load_tokenizer, model_config  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--config", default="Qwen2.5-1.5B-Instruct")
p.add_argument("--prompts", type=int, default=128)
p.add_argument("--prompt-len", type=int, default=1200)
p.add_argument("--new-tokens", type=int, default=256)
p.add_argument("--hf-prompts", type=int, default=64)
p.add_argument("--model-dir", default="/tmp/seed-bench-model")
p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--skip-vllm", action="store_true")
p.add_argument("--skip-hf", action="store_true")
p.add_argument("--json", default=None)
p.add_argument("--sync-repeats", type=int, default=3, help="weight syncs timed (the best is reported); 0: none")
args = p.parse_args()

from transformers import AutoModelForCausalLM  # noqa: E402
on_gpu = torch.cuda.is_available()
device = torch.device("cuda" if on_gpu else "cpu")
dtype = torch.bfloat16 if on_gpu else torch.float32
tok = load_tokenizer("tiny")  # the real Qwen2.5 tokenizer

# ---- a random-weight model folder of the real shape (vLLM loads models from disk)
# Qwen2.5-3B-Instruct's config.json is not among ../shared/assets' configs (0.5B, 1.5B, 7B): its sizes (as in its
# config.json on the hub: 36 layers, 16 query / 2 KV heads, hidden 2048, MLP 11008) on the 1.5B config, whose other
# fields (vocabulary, rope theta 1e6, tied embeddings, RMSNorm eps) the 3B shares: 3.09 B parameters, the published
# count. A folder with the official config.json (--config /path/to/it) gives the same shape.
QWEN25_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, max_window_layers=36)
if args.config == "Qwen2.5-3B-Instruct" and not os.path.isdir(args.config):
    base = model_config("Qwen2.5-1.5B-Instruct")
    d = {k: v for k, v in base.to_dict().items() if k != "layer_types"}  # layer_types: one per layer, remade
    cfg = type(base)(**{**d, **QWEN25_3B})
else:
    cfg = model_config(args.config)
torch.manual_seed(0)
with device:  # random init straight on the GPU (a 1.5B init on the CPU takes tens of seconds)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
if not args.skip_vllm:
    shutil.rmtree(args.model_dir, ignore_errors=True)
    model.save_pretrained(args.model_dir)
    tok.save_pretrained(args.model_dir)

g = torch.Generator().manual_seed(0)
prompts = torch.randint(0, 151643, (args.prompts, args.prompt_len), generator=g).tolist()
seeds = list(range(args.prompts))


VARIANTS = ("standalone", "project", "project_logprobs", "project_unseeded")


def time_sync(engine):
    """seed_rl.py's weight push into `engine` (sync_engine less the sleep/wake), from an FSDP2 policy of the same
    weights with fp32 master weights as the trainer holds them: the best of --sync-repeats, into res["sync"]."""
    import copy
    import torch.distributed as dist
    from common.training import full_params, init_distributed, shard_model
    if not dist.is_initialized():
        init_distributed()  # a process group of one: the gathers are those of one rank of a run
    policy = shard_model(copy.deepcopy(model).float(), device)
    wire = torch.bfloat16 if on_gpu else torch.float32  # as seed_rl.py's run.sync_dtype
    n_bytes = sum(p.numel() for p in policy.parameters()) * wire.itemsize
    best = None
    for _ in range(args.sync_repeats):
        torch.cuda.synchronize() if on_gpu else None
        t0 = time.perf_counter()
        engine.load_weights(full_params(policy, wire))
        torch.cuda.synchronize() if on_gpu else None
        best = min(best or float("inf"), time.perf_counter() - t0)
    res["sync"] = {"engine": type(engine).__name__, "s": best, "params": len(list(policy.parameters())),
                   "gb": n_bytes / 1e9, "gb_per_s": n_bytes / 1e9 / best}
    print(f"sync ({type(engine).__name__}): {res['sync']['gb']:.2f} GB of {wire} weights, "
          f"{res['sync']['params']} tensors, in {best:.3f} s = {res['sync']['gb_per_s']:.1f} GB/s")
    del policy


def report(res):
    """Print what has been measured so far and rewrite the JSON: a run cut short still leaves its figures."""
    for k in VARIANTS + ("hf",):
        if k in res:
            print(f"{k:<17} {res[k]['generated_tokens']:>7} tokens in {res[k]['s']:7.2f}s = "
                  f"{res[k]['tokens_per_s']:9.0f} tok/s" + (f" = {res[k]['ratio']:.3f}x standalone" if "ratio" in res[k] else ""))
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


res = {"config": args.config, "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
       "device": torch.cuda.get_device_name() if on_gpu else "cpu", "repeats": args.repeats}

if not args.skip_vllm:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    eng = VLLMBackend(args.model_dir, tok, max_model_len=args.prompt_len + args.new_tokens + 64,
                      gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=False)
    v2 = getattr(getattr(eng.llm.llm_engine, "vllm_config", None), "use_v2_model_runner", None)
    res["model_runner"] = {True: "v2", False: "v1", None: "unknown"}[v2]
    print("vLLM model runner:", res["model_runner"])
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.new_tokens, ignore_eos=True)
    tp = [TokensPrompt(prompt_token_ids=x) for x in prompts]
    eng.llm.generate(tp[:8], sp, use_tqdm=False)  # warm-up

    def project(want_logprobs, seeded):
        return eng.generate(prompts, max_new_tokens=args.new_tokens, temperature=1.0,
                            seeds=seeds if seeded else None, want_logprobs=want_logprobs)

    runs = {"standalone": lambda: [o.outputs[0] for o in eng.llm.generate(tp, sp, use_tqdm=False)],
            "project": lambda: project(False, True),  # collect.py, evaluate.py: per-request seeds
            "project_logprobs": lambda: project(True, True),  # seed_rl.py: + sampled-token log-probs
            "project_unseeded": lambda: project(False, False)}  # the wrapper alone
    for r in range(args.repeats):  # interleaved repeats; the best of each is reported
        for name in VARIANTS:
            eng.llm.reset_prefix_cache()  # no cached prompt blocks carried from one measurement to the next
            t0 = time.perf_counter()
            outs = runs[name]()
            dt = time.perf_counter() - t0
            if name not in res or dt < res[name]["s"]:
                n = sum(len(o.token_ids) for o in outs)
                res[name] = {"s": dt, "generated_tokens": n, "tokens_per_s": n / dt}
        for name in VARIANTS[1:]:
            res[name]["ratio"] = res[name]["tokens_per_s"] / res["standalone"]["tokens_per_s"]
        report(res)
    if args.sync_repeats:
        time_sync(eng)
        report(res)
    del eng
    torch.cuda.empty_cache() if on_gpu else None

# ---- HF generate on the first hf-prompts prompts
if args.skip_hf:
    raise SystemExit(0)
hf = HFBackend(model.to(device), tok, batch_size=args.hf_prompts)
if args.sync_repeats and args.skip_vllm:  # the HF engine's sync (CPU, or no vLLM)
    time_sync(hf)
hf.generate(prompts[:2], max_new_tokens=4, temperature=1.0)  # warm-up
t0 = time.perf_counter()
outs = hf.generate(prompts[:args.hf_prompts], max_new_tokens=args.new_tokens, temperature=1.0)
dt = time.perf_counter() - t0
n = sum(len(o.token_ids) for o in outs)
res["hf"] = {"prompts": args.hf_prompts, "s": dt, "generated_tokens": n, "tokens_per_s": n / dt}
if "standalone" in res:
    res["hf"]["ratio"] = res["hf"]["tokens_per_s"] / res["standalone"]["tokens_per_s"]

print('-- all measured')
report(res)
