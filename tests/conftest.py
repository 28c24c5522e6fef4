"""Shared fixtures: real ALFWorld games, the real Qwen2.5 tokenizer, small real trajectory files."""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _ensure_alfworld_data():
    """The games where the scripts find them: $ALFWORLD_DATA, else ~/.cache/alfworld, unpacked there from
    ../shared/alfworld/alfworld-data.tar.xz on first use (envs/alfworld.py data_dir). Exported, so every
    subprocess of the suite reads the same folder."""
    from envs.alfworld import data_dir
    os.environ["ALFWORLD_DATA"] = data_dir()


_ensure_alfworld_data()


def run_script(args, timeout=600, check=True, **kw):
    """Run a project script (or `-m torch.distributed.run ...`) in a subprocess from the repo root."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(kw.pop("env", {}))
    res = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"{args} exited {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n"
                             f"--- stderr\n{res.stderr[-4000:]}")
    return res


def side_by_side(*calls):
    """Run independent jobs at once, each a (function, args...) tuple (e.g. (run_script, [...])), in threads; returns
    their results in order and re-raises the first failure. A script run is one single-threaded process
    (OMP_NUM_THREADS=1), so on 2 cores two of them take about the time of one."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(*call) for call in calls]
        return [f.result() for f in futures]


@pytest.fixture(scope="session")
def tokenizer():
    from common.models import load_tokenizer
    return load_tokenizer("tiny")


def run_folder(tmp_path_factory):
    """A folder of this pytest run that every xdist worker shares (the parent of the workers' own basetemps);
    without xdist, the session's basetemp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def _collected(tmp_path_factory):
    """The two collect.py runs behind expert_trajectories and tiny_trajectories, side by side (the suite uses both:
    ~53 s at once against ~67 s one after the other on 2 cores), once per pytest run: the first xdist worker to
    need them writes them under a lock, the other reads the same files (the tests only read them). Returns
    (expert path, tiny path)."""
    import fcntl
    root = run_folder(tmp_path_factory) / "collected"
    expert, tiny = root / "expert" / "traj.jsonl", root / "tiny" / "traj.jsonl"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when a run below fails
        if not (root / "done").exists():
            for path in (expert, tiny):
                shutil.rmtree(path.parent, ignore_errors=True)  # a failed attempt's partial files: start afresh
                path.parent.mkdir()
            side_by_side((run_script, ["collect.py", "--model", "expert", "--tasks", "6", "--rollouts", "2",
                                       "--workers", "2", "--out", str(expert)]),
                         (run_script, ["collect.py", "--model", "tiny", "--tasks", "6", "--rollouts", "1",
                                       "--max-steps", "3", "--max-new-tokens", "16", "--workers", "2",
                                       "--out", str(tiny)]))
            (root / "done").touch()
    return expert, tiny


@pytest.fixture(scope="session")
def expert_trajectories(_collected):
    """collect.py with the scripted expert: 1 train task per type x 2 rollouts (12 winning episodes)."""
    return _collected[0]


@pytest.fixture(scope="session")
def tiny_trajectories(_collected):
    """collect.py with the tiny random model: 1 train task per type x 1 rollout, 3 steps (failures)."""
    return _collected[1]


def interrupt(args, path, lines=1, timeout=300):
    """Start a project script in its own session and press Ctrl-C (SIGINT to its whole process group, as a
    terminal does: the script and its env workers) once `path` holds `lines` complete lines. Returns
    (return code, stdout, stderr)."""
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    # SIGINT back to its default in the child: a suite started in the background (`pytest &`, nohup) hands its
    # children SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so the Ctrl-C would be lost
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    try:
        while not (os.path.exists(path) and open(path, "rb").read().count(b"\n") >= lines):
            assert proc.poll() is None, f"{args} ended before writing {lines} lines: {proc.communicate()}"
            assert time.monotonic() < deadline, f"{args} wrote no {lines} lines in {timeout} s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err
