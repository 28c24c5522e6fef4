"""Trainer checkpoints against a kill at every step of a save (common/checkpoints.py save_checkpoint_dir, used by
seed_rl.py and sft.py): at every instant a complete checkpoint exists, and the next start takes the last
complete one. Here each named step of the save raises in place of a kill (no cleanup runs after a kill point,
so the files are what a SIGKILL there leaves); tests/test_seed_rl.py and tests/test_sft.py SIGKILL the real
scripts at the step that used to leave no checkpoint ($SEED_KILL_AT) and check that the runs resume exactly."""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from common import checkpoints
from common.checkpoints import latest_checkpoint, save_checkpoint_dir

# the steps of a save in order, and the update a start right after a kill there resumes from (saving update 2
# over update 1): before the swap the previous checkpoint, from `checkpoint` or `checkpoint.old`
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: fine

STEPS = [("written", 1), ("marked", 1), ("retired", 1), ("swapped", 2), ("unmarked", 2)]


class Killed(BaseException):
    pass


def weights(update):
    return {"w": torch.full((4, 3), float(update)), "b": torch.arange(3.0) * update}


def save(path, update, kill_at=None, monkeypatch=None):
    def point(name):
        if name == kill_at:
            raise Killed(name)
    monkeypatch.setattr(checkpoints, "kill_point", point)
    sd = weights(update)
    try:
        save_checkpoint_dir(path, lambda tmp: dcp.save(sd, checkpoint_id=tmp), "state.json", {"update": update}, 0)
    except Killed:
        return False
    return True


def load(path):
    folder, state = latest_checkpoint(path, "state.json")
    if folder is None:
        return None, None
    sd = {k: torch.zeros_like(v) for k, v in weights(0).items()}
    dcp.load(sd, checkpoint_id=folder)
    return state["update"], sd


@pytest.mark.parametrize("step,resumes_at", STEPS)
def test_a_kill_at_each_step_of_a_save_resumes_from_the_last_complete_update(step, resumes_at, tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint")
    assert save(path, 1, monkeypatch=monkeypatch)
    assert not save(path, 2, kill_at=step, monkeypatch=monkeypatch), f"the save never reached {step}"
    update, sd = load(path)
    assert update == resumes_at, (step, sorted(os.listdir(tmp_path)))
    for k, v in weights(resumes_at).items():  # the very weights of that update, not a mix
        assert torch.equal(sd[k], v), k
    # the resumed run saves again, over whatever the kill left: one clean checkpoint, nothing stale
    assert save(path, 3, monkeypatch=monkeypatch)
    assert load(path)[0] == 3 and sorted(os.listdir(tmp_path)) == ["checkpoint"]


@pytest.mark.parametrize("step", ["written", "marked", "swapped"])
def test_a_kill_during_the_first_save_leaves_nothing_or_the_whole_checkpoint(step, tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint")
    assert not save(path, 1, kill_at=step, monkeypatch=monkeypatch)
    assert load(path)[0] == (1 if step == "swapped" else None)  # no half checkpoint is ever taken
