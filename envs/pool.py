"""A batched environment interface over a pool of worker processes.

Why processes: an ALFWorld reset costs ~2.3 s of CPU (the planner grounds the game) and a step 60-80 ms, so a
batch of 128 episodes must not run serially in the trainer's process. Episode slot i lives in worker
i % num_workers; each call sends every worker its share of the batch and the workers run in parallel.

Workers are fresh interpreters (`python -m envs.pool FD module:factory`) talking over a socketpair: no fork
of a trainer that holds CUDA or OpenMP state, and no re-import of the calling script (multiprocessing's
spawn would re-run a top-level script such as collect.py in every worker).

Robustness: a worker that dies or does not answer within the timeout is killed and replaced by a fresh one;
the episodes it held end with an env failure (`{"error": ...}`) instead of crashing the run.
"""
import importlib
import os
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker_main(conn, make_game):
    """Worker loop: holds the live games of its slots. Messages: ('batch', [(cmd, slot, arg), ...])."""
    games = {}
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if kind == "close":
            return
        replies = []
        for cmd, slot, arg in payload:
            try:
                if cmd == "reset":
                    game = make_game(arg)
                    games[slot] = game
                    replies.append(game.reset())
                elif cmd == "step":
                    replies.append(games[slot].step(arg))
                elif cmd == "clear":
                    games.clear()
                    replies.append(None)
                elif cmd == "pid":
                    replies.append(os.getpid())
                else:
                    replies.append({"error": f"unknown command {cmd!r}"})
            except Exception as e:  # a broken game is an env failure of that episode only
                replies.append({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=3)})
        conn.send(replies)


class EnvPool:
    """`reset(games)` starts a new batch (slot i plays games[i]); `step({slot: action})` advances the slots
    given. Each returns per slot a state dict (env-specific keys) or {"error": reason}."""

    def __init__(self, factory, num_workers, reset_timeout=180.0, step_timeout=60.0):
        self.factory = factory  # "module:function", game spec -> object with reset()/step(action)
        self.num_workers = max(1, int(num_workers))
        self.reset_timeout, self.step_timeout = reset_timeout, step_timeout
        self.workers = [self._spawn() for _ in range(self.num_workers)]
        self.stats = {"resets": 0, "steps": 0, "env_failures": 0, "workers_replaced": 0}

    def _spawn(self):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        proc = subprocess.Popen([sys.executable, "-m", "envs.pool", str(theirs.fileno()), self.factory],
                                pass_fds=[theirs.fileno()], env=env, stdout=subprocess.DEVNULL)
        theirs.close()
        return proc, Connection(ours.detach())

    def _kill(self, w):
        proc, conn = self.workers[w]
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        conn.close()

    def _replace(self, w):
        self._kill(w)
        self.workers[w] = self._spawn()
        self.stats["workers_replaced"] += 1

    def _fail(self, w, cmds, reason, out):
        self._replace(w)
        for _, slot, _ in cmds:
            out[slot] = {"error": reason}

    def _receive(self, w, deadline):
        """(replies, None) or (None, reason) for worker w."""
        proc, conn = self.workers[w]
        try:
            while not conn.poll(0.05):
                if proc.poll() is not None:
                    return None, f"env worker died (exit code {proc.returncode})"
                if time.monotonic() > deadline:
                    return None, "env worker timed out"
            return conn.recv(), None
        except (EOFError, OSError):
            return None, "env worker died"

    def _call(self, cmds_by_worker, timeout_per_cmd):
        """cmds_by_worker: {w: [(cmd, slot, arg)]} -> {slot: reply}. Replaces dead or hung workers."""
        out, pending = {}, {}
        for w, cmds in cmds_by_worker.items():
            try:
                self.workers[w][1].send(("batch", cmds))
                pending[w] = cmds
            except (BrokenPipeError, OSError):
                self._fail(w, cmds, "env worker died", out)
        start = time.monotonic()
        for w, cmds in pending.items():  # the workers run in parallel; collect in turn
            replies, reason = self._receive(w, start + timeout_per_cmd * len(cmds))
            if reason is not None:
                self._fail(w, cmds, reason, out)
            else:
                out.update((slot, rep) for (_, slot, _), rep in zip(cmds, replies))
        return out

    def _by_worker(self, items, cmd):
        cmds = {}
        for slot, arg in items:
            cmds.setdefault(slot % self.num_workers, []).append((cmd, slot, arg))
        return cmds

    def reset(self, games):
        """Start a new batch: slot i plays games[i]. Returns [state or {"error"}] in slot order."""
        self._call({w: [("clear", -1, None)] for w in range(self.num_workers)}, self.step_timeout)
        out = self._call(self._by_worker(enumerate(games), "reset"), self.reset_timeout)
        self.stats["resets"] += len(games)
        self.stats["env_failures"] += sum("error" in out[i] for i in range(len(games)))
        return [out[i] for i in range(len(games))]

    def step(self, actions):
        """actions: {slot: action text}. Returns {slot: state or {"error"}}."""
        out = self._call(self._by_worker(actions.items(), "step"), self.step_timeout)
        self.stats["steps"] += len(actions)
        self.stats["env_failures"] += sum("error" in r for r in out.values())
        return out

    def worker_pids(self):
        out = self._call({w: [("pid", -1 - w, None)] for w in range(self.num_workers)}, self.step_timeout)
        return [out[-1 - w] for w in range(self.num_workers)]

    def close(self):
        for proc, conn in self.workers:
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5
        for proc, conn in self.workers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            conn.close()
        self.workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":  # a worker: python -m envs.pool FD module:function
    fd, factory = int(sys.argv[1]), sys.argv[2]
    module, fn = factory.split(":")
    _worker_main(Connection(fd), getattr(importlib.import_module(module), fn))
