"""--log-to (common/tracking.py): a missing optional package is one line naming it, never a traceback; where
tensorboard is installed, every numeric metric reaches its event file beside metrics.jsonl."""
import os
import sys

import pytest

from common.tracking import Tracker
from conftest import run_script


@pytest.mark.parametrize("kind", ["wandb", "tensorboard"])
def test_a_missing_package_is_one_line_naming_it(kind, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, kind, None)  # import -> ImportError, as when it is not installed
    with pytest.raises(SystemExit) as e:
        Tracker(kind, str(tmp_path), {}, rank=0)
    msg = str(e.value)
    assert f"--log-to {kind}" in msg and f"'{kind}'" in msg and "\n" not in msg


def test_other_ranks_and_none_log_nothing(tmp_path):
    for t in (Tracker("none", str(tmp_path), {}), Tracker("wandb", str(tmp_path), {}, rank=1)):
        t.log({"update": 1, "loss/pg": 0.5})
        t.close()
    assert os.listdir(tmp_path) == []


def test_the_scripts_refuse_before_any_model_loads(tmp_path):
    """seed_rl.py and sft.py with a package that is not there: exit 1, one line, no traceback."""
    hide = "import sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; import runpy; "
    for script, flags in [("seed_rl.py", ["--model", "tiny", "--updates", "1", "--tasks-per-update", "1",
                                          "--group-size", "2"]),
                          ("sft.py", ["--model", "tiny", "--bc-data", os.path.join(str(tmp_path), "none.jsonl")])]:
        if script == "sft.py":
            open(flags[-1], "w").close()
        res = run_script(["-c", hide + f"runpy.run_path({script!r}, run_name='__main__')", script, *flags,
                          "--log-to", "wandb", "--out", str(tmp_path / script)], check=False, timeout=300)
        assert res.returncode == 1, res.stderr[-2000:]
        assert "Traceback" not in res.stderr and "--log-to wandb: the optional package 'wandb'" in res.stderr


def test_tensorboard_gets_every_numeric_metric(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    t = Tracker("tensorboard", str(tmp_path), {})
    for u in (1, 2):
        t.log({"update": u, "loss/pg": 0.1 * u, "rollout/probe_rate": None, "kind": "train"})
    t.close()
    acc = EventAccumulator(os.path.join(str(tmp_path), "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("loss/pg")] == [(1, 0.1), (2, 0.2)]
