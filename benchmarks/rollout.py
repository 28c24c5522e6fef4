"""Rollout throughput: the project's vLLM backend vs vLLM used directly, and HF `generate`, same prompts.

    python benchmarks/rollout.py                  # Qwen2.5-1.5B shape (random weights), 128 x (1,200 + 256)
    python benchmarks/rollout.py --config tiny --prompts 4 --prompt-len 32 --new-tokens 8 --hf-prompts 4   # CPU

  standalone  vllm.LLM.generate on the 128 prompts (token ids), SamplingParams(temperature 1, max 256 tokens,
              ignore_eos): the reference
  project     envs.backends.VLLMBackend.generate on the same engine and prompts (per-request seeds,
              sampled-token log-probs, Generation records), so the ratio is the cost of the project's layer
  hf          envs.backends.HFBackend (transformers `generate`, bf16, SDPA) on the first --hf-prompts
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
from envs.backends import HFBackend, VLLMBackend, default_tokenizer_path, load_tokenizer, shared_dir, tiny_config  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--config", default="Qwen2.5-1.5B-Instruct")
p.add_argument("--prompts", type=int, default=128)
p.add_argument("--prompt-len", type=int, default=1200)
p.add_argument("--new-tokens", type=int, default=256)
p.add_argument("--hf-prompts", type=int, default=64)
p.add_argument("--model-dir", default="/tmp/seed-bench-model")
p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
p.add_argument("--skip-vllm", action="store_true")
p.add_argument("--json", default=None)
args = p.parse_args()

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
on_gpu = torch.cuda.is_available()
device = torch.device("cuda" if on_gpu else "cpu")
dtype = torch.bfloat16 if on_gpu else torch.float32
tok = load_tokenizer("tiny")  # the real Qwen2.5 tokenizer

# ---- a random-weight model folder of the real shape (vLLM loads models from disk)
cfg = tiny_config() if args.config == "tiny" else AutoConfig.from_pretrained(
    os.path.join(shared_dir(), "assets", "qwen2.5-configs", args.config))
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


def report(res):
    """Print what has been measured so far and rewrite the JSON: a run cut short still leaves its figures."""
    for k in ("standalone", "project", "hf"):
        if k in res:
            print(f"{k:<11} {res[k]['generated_tokens']:>7} tokens in {res[k]['s']:7.2f}s = {res[k]['tokens_per_s']:9.0f} tok/s")
    for k in ("ratio_project_over_standalone", "ratio_hf_over_standalone"):
        if k in res:
            print(f"{k}: {res[k]:.3f}")
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


res = {"config": args.config, "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
       "device": torch.cuda.get_device_name() if on_gpu else "cpu"}

if not args.skip_vllm:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    eng = VLLMBackend(args.model_dir, tok, max_model_len=args.prompt_len + args.new_tokens + 64,
                      gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=False)
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.new_tokens, ignore_eos=True)
    tp = [TokensPrompt(prompt_token_ids=x) for x in prompts]
    eng.llm.generate(tp[:8], sp, use_tqdm=False)  # warm-up
    for name, run in (("standalone", lambda: eng.llm.generate(tp, sp, use_tqdm=False)),
                      ("project", lambda: eng.generate(prompts, max_new_tokens=args.new_tokens, temperature=1.0, seeds=seeds))):
        eng.llm.reset_prefix_cache()  # no cached prompt blocks carried from one measurement to the next
        t0 = time.perf_counter()
        outs = run()
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs) if name == "standalone" else sum(len(o.token_ids) for o in outs)
        res[name] = {"s": dt, "generated_tokens": n, "tokens_per_s": n / dt}
    res["ratio_project_over_standalone"] = res["project"]["tokens_per_s"] / res["standalone"]["tokens_per_s"]
    report(res)
    del eng
    torch.cuda.empty_cache() if on_gpu else None

# ---- HF generate on the first hf-prompts prompts
hf = HFBackend(model.to(device), tok, batch_size=args.hf_prompts)
hf.generate(prompts[:2], max_new_tokens=4, temperature=1.0)  # warm-up
t0 = time.perf_counter()
outs = hf.generate(prompts[:args.hf_prompts], max_new_tokens=args.new_tokens, temperature=1.0)
dt = time.perf_counter() - t0
n = sum(len(o.token_ids) for o in outs)
res["hf"] = {"prompts": args.hf_prompts, "s": dt, "generated_tokens": n, "tokens_per_s": n / dt}
if "standalone" in res:
    res["ratio_hf_over_standalone"] = res["hf"]["tokens_per_s"] / res["standalone"]["tokens_per_s"]

print('-- all measured')
report(res)
