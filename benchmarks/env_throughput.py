"""Env throughput of the ALFWorld worker pool, and where the time of one rollout step goes.

1. Env only: the scripted expert (no model) plays N valid_seen games through the full loop
   (prompt -> parse -> env) with 1 and with 2 env workers: episodes/min, resets/s, env steps/s.
2. Per-step latency split with the tiny random Qwen2 (real Qwen2.5 tokenizer) through HFBackend for a few
   steps: generate / prompt build + parse / env, in ms per episode-step.

    # CPU (this is what the closing note of Stage 1a reports)
    python benchmarks/env_throughput.py
    # more games, more workers (a GPU machine has more cores; the env pool is CPU-only either way)
    python benchmarks/env_throughput.py --games-per-type 5 --workers 1,2,4,8

Not a test (pytest does not collect it). Numbers depend on the machine and its load; run it on a quiet one.
"""
import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import envs.alfworld as alfworld  # noqa: E402
from envs.alfworld import select_games  # noqa: E402
from common.backends import ExpertPolicy, HFBackend  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from envs.pool import EnvPool  # noqa: E402
from common.rollout import play_episodes  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--split", default="valid_seen", choices=["train", "valid_seen", "valid_unseen"])
p.add_argument("--games-per-type", type=int, default=2, help="expert games per task type (6 types)")
p.add_argument("--workers", default="1,2", help="comma-separated env worker counts to compare")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--tiny-episodes", type=int, default=4, help="episodes played together by the tiny model")
p.add_argument("--tiny-steps", type=int, default=3)
p.add_argument("--max-new-tokens", type=int, default=64, help="tiny model: new tokens per step (paper: 512)")
p.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of the generating process (why 1: "
               "on a shared 2-core machine, 2 threads made the tiny model's generate 6-8x slower)")
args = p.parse_args()
torch.set_num_threads(args.torch_threads)

games = select_games(args.split, args.seed, tasks_per_type=args.games_per_type)
tokenizer = load_tokenizer("expert")
print(f"machine: {os.cpu_count()} CPU cores, torch threads {torch.get_num_threads()}, load average "
      f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")

# ---------------------------------------------------------------------------------------------------
# 1. Env throughput: the expert through the full loop, 1 vs 2 workers
def children_cpu():
    """CPU seconds of the reaped child processes (the env workers, once the pool is closed)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


rows = []
for w in [int(x) for x in args.workers.split(",")]:
    cpu0 = children_cpu()
    with EnvPool("envs.alfworld:make_game", num_workers=w) as pool:
        pool.worker_pids()  # workers started before the clock runs
        t0 = time.perf_counter()
        # lockstep: the phases below are then time in resets, env steps, generate calls, one batch at a time
        episodes, tm = play_episodes(alfworld, games, pool, ExpertPolicy(tokenizer), tokenizer, lockstep=True)
        wall = time.perf_counter() - t0
        steps = pool.stats["steps"]
    wins = sum(ep["success"] for ep in episodes)
    # workers' CPU per episode: independent of how many cores the machine lends us at the moment
    rows.append((w, len(games), wins, steps, wall, tm, (children_cpu() - cpu0) / len(games)))
    print(f"  {w} worker(s): {len(games)} episodes in {wall:.1f}s", flush=True)

print(f"\nenv throughput: scripted expert, {len(games)} {args.split} games ({args.games_per_type} per type)")
print(f"{'workers':>7} {'episodes':>8} {'won':>4} {'steps':>6} {'wall s':>7} {'episodes/min':>12} "
      f"{'resets/s':>8} {'env steps/s':>11} {'reset s':>7} {'env s':>6} {'other s':>7} {'worker CPU s/ep':>15}")
for w, n, wins, steps, wall, tm, cpu in rows:
    print(f"{w:>7} {n:>8} {wins:>4} {steps:>6} {wall:>7.1f} {60 * n / wall:>12.1f} {n / tm['reset']:>8.2f} "
          f"{steps / tm['env']:>11.1f} {tm['reset']:>7.1f} {tm['env']:>6.1f} "
          f"{tm['generate'] + tm['parse']:>7.2f} {cpu:>15.2f}")
print("(resets/s = episodes / time in pool.reset; env steps/s = steps / time in pool.step; both with all "
      "workers running in parallel; other = prompt building, parsing and the expert's answers)")

# ---------------------------------------------------------------------------------------------------
# 2. Per-step latency split: the tiny random model through HFBackend
policy = HFBackend(load_model("tiny", seed=args.seed), tokenizer)
specs = [dict(g, uid=f"{g['task_id']}#r0", seed=args.seed) for g in games[::max(1, len(games) // args.tiny_episodes)]]
specs = specs[:args.tiny_episodes]
with EnvPool("envs.alfworld:make_game", num_workers=2) as pool:
    torch.manual_seed(args.seed)
    episodes, tm = play_episodes(alfworld, specs, pool, policy, tokenizer, max_steps=args.tiny_steps,
                                 max_new_tokens=args.max_new_tokens, temperature=0.4, lockstep=True)
n_ep_steps = sum(ep["length"] for ep in episodes)
n_batched = max(len(ep["steps"]) for ep in episodes)  # one generate call per step for all live episodes
new_tokens = sum(len(s["response_ids"]) for ep in episodes for s in ep["steps"])
prompt_tokens = sum(len(s["prompt_ids"]) for ep in episodes for s in ep["steps"]) / max(n_ep_steps, 1)
print(f"\nper-step latency: tiny Qwen2 (HFBackend, CPU), {len(specs)} episodes x {args.tiny_steps} steps, "
      f"batch of {len(specs)}, up to {args.max_new_tokens} new tokens ({new_tokens / max(n_ep_steps, 1):.0f} "
      f"generated on average), prompts of {prompt_tokens:.0f} tokens on average")
print(f"{'phase':<18} {'total s':>8} {'ms / batched step':>17} {'ms / episode-step':>17}")
for name, key in (("generate", "generate"), ("prompt+parse", "parse"), ("env step", "env")):
    print(f"{name:<18} {tm[key]:>8.2f} {1000 * tm[key] / n_batched:>17.1f} {1000 * tm[key] / n_ep_steps:>17.1f}")
print(f"{'(reset, once)':<18} {tm['reset']:>8.2f}")
