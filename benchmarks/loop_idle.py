"""Does the rollout's `loop_idle` (common/rollout.py Clock, CudaMark) measure how long the loop's own work leaves
the vLLM engine idle? (issue 31, item 4). A known amount of "loop work" between polls, on a real engine:

    # one GPU, ~2 minutes with the engine start
    python benchmarks/loop_idle.py --model $QWEN_CODER_DIR --json /tmp/loop_idle.json

For each --work-ms d, the same requests (--requests prompts of 512 random token ids, up to --new-tokens tokens
each, seeded) go through VLLMBackend.submit/poll, one decode step per poll, and the loop sleeps d ms between
polls: a stand-in for its CPU work (the loop thread does it; vLLM runs nothing on another thread, so a sleep and
CPU work hold the engine up alike). Clock books the sleep as `parse`. vLLM queues its next forward before `step`
returns, so a work of d ms leaves the engine idle max(0, d - f) per poll, f being what is left of the queued
forward's GPU time when `step` returns (at most a forward; vLLM's own CPU work makes up the rest of a step). What to
read: loop_idle per poll against d, and the wall clock's growth per poll against d. On one H100 with the 0.5B model
(results/2026-12-07-loop-idle-seed-vs-grpo-bc-start): d + 0.04-0.2 ms for every d from 1 to 20 ms, the wall clock
growing alike: f ~ 0, the forward done within vLLM's 2.4 ms step. Not a test: figures are reported, never asserted.
"""
import argparse
import json
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common.backends import VLLMBackend  # noqa: E402
from common.models import load_tokenizer  # noqa: E402
from common.rollout import Clock  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", required=True, help="HF model folder vLLM loads")
p.add_argument("--requests", type=int, default=16, help="requests in flight (seed_rl.py's 2 x 8 episodes: 16)")
p.add_argument("--new-tokens", type=int, default=128, help="tokens per request (every one runs that long)")
p.add_argument("--work-ms", type=float, nargs="+", default=[0, 1, 2, 5, 10, 20], help="the loop's work per poll")
p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of the GPU")
p.add_argument("--json", default=None, help="write the results here")
args = p.parse_args()

tok = load_tokenizer(args.model)
engine = VLLMBackend(args.model, tok, max_model_len=1024, gpu_memory_utilization=args.gpu_memory_utilization,
                     enable_sleep_mode=False)
rng = random.Random(0)
prompts = [[rng.randrange(100, 20000) for _ in range(512)] for _ in range(args.requests)]


def run(work_s, tag):
    for k, ids in enumerate(prompts):  # seeded: the same tokens in every run, so the same polls
        engine.submit(f"{tag}-{k}", ids, max_new_tokens=args.new_tokens, temperature=1.0, seed=k)
    clock = Clock(engine.mark)
    polls = 0
    while engine.in_flight():
        if work_s:
            time.sleep(work_s)
        clock.lap("parse")
        clock.engine_poll()
        engine.poll()
        clock.lap("generate")
        clock.engine_polled()
        polls += 1
    t = clock.result()
    return dict(work_ms=1e3 * work_s, polls=polls, wall_s=t["wall"], generate_s=t["generate"], loop_s=t["parse"],
                loop_idle_s=t["loop_idle"], loop_idle_ms_per_poll=1e3 * t["loop_idle"] / polls,
                step_ms=1e3 * t["generate"] / polls)


run(0.0, "warmup")
rows = []
for d in args.work_ms:
    rows.append(run(d / 1e3, f"d{d}"))
    r = rows[-1]
    print(f"work {r['work_ms']:5.1f} ms/poll: {r['polls']} polls, wall {r['wall_s']:.2f} s, step {r['step_ms']:.2f} ms, "
          f"loop {r['loop_s']:.3f} s, loop_idle {r['loop_idle_s']:.3f} s ({r['loop_idle_ms_per_poll']:.2f} ms/poll)",
          flush=True)
if args.json:
    import torch
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), requests=args.requests, new_tokens=args.new_tokens,
                       rows=rows), f, indent=1)
