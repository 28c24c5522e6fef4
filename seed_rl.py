"""Stage 2 of SEED: self-evolving on-policy distillation (OPD) + GRPO + KL, FSDP2 over N GPUs, vLLM co-located.

One policy update (docs/paper.md, Stage 2) is the story of `main()` below:
  1. rollout     sync the latest weights into the generation engine; play tasks x group episodes with the
                 plain prompt (each rank plays its share of the groups), each episode at its own pace
  2. analysis    the same engine, same weights, writes one hindsight skill per episode (greedy), started the
                 moment that episode ends, while the others still play
  3. scoring     no grad, pre-update weights: old log-probs of the sampled response tokens under the plain
                 prompt and reference log-probs (started on a side thread the moment the last env step is in,
                 while the engine writes the last skills), then teacher log-probs of the SAME tokens under the
                 skill prompt
  4. advantages  GRPO per group of episodes, broadcast to every response token of every step
  5. update      PPO-clip + opd_coef x sigmoid-gated OPD + kl_coef x k3 KL, token-mean, AdamW
  6. log, save   metrics JSONL, plain-vs-skill example and self-analysis dumps, checkpoints
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
    # a held-out curve from the run itself: ALFWorld's 274 valid games, plain prompt, before the first update,
    # every 25 updates and after the last (heldout.jsonl; benchmarks/learning.py --eval-in-run reads it)
    torchrun --nproc_per_node 8 seed_rl.py --env alfworld --model runs/stage1/sft --eval-every 25 --out runs/seed

Where this follows the paper's public code rather than its Algorithm 1 (docs/paper.md): the teacher is scored
once, with the pre-update weights (Algorithm 1 re-scores it with the trainable policy; both agree at the
first mini-batch).
"""
import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import shutil
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from envs import env_from_argv, env_parser, refuse_unused, require_positive, require_split
from common.backends import HFBackend, ScriptedAnalyzer, VLLMBackend
from common.models import attn_implementation, load_model, load_tokenizer
from envs.pool import EnvPool
from common.records import (OPD_ONLY_FLAGS, append_jsonl, args_diff, check_resume, games_sha256,
                            open_jsonl_for_append, read_jsonl, resumed_manifest, run_manifest, write_manifest)
from common.tracking import Tracker, add_log_to_arg
from common.rollout import (add_kv_cache_arg, add_rollout_args, play_episodes, rollout_kwargs, step_prompt,
                            summarize_episodes)
from common.checkpoints import latest_checkpoint, save_checkpoint_dir, save_hf_checkpoint
from common.packing import gather_response, make_batch, packed_attention, response_select
from common.training import add_fused_arg, adamw_impl, check_fused, full_params, init_distributed, print0, shard_model
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
    Returns {"loss": the loss to backpropagate, and for logging the sums over the micro-batch's tokens:
    "pg", "kl", "opd", "gate", "gate_active", "gap", "clipped", "ratio"} (LOSS_SUMS)."""
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
    return {"loss": loss, **sums}


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


def clip_and_step(policy, optimizer, grad_clip):
    """Clip the global grad norm and take the optimizer step, unless the norm is not finite (then skip it; the
    norm is global, so every rank takes the same branch). Returns the norm, or None when skipped."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm if math.isfinite(grad_norm) else None


def device_used_gib():
    """Memory in use on this GPU, all processes and allocators (the driver's count), in GiB."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2 ** 30


class Timer(dict):
    """Seconds per phase of one update, {phase: s}, logged as time/<phase>: `with tm.phase("scoring"): ...`
    (a phase entered twice adds up)."""

    @contextlib.contextmanager
    def phase(self, name):
        t0 = time.perf_counter()
        yield
        self[name] = self.get(name, 0.0) + time.perf_counter() - t0


class DeviceMemory:
    """The update's GPU memory metrics (mem/*; none on CPU). Why the bookkeeping: vLLM's sleep unmaps the
    engine's memory but keeps its tensors, so torch's allocator counts a sleeping engine; the trainer's peak is
    therefore reset once the engine sleeps, and what the engines hold in that allocator is taken off it."""

    def __init__(self, on_gpu):
        self.on_gpu, self.engine_held, self.mem = on_gpu, 0, {}

    @contextlib.contextmanager
    def engines(self):
        """Around the engines' creation: what they hold in torch's allocator (mem/engine_held_gib)."""
        before = torch.cuda.memory_allocated() if self.on_gpu else 0
        yield
        self.engine_held = torch.cuda.memory_allocated() - before if self.on_gpu else 0

    def new_update(self):
        self.mem = {}
        if self.on_gpu:  # the rollout's peak is counted from here
            torch.cuda.reset_peak_memory_stats()
        return self.mem

    def sleep(self, engine):
        """Put the engine to sleep; record the device's use with it awake and the share its sleep gave back, and
        the allocator's peak so far (mem/rollout_peak_gib: the awake engine, the trainer's weights and optimizer
        state, and step 3a's plain scoring on the side thread, which ran beside the engine)."""
        if self.on_gpu:
            self.mem["mem/rollout_peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            self.mem["mem/device_used_gib_engine_awake"] = device_used_gib()
        engine.sleep()
        if self.on_gpu:  # the trainer's peak is counted from here
            self.mem["mem/engine_awake_gib"] = self.mem["mem/device_used_gib_engine_awake"] - device_used_gib()
            torch.cuda.reset_peak_memory_stats()

    def after_training(self):
        """The trainer's own peak over steps 3-5 (scoring and training), and the device's use."""
        if self.on_gpu:
            self.mem["mem/trainer_peak_gib"] = (torch.cuda.max_memory_allocated() - self.engine_held) / 2 ** 30
            self.mem["mem/engine_held_gib"] = self.engine_held / 2 ** 30
            self.mem["mem/device_used_gib_training"] = device_used_gib()


def lr_at(update, args):
    """The lr of an update (0-based): linear warm-up over the first ceil(warmup_ratio x updates), then constant."""
    warmup = math.ceil(args.warmup_ratio * args.updates)
    return args.lr * min(1.0, (update + 1) / warmup) if warmup else args.lr


def sequence(s, prompt="prompt_ids"):
    """A step sample as the scorer's (ids, prompt_len, response_len), under the plain or the teacher prompt."""
    return s[prompt] + s["response_ids"], len(s[prompt]), len(s["response_ids"])


# --eval-every: the paper's evaluation temperature (evaluate.py's default, from common/paper_results.json), the
# flags that only matter with it on, and how many held-out episodes play at once (evaluate.py's --batch-episodes)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "common", "paper_results.json")) as _f:
    EVAL_TEMPERATURE = json.load(_f)["settings"]["temperature"]["value"]
EVAL_FLAGS = ["eval_splits", "eval_limit", "eval_samples", "eval_temperature", "eval_max_steps", "eval_seed"]
EVAL_LIVE = 128


def parse_args():
    """--env first (pre-parsed), then every flag with that env's paper preset as its default."""
    env = env_from_argv()
    P = env.PRESET
    # The paper's settings (docs/paper.md, Stage 2 and Per-env settings); the run prints and records its diff to these.
    paper = dict(env=env.NAME, updates=P["updates"], tasks_per_update=P["tasks_per_update"],
                 group_size=P["group_size"], max_steps=P["max_steps"], history=P["history"],
                 max_prompt_tokens=P["max_prompt_tokens"], max_new_tokens=P["max_new_tokens"], temperature=1.0,
                 invalid_penalty=P["invalid_penalty"], invalid_rule="public", analysis_max_new_tokens=4096,
                 analysis_loop_stop=0, analysis_max_len=16384, min_skill_words=1, dual_clip=3.0,
                 lr=P["lr"], warmup_ratio=P["warmup_ratio"], mini_batch=P["mini_batch"],
                 micro_batch=P["micro_batch"], clip_eps=0.2, grad_clip=1.0, kl_coef=P["kl_coef"], opd_coef=0.01,
                 opd_beta=5.0, adv_mode="episode", adv_norm=P["adv_norm"], analyzer_model=None)
    p, g = env_parser(__doc__, env, group="env and rollout")
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
    g.add_argument("--probe-action", default=None, metavar="ACTION",
                   help="plumbing check, not a task: an episode's return is 1 when its first parsed action is ACTION "
                        "(e.g. 'look' in ALFWorld; 'admissible': any well-formed action the env offers at that step), "
                        "else 0; the env's reward is ignored. A working loop raises rollout/probe_rate within a few "
                        "updates (use with --max-steps 1)")
    env.add_args(g)
    g = p.add_argument_group("models and engine")
    g.add_argument("--model", required=True, help="the Stage 1 SFT checkpoint (HF folder or hub id) | tiny")
    g.add_argument("--ref-model", default=None, help="frozen KL reference (default: the starting --model)")
    g.add_argument("--analyzer-model", default=paper["analyzer_model"],
                   help="default: the evolving policy itself (SEED). A path: a fixed analyzer (static-analyzer "
                        "ablation). 'scripted': a rule-based stand-in for CPU demos")
    g.add_argument("--backend", default=None, choices=["vllm", "hf"], help="default: vllm if installed and on GPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of each GPU")
    add_kv_cache_arg(g)
    g.add_argument("--analysis-max-new-tokens", type=int, default=paper["analysis_max_new_tokens"],
                   help="tokens of one self-analysis answer (greedy)")
    g.add_argument("--analysis-loop-stop", type=int, default=paper["analysis_loop_stop"], metavar="WINDOW",
                   help="end a self-analysis once its last WINDOW tokens are one block written over and over (a loop). "
                   "A greedy answer that loops runs to --analysis-max-new-tokens, and the episodes that end last wait "
                   "for it. A skill that faithfully lists the episode's actions repeats at most --max-steps of them "
                   "(~12 tokens each), so a WINDOW above that never cuts one: e.g. 256 at 15 steps, 512 at 30 "
                   "(benchmarks/analysis_loops.py replays a run's answers). 0: off, as the paper")
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
                   help="padding-free micro-batches (common/packing.py packed_attention). auto: on GPU (flash-attn "
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
    g.add_argument("--checkpoint-policy", default="full", choices=["full", "selective"],
                   help="what a checkpointed layer recomputes in backward: full = the whole layer; selective = only "
                        "the elementwise ops (norms, rotary, SiLU), keeping the matmul and attention outputs")
    g.add_argument("--checkpoint-every", type=int, default=1,
                   help="checkpoint every N-th decoder layer (1 = all; 2 = half: memory the step does not need "
                        "buys back speed)")
    add_fused_arg(g)
    g.add_argument("--serial-scoring", action="store_true",
                   help="score the plain prompts (old and reference log-probs) after the rollout, with the engine "
                        "asleep, instead of on a side thread beside the awake engine while it writes the last "
                        "self-analyses: for a model whose scoring does not fit beside the engine, or to measure the "
                        "overlap (README, Performance)")
    g = p.add_argument_group("held-out evaluation during training (off by default; evaluate.py is the full report)")
    g.add_argument("--eval-every", type=int, default=0, help="play the held-out tasks with the plain prompt (no "
                   "skill: what is deployed) before the first update, every N updates and after the last, with the "
                   "run's own engine; one row per episode in heldout.jsonl. 0: off")
    # Search's test sets are files of evaluate.py (--test-files); its val split is held out of the train questions
    g.add_argument("--eval-splits", default="val" if env.NAME == "search" else ",".join(P["eval_splits"]),
                   help=f"comma-separated held-out splits ({env.NAME}: {', '.join(env.SPLITS)})")
    g.add_argument("--eval-limit", type=int, default=P["eval_limit"] or 0, help="tasks per split, as evaluate.py "
                   "--limit picks them (0: all, e.g. ALFWorld's 140 + 134 valid games)")
    g.add_argument("--eval-samples", type=int, default=1, help="episodes per held-out task")
    g.add_argument("--eval-temperature", type=float, default=EVAL_TEMPERATURE,
                   help="sampling temperature of the held-out episodes (the paper's evaluation: 0.4)")
    g.add_argument("--eval-max-steps", type=int, default=None, help="steps per held-out episode (default: --max-steps)")
    g.add_argument("--eval-seed", type=int, default=0, help="the held-out subset (--eval-limit) and its sampling "
                   "seeds, the same whatever --seed: every run and every evaluation point plays the same episodes' "
                   "seeds, so start and end, SEED and GRPO compare task by task")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--seed", type=int, default=0, help="task stream, sampling and mini-batch order")
    g.add_argument("--save-every", type=int, default=10, help="trainer checkpoint + HF checkpoint every N updates "
                   "and after the last; 0: none (timing runs: benchmarks/rollout_async.py)")
    g.add_argument("--dump-examples", type=int, default=4, help="steps dumped per update to examples.jsonl: "
                   "plain-vs-skill scores of the same tokens (GRPO: the plain scores); as many self-analysis "
                   "answers to analyses.jsonl (SEED)")
    g.add_argument("--out", default="runs/seed", help="output folder (metrics, examples, checkpoints, manifest)")
    add_log_to_arg(g)
    args = p.parse_args()
    require_positive(args, "updates", "tasks_per_update", "group_size", "max_steps", "max_new_tokens", "mini_batch",
                     "micro_batch", "workers", "checkpoint_every", "eval_samples",
                     "eval_max_steps")  # --save-every 0: no checkpoints (timing runs)
    if not args.activation_checkpointing and (args.checkpoint_policy != "full" or args.checkpoint_every != 1):
        sys.exit("--checkpoint-policy/--checkpoint-every choose how layers are recomputed, and "
                 "--no-activation-checkpointing recomputes none: drop one or the other")
    if args.group_size == 1 and not args.allow_group_of_one:
        sys.exit("--group-size 1: GRPO ranks the episodes of a task against each other, so with one episode every "
                 "advantage is 0 and the policy-gradient term trains nothing; use --group-size 2 or more (the paper: "
                 f"{paper['group_size']}), or pass --allow-group-of-one to train on the KL and OPD terms alone")
    if args.analysis_loop_stop < 0 or args.analysis_loop_stop == 1:
        sys.exit(f"--analysis-loop-stop {args.analysis_loop_stop}: expected 0 (off) or a WINDOW of at least 2 tokens "
                 "(a loop is a block written twice or more; e.g. 512)")
    # flags that would change nothing in this run are refused (issue 29; tests/test_flags.py walks them all)
    if args.opd_coef <= 0:
        refuse_unused(p, args, OPD_ONLY_FLAGS, "with --opd-coef 0 (GRPO) no episode is analyzed and there is no "
                      "OPD term")
    if args.kl_coef <= 0:
        refuse_unused(p, args, ["ref_model"], "with --kl-coef 0 there is no KL term and no reference model")
    if args.group_size != 1:
        refuse_unused(p, args, ["allow_group_of_one"], f"it applies to --group-size 1 only, not {args.group_size}")
    if args.micro_tokens > 0:
        refuse_unused(p, args, ["micro_batch"], f"with --micro-tokens {args.micro_tokens} the micro-batches are "
                      "filled by tokens, not by a count of samples")
    if args.eval_every < 0:
        sys.exit(f"--eval-every {args.eval_every}: expected 0 (off) or a number of updates")
    if args.eval_every == 0:
        refuse_unused(p, args, EVAL_FLAGS, "with --eval-every 0 there is no held-out evaluation")
    args.eval_max_steps = args.eval_max_steps or args.max_steps
    for split in args.eval_splits.split(","):
        require_split(env, "--eval-splits", split.strip())
    if env.NAME == "search":
        refuse_unused(p, args, ["test_files"], "seed_rl.py trains on the search env's train split (the test files "
                      "are evaluate.py's)")
    return args, env, paper


def main():
    args, env, paper = parse_args()
    rank, world, device = init_distributed()
    run = setup(args, env, paper, rank, world, device)  # models, engine, analyzer, env pool, task stream
    policy, optimizer, engine, tokenizer = run.policy, run.optimizer, run.engine, run.tokenizer

    # ------------------------------------------------------------------------------------------------
    # Resume: weights + optimizer (torch.distributed.checkpoint), update index = task cursor. The RNG needs
    # no saving: every update reseeds from (seed, update, rank) and samples are seeded per (episode, step).
    start = load_checkpoint(policy, optimizer, args, rank)
    if rank == 0:  # a resumed run keeps the first run's manifest and adds an entry for itself
        write_manifest(os.path.join(args.out, "seed_manifest.json"),
                       resumed_manifest(run.old_manifest, run.manifest, update=start, world_size=world))
    metrics_f, examples_f, lengths_f, analyses_f = [
        open_jsonl_for_append(os.path.join(args.out, name)) if rank == 0 else None
        for name in ("metrics.jsonl", "examples.jsonl", "lengths.jsonl", "analyses.jsonl")]

    for update in range(start, args.updates):
        tm, mem = Timer(), run.memory.new_update()
        t_update = time.perf_counter()
        torch.manual_seed(args.seed * 1_000_003 + update * 1009 + rank)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(update, args)

        # -------------------------------------------------------------------------------------------
        # 1. Rollout: the latest weights into the engine, then this rank's groups with the plain prompt.
        # 2. Self-analysis, overlapped: the moment an episode ends, the same engine (same weights) writes its
        #    skill, greedy, while the other episodes still play. Unparsable -> no teacher signal for that
        #    episode (teacher mask 0); it still trains with GRPO.
        with tm.phase("sync"):
            sync_engine(engine, policy, run.sync_dtype)
        if heldout_due(run, args, update):  # the policy after `update` updates (0: the start), before this rollout
            with tm.phase("heldout"):
                heldout_eval(run, args, env, update, rank, world)
        tasks = run.stream[update * args.tasks_per_update:(update + 1) * args.tasks_per_update]
        specs = [dict(tasks[g], uid=f"u{update}/g{g}/r{r}", group=g, rollout=r, seed=args.seed, update=update)
                 for g in run.my_groups for r in range(args.group_size)]
        # 3a, overlapped: the plain scoring needs only the played steps, so with self-analyses still to come it
        #     starts on a side thread the moment the last env step is in (the engine decodes a few answers and
        #     leaves the GPU mostly idle meanwhile); with none (GRPO) or --serial-scoring it runs after the sleep.
        plain_job = []
        start_plain = None if args.opd_coef <= 0 or args.serial_scoring else \
            (lambda eps: plain_job.append(run.side.submit(score_plain, run, args, device, eps, run.side_stream)))
        episodes, rt = play_episodes(env, specs, run.pool, engine, tokenizer, **rollout_kwargs(args),
                                     lockstep=args.lockstep, analyzer=run.analyzer if args.opd_coef > 0 else None,
                                     analysis_prompt=lambda ep: analysis_prompt(tokenizer, ep, args, env),
                                     analysis_max_new_tokens=args.analysis_max_new_tokens,
                                     analysis_loop_stop=args.analysis_loop_stop, on_played=start_plain)
        # the rollout's phases (sum: time/rollout; loop: its own CPU work, loop_idle: what of it idled the engine)
        tm.update(rollout=rt["wall"], generate=rt["generate"], env=rt["reset"] + rt["env"], loop=rt["parse"],
                  analysis=rt["analysis"], loop_idle=rt["loop_idle"],  # busy_*: time each had work in flight
                  **{k: v for k, v in rt.items() if k.startswith("busy_")})
        t_rollout_end = time.perf_counter()
        with tm.phase("scoring"):  # the side thread's scores: they must be in before the engine sleeps
            plain = plain_job[0].result() if plain_job else None
            if plain_job and device.type == "cuda":
                torch.cuda.empty_cache()  # the blocks it cached are its stream's: give them back for training
        with tm.phase("sleep"):
            episodes = drop_env_failures(episodes, rank)  # an env failure leaves its group, not poisons it
            if args.probe_action:  # the plumbing check's reward replaces the env's (what a working loop must learn)
                probe_returns(episodes, args.probe_action)
            for ep in episodes:  # the skill, or why there is none (logged as skill/fail/<reason>)
                ep["skill"], ep["skill_fail"] = parse_skill(ep.get("analysis"), args)
            skills = [ep["skill"] for ep in episodes]
            run.memory.sleep(engine)  # frees the engine's GPU memory for scoring and training

        # -------------------------------------------------------------------------------------------
        # 3. Dual-context scoring with the pre-update weights, no grad: old_lp and ref_lp under the plain prompt
        #    (3a: score_plain, already done when it ran beside the analyses), then teacher_lp of the SAME
        #    response tokens under the skill prompt (3b: score_teacher).
        with tm.phase("scoring"):
            # one sample per (episode, step) with its old_lp and ref_lp
            samples, t_plain_start, t_plain_end = plain or score_plain(run, args, device, episodes)
            record_lengths(lengths_f, update, samples)
            score_teacher(run, args, device, samples, episodes, skills)  # teacher_lp
        # the plain scoring's own time, and how much of it ran before the rollout was over (hidden behind it)
        tm.update(plain_scoring=t_plain_end - t_plain_start,
                  plain_scoring_hidden=max(0.0, min(t_plain_end, t_rollout_end) - t_plain_start))

        # -------------------------------------------------------------------------------------------
        # 4. Advantages: GRPO over the (surviving) episodes of each group, broadcast to every token
        adv = grpo_advantages([ep["return"] for ep in episodes], [ep["group"] for ep in episodes],
                              [len(ep["steps"]) for ep in episodes] if args.adv_mode == "steps" else None,
                              std_norm=args.adv_norm == "mean_std")
        for ep, a in zip(episodes, adv):
            ep["adv"] = a  # for the diagnostics (update_metrics: groups without task signal)
        for s in samples:
            s["adv"] = adv[s["ep"]]

        # -------------------------------------------------------------------------------------------
        # 5. Update: one pass over the update's step samples, mini-batches of `mini_batch` step samples over
        #    all ranks (one optimizer step each), micro-batches of `micro_batch` (gradient accumulation).
        totals, grad_norms, skipped = dict.fromkeys(LOSS_SUMS + ["tokens", "teacher_tokens"], 0.0), [], 0
        policy.train()
        with tm.phase("train"):
            for mini, n_tok, n_teach in plan_mini_batches(samples, args, update, device):
                for micro in plan_micro_batches(mini, [len(sequence(s)[0]) for s in mini], device, packed=run.packed,
                                                micro_batch=args.micro_batch, max_tokens=args.micro_tokens):
                    lp, _, sel = micro_batch_logprobs(policy, [sequence(s) for s in micro] or [DUMMY], device,
                                                      run.packed)  # lp: [rows, T]
                    out = seed_loss(lp, **per_token(micro, sel), n_tokens=n_tok, n_teacher_tokens=n_teach,
                                    clip_eps=args.clip_eps, kl_coef=args.kl_coef, opd_coef=args.opd_coef,
                                    beta=args.opd_beta, dual_clip=args.dual_clip or None)
                    # FSDP averages gradients over ranks; this rank's loss is already its share of the global
                    # token-mean, so undo the average by scaling with the world size.
                    (out["loss"] * world).backward()
                    for k in LOSS_SUMS:
                        totals[k] += float(out[k])
                totals["tokens"] += n_tok / world  # every rank adds it; summed over ranks in update_metrics
                totals["teacher_tokens"] += n_teach / world
                grad_norm = clip_and_step(policy, optimizer, args.grad_clip)  # None: skipped (not finite)
                if grad_norm is None:
                    print0(f"error: update {update + 1}: non-finite loss/gradient, optimizer step skipped")
                    skipped += 1
                else:
                    grad_norms.append(grad_norm)
        run.memory.after_training()

        # -------------------------------------------------------------------------------------------
        # 6. Log and save
        tm["update"] = time.perf_counter() - t_update - tm.get("heldout", 0.0)  # the update's own cost
        metrics = update_metrics(env, args, update, dict(
            episodes=episodes, skills=skills, samples=samples, failures=len(specs) - len(episodes), totals=totals,
            grad_norms=grad_norms, skipped=skipped, time=tm, mem=mem), device, world)
        if rank == 0:
            print0(progress_line(update, args, metrics))
            dump_examples(examples_f, update, samples, episodes, skills, tokenizer, args.dump_examples)
            dump_analyses(analyses_f, update, episodes, args.dump_examples)
        if args.save_every > 0 and ((update + 1) % args.save_every == 0 or update + 1 == args.updates):
            save_checkpoint(policy, optimizer, tokenizer, args, update + 1, metrics, rank)
        if rank == 0:
            append_jsonl(metrics_f, metrics)  # the source of truth; the tracker (--log-to) only mirrors it
            run.tracker.log(metrics)
    if heldout_due(run, args, args.updates):  # the end policy, whatever N divides
        sync_engine(engine, policy, run.sync_dtype)
        heldout_eval(run, args, env, args.updates, rank, world)
    run.pool.close()
    run.side.shutdown()
    run.tracker.close()
    dist.barrier()
    dist.destroy_process_group()


def setup(args, env, paper, rank, world, device):
    """Everything the loop needs, built once: the task stream (checked against a resumed run's), the policy and
    the frozen reference (FSDP2), AdamW, the generation engine and the analyzer, the env worker pool, and the
    GPU memory accounting. Returns them as attributes of one namespace."""
    on_gpu = device.type == "cuda"
    check_fused(args.fused, device)  # --fused liger on CPU: one line now, not a traceback after the models load
    if args.backend is None:
        try:
            import vllm  # noqa: F401
            args.backend = "vllm" if on_gpu else "hf"
        except ImportError:
            args.backend = "hf"
    args.ref_model = args.ref_model or args.model
    packed_attn = packed_attention(device, args.packing)  # None: padded micro-batches
    os.makedirs(args.out, exist_ok=True)
    print0(f"seed_rl: env {env.NAME}, world {world}, device {device.type}, backend {args.backend}, "
           f"{f'packed ({packed_attn})' if packed_attn else f'padded ({attn_implementation(device)})'} micro-batches "
           f"of {f'{args.micro_tokens} tokens' if args.micro_tokens else f'{args.micro_batch} samples'}")
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
    tracker = Tracker(args.log_to, args.out, vars(args), rank)  # after the checks: a refused run logs nothing
    policy = shard_model(load_model(args.model, device=device, seed=args.seed, attn=packed_attn), device,
                         activation_checkpointing=args.activation_checkpointing,
                         checkpoint_policy=args.checkpoint_policy, checkpoint_every=args.checkpoint_every,
                         fused=args.fused)
    ref = None
    if args.kl_coef > 0:
        ref = shard_model(load_model(args.ref_model, device=device, seed=args.seed, attn=packed_attn,
                                     dtype=torch.bfloat16 if on_gpu else torch.float32), device, train=False,
                     fused=args.fused)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.01,
                                  **adamw_impl(device))

    memory = DeviceMemory(on_gpu)
    with memory.engines():
        if args.backend == "vllm":
            if args.model == "tiny":
                raise SystemExit("--backend vllm needs a model folder (save the tiny model with sft.py first)")
            engine = VLLMBackend(args.model, tokenizer, max_model_len=max(args.analysis_max_len,
                                 args.max_prompt_tokens + args.max_new_tokens), seed=args.seed,
                                 gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=args.kv_cache_gib,
                                 want_logprobs=True)  # for the engine-vs-trainer log-prob check of every update
            engine.sleep()
        else:  # an unsharded copy for HF generate, refreshed by the same per-parameter sync as vLLM
            engine = HFBackend(load_model(args.model, device=device, seed=args.seed,
                                          dtype=torch.bfloat16 if on_gpu else torch.float32), tokenizer,
                               want_logprobs=True)
        analyzer = engine  # SEED: the evolving policy analyzes its own episodes
        if args.analyzer_model == "scripted":
            analyzer = ScriptedAnalyzer(tokenizer)
        elif args.analyzer_model:  # static analyzer ablation: fixed weights, never synced
            analyzer = VLLMBackend(args.analyzer_model, load_tokenizer(args.analyzer_model),
                                   max_model_len=args.analysis_max_len, seed=args.seed,
                                   gpu_memory_utilization=args.gpu_memory_utilization,
                                   kv_cache_gib=args.kv_cache_gib) if args.backend == "vllm" \
                else HFBackend(load_model(args.analyzer_model, device=device), load_tokenizer(args.analyzer_model))
    # step 3a's side thread (score_plain) and, on a GPU, its own CUDA stream: its kernels then run beside the
    # engine's instead of queueing behind them
    side = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="plain-scoring")
    side_stream = torch.cuda.Stream(device) if on_gpu else None
    my_groups = list(range(rank, args.tasks_per_update, world))  # each rank plays its share of the groups
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks sharing this node's CPU cores
    n_workers = args.workers or max(1, min(len(my_groups) * args.group_size, (os.cpu_count() or 2) // local_world))
    pool = EnvPool(f"envs.{env.NAME}:make_game", num_workers=n_workers)
    eval_plan = heldout_plan(env, args) if args.eval_every else []
    return SimpleNamespace(tokenizer=tokenizer, stream=stream, manifest=manifest, old_manifest=old_manifest,
                           eval_plan=eval_plan, eval_done=heldout_done(args.out, eval_plan),
                           policy=policy, ref=ref, optimizer=optimizer, engine=engine, analyzer=analyzer, pool=pool,
                           side=side, side_stream=side_stream,
                           my_groups=my_groups, packed=packed_attn is not None, memory=memory, tracker=tracker,
                           sync_dtype=torch.bfloat16 if on_gpu else torch.float32)


# ====================================================================================================
# The steps of an update, each a named function (called once per update by main, in this order)

def analysis_prompt(tokenizer, episode, args, env):
    """Step 2's prompt for an ended episode (token ids), or None where prompt + answer would not fit the
    engine's context (that episode gets no skill). The rollout loop submits it the moment the episode ends."""
    ids = chat_prompt(tokenizer, build_analysis_prompt(episode, env))[1]
    return ids if len(ids) + args.analysis_max_new_tokens <= args.analysis_max_len else None


def parse_skill(answer, args):
    """Step 2's skill from the analysis answer: (skill, "") or (None, why): 'no_answer' (not analyzed, or the
    prompt did not fit) or parse_analysis's reason ('no_json', 'missing_keys', 'skill_too_short', ...)."""
    if answer is None:
        return None, "no_answer"
    rec, why = parse_analysis(answer, min_words=args.min_skill_words)
    return (rec["episode_skill"], "") if rec else (None, why)


def step_samples(episodes):
    """Step 3's inputs: one sample per (episode, step) with a response, the unit of GRPO/PPO in this multi-turn
    setting; `ep` indexes `episodes`."""
    return [dict(ep=e, group=ep["group"], rollout=ep["rollout"], step=t, prompt_ids=st["prompt_ids"],
                 response_ids=st["response_ids"], engine_lp=st["response_logprobs"], teacher_mask=0.0)
            for e, ep in enumerate(episodes) for t, st in enumerate(ep["steps"]) if st["response_ids"]]


def score_plain(run, args, device, episodes, stream=None):
    """Step 3a: the step samples of the episodes that kept their env, with old_lp (the pre-update policy) and
    ref_lp (the reference) of their response tokens under the plain prompt, no grad. Returns (samples, start
    time, end time). main() runs it on a side thread and its own CUDA `stream` while the engine writes the last
    self-analyses (the weights do not change before step 5), or inline. Either way every rank calls it once per
    update, so the forwards' collectives (FSDP all-gathers, the micro-batch count) line up across ranks."""
    t0 = time.perf_counter()
    samples = step_samples([ep for ep in episodes if not ep["env_failure"]])  # drop_env_failures' list
    plain = [sequence(s) for s in samples]
    if stream is not None:
        torch.cuda.set_device(device)  # a new thread starts on GPU 0
        stream.wait_stream(torch.cuda.default_stream(device))  # the weights' last writes (optimizer, loads) first
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        old = score(run.policy, plain, args.micro_batch, device, run.packed, args.micro_tokens)
        refs = score(run.ref, plain, args.micro_batch, device, run.packed, args.micro_tokens) \
            if run.ref is not None else old
    for s, o, r in zip(samples, old, refs):
        s["old_lp"], s["ref_lp"] = o, r
    return samples, t0, time.perf_counter()


def score_teacher(run, args, device, samples, episodes, skills):
    """Step 3b: teacher_lp, the log-probs of the SAME response tokens under the teacher prompt (no grad, pre-update
    weights), for each sample whose episode has a skill; elsewhere old_lp, masked out by teacher_mask 0. The teacher
    prompt is the step's own plain prompt (same history entries) with the skill block inserted."""
    teach = []
    for s in samples:
        ep, skill = episodes[s["ep"]], skills[s["ep"]]
        s["teacher_mask"], s["teacher_lp"] = float(skill is not None), s["old_lp"]
        if skill is not None:
            st = ep["steps"][s["step"]]
            s["teacher_ids"] = chat_prompt(run.tokenizer, step_prompt(ep, s["step"], st["history_used"], skill))[1]
            teach.append(s)
    if args.opd_coef > 0:  # GRPO: not even a dummy forward
        lps = score(run.policy, [sequence(s, "teacher_ids") for s in teach], args.micro_batch, device, run.packed,
                    args.micro_tokens)
        for s, lp in zip(teach, lps):
            s["teacher_lp"] = lp


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


def drop_env_failures(episodes, rank):
    """The episodes without an env failure (a dead or hung worker); each dropped one is said in one line."""
    for ep in episodes:
        if ep["env_failure"]:
            print(f"[rank {rank}] env failure: episode {ep['uid']} dropped from its group ({ep['env_failure']})")
    return [ep for ep in episodes if not ep["env_failure"]]


def probe_returns(episodes, probe_action):
    """The plumbing check's reward (--probe-action), in place of the env's: return 1 when the episode's first
    parsed action is `probe_action` (case and surrounding blanks ignored), else 0; ep["probe_hit"] says which.
    probe_action 'admissible': 1 when the first step is valid and its action is one the env offered (a base model
    does this some of the time, so the groups have signal from the first update; a fixed action it never writes
    gives none)."""
    for ep in episodes:
        first = ep["steps"][0] if ep["steps"] else {}
        if probe_action.strip().lower() == "admissible":
            ep["probe_hit"] = bool(first.get("valid")) and first.get("admissible_action") is True
        else:
            ep["probe_hit"] = (first.get("action") or "").strip().lower() == probe_action.strip().lower()
        ep["return"] = float(ep["probe_hit"])


def group_signal(eps):
    """Why a curve can be flat. eps: one dict per episode with its GRPO group `gid`, return `ret` and advantage
    `adv`. A group whose returns are all equal (all lost, or all won) has advantage 0 on every token: it teaches
    the policy gradient nothing. Returns (share of such groups, mean |advantage| over the other groups' episodes,
    None when there are none)."""
    by_group = {}
    for x in eps:
        by_group.setdefault(x["gid"], []).append(x)
    flat = {g for g, xs in by_group.items() if len(xs) < 2 or len({x["ret"] for x in xs}) == 1}
    rest = [abs(x["adv"]) for g, xs in by_group.items() if g not in flat for x in xs]
    return len(flat) / max(1, len(by_group)), (sum(rest) / len(rest) if rest else None)


LOSS_SUMS = ["pg", "kl", "opd", "gate", "gate_active", "gap", "clipped", "ratio"]


def update_metrics(env, args, update, u, device, world):
    """Step 6: the update's metrics over all ranks (a collective: every rank calls it; rank 0 gets the dict).
    u: this rank's update, {episodes, skills (one per episode, None: no skill), samples (the step samples, scored),
    failures (episodes dropped for an env failure), totals (LOSS_SUMS + tokens, teacher_tokens, summed over the
    micro-batches), grad_norms (one per optimizer step taken), skipped (steps skipped), time (Timer), mem}."""
    episodes, skills, samples, totals = u["episodes"], u["skills"], u["samples"], u["totals"]
    keys = list(totals)
    totals = dict(zip(keys, global_sum([totals[k] for k in keys], device)))
    eng = [abs(a - b) for s in samples if s["engine_lp"] is not None
           for a, b in zip(s["engine_lp"], s["old_lp"].tolist())]
    light = [dict(group=ep.get("category"), success=ep["success"], score=ep.get("score", float(ep["success"])),
                  length=ep["length"], ret=ep["return"], invalid=sum(not s["valid"] for s in ep["steps"]),
                  inadmissible=sum(s.get("admissible_action") is False for s in ep["steps"]),
                  steps=len(ep["steps"]), truncated=ep["truncated_responses"], skill=skills[e] is not None,
                  gid=ep["group"], adv=ep.get("adv", 0.0), probe=ep.get("probe_hit"),
                  resp_tokens=sum(len(s["response_ids"] or []) for s in ep["steps"]), env=env.episode_stats(ep),
                  analysis_tokens=ep.get("analysis_tokens"), analysis_finish=ep.get("analysis_finish"),
                  skill_fail=ep.get("skill_fail"))
             for e, ep in enumerate(episodes)]
    # the sampled tokens' mean -log p under the pre-update policy: at temperature 1 an unbiased estimate of the
    # per-token entropy (no full-vocabulary pass needed); a collapse towards 0 means the policy stopped exploring
    nll = [float(-s["old_lp"].sum()) for s in samples], [len(s["response_ids"]) for s in samples]
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(eps=light, fails=u["failures"], eng=eng, mem=u["mem"], nll=(sum(nll[0]), sum(nll[1]))))
    if dist.get_rank() != 0:
        return None
    use_opd = args.opd_coef > 0
    eps = [x for g in gathered for x in g["eps"]]
    eng_diff = [x for g in gathered for x in g["eng"]]
    n_steps = sum(x["steps"] for x in eps) or 1
    tok, ttok = totals["tokens"] or 1, totals["teacher_tokens"]
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    opd = lambda k: totals[k] / ttok if use_opd and ttok else None
    zero_var_share, signal_adv = group_signal(eps)
    analyzed = [x for x in eps if x["analysis_tokens"]] if use_opd else []  # episodes whose analysis came back
    env_keys = sorted({k for x in eps for k in x["env"]})
    nll_sum, nll_n = sum(g["nll"][0] for g in gathered), sum(g["nll"][1] for g in gathered)
    metrics = {"update": update + 1, "time": time.time(), "lr": lr_at(update, args),
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
               "rollout/response_tokens_mean": sum(x["resp_tokens"] for x in eps) / n_steps,
               "rollout/probe_rate": mean([x["probe"] for x in eps]) if args.probe_action else None,
               "adv/zero_var_group_share": zero_var_share,
               "adv/abs_mean_signal_groups": signal_adv,
               "policy/entropy_mc": nll_sum / nll_n if nll_n else None,
               **{f"env/{k}": mean([x["env"][k] for x in eps if x["env"].get(k) is not None]) for k in env_keys},
               "skill/parse_rate": mean([x["skill"] for x in eps]) if use_opd else None,
               # the self-analysis's length: the episodes that end last wait for theirs (SEED's extra rollout time),
               # and an answer stopped at the cap (--analysis-max-new-tokens) rarely parses
               "skill/analysis_tokens_mean": mean([x["analysis_tokens"] for x in analyzed]) if analyzed else None,
               "skill/analysis_tokens_max": max((x["analysis_tokens"] for x in analyzed), default=None),
               "skill/analysis_capped": mean([x["analysis_finish"] == "length" for x in analyzed])
               if analyzed else None,
               "skill/analysis_loop_stopped": mean([x["analysis_finish"] == "repetition" for x in analyzed])
               if analyzed and args.analysis_loop_stop else None,  # ended by --analysis-loop-stop
               **{f"skill/fail/{why}": mean([x["skill_fail"] == why for x in eps])  # share of episodes, per reason
                  for why in (sorted({x["skill_fail"] for x in eps} - {"", None}) if use_opd else [])},
               "opd/teacher_coverage": ttok / tok if use_opd else None,
               "loss/pg": totals["pg"] / tok, "loss/kl": totals["kl"] / tok, "loss/opd": opd("opd"),
               "opd/gate_mean": opd("gate"), "opd/gate_active_ratio": opd("gate_active"),
               "opd/teacher_gap_mean": opd("gap"),
               "pg/clipfrac": totals["clipped"] / tok, "pg/ratio_mean": totals["ratio"] / tok,
               "grad_norm": mean(u["grad_norms"]), "tokens/response": int(totals["tokens"]),
               "train/optimizer_steps": len(u["grad_norms"]), "train/skipped_steps": u["skipped"],
               "check/engine_lp_absdiff_mean": mean(eng_diff), "check/engine_lp_absdiff_max": max(eng_diff, default=None),
               **{f"time/{k}": v for k, v in u["time"].items()},
               # the loop's CPU work as a share of the rollout, and the part of it on the critical path (Clock)
               **{f"rollout/{k}_share": u["time"][k] / u["time"]["rollout"] if u["time"].get("rollout") else None
                  for k in ("loop", "loop_idle")},
               **{k: max(g["mem"][k] for g in gathered) for k in gathered[0]["mem"]}}  # the fullest rank
    metrics["loss/total"] = metrics["loss/pg"] + args.kl_coef * metrics["loss/kl"] + \
        args.opd_coef * (metrics["loss/opd"] or 0.0)
    return metrics


def progress_line(update, args, metrics):
    """Step 6's one line per update on the console."""
    g = lambda k: "-" if metrics[k] is None else f"{metrics[k]:.4g}"
    return (f"update {update + 1}/{args.updates} | success {g('rollout/success_rate')} len "
            f"{g('rollout/episode_length')} invalid {g('rollout/invalid_rate')} | no-signal groups "
            f"{g('adv/zero_var_group_share')} | pg {g('loss/pg')} kl {g('loss/kl')} opd {g('loss/opd')} gate "
            f"{g('opd/gate_mean')} cover {g('opd/teacher_coverage')} parse {g('skill/parse_rate')} | "
            f"{metrics['time/update']:.1f}s"
            + (" | NO TASK SIGNAL: every group's returns are equal, so GRPO's advantage is 0 everywhere"
               if metrics["adv/zero_var_group_share"] == 1.0 else ""))


def spread(items, n):
    """n of items (all when fewer), evenly spaced over the list: the dumps cover every group, not the first."""
    k = min(n, len(items))
    return [items[i * len(items) // k] for i in range(k)]


def dump_examples(f, update, samples, episodes, skills, tokenizer, n):
    """Plain vs skill scores of the same sampled actions, so a reader can *see* the OPD signal. Without a teacher
    pass (GRPO, or no skill parsed) sampled steps with their plain scores: what the policy now writes, which is
    what a collapsing run (invalid or inadmissible rate rising) needs read. The n steps are spread evenly over the
    update's (every group, success and failure), not the first episode's only."""
    taught = [s for s in samples if s["teacher_mask"]]
    pool = taught or samples
    for s in spread(pool, n):
        ep, st = episodes[s["ep"]], episodes[s["ep"]]["steps"][s["step"]]
        gap = (s["teacher_lp"] - s["old_lp"]).tolist() if taught else None
        append_jsonl(f, {"update": update + 1, "uid": ep["uid"], "step": s["step"] + 1, "skill": skills[s["ep"]],
                         "action": st["action"], "valid": st.get("valid"),
                         "admissible": st.get("admissible_action"), "advantage": float(s["adv"]),
                         "tokens": [tokenizer.decode([t]) for t in s["response_ids"]],
                         "plain_lp": s["old_lp"].tolist(), "teacher_lp": s["teacher_lp"].tolist() if taught else None,
                         "gap": gap})


def dump_analyses(f, update, episodes, n):
    """The self-analysis answers themselves (SEED only), n per update spread over this rank's analyzed episodes:
    what the policy writes about its own episodes, how the answer ended, and what was parsed from it."""
    pool = [ep for ep in episodes if ep.get("analysis") is not None]
    for ep in spread(pool, n):
        append_jsonl(f, {"update": update + 1, "uid": ep["uid"], "success": ep["success"], "length": ep["length"],
                         "tokens": ep["analysis_tokens"], "finish": ep["analysis_finish"], "skill": ep.get("skill"),
                         "skill_fail": ep.get("skill_fail"), "text": ep["analysis"]})


# ====================================================================================================
# Resume and checkpoints

def heldout_plan(env, args):
    """--eval-every's episodes: evaluate.py's plan for --splits/--limit/--samples/--seed = the --eval-* flags
    (same uids, so the same sampling seeds as `evaluate.py --seed <eval-seed>`)."""
    plan = []
    for split in [s.strip() for s in args.eval_splits.split(",")]:
        games = env.eval_tasks(split, args.eval_seed, args.eval_limit or None, args)
        if not games:
            sys.exit(f"--eval-splits: {env.NAME} split {split!r} has no tasks; nothing to evaluate")
        plan += [dict(g, uid=f"{g['task_id']}#s{k}", group=gi, rollout=k, sample=k, seed=args.eval_seed)
                 for gi, g in enumerate(games) for k in range(args.eval_samples)]
    return plan


def heldout_due(run, args, after):
    """--eval-every: the policy after `after` updates is evaluated (0, every N, the last) unless it is on file."""
    return (args.eval_every > 0 and (after % args.eval_every == 0 or after == args.updates)
            and after not in run.eval_done)


def heldout_done(out, plan):
    """The evaluation points (updates) whose every episode is in heldout.jsonl: a resumed run skips them."""
    uids, seen = {e["uid"] for e in plan}, {}
    for r in read_jsonl(os.path.join(out, "heldout.jsonl")):
        seen.setdefault(r["update"], set()).add(r["uid"])
    return {u for u, done in seen.items() if uids <= done}


def heldout_eval(run, args, env, after, rank, world):
    """The policy after `after` updates plays the held-out tasks as evaluate.py does: plain prompt, no analysis,
    --eval-temperature; each rank its share, on its own engine. Rank 0 appends one row per episode to
    heldout.jsonl (the step records cut to what the summaries read) and prints one line. A point cut off midway
    is played again on resume; only the episodes not yet on file are appended."""
    t0 = time.perf_counter()
    mine = split_even(run.eval_plan, world)[rank]
    kw = dict(rollout_kwargs(args), temperature=args.eval_temperature, max_steps=args.eval_max_steps)
    episodes, _ = play_episodes(env, mine, run.pool, run.engine, run.tokenizer, max_live=EVAL_LIVE, **kw)
    rows = [dict({k: ep.get(k) for k in HELDOUT_KEYS}, update=after, env_stats=env.episode_stats(ep),
                 steps=[{k: st.get(k) for k in ("valid", "admissible_action")} for st in ep["steps"]])
            for ep in episodes]
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank != 0:
        return
    path = os.path.join(args.out, "heldout.jsonl")
    on_file = {r["uid"] for r in read_jsonl(path) if r["update"] == after}
    rows = [r for part in gathered for r in part]
    with open_jsonl_for_append(path) as f:
        for r in rows:
            if r["uid"] not in on_file:
                append_jsonl(f, r)
    summ = summarize_episodes(rows, env)
    splits = sorted({r["split"] for r in rows})
    per = ", ".join(f"{s} {100 * summarize_episodes([r for r in rows if r['split'] == s], env)['All']['success']:.1f}%"
                    for s in splits) if len(splits) > 1 else ""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    print0(f"held-out after {after} updates: success {pct(summ['All']['success'])}{f' ({per})' if per else ''} of "
           f"{summ['All']['episodes']} episodes, invalid {pct(summ['All']['invalid_rate'])}, inadmissible "
           f"{pct(summ['All']['inadmissible_rate'])}, length {summ['All']['length'] or 0:.1f}; "
           f"{time.perf_counter() - t0:.0f} s")
    run.tracker.log({"update": after, "heldout/success": summ["All"]["success"],
                     "heldout/invalid_rate": summ["All"]["invalid_rate"]})


# what heldout.jsonl keeps of an episode (with `update`, the env's episode_stats and the steps' validity)
HELDOUT_KEYS = ["uid", "task_id", "split", "category", "sample", "success", "score", "return", "length", "env_failure",
                "prompt_too_long", "truncated_responses"]


def check_resumed_stream(old_manifest, stream, env, args):
    """A resumed run may change --updates (common/records.py RESUME_MAY_CHANGE), so its task stream may be longer
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
        for name in ("metrics.jsonl", "examples.jsonl", "lengths.jsonl", "analyses.jsonl"):
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
    (common/checkpoints.py save_checkpoint_dir)."""
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
