"""A stand-in for evaluate.py in tests/test_learning.py: its flags and results.json; a trained policy (a path
under hf/final) is given a lower invalid rate than the start."""
import argparse
import json
import os

p = argparse.ArgumentParser()
for f in ("--env", "--model", "--limit", "--seed", "--max-steps", "--workers", "--backend", "--out", "--splits",
          "--gpu-memory-utilization", "--kv-cache-gib", "--max-new-tokens", "--samples"):
    p.add_argument(f)
a = p.parse_args()
invalid = 40.0 if "hf/final" in a.model else 80.0


def split(extra):
    return {"episodes": 4, "success_pct": {"All": {"mean": 0.0}, "Avg": {"mean": 0.0}, "Pick": {"mean": 0.0}},
            "score_pct": {"All": 0.0}, "invalid_action_pct": {"All": invalid + extra},
            "inadmissible_action_pct": {"All": 5.0}, "episode_length": {"All": 15.0}}


os.makedirs(a.out, exist_ok=True)
with open(os.path.join(a.out, "results.json"), "w") as f:
    json.dump({"model": a.model, "elapsed_s": 1.0, "splits": {"valid_seen": split(0.0), "valid_unseen": split(2.0)}}, f)
