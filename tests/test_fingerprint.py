"""ALFWorld behaviour pinned across refactors: the same seeds give the same episodes and the same losses.

tests/data/alfworld_fingerprint.json: the expert and tiny collect.py runs of the conftest fixtures (executed
actions, validity, returns) and the 2 seed_rl.py updates of tests/test_seed_rl.py (losses and rollout statistics;
asserted there, on the run that file already makes). Recorded before the env interface existed (4fa96d7) and
asserted after the move; re-recorded at the protocol-fidelity change that alters the fallback action, and its
seed_rl updates at the scripted analyzer's trajectory-specific failure skills (its "about" says so).
"""
import json
import os

import pytest

from conftest import REPO

FINGERPRINT = os.path.join(REPO, "tests", "data", "alfworld_fingerprint.json")


def load_fingerprint():
    with open(FINGERPRINT) as f:
        return json.load(f)


def collect_fingerprint(path):
    """{uid: executed actions, validity, return, success} of a collect.py output file."""
    out = {}
    with open(path) as f:
        for line in f:
            ep = json.loads(line)
            out[ep["uid"]] = {"executed": [s["executed"] for s in ep["steps"]],
                              "valid": [s["valid"] for s in ep["steps"]], "return": ep["return"],
                              "success": ep["success"]}
    return out


@pytest.mark.parametrize("which", ["expert", "tiny"])
def test_collect_matches_the_fingerprint(which, request):
    path = request.getfixturevalue(f"{which}_trajectories")
    assert collect_fingerprint(path) == load_fingerprint()[f"{which}_collect"]
