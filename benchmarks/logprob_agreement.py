"""Is the engine-vs-trainer log-prob difference bf16 noise? The same sampled tokens scored four ways.

    python benchmarks/logprob_agreement.py --model $QWEN_CODER_DIR --trajectories runs/stage1/traj.jsonl  # GPU
    python benchmarks/logprob_agreement.py --model tiny --trajectories T.jsonl --samples 4 --new-tokens 8   # CPU

Real ALFWorld prompts (the step prompts of collect.py's trajectories) -> the generation backend samples a
continuation at temperature 1 and reports each sampled token's log-prob (vLLM on GPU; HF `generate` on CPU,
where this is only a smoke run). The same tokens are then scored by
  fsdp_bf16   seed_rl.py's trainer path: FSDP2 (world size 1), fp32 master weights, bf16 compute,
              chunked `token_logprobs` (these are the "old log-probs" of the PPO ratio)
  hf_bf16     a plain bf16 Hugging Face forward (the reference the device README measured vLLM against)
  fp32        the same weights in fp32: the closest thing to the exact value
and the mean / max absolute difference of every pair is reported, overall and by the fp32 entropy tercile of
the position. If engine-vs-fsdp_bf16 is about the size of engine-vs-fp32 and fsdp_bf16-vs-fp32, the
difference is two bf16 roundings, not a bug. Not a test: figures are reported, never asserted.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.backends import HFBackend  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from common.records import read_jsonl  # noqa: E402
from common.packing import make_batch, response_select  # noqa: E402
from common.training import init_distributed, shard_model  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--trajectories", required=True, help="collect.py output: its step prompts are the prompts")
p.add_argument("--samples", type=int, default=64)
p.add_argument("--new-tokens", type=int, default=128)
p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
p.add_argument("--json", default=None)
args = p.parse_args()

rank, world, device = init_distributed()  # before the engine, as in seed_rl.py (vLLM's external_launcher)
on_gpu = device.type == "cuda"
tok = load_tokenizer(args.model)

# ---- prompts: step prompts spread over the episodes (episode i, step k for k = 0, 1, ...)
eps = [e for e in read_jsonl(args.trajectories) if e.get("steps")]
prompts, k = [], 0
while len(prompts) < args.samples and any(k < len(e["steps"]) for e in eps):
    prompts += [e["steps"][k]["prompt_ids"] for e in eps if k < len(e["steps"])]
    k += 1
prompts = prompts[:args.samples]
seeds = list(range(len(prompts)))

# ---- sample with the generation backend, keeping its sampled-token log-probs
if on_gpu:
    from common.backends import VLLMBackend
    eng = VLLMBackend(args.model, tok, max_model_len=max(map(len, prompts)) + args.new_tokens + 16,
                      gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=False, want_logprobs=True)
    engine_name = "vllm"
else:
    eng = HFBackend(load_model(args.model), tok, batch_size=8, want_logprobs=True)
    engine_name = "hf_generate"
gens = eng.generate(prompts, max_new_tokens=args.new_tokens, temperature=1.0, seeds=seeds)
keep = [i for i, g in enumerate(gens) if g.token_ids and g.logprobs is not None]
seqs = [prompts[i] + gens[i].token_ids for i in keep]
spans = [(len(prompts[i]), len(gens[i].token_ids)) for i in keep]
scores = {"engine": torch.tensor([lp for i in keep for lp in gens[i].logprobs], dtype=torch.float64)}


def score(fn, micro=4):
    """Concatenated response-token log-probs of all seqs, micro-batch by micro-batch."""
    out = []
    with torch.no_grad():
        for s in range(0, len(seqs), micro):
            b = make_batch(seqs[s:s + micro], device)
            sel = response_select(b, spans[s:s + micro])
            out.append(fn(b, sel)[sel].double().cpu())
    return torch.cat(out)


# fsdp_bf16: exactly seed_rl.py's scoring path
policy = shard_model(load_model(args.model, device=device), device, train=False)
scores["fsdp_bf16"] = score(lambda b, sel: policy.token_logprobs(b["input_ids"], b["targets"], sel,
                                                                  attention_mask=b.get("attention_mask")))
del policy
# fp32 and plain bf16 HF: the same weights without FSDP; entropy from the fp32 logits
model = load_model(args.model, device=device)
ent = []


def fp32_scores(b, sel):
    logits = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask")).logits.float()
    logp = logits.log_softmax(-1)
    ent.append(-(logp.exp() * logp).sum(-1)[sel].double().cpu())
    return logp.gather(-1, b["targets"][..., None])[..., 0]


scores["fp32"] = score(fp32_scores, micro=1)
entropy = torch.cat(ent)
if on_gpu:
    model = model.to(torch.bfloat16)
    scores["hf_bf16"] = score(lambda b, sel: model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"))
                              .logits.float().log_softmax(-1).gather(-1, b["targets"][..., None])[..., 0], micro=1)

# ---- report
n = len(scores["fp32"])
assert all(len(v) == n for v in scores.values()), {k: len(v) for k, v in scores.items()}
lo, hi = entropy.quantile(torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)).tolist()
terciles = {"low": entropy <= lo, "mid": (entropy > lo) & (entropy <= hi), "high": entropy > hi}
res = {"model": args.model, "engine": engine_name, "sequences": len(seqs), "tokens": n,
       "mean_prompt_tokens": sum(p for p, _ in spans) / max(len(spans), 1),
       "entropy_terciles": [lo, hi], "pairs": {}}
names = list(scores)
print(f"{len(seqs)} sequences, {n} sampled tokens, mean prompt {res['mean_prompt_tokens']:.0f} tokens; engine = {engine_name}")
print(f"{'pair':<24} {'mean':>8} {'max':>8}   mean by fp32-entropy tercile (low / mid / high)")
for i, a in enumerate(names):
    for b in names[i + 1:]:
        d = (scores[a] - scores[b]).abs()
        by = {t: float(d[m].mean()) for t, m in terciles.items()}
        res["pairs"][f"{a}~{b}"] = {"mean": float(d.mean()), "max": float(d.max()), "by_entropy_tercile": by}
        print(f"{a + ' ~ ' + b:<24} {d.mean():8.4f} {d.max():8.4f}   {by['low']:.4f} / {by['mid']:.4f} / {by['high']:.4f}")
if args.json:
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2)
torch.distributed.destroy_process_group()
