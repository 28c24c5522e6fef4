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
# two held-out episodes in evaluate.py's record schema (what learning.py slims into actions.jsonl)
step = {"prompt": "p" * 100, "prompt_ids": [1] * 50, "response": "<action>go to desk 1</action>",
        "action": "go to desk 1", "valid": True, "invalid_reason": None, "admissible_action": False,
        "feedback": "Nothing happens."}
with open(os.path.join(a.out, "trajectories.jsonl"), "w") as f:
    for i in range(2):
        f.write(json.dumps({"task_id": f"t{i}", "split": "valid_seen", "category": "Pick", "success": i == 1,
                            "length": 1, "env_failure": None, "steps": [step]}) + "\n")
