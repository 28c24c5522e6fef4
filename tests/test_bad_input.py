"""What a new user can get wrong, and what each script answers: one line that names the problem, a non-zero
exit, within seconds, and nothing written. Each test backs a row of the README's "Bad input and interrupts"
table. Real subprocesses of the scripts; none loads a model or plays a game."""
import os
import socket
import subprocess
import sys
import threading
import time

from conftest import REPO, run_script
from common.models import shared_dir


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


# ---------------------------------------------------------------------------------------------------
# --model that cannot load (common/models.py check_model): one line naming it, no hub call for a local path

class HubSpy:
    """A TCP listener standing in for the hub (HF_ENDPOINT): it counts the connections the scripts open."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()
        self.env = {"HF_ENDPOINT": f"http://127.0.0.1:{self.sock.getsockname()[1]}"}

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


def test_missing_local_model_folder_is_one_line_without_a_hub_call(tmp_path):
    hub, missing = HubSpy(), str(tmp_path / "runs" / "sft")
    t0 = time.monotonic()
    res = run_script(["seed_rl.py", "--model", missing, "--out", str(tmp_path / "seed")], check=False, env=hub.env)
    line = one_line_error(res)
    assert line == f"model {missing}: no such folder ({missing})"
    assert hub.connections == 0 and time.monotonic() - t0 < 60  # it was 54 s of hub retries
    assert not os.path.exists(tmp_path / "seed" / "seed_manifest.json")


def test_malformed_model_id_and_a_folder_that_is_no_model_are_one_line(tmp_path):
    hub = HubSpy()
    res = run_script(["collect.py", "--model", "Qwen2.5-3B Instruct", "--tasks", "6", "--rollouts", "1",
                      "--out", str(tmp_path / "t.jsonl")], check=False, env=hub.env)
    assert one_line_error(res) == "model 'Qwen2.5-3B Instruct': not a folder here, and not a hub id (org/name)"
    res = run_script(["evaluate.py", "--model", str(tmp_path), "--limit", "1", "--out", str(tmp_path / "e")],
                     check=False, env=hub.env)
    assert one_line_error(res).startswith(f"model {tmp_path}: the folder {tmp_path} has no tokenizer_config.json")
    assert hub.connections == 0


def test_hub_id_not_in_the_cache_while_offline_is_one_line_without_a_hub_call(tmp_path):
    hub = HubSpy()
    res = run_script(["evaluate.py", "--model", "Qwen/No-Such-Model-0.1B", "--limit", "1", "--out",
                      str(tmp_path / "e")], check=False, env=dict(hub.env, HF_HUB_OFFLINE="1"))
    assert one_line_error(res).startswith("model Qwen/No-Such-Model-0.1B: not a folder here, and not in the local "
                                          "hub cache (HF_HUB_OFFLINE is set")
    assert hub.connections == 0


# ---------------------------------------------------------------------------------------------------
# Settings that would do nothing are refused

def test_group_of_one_and_zero_counts_are_refused(tmp_path):
    out = str(tmp_path / "seed")
    one = one_line_error(run_script(["seed_rl.py", "--model", "tiny", "--group-size", "1", "--out", out], check=False))
    assert one.startswith("--group-size 1: GRPO ranks the episodes") and "--allow-group-of-one" in one
    zero = one_line_error(run_script(["seed_rl.py", "--model", "tiny", "--group-size", "0", "--updates", "0",
                                      "--out", out], check=False))
    assert zero == "--updates 0, --group-size 0: must be 1 or more (with 0 nothing is played or trained)"
    res = run_script(["collect.py", "--model", "expert", "--rollouts", "0", "--out", str(tmp_path / "t.jsonl")],
                     check=False)
    assert one_line_error(res) == "--rollouts 0: must be 1 or more (with 0 nothing is played or trained)"
    assert not os.path.exists(out) and not os.path.exists(tmp_path / "t.jsonl")


def test_an_empty_split_is_refused_in_collect_and_evaluate(tmp_path):
    """A data folder whose splits hold no game: one line each, not 0 episodes or `max() arg is an empty
    sequence`."""
    data = tmp_path / "alfworld"
    for split in ("train", "valid_seen", "valid_unseen"):
        (data / "json_2.1.1" / split).mkdir(parents=True)
    env = {"ALFWORLD_DATA": str(data)}
    res = run_script(["collect.py", "--model", "expert", "--tasks", "6", "--out", str(tmp_path / "t.jsonl")],
                     check=False, env=env)
    assert one_line_error(res) == ("alfworld: split 'train' has no tasks (is the env's data complete?); nothing "
                                   "to play")
    res = run_script(["evaluate.py", "--model", "expert", "--limit", "6", "--out", str(tmp_path / "e")],
                     check=False, env=env)
    assert one_line_error(res) == ("alfworld: split 'valid_seen' has no tasks (is the env's data complete?); "
                                   "nothing to evaluate")
    assert not os.path.exists(tmp_path / "t.jsonl") and not os.path.exists(tmp_path / "e")
