"""What a new user can get wrong, and what each script answers: one line that names the problem, a non-zero
exit, within seconds, and nothing written. Each test backs a row of the README's "Bad input and interrupts"
table. Real subprocesses of the scripts; none loads a model or plays a game."""
import os
import subprocess
import sys

from conftest import REPO, run_script
from envs.models import shared_dir


def one_line_error(res):
    """The error line of a refused run (stderr's last line), after checking the run was refused cleanly."""
    assert res.returncode != 0, res.stdout[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return res.stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------------
# ALFWorld games: one location, ~/.cache/alfworld (envs/alfworld.py data_dir)

def test_alfworld_games_are_unpacked_on_first_use_into_the_one_location(tmp_path):
    """ALFWORLD_DATA unset, ~/.cache/alfworld empty, the archive beside the checkout: unpacked there, once."""
    env = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    env.update(HOME=str(tmp_path), SHARED=shared_dir(), PYTHONPATH=REPO)
    code = "from envs.alfworld import data_dir, list_games; print(data_dir()); print(len(list_games('valid_seen')))"
    first = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == [str(tmp_path / ".cache" / "alfworld"), "140"]
    assert "unpacking" in first.stderr
    again = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert again.stdout == first.stdout and "unpacking" not in again.stderr


def test_missing_alfworld_games_name_the_one_command(tmp_path):
    """No games and no archive: collect.py stops with the command that gets them."""
    env = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}  # conftest exports the suite's
    env.update(HOME=str(tmp_path), SHARED=str(tmp_path / "no-shared"), PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "collect.py", "--model", "expert", "--out", str(tmp_path / "t.jsonl")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    line = one_line_error(res)
    assert "ALFWorld games not found in" in line and "`alfworld-download`" in line
    assert not os.path.exists(tmp_path / "t.jsonl")
