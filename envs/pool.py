"""A batched environment interface over a pool of worker processes, blocking or not.

Why processes: an ALFWorld reset costs ~2.3 s of CPU (the planner grounds the game) and a step 60-80 ms, so a
batch of 128 episodes must not run serially in the trainer's process. Episode slot i lives in worker
i % num_workers; the workers run in parallel, each working through its own commands in order.

Two ways to drive it:
  blocking      reset(games) / step({slot: action}): send a batch, wait for every answer (the tests, simple
                callers)
  non-blocking  submit(slot, cmd, arg) sends one command and returns at once; poll(timeout) hands back the
                answers that have arrived, [(slot, reply)], so the rollout loop (common/rollout.py) steps the
                env of one episode while the engine generates for the others. A worker answers each command
                as soon as it is done, not when its whole batch is.

Workers are fresh interpreters (`python -m envs.pool FD module:factory`) talking over a socketpair: no fork
of a trainer that holds CUDA or OpenMP state, and no re-import of the calling script (multiprocessing's
spawn would re-run a top-level script such as collect.py in every worker).

Robustness: a worker that dies, or does not answer a command within its timeout (counted from when the worker
could start it), is killed and replaced by a fresh one. Every game it held is lost: its pending commands, and
any later step of those slots, answer `{"error": ...}`, so those episodes end with an env failure instead of
crashing the run. A reset of the slot starts it afresh.
"""
import collections
import importlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker_main(conn, make_game):
    """Worker loop: holds the live games of its slots. Messages: ('batch', [(cmd, slot, arg), ...]); one
    reply (slot, state) per command, sent as soon as that command is done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes the pool
    games = {}
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if kind == "close":
            return
        for cmd, slot, arg in payload:
            try:
                if cmd == "reset":
                    games.pop(slot, None)
                    game = make_game(arg)
                    games[slot] = game
                    reply = game.reset()
                elif cmd == "step":
                    reply = games[slot].step(arg)
                elif cmd == "clear":
                    games.clear()
                    reply = None
                elif cmd == "pid":
                    reply = os.getpid()
                else:
                    reply = {"error": f"unknown command {cmd!r}"}
            except Exception as e:  # a broken game is an env failure of that episode only
                reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=3)}
            try:
                conn.send((slot, reply))
            except (BrokenPipeError, OSError, KeyboardInterrupt):
                return


class EnvPool:
    """Slots of live games over worker processes. Every answer is, per slot, a state dict (env-specific keys)
    or {"error": reason}."""

    def __init__(self, factory, num_workers, reset_timeout=180.0, step_timeout=60.0):
        self.factory = factory  # "module:function", game spec -> object with reset()/step(action)
        self.num_workers = max(1, int(num_workers))
        self.reset_timeout, self.step_timeout = reset_timeout, step_timeout
        # One selector over every worker's socket, kept for the pool's life: the rollout loop polls once per
        # engine step (~1,000 times an update), and building a fresh one per poll (multiprocessing's `wait`)
        # with a waitpid per worker was most of the loop's own CPU time (issue 31; benchmarks/loop_cpu.py)
        self.selector = selectors.DefaultSelector()
        self.workers = [self._spawn(w) for w in range(self.num_workers)]
        self.next_check = 0.0  # when poll next asks the OS whether busy workers are still alive
        self.queue = [collections.deque() for _ in range(self.num_workers)]  # per worker: [(slot, cmd, timeout)]
        self.head_since = [0.0] * self.num_workers  # when the worker could start its oldest pending command
        self.held = [set() for _ in range(self.num_workers)]  # slots whose game lives in that worker
        self.lost = {}  # slot -> why its game is gone (its worker was replaced)
        self.ready = []  # answers produced here (lost slots, failed sends), handed out by the next poll
        self.stats = {"resets": 0, "steps": 0, "env_failures": 0, "workers_replaced": 0}

    # ---- workers

    def _spawn(self, w):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        proc = subprocess.Popen([sys.executable, "-m", "envs.pool", str(theirs.fileno()), self.factory],
                                pass_fds=[theirs.fileno()], env=env, stdout=subprocess.DEVNULL)
        theirs.close()
        conn = Connection(ours.detach())
        self.selector.register(conn, selectors.EVENT_READ, w)
        return proc, conn

    def _kill(self, w):
        proc, conn = self.workers[w]
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        self.selector.unregister(conn)
        conn.close()

    def _fail(self, w, reason):
        """Replace worker w: each of its pending commands answers the error, each game it held is lost."""
        self._kill(w)
        self.workers[w] = self._spawn(w)
        self.stats["workers_replaced"] += 1
        for slot, cmd, _ in self.queue[w]:
            self.ready.append((slot, {"error": reason}))
        self.queue[w].clear()
        for slot in self.held[w]:
            self.lost[slot] = reason
        self.held[w].clear()

    # ---- non-blocking interface

    def submit(self, slot, cmd, arg=None):
        """Send one command ('reset' with a game spec, 'step' with an action) for a slot; never blocks on the
        worker. A step of a slot whose game was lost answers the error at the next poll."""
        w = slot % self.num_workers
        self.stats["resets"] += cmd == "reset"
        self.stats["steps"] += cmd == "step"
        if cmd == "reset":
            self.lost.pop(slot, None)
            self.held[w].add(slot)
        elif cmd == "step" and slot in self.lost:
            self.ready.append((slot, {"error": self.lost[slot]}))
            return
        if not self.queue[w]:
            self.head_since[w] = time.monotonic()
        timeout = self.reset_timeout if cmd == "reset" else self.step_timeout
        self.queue[w].append((slot, cmd, timeout))
        try:
            self.workers[w][1].send(("batch", [(cmd, slot, arg)]))
        except (BrokenPipeError, OSError):
            self._fail(w, "env worker died")

    def pending(self):
        """Commands sent and not answered yet (answers already waiting in `ready` excluded)."""
        return sum(len(q) for q in self.queue)

    def poll(self, timeout=0.0):
        """Answers that have arrived, [(slot, reply)] in arrival order. timeout: seconds to wait for at least
        one (None: until one arrives or a worker fails; 0: only what is there now). A worker past its deadline
        or dead is replaced here."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            busy = [w for w in range(self.num_workers) if self.queue[w]]
            if self.ready or not busy:
                break
            now = time.monotonic()
            deadline, wait_s = None, 0.0
            if end is None or end > now:  # a wait: no longer than the nearest worker's deadline
                deadline = min(self.head_since[w] + self.queue[w][0][2] for w in busy)
                wait_s = max(0.0, min(deadline - now, 0.5 if end is None else end - now))
            gone = set()
            for key, _ in self.selector.select(wait_s):
                w, conn = key.data, key.fileobj
                try:
                    while self.queue[w] and conn.poll():
                        slot, reply = conn.recv()
                        self.queue[w].popleft()
                        self.head_since[w] = time.monotonic()
                        self.ready.append((slot, reply))
                    if not self.queue[w] and conn.poll():  # readable with nothing asked of it: its end closed
                        raise EOFError
                except (EOFError, OSError):
                    gone.add(w)
            # A dead worker's socket reads as closed at once (gone); waitpid is for one whose socket a child of
            # its own still holds open, and a few times a second is soon enough for that, as for the deadlines
            # (tens of seconds). The rollout loop polls with timeout 0 once per engine step (~2.5 ms): going over
            # every busy worker on each call tripled its cost (benchmarks/loop_cpu.py: 15.0 -> 4.4 us, 16 workers)
            now = time.monotonic()
            check = now >= self.next_check or (deadline is not None and now >= deadline)
            if check:
                self.next_check = now + 0.2
            for w in sorted(gone.union(busy if check else ())):
                proc = self.workers[w][0]
                if w in gone or (self.queue[w] and proc.poll() is not None):  # busy ones only when check
                    try:
                        proc.wait(timeout=1)
                    except subprocess.TimeoutExpired:
                        pass
                    code = proc.poll()
                    self._fail(w, "env worker died" + (f" (exit code {code})" if code is not None else ""))
                elif self.queue[w] and now > self.head_since[w] + self.queue[w][0][2]:
                    self._fail(w, "env worker timed out")
            if end is not None and time.monotonic() >= end:
                break
        out, self.ready = self.ready, []
        for slot, reply in out:
            self.stats["env_failures"] += isinstance(reply, dict) and "error" in reply
        return out

    def clear(self):
        """Drop every worker's games (a new set of episodes begins; blocking)."""
        self._call([(w, "clear", None) for w in range(-self.num_workers, 0)])
        for w in range(self.num_workers):
            self.held[w].clear()
        self.lost.clear()

    # ---- blocking interface

    def _call(self, cmds):
        """[(slot, cmd, arg)] -> {slot: reply}, waiting for every answer."""
        for slot, cmd, arg in cmds:
            self.submit(slot, cmd, arg)
        want, out = {slot for slot, _, _ in cmds}, {}
        while want - set(out):
            for slot, reply in self.poll(timeout=None):
                out[slot] = reply
        return out

    def reset(self, games):
        """Start a new batch: slot i plays games[i]. Returns [state or {"error"}] in slot order."""
        self.clear()
        out = self._call([(i, "reset", g) for i, g in enumerate(games)])
        return [out[i] for i in range(len(games))]

    def step(self, actions):
        """actions: {slot: action text}. Returns {slot: state or {"error"}}."""
        out = self._call([(slot, "step", a) for slot, a in actions.items()])
        return out

    def worker_pids(self):
        out = self._call([(w, "pid", None) for w in range(-self.num_workers, 0)])
        return [out[w] for w in range(-self.num_workers, 0)]

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
        self.selector.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":  # a worker: python -m envs.pool FD module:function
    fd, factory = int(sys.argv[1]), sys.argv[2]
    module, fn = factory.split(":")
    _worker_main(Connection(fd), getattr(importlib.import_module(module), fn))
