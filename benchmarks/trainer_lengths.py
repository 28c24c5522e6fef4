"""The trainer step on real step-sample lengths: the project's step padded (as before packing) and packed, and a
plain Hugging Face step padded, all on the same samples (issue 20).

    python benchmarks/trainer_lengths.py --json trainer_lengths.json      # one H200: Qwen2.5-1.5B shape, synthetic lengths
    python benchmarks/trainer_lengths.py --lengths runs/seed/lengths.jsonl --json trainer_lengths.json   # recorded ones
    python benchmarks/trainer_lengths.py --config tiny --episodes 2 --steps-per-episode 6 --mini-batch 12 \\
        --micro-batch 4 --micro-tokens 3000 --hf-micro-batch 4 --scale 0.25 --json /tmp/tl.json   # CPU smoke run

Lengths: seed_rl.py writes one line per update to lengths.jsonl in its --out folder, the (prompt, response)
token lengths of every step sample ({"update": 1, "samples": [[812, 64], ...]}); --update picks the line
(default: the last). Without --lengths, a synthetic list shaped like ALFWorld's (reported as synthetic):
--episodes x --steps-per-episode step samples (default 16 x 30: seed_rl.py's update on one GPU in
benchmarks/remote/h200.sh B), the prompt growing with each of up to 5 history entries (about 350-900 tokens at step
1, up to ~1,800), responses mostly 30-150 tokens with 2.5% cut at 512 (the H200 runs of 2026-12-03: 71
response tokens per step sample on average, 2.5% truncated).

The mini-batches are drawn as seed_rl.py's step 5 draws them (one seeded permutation, --mini-batch samples
each); the first --mini-batches are timed. Random weights with the official config
(../shared/assets/qwen2.5-configs, or $SHARED); random token ids of the recorded lengths. Paths, each one
optimizer step per mini-batch, activation checkpointing on as in seed_rl.py (--no-activation-checkpointing):
  hf_padded            plain HF: bf16 parameters, SDPA, model(input_ids, attention_mask, labels) on length-sorted
                       micro-batches of --hf-micro-batch (its [tokens, vocab] fp32 logits do not fit 32 rows of
                       2,500 tokens), backward, AdamW (foreach)
  padded               the project's step as seed_rl.py ran it before packing: FSDP2 (world size 1), fp32 master
                       weights + bf16 compute, length-sorted micro-batches of --micro-batch samples padded (SDPA
                       with a mask), chunked log-probs of the response tokens, SEED's loss, grad clip, AdamW (fused)
  packed:ATTN          the same micro-batches, each packed into one row, through attention ATTN (seed_varlen:
                       PyTorch's varlen flash kernel; flex_attention: transformers' document mask)
  packed:ATTN:tokens   micro-batches filled up to --micro-tokens tokens instead (seed_rl.py --micro-tokens);
                       :tokens=N a budget of N; :nockpt without activation checkpointing (a token budget bounds
                       the activations: small micro-batches may fit without recomputing every layer); :sel
                       selective checkpointing (seed_rl.py --checkpoint-policy selective: matmul and attention
                       outputs kept, elementwise ops recomputed); :every=N every N-th layer (--checkpoint-every);
                       :liger / :compile fused kernels (seed_rl.py --fused: liger-kernel's RMSNorm, SwiGLU, rotary, or
                       torch.compile of each layer) on a fresh model with the same initial weights, whose log-probs
                       of the first micro-batch are compared with the unfused model's (logprob_vs_unfused in the JSON)
                       and, as the yardstick for that difference, the unfused model's own bf16 compute with an fp32
                       copy of the same weights (unfused_vs_fp32: bf16 rounding alone; 0 on CPU, where all is fp32)
Reported per path: seconds per optimizer step, real tokens/s (prompt + response tokens, padding not counted),
pad fraction (pad slots / slots computed), MFU of the real tokens (6 x parameters x real tokens / s / peak: no
attention FLOPs, no recomputation), peak memory. --profile writes kernel tables (where the time goes).
Prints a table and writes JSON (--json). Not a test: timings are reported, never asserted.
"""
import argparse
import json
import math
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.models import model_config  # noqa: E402
from common.packing import make_batch, packed_attention, register_attention  # noqa: E402
from common.training import (_token_logprobs, adamw_impl, check_fused, checkpoint_kwargs, init_distributed,  # noqa: E402
                             shard_model)
from seed_rl import micro_batch_logprobs, plan_micro_batches, seed_loss  # noqa: E402

register_attention()  # packed:seed_varlen paths set it on models built here, not through load_model

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
# Lengths
p.add_argument("--lengths", default=None, help="seed_rl.py's lengths.jsonl (default: synthetic ALFWorld-shaped)")
p.add_argument("--update", type=int, default=None, help="the update (line) of --lengths; default the last")
p.add_argument("--episodes", type=int, default=16, help="synthetic: episodes (2 groups of 8 = one GPU's update)")
p.add_argument("--steps-per-episode", type=int, default=30, help="synthetic: step samples per episode")
p.add_argument("--scale", type=float, default=1.0, help="multiply every length (CPU smoke runs: < 1)")
# Model and step
p.add_argument("--config", default="Qwen2.5-1.5B-Instruct", help="a folder name under assets/qwen2.5-configs, a path, or tiny")
p.add_argument("--mini-batch", type=int, default=256, help="step samples per optimizer step (seed_rl.py's default)")
p.add_argument("--mini-batches", type=int, default=1, help="mini-batches timed (the first ones of the permutation)")
p.add_argument("--micro-batch", type=int, default=32, help="samples per forward, padded and packed:ATTN")
p.add_argument("--micro-tokens", type=int, default=65536, help="token budget per forward of packed:ATTN:tokens")
p.add_argument("--hf-micro-batch", type=int, default=8, help="samples per forward of hf_padded")
p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
p.add_argument("--paths", default=None, help="comma-separated; default: hf_padded, padded, packed:A for A = seed_rl.py's "
               "choice (seed_varlen where it runs) and flex_attention, packed:A:tokens, packed:A:tokens=16384:nockpt; "
               "options :tokens[=N] :nockpt :sel :every=N :liger :compile (see above)")
# Measurement
p.add_argument("--repeats", type=int, default=1, help="timed passes over the mini-batches, after one warm-up pass")
p.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul rate of the H200 here")
p.add_argument("--profile", default=None, help="write torch.profiler kernel tables of each path to this folder")
p.add_argument("--json", default=None)
args = p.parse_args()

rank, world, device = init_distributed()
on_gpu = device.type == "cuda"
sync = torch.cuda.synchronize if on_gpu else (lambda: None)
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

# liger patches these process-wide (its rotary, the RMSNorm and MLP classes): restored after each :liger path
QWEN2_GLOBALS = dict(vars(modeling_qwen2))


# ----------------------------------------------------------------------------------------------------
# Lengths: recorded or synthetic

def synthetic_lengths(episodes, steps, seed=0):
    """ALFWorld-shaped (prompt, response) token lengths (see the docstring for the shape and its sources)."""
    g = torch.Generator().manual_seed(seed)
    u = lambda lo, hi: lo + (hi - lo) * float(torch.rand((), generator=g))
    out = []
    for _ in range(episodes):
        first, entry = u(350, 900), u(40, 180)  # the game's first prompt; tokens per history entry
        for t in range(steps):
            prompt = int(first + min(t, 5) * entry * u(0.7, 1.3))
            resp = 512 if u(0, 1) < 0.025 else int(min(max(math.exp(math.log(55) + 0.45 * float(torch.randn((), generator=g))), 30), 511))
            out.append((prompt, resp))
    return out


if args.lengths:
    with open(args.lengths) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    row = [r for r in rows if args.update is None or r["update"] == args.update][-1]
    lengths, source = [tuple(x) for x in row["samples"]], {"file": args.lengths, "update": row["update"], "synthetic": False}
else:
    lengths = synthetic_lengths(args.episodes, args.steps_per_episode)
    source = {"synthetic": True, "episodes": args.episodes, "steps_per_episode": args.steps_per_episode}
lengths = [(max(1, round(p_ * args.scale)), max(1, round(r_ * args.scale))) for p_, r_ in lengths]
torch.manual_seed(0)
ids = [torch.randint(0, 151643, (p_ + r_,)).tolist() for p_, r_ in lengths]  # random tokens, recorded lengths
perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
minis = [perm[i:i + args.mini_batch] for i in range(0, len(perm), args.mini_batch)][:args.mini_batches]
real_tokens = sum(len(ids[i]) for m in minis for i in m)
pr = sorted(p_ for p_, _ in lengths)
rs = sorted(r_ for _, r_ in lengths)
q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]
source.update(samples=len(lengths), scale=args.scale, mini_batch_sizes=[len(m) for m in minis], real_tokens_timed=real_tokens,
              prompt={"mean": sum(pr) / len(pr), "p05": q(pr, 0.05), "p50": q(pr, 0.5), "p95": q(pr, 0.95), "max": pr[-1]},
              response={"mean": sum(rs) / len(rs), "p05": q(rs, 0.05), "p50": q(rs, 0.5), "p95": q(rs, 0.95), "max": rs[-1]})
print(f"lengths: {'synthetic' if source['synthetic'] else args.lengths}, {len(lengths)} step samples, prompt mean "
      f"{source['prompt']['mean']:.0f} (p95 {source['prompt']['p95']}), response mean {source['response']['mean']:.0f} "
      f"(p95 {source['response']['p95']}); timed: {len(minis)} mini-batch(es), {real_tokens} real tokens")

cfg = model_config(args.config)
cfg.use_cache = False


# ----------------------------------------------------------------------------------------------------
# Measurement

def peak_reset():
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def plan(mini, packed, **kw):
    """The micro-batches of a mini-batch (sample indices), as seed_rl.py plans them."""
    return plan_micro_batches(mini, [len(ids[i]) for i in mini], device, packed=packed, **kw)


def pad_fraction(plans, packed):
    slots = sum(sum(len(ids[i]) for i in g) if packed else len(g) * max(len(ids[i]) for i in g)
                for micro in plans for g in micro if g)
    return 1 - real_tokens / slots


def profile(step, name):
    """Kernel table of one pass (after the warm-up) and the share of the wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        for m in minis:
            step(m)
        sync()
    wall = time.perf_counter() - t0
    ka = prof.key_averages()
    kernels = [e for e in ka if e.device_type.name == "CUDA"] if on_gpu else []
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    # where the GPU time goes, by kernel family (names as cuBLAS/CUTLASS, the flash kernels, fused AdamW and
    # PyTorch's elementwise/reduction kernels spell them); "idle" = wall time with no kernel running
    shares = {}
    for e in kernels:
        fam = kernel_family(e.key)
        shares[fam] = shares.get(fam, 0.0) + e.self_device_time_total / 1e6
    shares["idle"] = max(0.0, wall - busy)
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"{name.replace(':', '_')}.txt"), "w") as f:
        f.write(f"wall {wall:.3f} s per pass (profiled), GPU kernel time {busy:.3f} s\n")
        f.write("by family: " + ", ".join(f"{k} {v:.3f} s ({v / wall:.0%})" for k, v in
                                          sorted(shares.items(), key=lambda kv: -kv[1])) + "\n")
        f.write(ka.table(sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total", row_limit=40,
                         max_name_column_width=70) + "\n")
    return dict(shares, wall=wall, busy=busy)


# first match wins: attention before matmul, since flash kernels are CUTLASS templates too
FAMILIES = [("attention", ("flash", "fmha", "attention", "sdpa")),
            ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_")),
            ("optimizer", ("adam", "multi_tensor")), ("copy", ("memcpy", "memset", "copy_")),
            ("loss/softmax", ("softmax", "logsumexp", "cross_entropy", "gather"))]


def kernel_family(kernel_name):
    low = kernel_name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "elementwise/norm/other")


def measure(name, step, pads):
    """One warm-up pass over the mini-batches (compilation, allocator), then --repeats timed passes."""
    peak_reset()
    try:
        t0 = time.perf_counter()
        for m in minis:
            step(m)
        sync()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            for m in minis:
                step(m)
        sync()
        t = (time.perf_counter() - t0) / args.repeats
        prof = profile(step, name) if args.profile else None
    except Exception as e:  # an OOM is a result too
        out = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(f"{name}: {out['error']}")
        return out
    out = {"s_per_step": t / len(minis), "warmup_s": warm, "real_tokens_per_s": real_tokens / t, "pad_fraction": pads,
           "mfu_real": 6 * n_params * real_tokens / t / (args.peak_tflops * 1e12),
           "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if on_gpu else None}
    if prof:
        out["profile_s"] = prof
    print(f"{name}: {out['s_per_step']:.3f} s/step, {out['real_tokens_per_s']:.0f} real tok/s, pad {pads:.1%}, "
          f"MFU {out['mfu_real']:.1%}, peak {out['peak_gib'] or float('nan'):.1f} GiB (warm-up {warm:.1f} s)")
    return out


def save():
    """The JSON so far: written after each path, so a time limit still leaves the paths measured before it."""
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


results = {"config": args.config, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "lengths": source,
           "args": vars(args), "paths": {}}

if args.paths:
    paths = args.paths.split(",")
else:
    auto = packed_attention(device, "on")  # seed_rl.py's choice on GPU (seed_varlen where the probe passes)
    attns = [auto] + (["flex_attention"] if on_gpu and auto != "flex_attention" else [])
    paths = ["hf_padded", "padded"] + [f"packed:{a}" for a in attns] + [f"packed:{auto}:tokens",
                                                                        f"packed:{auto}:tokens=16384:nockpt"]
results["packed_attention_auto"] = packed_attention(device, "auto")

# ---- the project's step: FSDP2 (world size 1), fp32 master weights, bf16 compute, chunked log-probs, SEED loss

def parse_path(name):
    """padded | packed:ATTN, then the options tokens | tokens=N | nockpt | sel | every=N | liger | compile."""
    parts = name.split(":")
    packed, attn = parts[0] == "packed", parts[1] if parts[0] == "packed" else "sdpa"
    opts = dict(o.partition("=")[::2] for o in parts[1 + packed:])
    kw = dict(micro_batch=args.micro_batch,
              max_tokens=int(opts["tokens"] or args.micro_tokens) if "tokens" in opts else 0)
    ckpt = dict(activation_checkpointing=args.activation_checkpointing and "nockpt" not in opts,
                checkpoint_policy="selective" if "sel" in opts else "full", checkpoint_every=int(opts.get("every") or 1))
    fused = "liger" if "liger" in opts else "compile" if "compile" in opts else "off"
    return packed, attn, kw, ckpt, fused


def build(fused="off", **ckpt):
    """The model (the same initial weights at every build: fused paths are compared with the unfused one) and AdamW."""
    if fused == "compile":
        torch._dynamo.reset()  # each path its own graphs: earlier paths' would count against the recompile limit
        counters.clear()  # reported with the path: a graph break inside a checkpointed layer runs it all eagerly
    torch.manual_seed(1)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").to(device)
    m = shard_model(m, device, fused=fused, **ckpt)
    m.train()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-6, weight_decay=0.01, **adamw_impl(device))


def first_logprobs(packed, attn, kw, m=None):
    """Log-probs of the response tokens of the first micro-batch of the first mini-batch (no grad, flat, fp32),
    by `m` (default: the model being timed)."""
    m = m or model
    m.set_attn_implementation(attn)
    micro = next(g for g in plan(minis[0], packed, **kw) if g)
    with torch.no_grad():
        lp, _, sel = micro_batch_logprobs(m, [(ids[i], *lengths[i]) for i in micro], device, packed)
    return lp[sel].float()


def fp32_logprobs(packed, attn, kw):
    """first_logprobs through an fp32 copy of the same initial weights, no mixed precision: how far the unfused
    model's own bf16 compute moves the log-probs, the yardstick for a fused path's difference."""
    torch.manual_seed(1)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    ref.token_logprobs = types.MethodType(_token_logprobs, ref)  # the trainer's chunked log-probs (shard_model's)
    return first_logprobs(packed, attn, kw, m=ref)


def abs_diff(a, b):
    d = (a - b).abs()
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "tokens": d.numel()}


fused_paths = [x for x in paths if x != "hf_padded" and parse_path(x)[4] != "off"]
for name in fused_paths:
    check_fused(parse_path(name)[4], device)  # liger without a GPU or the package: one line, before any timing
model, opt = build(activation_checkpointing=args.activation_checkpointing)
model_fused = False
n_params = sum(x.numel() for x in model.parameters())
unfused_lp = {name: first_logprobs(*parse_path(name)[:3]) for name in fused_paths}  # the fresh weights, before any step
yardstick = {name: abs_diff(unfused_lp[name], fp32_logprobs(*parse_path(name)[:3])) for name in fused_paths}
peak_reset()


def project_step(mini, packed, **kw):
    """seed_rl.py's step 5 on one mini-batch: its micro-batch plan, log-probs, loss (dummy old/ref/teacher
    log-probs and advantages: the same arithmetic), backward, grad clip, AdamW."""
    n_tok = sum(len(ids[i]) - lengths[i][0] for i in mini)
    for micro in plan(mini, packed, **kw):
        seqs = [(ids[i], *lengths[i]) for i in micro]
        lp, batch, sel = micro_batch_logprobs(model, seqs, device, packed)
        m = sel.float()
        loss = seed_loss(lp, lp.detach(), lp.detach(), lp.detach() + 0.1, m * 0.5, m, m, n_tok, n_tok)["loss"]
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


for name in [x for x in paths if x != "hf_padded"]:
    packed, attn, kw, ckpt, fused = parse_path(name)
    check = {}
    if fused != "off" or model_fused:
        # a fused model is built fused (compile moves the checkpoint inside the compiled layer: set before
        # fusing, not toggled after), from the same initial weights as the unfused model of unfused_lp
        model = opt = None
        peak_reset()
        model_fused = True  # until built: a failed build leaves the next path to build its own
        try:
            model, opt = build(fused, **ckpt)
            if fused != "off":
                d, y = abs_diff(first_logprobs(packed, attn, kw), unfused_lp[name]), yardstick[name]
                check = {"logprob_vs_unfused": d, "unfused_vs_fp32": y}
                print(f"{name}: response log-probs of the first micro-batch vs unfused: max |diff| "
                      f"{d['max_abs_diff']:.3g}, mean {d['mean_abs_diff']:.3g} over {d['tokens']} tokens (the unfused "
                      f"bf16 step vs fp32 weights: max {y['max_abs_diff']:.3g}, mean {y['mean_abs_diff']:.3g})")
        except Exception as e:  # a fused path that does not run here is a result too
            results["paths"][name] = {"error": f"{type(e).__name__}: {e}"[:400], "fused": fused}
            print(f"{name}: {results['paths'][name]['error']}")
            vars(modeling_qwen2).update(QWEN2_GLOBALS)
            save()
            continue
        model_fused = fused != "off"
    elif ckpt["activation_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(ckpt["checkpoint_policy"]),
                                            every_n_layers=ckpt["checkpoint_every"])
    else:
        model.gradient_checkpointing_disable()
    model.set_attn_implementation(attn)
    pads = pad_fraction([plan(m, packed, **kw) for m in minis], packed)
    results["paths"][name] = dict(measure(name, lambda m: project_step(m, packed, **kw), pads),
                                  micro_batches=sum(len(plan(m, packed, **kw)) for m in minis), fused=fused, **check)
    opt.zero_grad(set_to_none=True)
    if fused == "compile":
        results["paths"][name]["dynamo"] = {"graphs": counters["stats"]["unique_graphs"],
                                            "graph_breaks": sum(counters["graph_break"].values())}
    if fused == "liger":
        vars(modeling_qwen2).update(QWEN2_GLOBALS)  # later paths (and hf_padded) run transformers' own kernels
    save()
del model, opt
peak_reset()

# ---- plain HF: bf16 parameters, padded length-sorted micro-batches, labels on the response tokens, AdamW
if "hf_padded" in paths:
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if on_gpu else torch.float32,
                                           attn_implementation="sdpa").to(device)
    if args.activation_checkpointing:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-6)

    def hf_step(mini):
        for micro in plan(mini, False, micro_batch=args.hf_micro_batch):
            batch = make_batch([ids[i] for i in micro], device)
            labels = torch.full_like(batch["input_ids"], -100)
            for row, i in enumerate(micro):
                p_, r_ = lengths[i]
                labels[row, p_:p_ + r_] = batch["input_ids"][row, p_:p_ + r_]
            ref(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=labels).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    pads = pad_fraction([plan(m, False, micro_batch=args.hf_micro_batch) for m in minis], False)
    results["paths"]["hf_padded"] = dict(measure("hf_padded", hf_step, pads),
                                         micro_batches=sum(len(plan(m, False, micro_batch=args.hf_micro_batch)) for m in minis))
    del ref, ref_opt

# ---- report
ok = {k: v for k, v in results["paths"].items() if "error" not in v}
if "hf_padded" in ok:
    for k, v in ok.items():
        v["speedup_over_hf_padded"] = ok["hf_padded"]["s_per_step"] / v["s_per_step"]
print(f"\n{'path':<38} {'s/step':>8} {'real tok/s':>11} {'pad':>6} {'MFU':>6} {'peak GiB':>9} {'x HF':>6}")
for k, v in results["paths"].items():
    if "error" in v:
        print(f"{k:<38} {v['error'][:80]}")
        continue
    print(f"{k:<38} {v['s_per_step']:>8.3f} {v['real_tokens_per_s']:>11.0f} {v['pad_fraction']:>6.1%} {v['mfu_real']:>6.1%} "
          f"{v['peak_gib'] or float('nan'):>9.1f} {v.get('speedup_over_hf_padded', float('nan')):>6.2f}")
print(f"({'synthetic' if source['synthetic'] else 'recorded'} lengths; MFU = 6 x {n_params / 1e9:.2f}B params x real "
      f"tokens / s / {args.peak_tflops:.0f} TFLOP/s)")
save()
torch.distributed.destroy_process_group()
