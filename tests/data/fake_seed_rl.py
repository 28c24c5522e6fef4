"""A stand-in for seed_rl.py in tests/test_learning.py: its flags and its outputs (metrics.jsonl with the keys
benchmarks/learning.py reads, seed_manifest.json, hf/final), no model. Env knobs:
  FAKE_VLLM=S   print a vLLM-style log line, then a "profiling window" of S seconds writing W beats, then
                vLLM's "init engine ... took" line (what the engine gate watches)
  FAKE_SLEEP=S  seconds per update, writing R beats (so a test can see when this process was running)
  FAKE_BARRIER=DIR:N  before the engine start, wait (up to 60 s) until N jobs have reached it (a file each in
                DIR), so that side-by-side jobs reach their engine starts together whatever their start-up times
--eval-every N writes heldout.jsonl (2 tasks per split: at the end the first is won; at the start, with --seed 1,
the second; else none).
An env-worker stand-in (its argv holds "envs.pool", as `python -m envs.pool ...` does) writes E beats all along."""
import argparse
import json
import os
import random
import subprocess
import sys
import time

p = argparse.ArgumentParser()
for f in ("--env", "--model", "--lr", "--gpu-memory-utilization", "--kv-cache-gib", "--analyzer-model",
          "--max-new-tokens"):
    p.add_argument(f)
for f in ("--updates", "--tasks-per-update", "--group-size", "--max-steps", "--seed", "--workers", "--save-every",
          "--dump-examples", "--eval-every", "--eval-limit", "--eval-seed", "--eval-max-steps", "--eval-samples"):
    p.add_argument(f, type=int)
p.add_argument("--eval-splits", default="valid_seen,valid_unseen")
p.add_argument("--opd-coef", type=float, default=0.01)
p.add_argument("--out")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
beats = os.path.join(a.out, "beats")
ENV_WORKER = ("import sys, time\nwhile True:\n    open(sys.argv[1], 'a').write(f'E {time.time()}\\n'); "
              "time.sleep(0.02)")
worker = subprocess.Popen([sys.executable, "-c", ENV_WORKER, beats, "envs.pool"])


def beat(kind, seconds):
    t0 = time.time()
    while time.time() - t0 < seconds:
        with open(beats, "a") as f:
            f.write(f"{kind} {time.time()}\n")
        time.sleep(0.02)


if os.environ.get("FAKE_BARRIER"):
    # a cold start of torchrun (torch's import) can differ between two jobs by more than the profiling window;
    # the tests are about what happens when engine starts collide, so the jobs are lined up first
    bar, n = os.environ["FAKE_BARRIER"].rsplit(":", 1)
    os.makedirs(bar, exist_ok=True)
    open(os.path.join(bar, str(os.getpid())), "w").close()
    t_bar = time.time()
    while len(os.listdir(bar)) < int(n) and time.time() - t_bar < 60:
        time.sleep(0.01)
if os.environ.get("FAKE_VLLM"):
    print("INFO 12-03 12:00:00 [fake.py:1] engine starting", flush=True)
    time.sleep(0.6)  # the gate reads the line within 0.25 s; the profiling starts after it
    beat("W", float(os.environ["FAKE_VLLM"]))
    print("INFO 12-03 12:00:01 [core.py:1] init engine (profile, create kv cache, warmup model) took 1.0 s", flush=True)
with open(os.path.join(a.out, "seed_manifest.json"), "w") as f:
    json.dump({"git": {"commit": "fake"}, "hardware": {"gpus": []}, "argv": vars(a)}, f)
seed_method = a.opd_coef > 0
rng = random.Random(a.seed * 7 + seed_method)
with open(os.path.join(a.out, "metrics.jsonl"), "a") as f:
    for u in range(1, a.updates + 1):
        beat("R", float(os.environ.get("FAKE_SLEEP", "0")))
        inv = max(0.0, 0.8 - 0.05 * u * (1.5 if seed_method else 1.0) + rng.uniform(-0.03, 0.03))
        f.write(json.dumps({"update": u, "rollout/return_mean": -inv, "rollout/success_rate": 0.0,
                            "rollout/score_mean": 0.0, "rollout/invalid_rate": inv, "rollout/inadmissible_rate": 0.1,
                            "rollout/episode_length": a.max_steps, "skill/parse_rate": 0.5 if seed_method else None,
                            "opd/teacher_coverage": 0.4 if seed_method else None, "loss/kl": 0.001 * u,
                            "time/update": 1.0}) + "\n")
        f.flush()
        print(f"update {u}/{a.updates}", flush=True)
if a.eval_every:  # heldout.jsonl: 2 tasks per split, at update 0, every N and after the last; the end does better
    with open(os.path.join(a.out, "heldout.jsonl"), "a") as f:
        for u in sorted({*range(0, a.updates, a.eval_every), a.updates}):
            for split in a.eval_splits.split(","):
                for k in range(2):
                    won = (k == 0 and u == a.updates) or (k == 1 and u == 0 and a.seed == 1)
                    f.write(json.dumps({"uid": f"{split}/t{k}#s0", "task_id": f"{split}/t{k}", "split": split,
                                        "category": "Pick", "success": won, "score": float(won), "length": 2,
                                        "env_failure": None, "update": u,
                                        "steps": [{"valid": True, "admissible_action": True}] * 2}) + "\n")
worker.kill()
os.makedirs(os.path.join(a.out, "hf", "final"), exist_ok=True)
with open(os.path.join(a.out, "hf", "final", "config.json"), "w") as f:
    json.dump({}, f)
