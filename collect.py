"""Stage 1a: the base policy plays the train split; every episode is recorded for the analyzer.

The paper's set: 30 tasks per type x 6 types = 180 tasks, 8 rollouts each = 1,440 trajectories, temperature
0.4, up to 512 new tokens per step, 30 steps, the last 5 history entries, the plain prompt (no skill).

    # 1 GPU (vLLM engine)
    python collect.py --env alfworld --model Qwen/Qwen2.5-3B-Instruct --backend vllm --out runs/stage1/traj.jsonl
    # 8 GPUs: collection is embarrassingly parallel; shard it and concatenate the files
    for i in 0 1 2 3 4 5 6 7; do CUDA_VISIBLE_DEVICES=$i python collect.py --model Qwen/Qwen2.5-3B-Instruct \
        --backend vllm --shard $i/8 --out runs/stage1/traj.$i.jsonl & done; wait
    # CPU demo (no GPU): the scripted expert, and a tiny random model with the real Qwen2.5 tokenizer
    python collect.py --model expert --tasks-per-type 1 --rollouts 2 --out runs/demo/expert.jsonl
    python collect.py --model tiny --tasks-per-type 1 --rollouts 1 --max-steps 3 --max-new-tokens 16 --out runs/demo/tiny.jsonl

Output: one JSON line per episode (append-only; a killed run restarts where it stopped: episodes already
written are skipped by id, a torn last line is cut), and `<out>.manifest.json` beside it.
"""
import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

from envs.alfworld import select_games
from envs.backends import ExpertPolicy, HFBackend, VLLMBackend, load_model, load_tokenizer
from envs.pool import EnvPool
from envs.records import append_jsonl, open_jsonl_for_append, read_jsonl, run_manifest, write_manifest
from envs.rollout import format_summary, play_episodes, summarize_episodes

# The paper's settings (SPEC.md Stage 1 / Table 5); argparse defaults equal these.
PAPER = dict(env="alfworld", split="train", tasks_per_type=30, rollouts=8, max_steps=30, history=5,
             temperature=0.4, max_new_tokens=512, max_prompt_tokens=2048)

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--env", default="alfworld", choices=["alfworld"])
p.add_argument("--model", required=True, help="HF path or hub id | tiny | expert")
p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
p.add_argument("--split", default=PAPER["split"], choices=["train", "valid_seen", "valid_unseen"])
p.add_argument("--tasks-per-type", type=int, default=PAPER["tasks_per_type"])
p.add_argument("--rollouts", type=int, default=PAPER["rollouts"])
p.add_argument("--max-steps", type=int, default=PAPER["max_steps"])
p.add_argument("--history", type=int, default=PAPER["history"])
p.add_argument("--temperature", type=float, default=PAPER["temperature"])
p.add_argument("--max-new-tokens", type=int, default=PAPER["max_new_tokens"])
p.add_argument("--max-prompt-tokens", type=int, default=PAPER["max_prompt_tokens"])
p.add_argument("--invalid-fallback", default=None, help="action executed when a response has no action tags "
               "(default: the raw text's tail, answered by 'Nothing happens.')")
p.add_argument("--seed", type=int, default=0, help="task choice and sampling")
p.add_argument("--shard", default="0/1", help="i/n: play every n-th episode starting at i")
p.add_argument("--batch-episodes", type=int, default=64, help="episodes played together (one generate call per step)")
p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="env worker processes")
p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
p.add_argument("--out", required=True)
args = p.parse_args()

# ---------------------------------------------------------------------------------------------------
# Plan: the deterministic list of episodes, minus those already written (resume)
games = select_games(args.split, args.seed, tasks_per_type=args.tasks_per_type)
shard_i, shard_n = map(int, args.shard.split("/"))
plan = [dict(g, uid=f"{g['task_id']}#r{r}", group=gi, rollout=r, seed=args.seed)
        for gi, g in enumerate(games) for r in range(args.rollouts)][shard_i::shard_n]

manifest_path = args.out + ".manifest.json"
tokenizer = load_tokenizer(args.model)
manifest = run_manifest("collect.py", args, paper=PAPER, model=args.model, tokenizer=tokenizer, split=args.split,
                        games=games, seeds={"seed": args.seed})
KEY = ("env", "model", "split", "tasks_per_type", "rollouts", "seed", "shard", "max_steps", "history", "temperature",
       "max_new_tokens", "max_prompt_tokens", "invalid_fallback")  # everything that shapes an episode record
if os.path.exists(manifest_path):  # resuming: refuse to mix two different collections in one file
    old = __import__("json").load(open(manifest_path))["args"]
    diff = {k: (old.get(k), getattr(args, k)) for k in KEY if old.get(k) != getattr(args, k)}
    if diff:
        sys.exit(f"{args.out} was written with other settings {diff}; use another --out")
write_manifest(manifest_path, manifest)

done_ids = {ep["uid"] for ep in read_jsonl(args.out)}
todo = [e for e in plan if e["uid"] not in done_ids]
print(f"collect: {len(games)} tasks x {args.rollouts} rollouts = {len(plan)} episodes in this shard; "
      f"{len(plan) - len(todo)} already in {args.out}, {len(todo)} to play")

# ---------------------------------------------------------------------------------------------------
# Policy: scripted expert, HF generate, or vLLM
if args.model == "expert":
    policy = ExpertPolicy(tokenizer)
elif args.backend == "vllm":
    policy = VLLMBackend(args.model, tokenizer, max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                         gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed, enable_sleep_mode=False)
else:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    policy = HFBackend(load_model(args.model, dtype=dtype, device=device, seed=args.seed), tokenizer)

# ---------------------------------------------------------------------------------------------------
# Play in batches; append each episode as soon as its batch ends
t_start, timings = time.time(), {}
out = open_jsonl_for_append(args.out)
bar = tqdm(total=len(todo), desc="episodes", unit="ep")
with EnvPool("envs.alfworld:make_alfworld_game", num_workers=min(args.workers, max(1, len(todo)))) as pool:
    for b in range(0, len(todo), args.batch_episodes):
        batch = todo[b:b + args.batch_episodes]
        torch.manual_seed(args.seed * 1_000_003 + shard_i * 10_007 + b)  # sampling depends on (seed, shard, batch)
        episodes, tm = play_episodes(batch, pool, policy, tokenizer, max_steps=args.max_steps, history=args.history,
                                     max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, invalid_fallback=args.invalid_fallback)
        for k, v in tm.items():
            timings[k] = timings.get(k, 0.0) + v
        for ep in episodes:
            append_jsonl(out, ep)
        bar.update(len(batch))
    env_stats = dict(pool.stats)
bar.close()
out.close()

# ---------------------------------------------------------------------------------------------------
# Summary over everything in the file (this run and earlier, resumed ones)
elapsed = time.time() - t_start
records = read_jsonl(args.out)
print(format_summary(summarize_episodes(records), f"success per task type ({len(records)} episodes in {args.out})"))
n_steps = env_stats["steps"]
print(f"this run: {len(todo)} episodes, {n_steps} steps in {elapsed:.1f}s "
      f"({60 * len(todo) / max(elapsed, 1e-9):.1f} episodes/min); time split: "
      + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items())
      + f"; env failures {env_stats['env_failures']}, workers replaced {env_stats['workers_replaced']}")
