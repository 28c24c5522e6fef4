"""Trainer step throughput and memory: the project's path vs a plain bf16 Hugging Face step, same shape.

    python benchmarks/trainer_step.py                       # Qwen2.5-1.5B shape, 8 x 1,536 tokens (GPU)
    python benchmarks/trainer_step.py --config tiny --batch 2 --seq 128 --steps 2   # CPU smoke run

Random weights with the official config (../shared/assets/qwen2.5-configs, or $SHARED). Three measurements:
  reference  plain HF: bf16 parameters, model(input_ids, labels).loss, backward, AdamW (foreach)
  project    seed_rl.py's step: FSDP2 fully_shard (world size 1), fp32 master weights + bf16 compute,
             log-probs of the sampled tokens through the chunked `token_logprobs`, SEED's loss, backward,
             grad clip, AdamW (fused on GPU)
             Both models stay on the device, and their timings alternate for --rounds rounds (reference,
             project, reference, ...): the medians and the per-round ratios are reported, so that a drift of
             the GPU's speed during the run lands on both paths. Peak memory is each path's own (the other
             model's resting memory subtracted).
  --ablate   the project step again with one knob changed, each paired with a reference run: no grad clip,
             foreach AdamW, LM-head chunks of 4,096 rows, no resharding after forward, and the LM head's backward
             with G in fp32 (the code before 2026-12-03)
  --profile  torch.profiler kernel tables of both steps (where the time goes)
  log-probs  peak memory of forward+backward for the log-probs of a micro-batch: full fp32 logits
             [tokens, vocab] at once vs the chunked path
Prints a table and writes JSON (--json). Not a test: timings are reported, never asserted.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.models import model_config  # noqa: E402
from common.packing import response_select, make_batch  # noqa: E402
from common.training import _TokenLogprob, adamw_impl, init_distributed, shard_model  # noqa: E402
from seed_rl import seed_loss  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--config", default="Qwen2.5-1.5B-Instruct", help="a folder name under assets/qwen2.5-configs, a path, or tiny")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=1536)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--rounds", type=int, default=5, help="alternating reference/project timings")
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul rate of the H200 here")
p.add_argument("--json", default=None)
p.add_argument("--ablate", action="store_true", help="also time the project step with one knob changed at a time")
p.add_argument("--profile", default=None, help="write torch.profiler kernel tables of both paths to this folder")
args = p.parse_args()

rank, world, device = init_distributed()
on_gpu = device.type == "cuda"
from transformers import AutoModelForCausalLM  # noqa: E402
cfg = model_config(args.config)
cfg.use_cache = False
torch.manual_seed(0)
ids = torch.randint(0, 151643, (args.batch, args.seq), device=device)
n_tokens = args.batch * args.seq
sync = torch.cuda.synchronize if on_gpu else (lambda: None)


def peak_reset():
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2 ** 30 if on_gpu else float("nan")


def timed(step):
    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    return (time.perf_counter() - t0) / args.steps


results = {"config": args.config, "batch": args.batch, "seq": args.seq, "device": torch.cuda.get_device_name() if on_gpu else "cpu"}


def profile(step, name):
    """Kernel table of 3 steps (after warm-up) and the share of wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        sync()
    wall = time.perf_counter() - t0
    ka = prof.key_averages()
    busy = sum(getattr(e, "self_device_time_total", 0) for e in ka if e.device_type.name == "CUDA") / 1e6
    table = ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"{name}.txt"), "w") as f:
        f.write(f"wall {wall / 3:.4f} s/step (profiled), GPU kernel time {busy / 3:.4f} s/step\n{table}\n")
    print(f"profile {name}: wall {wall / 3:.4f} s/step, GPU kernels {busy / 3:.4f} s/step")


def resting_gib(step):
    """Run one step (AdamW's state now exists; gradients are freed after it) and return the memory in use."""
    step()
    sync()
    return torch.cuda.memory_allocated() / 2 ** 30 if on_gpu else float("nan")


def measure(step, other_gib):
    """Seconds per step (after warm-up), tokens/s, peak memory (less the other model's resting memory) and
    MFU (6 x params x tokens / peak)."""
    peak_reset()
    t = timed(step)
    return {"s_per_step": t, "tokens_per_s": n_tokens / t, "peak_gib": peak_gib() - other_gib,
            "mfu": 6 * n_params * n_tokens / t / (args.peak_tflops * 1e12)}


# ---- reference: plain bf16 HF forward + backward + AdamW
ref_model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if on_gpu else torch.float32,
                                             attn_implementation="sdpa").to(device)
n_params = sum(p.numel() for p in ref_model.parameters())
ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-6)


def ref_step():
    loss = ref_model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)


ref_rest = resting_gib(ref_step)

# ---- project: FSDP2 (world size 1), fp32 master weights, bf16 compute, chunked log-probs, SEED loss
model = shard_model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").to(device), device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, **adamw_impl(device))
batch = make_batch([row.tolist() for row in ids.cpu()], device)
sel = response_select(batch, [(1, args.seq - 1)] * args.batch)  # every position predicts a scored token
zeros = torch.zeros(sel.shape, device=device)


chunk = 1024  # rows of the LM head per chunk (seed_rl.py's default)


def project_step(clip=True):
    lp = model.token_logprobs(batch["input_ids"], batch["targets"], sel, attention_mask=batch.get("attention_mask"),
                              chunk_size=chunk)
    m = sel.float()
    loss = seed_loss(lp, lp.detach(), lp.detach(), lp.detach() + 0.1, zeros + 0.5, m, m, float(m.sum()), float(m.sum()))["loss"]
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


project_rest = resting_gib(project_step) - ref_rest

# ---- alternating rounds: reference, project, reference, project, ...
rounds = []
for r in range(args.rounds):
    ref, proj = measure(ref_step, project_rest), measure(project_step, ref_rest)
    rounds.append({"reference": ref, "project": proj, "ratio": ref["s_per_step"] / proj["s_per_step"]})
    print(f"round {r}: reference {ref['s_per_step']:.4f} s, project {proj['s_per_step']:.4f} s, ratio {rounds[-1]['ratio']:.3f}")


def median_run(key):
    """The round whose s/step is the median for this path (odd --rounds: a real measurement, not a blend)."""
    return sorted((rd[key] for rd in rounds), key=lambda m: m["s_per_step"])[len(rounds) // 2]


results["reference"], results["project"] = median_run("reference"), median_run("project")
results["ratio_project_over_reference"] = results["reference"]["s_per_step"] / results["project"]["s_per_step"]
results["round_ratios"] = [rd["ratio"] for rd in rounds]
results["rounds"] = rounds
if args.profile:
    profile(ref_step, "reference")
    profile(project_step, "project")

# ---- ablations: the project step with one knob changed at a time, each right after a reference run
if args.ablate:
    abl = {}

    def ablate(name, step):
        ref = measure(ref_step, project_rest)
        abl[name] = dict(measure(step, ref_rest), reference_s_per_step=ref["s_per_step"])
        abl[name]["ratio"] = ref["s_per_step"] / abl[name]["s_per_step"]

    ablate("no_grad_clip", lambda: project_step(clip=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, foreach=True)
    ablate("adamw_foreach", project_step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, **adamw_impl(device))
    chunk = 4096
    ablate("lm_head_chunk_4096", project_step)
    chunk = 1024
    model.set_reshard_after_forward(False)  # keep bf16 layers gathered between forward and backward
    ablate("no_reshard_after_forward", project_step)
    model.set_reshard_after_forward(True)

    def fp32_G_backward(ctx, g):  # _TokenLogprob.backward before 2026-12-03: G in fp32, cast for the matmuls
        h, w, tgt, lp = ctx.saved_tensors
        grad_h, grad_w = torch.empty_like(h), torch.zeros_like(w)
        for s in range(0, h.shape[0], ctx.chunk):
            hc, gc = h[s:s + ctx.chunk], g[s:s + ctx.chunk]
            G = torch.softmax(hc @ w.t(), -1, dtype=g.dtype)
            G.mul_(-gc[:, None])
            G[torch.arange(len(hc), device=h.device), tgt[s:s + ctx.chunk]] += gc
            G = G.to(h.dtype)
            torch.mm(G, w, out=grad_h[s:s + ctx.chunk])
            grad_w.addmm_(G.t(), hc)
        return grad_h, grad_w, None, None

    bf16_G_backward, _TokenLogprob.backward = _TokenLogprob.backward, staticmethod(fp32_G_backward)
    ablate("lm_head_backward_fp32_G", project_step)
    _TokenLogprob.backward = staticmethod(bf16_G_backward)  # as defined: the log-prob memory test below runs it
    results["ablations"] = abl
del opt, ref_model, ref_opt
peak_reset()

# ---- log-prob memory: full fp32 logits for the micro-batch vs chunked
def full_logprobs():
    h = model.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).last_hidden_state
    logits = model.lm_head(h).float()  # [B, T, V] fp32: 8 x 1,536 x 151,936 x 4 bytes = 7.5 GB
    return logits.log_softmax(-1).gather(-1, batch["targets"][..., None])[..., 0]


def chunked_logprobs():
    return model.token_logprobs(batch["input_ids"], batch["targets"], sel, attention_mask=batch.get("attention_mask"))


mem = {}
for name, fn in (("full_fp32_logits", full_logprobs), ("chunked", chunked_logprobs)):
    model.zero_grad(set_to_none=True)
    peak_reset()
    base = torch.cuda.memory_allocated() / 2 ** 30 if on_gpu else float("nan")
    try:
        # full_logprobs bypasses the FSDP root forward, so unshard the root's parameters by hand
        if name == "full_fp32_logits":
            model.unshard()
        (fn() * sel).sum().backward()
        mem[name] = {"peak_gib": peak_gib(), "peak_over_base_gib": peak_gib() - base}
    except Exception as e:  # an OOM is a result too
        mem[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        model.reshard() if name == "full_fp32_logits" else None
results["logprob_memory"] = mem

# ---- report
print(f"{'path':<10} {'s/step':>8} {'tok/s':>10} {'MFU':>6} {'peak GiB':>9}")
for k in ("reference", "project"):
    r = results[k]
    print(f"{k:<10} {r['s_per_step']:>8.3f} {r['tokens_per_s']:>10.0f} {100 * r['mfu']:>5.1f}% {r['peak_gib']:>9.1f}")
print(f"project / reference throughput: {results['ratio_project_over_reference']:.3f} (medians of {args.rounds} rounds; "
      f"per round {min(results['round_ratios']):.3f}-{max(results['round_ratios']):.3f})")
for k, r in results.get("ablations", {}).items():
    print(f"  project, {k:<26} {r['s_per_step']:>8.3f} s {r['tokens_per_s']:>10.0f} tok/s {r['ratio']:.3f}x {r['peak_gib']:>6.1f} GiB")
for k, v in mem.items():
    print(f"log-probs fwd+bwd, {k}: {v}")
if args.json:
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
torch.distributed.destroy_process_group()
