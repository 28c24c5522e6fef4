"""collect.py end to end: killed mid-run (SIGKILL, plus a torn last line) and restarted, every planned episode
is in the output exactly once; restarting into the same --out with other settings is refused.

Real subprocesses of collect.py with the scripted expert on real valid_seen games: 1 task per type x 1 rollout,
shard 0/2 (3 episodes, which also covers the sharded plan), one episode per batch so a kill lands between
appended episodes."""
import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, interrupt, run_script
from envs.alfworld import select_games
from common.records import read_jsonl

ARGS = ["--model", "expert", "--split", "valid_seen", "--tasks", "6", "--rollouts", "1", "--seed", "5",
        "--shard", "0/2", "--batch-episodes", "1", "--workers", "1"]
N = 3  # episodes in shard 0/2 of 6


def _planned_uids():
    """Every second episode of the plan (task order, then rollout), starting at the first."""
    uids = [f"{g['task_id']}#r0" for g in select_games("valid_seen", 5, tasks_per_type=1)]
    assert len(uids) == 6
    return set(uids[0::2])


def _complete_lines(path):
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Start collect.py, SIGKILL it (and its env worker) once 2 of its 3 episodes are written, tear the last
    written line, restart with the same settings. Returns (out path, kill-time lines, restart result)."""
    tmp = tmp_path_factory.mktemp("collect")
    out = str(tmp / "traj.jsonl")
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(tmp / "first.log", "wb") as log:  # a file, not a pipe: nobody reads a pipe while we poll
        proc = subprocess.Popen([sys.executable, "collect.py", *ARGS, "--out", out], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while _complete_lines(out) < 2:
            assert proc.poll() is None, f"collect.py exited early: {(tmp / 'first.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "collect.py did not write 2 episodes in 300 s"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: collect.py and its env worker
        except ProcessLookupError:  # it had already exited (the assertion above says why)
            pass
        proc.wait()
    n_at_kill = _complete_lines(out)
    assert 2 <= n_at_kill < N, f"the kill did not land mid-run ({n_at_kill} episodes written)"

    # a kill during a write leaves a torn last line: keep all but the last record, and half of that one
    with open(out, "rb") as f:
        lines = f.read().split(b"\n")[:n_at_kill]
    with open(out, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    torn_uid = json.loads(lines[-1])["uid"]
    res = run_script(["collect.py", *ARGS, "--out", out], timeout=300)
    return out, n_at_kill, torn_uid, res


def test_killed_run_resumes_with_each_episode_exactly_once(resumed):
    out, n_at_kill, torn_uid, res = resumed
    kept = n_at_kill - 1  # the torn record is not kept: it is played again
    assert f"{N} episodes in this shard; {kept} already in {out}, {N - kept} to play" in res.stdout
    assert "cutting a torn last line" in res.stderr
    with open(out, "rb") as f:
        data = f.read()
    assert data.endswith(b"\n") and all(json.loads(line) for line in data.splitlines())  # no torn bytes left
    records = read_jsonl(out)
    counts = collections.Counter(ep["uid"] for ep in records)
    assert set(counts) == _planned_uids() and set(counts.values()) == {1}, counts
    assert torn_uid in counts
    assert all(ep["success"] and ep["env_failure"] is None and ep["steps"] for ep in records)
    assert f"({N} episodes in {out})" in res.stdout  # the summary covers the whole file
    manifest = json.load(open(out + ".manifest.json"))
    assert manifest["script"] == "collect.py" and manifest["games"]["count"] == 6 and manifest["args"]["shard"] == "0/2"
    (entry,) = manifest["resumes"]  # the restart kept the first run's manifest and added itself
    assert entry["episodes_done"] == kept and entry["changed"] == {}


def test_restart_with_other_settings_is_refused(resumed):
    """Same plan, other sampling: the records would mix two collections. (One run, two changed flags: both
    must be named; each collect.py start costs seconds.)"""
    out = resumed[0]
    before = open(out, "rb").read(), open(out + ".manifest.json", "rb").read()
    args = ARGS + ["--temperature", "1.0", "--max-new-tokens", "64"]
    res = run_script(["collect.py", *args, "--out", out], timeout=300, check=False)
    assert res.returncode != 0
    assert "other settings" in res.stderr and "--temperature 0.4 then, 1.0 now" in res.stderr
    assert "--max-new-tokens" in res.stderr and "Traceback" not in res.stderr
    assert "seed" not in res.stderr.split("other settings")[1]  # only what changed is named
    assert (open(out, "rb").read(), open(out + ".manifest.json", "rb").read()) == before  # nothing touched


@pytest.mark.slow  # ~58 s on 2 cores: 12 expert episodes over an interrupted run and its rerun
def test_ctrl_c_saves_every_finished_episode_and_says_how_to_resume(tmp_path):
    """Six expert episodes in play at once (2 env workers): each is written the moment it ends, so a Ctrl-C
    after the first keeps it and those that ended since, prints one line (no tracebacks), and rerunning the
    same command plays only the rest."""
    out = str(tmp_path / "traj.jsonl")
    # 12 episodes, 6 in play at once: when the first is written, at least 6 have not even started, so the
    # Ctrl-C always lands mid-run (with 6 in all, a loaded machine could finish them all before it arrived)
    args = ["collect.py", "--model", "expert", "--split", "valid_seen", "--tasks", "6", "--rollouts", "2",
            "--seed", "5", "--batch-episodes", "6", "--workers", "2", "--out", out]
    code, stdout, stderr = interrupt(args, out, lines=1)
    saved = len(read_jsonl(out))
    assert code == 130 and 1 <= saved < 12, (code, saved, stderr[-2000:])
    assert "Traceback" not in stderr + stdout and "KeyboardInterrupt" not in stderr + stdout
    last = stderr.strip().splitlines()[-1]
    assert last == (f"interrupted: {saved} of 12 episodes are saved in {out} ({saved} by this run); "
                    "rerun the same command to resume")
    res = run_script(args)
    assert f"12 episodes in this shard; {saved} already in {out}, {12 - saved} to play" in res.stdout
    counts = collections.Counter(ep["uid"] for ep in read_jsonl(out))
    assert len(counts) == 12 and set(counts.values()) == {1}
