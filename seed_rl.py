"""Stage 2 of SEED: self-evolving on-policy distillation (OPD) + GRPO + KL, FSDP2 over N GPUs, vLLM co-located.

One policy update (docs/paper.md, Stage 2) is the story of `main()` below:
  1. rollout     sync the latest weights into the generation engine; play tasks x group episodes with the
                 plain prompt (each rank plays its share of the groups), each episode at its own pace
  2. analysis    the same engine, same weights, writes one hindsight skill per episode (greedy), started the
                 moment that episode ends, while the others still play
  3. scoring     no grad, pre-update weights: old log-probs of the sampled response tokens under the plain
                 prompt, teacher log-probs of the SAME tokens under the skill prompt, reference log-probs
  4. advantages  GRPO per group of episodes, broadcast to every response token of every step
  5. update      PPO-clip + opd_coef x sigmoid-gated OPD + kl_coef x k3 KL, token-mean, AdamW
  6. log, save   metrics JSONL, plain-vs-skill example dumps, checkpoints
Skills exist only here, at training time: the trained policy is deployed with the plain prompt.

    # 8 GPUs, one node: FSDP2 over 8 ranks, one vLLM engine per rank on the same GPU (sleeps while training)
    torchrun --nproc_per_node 8 seed_rl.py --env alfworld --model runs/stage1/sft --out runs/seed
    # 1 GPU
    python seed_rl.py --env alfworld --model runs/stage1/sft --out runs/seed
    # the other benchmarks: every default (steps, history, lengths, batch, KL, penalty, lr schedule) from --env
    torchrun --nproc_per_node 8 seed_rl.py --env webshop --model runs/stage1/sft --out runs/seed_webshop
    torchrun --nproc_per_node 8 seed_rl.py --env search --model runs/stage1/sft --out runs/seed_search
    # baselines: GRPO (no analysis, no teacher pass) / without SFT / static analyzer
    torchrun --nproc_per_node 8 seed_rl.py --env alfworld --model runs/stage1/sft --opd-coef 0 --out runs/grpo
    torchrun --nproc_per_node 8 seed_rl.py --env alfworld --model Qwen/Qwen2.5-3B-Instruct --out runs/seed_nosft
    torchrun --nproc_per_node 8 seed_rl.py --env alfworld --model runs/stage1/sft --analyzer-model runs/stage1/sft \\
        --out runs/seed_static
    # CPU demo: a tiny random Qwen2 (real tokenizer, real ALFWorld); a random model writes no JSON, so a
    # rule-based analyzer stands in for the self-analysis (--analyzer-model scripted)
    python seed_rl.py --env alfworld --model tiny --updates 2 --tasks-per-update 2 --group-size 4 \\
        --max-steps 4 --max-new-tokens 24 --analyzer-model scripted --out runs/demo/seed
    python -m torch.distributed.run --nproc_per_node 2 seed_rl.py ...same flags...   # 2 processes, gloo

Where this follows the paper's public code rather than its Algorithm 1 (docs/paper.md): the teacher is scored
once, with the pre-update weights (Algorithm 1 re-scores it with the trainable policy; both agree at the
first mini-batch).
"""
import argparse
import json
import math
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

from envs import HelpFormatter, add_env_arg, env_from_argv, require_positive
from envs.backends import HFBackend, ScriptedAnalyzer, VLLMBackend
from envs.models import attn_implementation, load_model, load_tokenizer
from envs.pool import EnvPool
from envs.records import (append_jsonl, args_diff, check_resume, games_sha256, open_jsonl_for_append, read_jsonl,
                          resumed_manifest, run_manifest, write_manifest)
from envs.rollout import add_rollout_args, play_episodes, step_prompt
from envs.training import (adamw_impl, full_params, gather_response, init_distributed, latest_checkpoint, make_batch,
                           packed_attention, print0, response_select, save_checkpoint_dir, save_hf_checkpoint,
                           shard_model)
from prompts import build_analysis_prompt, chat_prompt, parse_analysis

# ====================================================================================================
# The algorithm. Everything else in this file is plumbing around these two functions.

def grpo_advantages(returns, groups, lengths=None, eps=1e-6, std_norm=True):
    """GRPO: A_i = (R_i - mean_group(R)) / (std_group(R) + eps) over the episodes of the same task.

    returns, groups: one entry per episode. lengths=None: statistics over the group's episodes (the paper);
    lengths given: over the group's flattened step samples, each episode's return counted once per step
    (the public code's choice, `--adv-mode steps`). std is the unbiased one (as verl). A group of one, or
    one whose returns are all equal, carries no ranking signal: A = 0 (no policy gradient). std_norm=False:
    A = R - mean only (the public code's WebShop runs, SEED_MODE=mean_norm).
    """
    adv = [0.0] * len(returns)
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = torch.tensor([returns[i] for i in idx], dtype=torch.float64)
        pop = r if lengths is None else r.repeat_interleave(torch.tensor([lengths[i] for i in idx]))
        if len(pop) < 2 or bool((pop == pop[0]).all()):
            continue
        mean, std = pop.mean(), pop.std()
        for i, ri in zip(idx, r):
            adv[i] = float((ri - mean) / (std + eps)) if std_norm else float(ri - mean)
    return adv


def seed_loss(lp, old_lp, ref_lp, teacher_lp, adv, mask, teacher_mask, n_tokens, n_teacher_tokens, *,
              clip_eps=0.2, kl_coef=0.01, opd_coef=0.01, beta=5.0, dual_clip=None):
    """SEED's loss on one micro-batch. Every tensor is per token, same shape (e.g. [rows, T]); mask is 1 on
    response tokens (0 on prompt and padding), teacher_mask 1 where the episode has a parsed skill.
    n_tokens, n_teacher_tokens: token counts of the whole mini-batch over all ranks, so that summing the
    micro-batch losses gives the token-mean over the mini-batch. dual_clip: None (docs/paper.md's PPO clip), or verl's
    dual-clip constant c (the public code's runs: 3), which caps a negative-advantage token's loss at -c * A.
    Returns (loss, sums for logging)."""
    m, mt = mask, mask * teacher_mask
    # policy: PPO clip, ratio = exp(lp - old_lp); L_pg = -min(ratio * A, clip(ratio, 1 -+ eps) * A)
    ratio = torch.exp(lp - old_lp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    if dual_clip is not None:  # A < 0 and ratio > c: the loss stops growing with the ratio
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    # KL to the reference, k3 ("low-var") estimator: d = ref_lp - lp; kl = exp(d) - d - 1
    d = (ref_lp - lp).clamp(-20, 20)
    kl = (torch.exp(d) - d - 1).clamp(-10, 10)
    # OPD, sigmoid-gated: the gate is a constant weight (gap uses lp.detach()), so the gradient of
    # g * (teacher_lp - lp) is -g * grad(lp): tokens the skill endorses (gap > 0, g > 0.5) are pushed up;
    # tokens it rejects get a weight near 0, never a negative one.
    gap = teacher_lp - lp.detach()
    gate = torch.sigmoid(beta * gap)
    opd = gate * (teacher_lp - lp)
    loss = ((pg + kl_coef * kl) * m).sum() / max(n_tokens, 1) + opd_coef * (opd * mt).sum() / max(n_teacher_tokens, 1)
    with torch.no_grad():
        sums = {"pg": (pg * m).sum(), "kl": (kl * m).sum(), "opd": (opd * mt).sum(), "gate": (gate * mt).sum(),
                "gate_active": ((gate > 0.5).float() * mt).sum(), "gap": (gap * mt).sum(),
                "clipped": (((ratio - 1).abs() > clip_eps).float() * m).sum(), "ratio": (ratio * m).sum()}
    return loss, sums


# ====================================================================================================
# Plumbing: micro-batches that line up across ranks, scoring, engine sync

def split_even(items, n):
    """n contiguous, nearly equal parts (some may be empty)."""
    k, r = divmod(len(items), n)
    out, i = [], 0
    for j in range(n):
        out.append(items[i:i + k + (j < r)])
        i += k + (j < r)
    return out


def agreed_max(x, device):
    """The max of x over all ranks: every rank must run the same number of FSDP forwards."""
    t = torch.tensor([x], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def global_sum(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


DUMMY = ([0, 0], 1, 1)  # (ids, prompt_len, response_len): a 2-token stand-in for an empty micro-batch


def plan_micro_batches(items, lengths, device, *, micro_batch, max_tokens=0, packed=False):
    """This rank's items (with their token lengths) in micro-batches of similar lengths, the same number of
    micro-batches on every rank (a rank with fewer gets empty ones, which run a dummy forward).
      max_tokens = 0: about `micro_batch` items each (nearly equal counts)
      max_tokens > 0: longest first, each filled up to max_tokens tokens as the forward computes them: the
                      sum of the lengths when packed, rows x the longest when padded (an item longer than the
                      budget goes alone). Memory is then bounded by the budget, not by the longest samples.
    The loss of a micro-batch is its share of the mini-batch's global token-mean, so the split changes nothing
    but the float summation order."""
    order = sorted(range(len(items)), key=lambda i: lengths[i])  # similar lengths together: less padding
    if max_tokens <= 0:
        n = agreed_max(math.ceil(len(items) / micro_batch), device)
        groups = split_even(order, max(n, 1))
    else:
        groups = []
        for i in reversed(order):  # longest first
            g = groups[-1] if groups else []
            if packed:
                tokens = sum(lengths[j] for j in g) + lengths[i]
            else:  # rows x the longest row (the group's first)
                tokens = (len(g) + 1) * lengths[g[0] if g else i]
            if g and tokens <= max_tokens:
                g.append(i)
            else:
                groups.append([i])
        n = agreed_max(len(groups), device)
        groups += [[] for _ in range(max(n, 1) - len(groups))]
    return [[items[i] for i in g] for g in groups]


def micro_batch_logprobs(model, seqs, device, packed, chunk_size=1024):
    """seqs: [(ids, prompt_len, response_len)]. Returns (lp [rows, T], batch, select); lp holds the log-prob
    of each response token at the position that predicts it, 0 elsewhere."""
    batch = make_batch([s[0] for s in seqs], device, packed=packed)
    sel = response_select(batch, [(p, r) for _, p, r in seqs])
    lp = model.token_logprobs(batch["input_ids"], batch["targets"], sel, attention_mask=batch.get("attention_mask"),
                              position_ids=batch.get("position_ids"), chunk_size=chunk_size)
    return lp, batch, sel


@torch.no_grad()
def score(model, seqs, micro_batch, device, packed, max_tokens=0):
    """Response-token log-probs of every sequence (list of 1-D CPU tensors), micro-batched with the same
    number of forwards on every rank (empty parts run a dummy)."""
    out = [None] * len(seqs)
    for part in plan_micro_batches(list(range(len(seqs))), [len(s[0]) for s in seqs], device,
                                   micro_batch=micro_batch, max_tokens=max_tokens, packed=packed):
        chunk = [seqs[i] for i in part]
        lp, batch, _ = micro_batch_logprobs(model, chunk or [DUMMY], device, packed)
        for i, x in zip(part, gather_response(lp, batch, [(p, r) for _, p, r in chunk])):
            out[i] = x.float().cpu()
    return out


def dense(values, sel, dtype=torch.float32):
    """Per-sequence response values (list of 1-D tensors) -> the [rows, T] layout of `sel`, 0 elsewhere."""
    flat = torch.cat(values).to(sel.device, dtype) if values else torch.zeros(0, device=sel.device)
    return torch.zeros(sel.shape, dtype=dtype, device=sel.device).masked_scatter(sel, flat)


def record_lengths(f, update, samples):
    """One line of lengths.jsonl per update (rank 0 writes, f=None elsewhere): the (prompt, response) token
    lengths of every rank's step samples, {"update": 1, "samples": [[812, 64], ...]}, for
    benchmarks/trainer_lengths.py. A resumed run cuts it to its checkpoint (load_checkpoint): one line per update."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [[len(s["prompt_ids"]), len(s["response_ids"])] for s in samples])
    if f is not None:
        append_jsonl(f, {"update": update + 1, "samples": [x for g in gathered for x in g]})


def sync_engine(engine, policy, dtype):
    """Push the latest weights into the generation engine parameter by parameter (each `full_tensor()` is an
    all-gather, in the same order on all ranks); never a full state dict on one GPU."""
    if torch.cuda.is_available():  # give the trainer's cached blocks back first, or the engine cannot
        torch.cuda.empty_cache()    # re-map its memory (an OOM in vLLM's wake_up, seen on the H200)
    engine.wake_up(tags=["weights"])
    engine.load_weights(full_params(policy, dtype))
    engine.wake_up(tags=["kv_cache"])


def device_used_gib():
    """Memory in use on this GPU, all processes and allocators (the driver's count), in GiB."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2 ** 30


def parse_args():
    """--env first (pre-parsed), then every flag with that env's paper preset as its default."""
    env = env_from_argv()
    P = env.PRESET
    # The paper's settings (docs/paper.md, Stage 2 and Per-env settings); the run prints and records its diff to these.
    paper = dict(env=env.NAME, updates=P["updates"], tasks_per_update=P["tasks_per_update"],
                 group_size=P["group_size"], max_steps=P["max_steps"], history=P["history"],
                 max_prompt_tokens=P["max_prompt_tokens"], max_new_tokens=P["max_new_tokens"], temperature=1.0,
                 invalid_penalty=P["invalid_penalty"], invalid_rule="public", analysis_max_new_tokens=4096,
                 analysis_max_len=16384, min_skill_words=1, dual_clip=3.0,
                 lr=P["lr"], warmup_ratio=P["warmup_ratio"], mini_batch=P["mini_batch"],
                 micro_batch=P["micro_batch"], clip_eps=0.2, grad_clip=1.0, kl_coef=P["kl_coef"], opd_coef=0.01,
                 opd_beta=5.0, adv_mode="episode", adv_norm=P["adv_norm"], analyzer_model=None)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("env and rollout")
    add_env_arg(g, env)
    g.add_argument("--updates", type=int, default=paper["updates"], help="policy updates (each plays a fresh task batch)")
    g.add_argument("--tasks-per-update", type=int, default=paper["tasks_per_update"], help="tasks (GRPO groups) per update")
    g.add_argument("--group-size", type=int, default=paper["group_size"], help="episodes per task (a GRPO group)")
    g.add_argument("--allow-group-of-one", action="store_true", help="run --group-size 1 anyway: every GRPO "
                   "advantage is then 0, so only the KL and OPD terms train")
    add_rollout_args(g, paper, temperature_help="rollout sampling temperature (the trainer scores at 1)")
    g.add_argument("--workers", type=int, default=None, help="env worker processes per rank (default: one per "
                   "episode, at most this node's cores / local ranks)")
    g.add_argument("--lockstep", action="store_true", help="the old rollout schedule, for comparison: every "
                   "episode generates, then every env steps, turn after turn; analyses after the last episode "
                   "(benchmarks/rollout_async.py); same seeds, same episodes")
    env.add_args(g)
    g = p.add_argument_group("models and engine")
    g.add_argument("--model", required=True, help="the Stage 1 SFT checkpoint (HF folder or hub id) | tiny")
    g.add_argument("--ref-model", default=None, help="frozen KL reference (default: the starting --model)")
    g.add_argument("--analyzer-model", default=paper["analyzer_model"],
                   help="default: the evolving policy itself (SEED). A path: a fixed analyzer (static-analyzer "
                        "ablation). 'scripted': a rule-based stand-in for CPU demos")
    g.add_argument("--backend", default=None, choices=["vllm", "hf"], help="default: vllm if installed and on GPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of each GPU")
    g.add_argument("--analysis-max-new-tokens", type=int, default=paper["analysis_max_new_tokens"],
                   help="tokens of one self-analysis answer (greedy)")
    g.add_argument("--min-skill-words", type=int, default=paper["min_skill_words"], help="shortest skill that "
                   "gets a teacher signal (the public code: any non-empty skill; Stage 1's annotations use 5)")
    g.add_argument("--analysis-max-len", type=int, default=paper["analysis_max_len"],
                   help="analysis prompt + answer limit; longer episodes get no skill (teacher mask 0)")
    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=float, default=paper["lr"], help="AdamW learning rate")
    g.add_argument("--warmup-ratio", type=float, default=paper["warmup_ratio"],
                   help="linear lr warm-up over this fraction of the updates, then constant")
    g.add_argument("--mini-batch", type=int, default=paper["mini_batch"], help="step samples per optimizer step (all ranks)")
    g.add_argument("--micro-batch", type=int, default=paper["micro_batch"], help="step samples per forward (per rank)")
    g.add_argument("--micro-tokens", type=int, default=0,
                   help="token budget per forward (per rank) instead of --micro-batch samples: packed tokens, or "
                        "rows x longest when padded; 0 = off")
    g.add_argument("--packing", default="auto",
                   help="padding-free micro-batches (envs/training.py packed_attention). auto: on GPU (flash-attn "
                        "if installed, else PyTorch's varlen flash kernel, else FlexAttention), padded on CPU; on; "
                        "off; or an attention name (seed_varlen, flex_attention, flash_attention_2)")
    g.add_argument("--clip-eps", type=float, default=paper["clip_eps"], help="PPO clip range")
    g.add_argument("--dual-clip", type=float, default=paper["dual_clip"], help="dual-clip constant c: a negative-"
                   "advantage token's loss is capped at -c*A (the paper's public code, verl's clip_ratio_c); 0: off, "
                   "the plain PPO clip of the paper's text")
    g.add_argument("--grad-clip", type=float, default=paper["grad_clip"], help="global grad-norm clip")
    g.add_argument("--kl-coef", type=float, default=paper["kl_coef"], help="k3 KL-to-reference coefficient (0: no reference)")
    g.add_argument("--opd-coef", type=float, default=paper["opd_coef"], help="OPD coefficient; 0 = plain GRPO (no "
                   "analysis, no teacher pass)")
    g.add_argument("--opd-beta", type=float, default=paper["opd_beta"], help="sharpness of the OPD sigmoid gate")
    g.add_argument("--adv-mode", default=paper["adv_mode"], choices=["episode", "steps"],
                   help="GRPO statistics over the group's episodes (paper) or its flattened step samples (public code)")
    g.add_argument("--adv-norm", default=paper["adv_norm"], choices=["mean_std", "mean"],
                   help="GRPO advantage (R - mean) / std, or R - mean alone (the public code's WebShop runs)")
    g.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each decoder layer in backward: a micro-batch of 32 x ~2.5k tokens of a 0.5B "
                        "model holds ~80 GB of activations without it. Off with --micro-tokens 16384 bounds them: "
                        "the 1.5B step then ran 1.15x faster at a 71.5 GiB peak on one H200 (README, Performance)")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--seed", type=int, default=0, help="task stream, sampling and mini-batch order")
    g.add_argument("--save-every", type=int, default=10, help="trainer checkpoint + HF checkpoint every N updates "
                   "and after the last; 0: none (timing runs: benchmarks/rollout_async.py)")
    g.add_argument("--dump-examples", type=int, default=4, help="plain-vs-skill examples dumped per update")
    g.add_argument("--out", default="runs/seed", help="output folder (metrics, examples, checkpoints, manifest)")
    args = p.parse_args()
    require_positive(args, "updates", "tasks_per_update", "group_size", "max_steps", "max_new_tokens", "mini_batch",
                     "micro_batch", "workers")  # --save-every 0 is meaningful: no checkpoints (timing runs)
    if args.group_size == 1 and not args.allow_group_of_one:
        sys.exit("--group-size 1: GRPO ranks the episodes of a task against each other, so with one episode every "
                 "advantage is 0 and the policy-gradient term trains nothing; use --group-size 2 or more (the paper: "
                 f"{paper['group_size']}), or pass --allow-group-of-one to train on the KL and OPD terms alone")
    return args, env, paper


def main():
    args, env, paper = parse_args()

    # ------------------------------------------------------------------------------------------------
    # Setup: process group, models (policy + reference sharded with FSDP2), engine, env pool
    rank, world, device = init_distributed()
    on_gpu = device.type == "cuda"
    if args.backend is None:
        try:
            import vllm  # noqa: F401
            args.backend = "vllm" if on_gpu else "hf"
        except ImportError:
            args.backend = "hf"
    args.ref_model = args.ref_model or args.model
    use_opd = args.opd_coef > 0
    packed_attn = packed_attention(device, args.packing)  # None: padded micro-batches
    packed = packed_attn is not None
    os.makedirs(args.out, exist_ok=True)
    print0(f"seed_rl: env {env.NAME}, world {world}, device {device.type}, backend {args.backend}, "
           f"{f'packed ({packed_attn})' if packed else f'padded ({attn_implementation(device)})'} micro-batches of "
           f"{f'{args.micro_tokens} tokens' if args.micro_tokens else f'{args.micro_batch} samples'}")
    print0("config: " + json.dumps(vars(args)))
    print0("differs from the paper: " + json.dumps(args_diff(args, paper)))
    if args.temperature != 1.0:
        print0("warning: the trainer scores at temperature 1; with --temperature != 1 the PPO ratio is off-policy")

    tokenizer = load_tokenizer(args.model)
    stream = env.rl_tasks(args.seed, args.tasks_per_update * args.updates, args)
    if len(stream) < args.tasks_per_update * args.updates:  # the last updates would play nothing
        sys.exit(f"{env.NAME}: the train split gives {len(stream)} tasks, fewer than --updates {args.updates} x "
                 f"--tasks-per-update {args.tasks_per_update}")
    manifest = run_manifest("seed_rl.py", args, paper=paper, model=args.model, ref_model=args.ref_model,
                            tokenizer=tokenizer, split="train", games=stream, seeds={"seed": args.seed},
                            extra={"world_size": world})
    old_manifest = check_resume(os.path.join(args.out, "seed_manifest.json"), args, script="seed_rl.py",
                                out=args.out)  # every rank reads it: all refuse together, before any model loads
    if old_manifest:
        check_resumed_stream(old_manifest, stream, env, args)
    policy = shard_model(load_model(args.model, device=device, seed=args.seed, attn=packed_attn), device,
                         activation_checkpointing=args.activation_checkpointing)
    ref = None
    if args.kl_coef > 0:
        ref = shard_model(load_model(args.ref_model, device=device, seed=args.seed, attn=packed_attn,
                                     dtype=torch.bfloat16 if on_gpu else torch.float32), device, train=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.01,
                                  **adamw_impl(device))
    sync_dtype = torch.bfloat16 if on_gpu else torch.float32

    held_before = torch.cuda.memory_allocated() if on_gpu else 0  # for mem/engine_held_gib (step 5's comment)
    if args.backend == "vllm":
        if args.model == "tiny":
            raise SystemExit("--backend vllm needs a model folder (save the tiny model with sft.py first)")
        engine = VLLMBackend(args.model, tokenizer, max_model_len=max(args.analysis_max_len,
                             args.max_prompt_tokens + args.max_new_tokens), seed=args.seed,
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             want_logprobs=True)  # for the engine-vs-trainer log-prob check of every update
        engine.sleep()
    else:  # an unsharded copy for HF generate, refreshed by the same per-parameter sync as vLLM
        engine = HFBackend(load_model(args.model, device=device, seed=args.seed,
                                      dtype=torch.bfloat16 if on_gpu else torch.float32), tokenizer, want_logprobs=True)
    analyzer = engine  # SEED: the evolving policy analyzes its own episodes
    if args.analyzer_model == "scripted":
        analyzer = ScriptedAnalyzer(tokenizer)
    elif args.analyzer_model:  # static analyzer ablation: fixed weights, never synced
        analyzer = VLLMBackend(args.analyzer_model, load_tokenizer(args.analyzer_model), max_model_len=args.analysis_max_len,
                               seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization) \
            if args.backend == "vllm" else HFBackend(load_model(args.analyzer_model, device=device), load_tokenizer(args.analyzer_model))
    engine_held = torch.cuda.memory_allocated() - held_before if on_gpu else 0
    my_groups = list(range(rank, args.tasks_per_update, world))  # each rank plays its share of the groups
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks sharing this node's CPU cores
    n_workers = args.workers or max(1, min(len(my_groups) * args.group_size, (os.cpu_count() or 2) // local_world))
    pool = EnvPool(f"envs.{env.NAME}:make_game", num_workers=n_workers)

    # ------------------------------------------------------------------------------------------------
    # Resume: weights + optimizer (torch.distributed.checkpoint), update index = task cursor. The RNG needs
    # no saving: every update reseeds from (seed, update, rank) and samples are seeded per (episode, step).
    start = load_checkpoint(policy, optimizer, args, rank)
    if rank == 0:  # a resumed run keeps the first run's manifest and adds an entry for itself
        write_manifest(os.path.join(args.out, "seed_manifest.json"),
                       resumed_manifest(old_manifest, manifest, update=start, world_size=world))
    metrics_f = open_jsonl_for_append(os.path.join(args.out, "metrics.jsonl")) if rank == 0 else None
    examples_f = open_jsonl_for_append(os.path.join(args.out, "examples.jsonl")) if rank == 0 else None
    lengths_f = open_jsonl_for_append(os.path.join(args.out, "lengths.jsonl")) if rank == 0 else None
    warmup = math.ceil(args.warmup_ratio * args.updates)

    for update in range(start, args.updates):
        t_update, tm, mem = time.perf_counter(), {}, {}
        torch.manual_seed(args.seed * 1_000_003 + update * 1009 + rank)
        for group in optimizer.param_groups:  # linear warm-up over the first `warmup` updates, then constant
            group["lr"] = args.lr * min(1.0, (update + 1) / warmup) if warmup else args.lr

        # -------------------------------------------------------------------------------------------
        # 1. Rollout: the latest weights into the engine, then this rank's groups with the plain prompt.
        # 2. Self-analysis, overlapped: the moment an episode ends, the same engine (same weights) writes its
        #    skill, greedy, while the other episodes still play. Unparsable -> no teacher signal for that
        #    episode (teacher mask 0); it still trains with GRPO.
        t0 = time.perf_counter()
        sync_engine(engine, policy, sync_dtype)
        tm["sync"] = time.perf_counter() - t0
        tasks = stream[update * args.tasks_per_update:(update + 1) * args.tasks_per_update]
        specs = [dict(tasks[g], uid=f"u{update}/g{g}/r{r}", group=g, rollout=r, seed=args.seed, update=update)
                 for g in my_groups for r in range(args.group_size)]
        episodes, rt = play_episodes(env, specs, pool, engine, tokenizer, max_steps=args.max_steps,
                                     history=args.history, max_prompt_tokens=args.max_prompt_tokens,
                                     max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     invalid_fallback=args.invalid_fallback, invalid_penalty=args.invalid_penalty,
                                     invalid_rule=args.invalid_rule, lockstep=args.lockstep,
                                     analyzer=analyzer if use_opd else None,
                                     analysis_prompt=lambda ep: analysis_prompt(tokenizer, ep, args),
                                     analysis_max_new_tokens=args.analysis_max_new_tokens)
        t0 = time.perf_counter()
        for ep in episodes:  # an env failure leaves its group instead of poisoning the advantages
            if ep["env_failure"]:
                print(f"[rank {rank}] env failure: episode {ep['uid']} dropped from its group ({ep['env_failure']})")
        episodes = [ep for ep in episodes if not ep["env_failure"]]
        skills = [parse_skill(ep.get("analysis"), args) for ep in episodes]
        if on_gpu:  # device memory with the engine awake (its weights + KV cache) and the trainer resident
            mem["mem/device_used_gib_engine_awake"] = device_used_gib()
        engine.sleep()  # frees the engine's GPU memory for scoring and training
        if on_gpu:  # the engine's share: what its sleep gave back; the trainer's peak is counted from here
            mem["mem/engine_awake_gib"] = mem["mem/device_used_gib_engine_awake"] - device_used_gib()
            torch.cuda.reset_peak_memory_stats()
        # phases of the rollout's wall time (they sum to time/rollout); busy_*: time each had work in flight
        tm.update(rollout=rt["wall"], generate=rt["generate"], env=rt["reset"] + rt["env"] + rt["parse"],
                  analysis=rt["analysis"], sleep=time.perf_counter() - t0,
                  **{k: v for k, v in rt.items() if k.startswith("busy_")})

        # -------------------------------------------------------------------------------------------
        # 3. Dual-context scoring with the pre-update weights, no grad: old_lp under the plain prompt,
        #    teacher_lp of the SAME response tokens under the skill prompt, ref_lp under the plain prompt.
        t0 = time.perf_counter()
        samples = step_samples(episodes, skills, tokenizer)  # one per (episode, step)
        plain = [(s["prompt_ids"] + s["response_ids"], len(s["prompt_ids"]), len(s["response_ids"])) for s in samples]
        teach = [(s["teacher_ids"] + s["response_ids"], len(s["teacher_ids"]), len(s["response_ids"]))
                 for s in samples if "teacher_ids" in s]
        record_lengths(lengths_f, update, samples)
        lps = score(policy, plain + teach, args.micro_batch, device, packed, args.micro_tokens)  # both contexts
        old, tlp = lps[:len(plain)], iter(lps[len(plain):])
        refs = score(ref, plain, args.micro_batch, device, packed, args.micro_tokens) if ref is not None else old
        for s, o, r in zip(samples, old, refs):
            s["old_lp"], s["ref_lp"] = o, r
            s["teacher_lp"] = next(tlp) if "teacher_ids" in s else o  # masked out when there is no skill
        tm["scoring"] = time.perf_counter() - t0

        # -------------------------------------------------------------------------------------------
        # 4. Advantages: GRPO over the (surviving) episodes of each group, broadcast to every token
        rets, grps, lens = [ep["return"] for ep in episodes], [ep["group"] for ep in episodes], [len(ep["steps"]) for ep in episodes]
        adv = grpo_advantages(rets, grps, lens if args.adv_mode == "steps" else None, std_norm=args.adv_norm == "mean_std")
        for s in samples:
            s["adv"] = adv[s["ep"]]

        # -------------------------------------------------------------------------------------------
        # 5. Update: one pass over the update's step samples, mini-batches of `mini_batch` step samples over
        #    all ranks (one optimizer step each), micro-batches of `micro_batch` (gradient accumulation).
        t0 = time.perf_counter()
        totals = dict.fromkeys(LOSS_SUMS + ["tokens", "teacher_tokens"], 0.0)
        grad_norms, skipped = [], 0
        policy.train()
        for mini, n_tok, n_teach in plan_mini_batches(samples, args, update, device):
            for micro in plan_micro_batches(mini, [len(s["prompt_ids"]) + len(s["response_ids"]) for s in mini], device,
                                            micro_batch=args.micro_batch, max_tokens=args.micro_tokens, packed=packed):
                seqs = [(s["prompt_ids"] + s["response_ids"], len(s["prompt_ids"]), len(s["response_ids"])) for s in micro]
                lp, batch, sel = micro_batch_logprobs(policy, seqs or [DUMMY], device, packed)
                t = per_token(micro, sel)  # old_lp, ref_lp, teacher_lp, adv, mask, teacher_mask: each [rows, T]
                loss, sums = seed_loss(lp, t["old_lp"], t["ref_lp"], t["teacher_lp"], t["adv"], t["mask"],
                                       t["teacher_mask"], n_tok, n_teach, clip_eps=args.clip_eps,
                                       kl_coef=args.kl_coef, opd_coef=args.opd_coef, beta=args.opd_beta,
                                       dual_clip=args.dual_clip or None)
                # FSDP averages gradients over ranks; this rank's loss is already its share of the global
                # token-mean, so undo the average by scaling with the world size.
                (loss * world).backward()
                for k, v in sums.items():
                    totals[k] += float(v)
            totals["tokens"] += n_tok / world  # every rank adds it; summed over ranks below
            totals["teacher_tokens"] += n_teach / world
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if math.isfinite(grad_norm):  # the norm is global, so every rank takes the same branch
                optimizer.step()
                grad_norms.append(grad_norm)
            else:
                print0(f"error: update {update + 1}: non-finite loss/gradient, optimizer step skipped")
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
        tm["train"] = time.perf_counter() - t0
        if on_gpu:
            # The trainer's own peak over steps 3-5 (scoring and training). vLLM's sleep unmaps the memory under the
            # engine's weights and KV cache but keeps their tensors (vllm/device_allocator/cumem.py), so torch's
            # allocator still counts them: max_memory_allocated() includes a sleeping engine. The H200 runs'
            # 67-73 GiB "trainer peak" of a 0.5B policy fits that: the engine's 0.4 x 140 GiB plus the trainer's
            # (and the peak was reset at the end of an update, so the next wake-up fell inside it). So the peak is
            # reset once the engine sleeps (step 2), and what the engines hold in torch's allocator, measured
            # around their creation, is taken off; the engine's own share on the device is mem/engine_awake_gib.
            # (Not yet run on a GPU since: the CPU tests do not reach this.)
            mem["mem/trainer_peak_gib"] = (torch.cuda.max_memory_allocated() - engine_held) / 2 ** 30
            mem["mem/engine_held_gib"] = engine_held / 2 ** 30
            mem["mem/device_used_gib_training"] = device_used_gib()

        # -------------------------------------------------------------------------------------------
        # 6. Log and save
        tm["update"] = time.perf_counter() - t_update
        metrics = update_metrics(env, args, update, episodes, skills, samples, totals, grad_norms, skipped,
                                 len(specs) - len(episodes), tm, mem, device, world)
        if rank == 0:
            g = lambda k: "-" if metrics[k] is None else f"{metrics[k]:.4g}"
            print0(f"update {update + 1}/{args.updates} | success {g('rollout/success_rate')} len "
                   f"{g('rollout/episode_length')} invalid {g('rollout/invalid_rate')} | pg {g('loss/pg')} kl "
                   f"{g('loss/kl')} opd {g('loss/opd')} gate {g('opd/gate_mean')} cover {g('opd/teacher_coverage')} "
                   f"parse {g('skill/parse_rate')} | {tm['update']:.1f}s")
            dump_examples(examples_f, update, samples, episodes, skills, tokenizer, args.dump_examples)
        if args.save_every > 0 and ((update + 1) % args.save_every == 0 or update + 1 == args.updates):
            save_checkpoint(policy, optimizer, tokenizer, args, update + 1, metrics, rank)
        if rank == 0:
            append_jsonl(metrics_f, metrics)
    pool.close()
    dist.barrier()
    dist.destroy_process_group()


# ====================================================================================================
# The steps of an update, each a named function (called once per update by main, in this order)

def analysis_prompt(tokenizer, episode, args):
    """Step 2's prompt for an ended episode (token ids), or None where prompt + answer would not fit the
    engine's context (that episode gets no skill). The rollout loop submits it the moment the episode ends."""
    ids = chat_prompt(tokenizer, build_analysis_prompt(episode))[1]
    return ids if len(ids) + args.analysis_max_new_tokens <= args.analysis_max_len else None


def parse_skill(answer, args):
    """Step 2's skill from the analysis answer (None: no answer, or it does not parse)."""
    rec, _ = parse_analysis(answer, min_words=args.min_skill_words) if answer is not None else (None, None)
    return rec["episode_skill"] if rec else None


def step_samples(episodes, skills, tokenizer):
    """Step 3's inputs: one sample per (episode, step) with a response, the unit of GRPO/PPO in this multi-turn
    setting. The teacher prompt is the step's own plain prompt (same history entries) with the skill block
    inserted; the response token ids are the very same list in both contexts."""
    samples = []
    for e, ep in enumerate(episodes):
        for t, st in enumerate(ep["steps"]):
            if not st["response_ids"]:
                continue
            s = dict(ep=e, group=ep["group"], rollout=ep["rollout"], step=t, prompt_ids=st["prompt_ids"],
                     response_ids=st["response_ids"], engine_lp=st["response_logprobs"],
                     teacher_mask=float(skills[e] is not None))
            if skills[e] is not None:
                s["teacher_ids"] = chat_prompt(tokenizer, step_prompt(ep, t, st["history_used"], skills[e]))[1]
            samples.append(s)
    return samples


def plan_mini_batches(samples, args, update, device):
    """Step 5's plan: yields (this rank's samples of the mini-batch, its response tokens over all ranks, its
    teacher tokens over all ranks). Mini-batches are drawn from one seeded permutation of a global sample
    order (group, rollout, step), identical on every world size; each rank keeps the samples it holds."""
    counts = [0.0] * args.tasks_per_update
    for s in samples:
        counts[s["group"]] += 1
    counts = [int(c) for c in global_sum(counts, device)]
    offset = [sum(counts[:g]) for g in range(len(counts))]
    samples.sort(key=lambda s: (s["group"], s["rollout"], s["step"]))
    seen = {}
    for s in samples:  # gid: the sample's index in the global order
        s["gid"] = offset[s["group"]] + seen.get(s["group"], 0)
        seen[s["group"]] = seen.get(s["group"], 0) + 1
    n_global = sum(counts)
    perm = torch.randperm(n_global, generator=torch.Generator().manual_seed(args.seed * 7919 + update)).tolist()
    by_gid = {s["gid"]: s for s in samples}
    for i in range(max(1, math.ceil(n_global / args.mini_batch))):
        part = [by_gid[g] for g in perm[i * args.mini_batch:(i + 1) * args.mini_batch] if g in by_gid]
        n_tok, n_teach = global_sum([sum(len(s["response_ids"]) for s in part),
                                     sum(len(s["response_ids"]) * s["teacher_mask"] for s in part)], device)
        yield part, n_tok, n_teach


def per_token(micro, sel):
    """The loss's per-token inputs of a micro-batch in the [rows, T] layout of `sel` (0 off the responses)."""
    if not micro:  # a dummy micro-batch: every mask 0, so it adds nothing but keeps the ranks in step
        zero = torch.zeros_like(sel, dtype=torch.float32)
        return dict(old_lp=zero, ref_lp=zero, teacher_lp=zero, adv=zero, mask=zero, teacher_mask=zero)
    full = lambda key: [torch.full((len(s["response_ids"]),), float(s[key])) for s in micro]
    return dict(old_lp=dense([s["old_lp"] for s in micro], sel), ref_lp=dense([s["ref_lp"] for s in micro], sel),
                teacher_lp=dense([s["teacher_lp"] for s in micro], sel), adv=dense(full("adv"), sel),
                mask=sel.float(), teacher_mask=dense(full("teacher_mask"), sel))


LOSS_SUMS = ["pg", "kl", "opd", "gate", "gate_active", "gap", "clipped", "ratio"]


def update_metrics(env, args, update, episodes, skills, samples, totals, grad_norms, skipped, failures, tm, mem,
                   device, world):
    """Step 6: the update's metrics over all ranks (a collective: every rank calls it; rank 0 gets the dict)."""
    keys = list(totals)
    totals = dict(zip(keys, global_sum([totals[k] for k in keys], device)))
    eng = [abs(a - b) for s in samples if s["engine_lp"] is not None
           for a, b in zip(s["engine_lp"], s["old_lp"].tolist())]
    light = [dict(group=ep.get("category"), success=ep["success"], score=ep.get("score", float(ep["success"])),
                  length=ep["length"], ret=ep["return"], invalid=sum(not s["valid"] for s in ep["steps"]),
                  inadmissible=sum(s.get("admissible_action") is False for s in ep["steps"]),
                  steps=len(ep["steps"]), truncated=ep["truncated_responses"], skill=skills[e] is not None)
             for e, ep in enumerate(episodes)]
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(eps=light, fails=failures, eng=eng, mem=mem))
    if dist.get_rank() != 0:
        return None
    use_opd = args.opd_coef > 0
    eps = [x for g in gathered for x in g["eps"]]
    eng_diff = [x for g in gathered for x in g["eng"]]
    n_steps = sum(x["steps"] for x in eps) or 1
    tok, ttok = totals["tokens"] or 1, totals["teacher_tokens"]
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    opd = lambda k: totals[k] / ttok if use_opd and ttok else None
    metrics = {"update": update + 1, "time": time.time(), "lr": args.lr * min(1.0, (update + 1) / max(1, math.ceil(
                   args.warmup_ratio * args.updates))) if args.warmup_ratio else args.lr,
               "rollout/episodes": len(eps), "rollout/env_failures": sum(g["fails"] for g in gathered),
               "rollout/success_rate": mean([x["success"] for x in eps]),
               **{f"rollout/success/{c}": mean([x["success"] for x in eps if x["group"] == c])
                  for c in env.GROUPS or sorted({str(x["group"]) for x in eps})},  # WebShop: the categories seen
               "rollout/score_mean": mean([x["score"] for x in eps]),
               "rollout/return_mean": mean([x["ret"] for x in eps]),
               "rollout/episode_length": mean([x["length"] for x in eps]),
               "rollout/invalid_rate": sum(x["invalid"] for x in eps) / n_steps,
               "rollout/inadmissible_rate": sum(x["inadmissible"] for x in eps) / n_steps,
               "rollout/truncated_rate": sum(x["truncated"] for x in eps) / n_steps,
               "skill/parse_rate": mean([x["skill"] for x in eps]) if use_opd else None,
               "opd/teacher_coverage": ttok / tok if use_opd else None,
               "loss/pg": totals["pg"] / tok, "loss/kl": totals["kl"] / tok, "loss/opd": opd("opd"),
               "opd/gate_mean": opd("gate"), "opd/gate_active_ratio": opd("gate_active"),
               "opd/teacher_gap_mean": opd("gap"),
               "pg/clipfrac": totals["clipped"] / tok, "pg/ratio_mean": totals["ratio"] / tok,
               "grad_norm": mean(grad_norms), "tokens/response": int(totals["tokens"]),
               "train/optimizer_steps": len(grad_norms), "train/skipped_steps": skipped,
               "check/engine_lp_absdiff_mean": mean(eng_diff), "check/engine_lp_absdiff_max": max(eng_diff, default=None),
               **{f"time/{k}": v for k, v in tm.items()},
               **{k: max(g["mem"][k] for g in gathered) for k in gathered[0]["mem"]}}  # the fullest rank
    metrics["loss/total"] = metrics["loss/pg"] + args.kl_coef * metrics["loss/kl"] + \
        args.opd_coef * (metrics["loss/opd"] or 0.0)
    return metrics


def dump_examples(f, update, samples, episodes, skills, tokenizer, n):
    """Plain vs skill scores of the same sampled actions, so a reader can *see* the OPD signal."""
    for s in [s for s in samples if s["teacher_mask"]][:n]:
        ep = episodes[s["ep"]]
        append_jsonl(f, {"update": update + 1, "uid": ep["uid"], "step": s["step"] + 1, "skill": skills[s["ep"]],
                         "action": ep["steps"][s["step"]]["action"],
                         "tokens": [tokenizer.decode([t]) for t in s["response_ids"]],
                         "plain_lp": s["old_lp"].tolist(), "teacher_lp": s["teacher_lp"].tolist(),
                         "gap": (s["teacher_lp"] - s["old_lp"]).tolist()})


# ====================================================================================================
# Resume and checkpoints

def check_resumed_stream(old_manifest, stream, env, args):
    """A resumed run may change --updates (envs/records.py RESUME_MAY_CHANGE), so its task stream may be longer
    or shorter; the updates both runs play must still get the same tasks, and the lr warm-up (a fraction of
    --updates) must keep its length."""
    old_args = old_manifest["args"]
    if old_args.get("updates", args.updates) == args.updates:
        ok = old_manifest["games"]["sha256"] == games_sha256(stream)
    else:
        old_stream = env.rl_tasks(args.seed, args.tasks_per_update * old_args["updates"], args)
        n = min(len(old_stream), len(stream))
        ok = old_manifest["games"]["sha256"] == games_sha256(old_stream) and old_stream[:n] == stream[:n]
        warm = [math.ceil(args.warmup_ratio * u) for u in (old_args["updates"], args.updates)]
        if warm[0] != warm[1]:
            sys.exit(f"{args.out}: --updates {old_args['updates']} then, {args.updates} now, moves the lr warm-up "
                     f"(--warmup-ratio {args.warmup_ratio} of --updates: {warm[0]} then, {warm[1]} now); rerun with "
                     f"--updates {old_args['updates']}, or use another --out")
    if not ok:
        sys.exit(f"{args.out}: the task stream differs from the one this run started with (other data?); use "
                 f"another --out")


def load_checkpoint(policy, optimizer, args, rank):
    """Weights + optimizer of the last complete trainer checkpoint (`checkpoint`, or `checkpoint.old` after a
    kill between the two renames of a save), and metrics.jsonl, examples.jsonl and lengths.jsonl cut to its
    update, so that the updates after it, played again, are written once. Returns the number of updates done
    (0 without a checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    folder, state = latest_checkpoint(os.path.join(args.out, "checkpoint"), "state.json")
    start = state["update"] if state else 0
    if folder:
        msd, osd = get_state_dict(policy, optimizer)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=folder)
        set_state_dict(policy, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if rank == 0:  # one line per update: what is past the checkpoint is recomputed
        for name in ("metrics.jsonl", "examples.jsonl", "lengths.jsonl"):
            path = os.path.join(args.out, name)
            rows = [r for r in read_jsonl(path) if r["update"] <= start]
            if name == "metrics.jsonl" and state and state.get("metrics") and \
                    not any(r["update"] == start for r in rows):  # killed between the save and the metrics line
                rows.append(state["metrics"])
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            os.replace(path + ".tmp", path)
    if folder:
        print0(f"resumed from {folder} after update {start}")
    return start


def save_checkpoint(policy, optimizer, tokenizer, args, update, metrics, rank):
    """A Hugging Face folder of the policy, then the trainer state (sharded weights and optimizer, the update
    index). Each is written under a temporary name and renamed into place, so neither is ever half written;
    the trainer state last, so a kill before it is complete resumes from the previous update, which plays
    this one again and rewrites its HF folder. The trainer state keeps a complete checkpoint at every instant
    (envs/training.py save_checkpoint_dir)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    hf = os.path.join(args.out, "hf", "final" if update == args.updates else f"update_{update:04d}")
    if rank == 0:
        shutil.rmtree(hf + ".tmp", ignore_errors=True)
    save_hf_checkpoint(policy, tokenizer, hf + ".tmp", rank)
    if rank == 0:
        shutil.rmtree(hf, ignore_errors=True)
        os.rename(hf + ".tmp", hf)
    msd, osd = get_state_dict(policy, optimizer)
    save_checkpoint_dir(os.path.join(args.out, "checkpoint"),
                        lambda tmp: dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp),
                        "state.json", {"update": update, "metrics": metrics}, rank)


if __name__ == "__main__":
    main()
