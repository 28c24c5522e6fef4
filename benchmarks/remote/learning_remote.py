"""The learning benchmark in short calls of a lent remote GPU (benchmarks/remote/h200.sh part L): the same runs,
records and report as benchmarks/learning.py, whose plan, commands and records this imports, plus what a
machine lent for ~10 minutes at a time needs. On your own GPU box run benchmarks/learning.py instead.

    # one call of part L (h200.sh wraps this): SEED and GRPO of seed 0 side by side, return at the deadline
    python benchmarks/remote/learning_remote.py --model $QWEN_CODER_DIR --seeds 0 --lanes 2 --deadline-s 500 --detach
    # the next call on the same machine re-attaches to the jobs left running and collects what finished
    python benchmarks/remote/learning_remote.py --model $QWEN_CODER_DIR --seeds 0 --lanes 2 --deadline-s 500 --detach
    # bring the records of a call home (dedupes by run id)
    python benchmarks/remote/learning_remote.py --merge /path/to/returned/learning
    # the machine went away before the driver collected its jobs: records from the job folders part L returned
    python benchmarks/remote/learning_remote.py --salvage /path/to/returned/L.tar.gz

Units of work. A *job* (one run: train, then evaluate the end policy; or one start evaluation) has a folder under
--scratch and is executed by a *runner* (this file with --job DIR: learning.py's run_job) in its own process
session, so that it survives the driver: with --detach the driver returns at its deadline and the jobs run on; the
next call (same machine, same --scratch) re-attaches to them and collects what finished. A finished job leaves
done.json; the driver turns it into a record. A job killed on the way leaves no record: its rerun starts training
afresh (or resumes seed_rl.py's own checkpoint, with --save-every), and evaluate.py resumes itself. A machine that
goes away takes its jobs with it; --salvage records what the returned job folders hold (a run whose training
finished, without its end evaluation; the rest as lost attempts). Without --detach, only jobs that the estimates
say end before --deadline-s are started, and what is still running then is killed (attempts.jsonl says so).

Side by side on one GPU (--lanes 2): every process gets a share of the GPU (vLLM's gpu_memory_utilization).
vLLM sizes its KV cache at start-up from how the device's free memory changes while it profiles, and asserts
that free memory did not grow; another process waking, sleeping or allocating meanwhile breaks that (vLLM:
"Error in memory profiling ... other processes sharing the same container release GPU memory"). So the runners
share one gate: while one process starts an engine (from its first vLLM log line to "init engine ... took"),
the other jobs' processes are stopped (SIGSTOP) and then continued. The stopped seconds are recorded (frozen_s).
With --kv-cache-gib the engines do not profile (a fixed KV cache), so the other jobs run on while one engine starts,
and only the first engine start of each kind (training, evaluation) goes alone: it compiles and fills vLLM's compile
cache on this machine; the later ones read it and start side by side (one at a time, five engine starts of 40-50 s
each had held the last job back ~150 s: results/2026-12-05-plumbing-check-bc-start-alfworld-0.5b/).
"""
import argparse
import fcntl
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the plain runner

from learning import (REPO, Results, add_run, attempt_record, build_parser, finish_args, job_record,  # noqa: E402
                      now, plan_jobs, read_json, read_jsonl, run_job, run_summary, train_complete, write_json)

# Time model for planning under a deadline (seconds), until runs of the same group are on file. Alone (fifth
# session, results/2026-12-03-rollout-async-trainer-profile), at 15 steps of 2 x 8 episodes: SEED 18-22 s and GRPO
# 15-17.5 s per update, vLLM's engine start with compilation ~75 s, the end evaluation ~95 s. Side by side (sixth
# session, results/2026-12-03-learning-alfworld-base-partial): per update, median over a run, SEED 42-44 s at
# --lanes 2 (two SEED runs) and 35-38 s at --lanes 3, GRPO 24-27 s at --lanes 3: ~1.5-2.1x alone, so 1.9; two end
# evaluations side by side had not finished after 147 s (the gate stops one while the other's engine starts), so
# the evaluation slows by as much.
EST = dict(startup=100, save=30, eval_start=45, eval_min=50, eval_episode=0.5, per_update={"seed": 20.0, "grpo": 16.5},
           lane_slowdown=1.9)


def parse_args(argv=None):
    p = build_parser(__doc__)
    g = p.add_argument_group("remote calls: side by side, deadlines, detached jobs, records brought home")
    g.add_argument("--lanes", type=int, default=1, help="jobs at a time on the one GPU (2: two seed_rl.py side by "
                   "side, their engine starts kept apart by the gate)")
    g.add_argument("--deadline-s", type=float, default=None, help="stop after this many seconds: no job is started "
                   "that would not end by then (estimates), and running jobs are killed at it unless --detach")
    g.add_argument("--detach", action="store_true", help="at the deadline leave the jobs running (their own process "
                   "sessions) for the next call on the same machine to collect; starts jobs while lanes are free")
    g.add_argument("--merge", nargs="+", metavar="DIR", help="append the records of returned results folders "
                   "(runs.jsonl, evals.jsonl, attempts.jsonl) to --results-dir, skipping those already there")
    g.add_argument("--salvage", nargs="+", metavar="PATH", help="records from part L's returned job folders "
                   "(L.tar.gz or its unpacked folder) that no driver collected: finished jobs, and runs whose training "
                   "finished but whose end evaluation did not (recorded without it); the rest as lost attempts")
    g.add_argument("--job", metavar="DIR", help=argparse.SUPPRESS)  # internal: run one job (the runner)
    args = p.parse_args(argv)
    return finish_args(p, args, need_model=not (args.job or args.merge or args.salvage))


# ====================================================================================================
# Processes: a job's tree, alive or not, signalled as a whole

def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def process_tree(root):
    """root and its descendants, parents first (from /proc). A tree, not a process group: torchrun starts its
    worker in a session of its own."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def is_env_worker(pid):
    """An env worker (`python -m envs.pool ...`): CPU only."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"envs.pool" in f.read().split(b"\0")
    except OSError:
        return False


def signal_tree(root, sig, keep_env_workers=False):
    """Signal root and its descendants. keep_env_workers: leave the env workers alone (the gate's stops: an env
    pool's step deadline is wall-clock time in the trainer, so a stopped worker would count the stop against
    it; a worker left running has its answer ready when the trainer continues)."""
    for pid in process_tree(root):
        if keep_env_workers and pid != root and is_env_worker(pid):
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# ====================================================================================================
# The engine gate: one vLLM engine start at a time on the GPU

class EngineGate:
    """One vLLM engine start at a time on the GPU, every other job's processes stopped meanwhile (the module
    docstring says why). Shared through files in the scratch folder: a lock, its holder, and one registry entry
    per runner (its child's pid and the runner's state). Each runner polls for its own child:
      before  the child has not begun an engine start yet
      wants   it has (a vLLM log line): the child is stopped until the lock is free
      holds   the lock taken: every other registered child's process tree (less its env workers: CPU only, and
              the env pool's deadlines are wall-clock) is stopped at once (SIGSTOP), then
              this child runs until vLLM says the engine is up ("init engine ... took"), or its readiness file
              appears, or TIMEOUT; then the lock is released and the trees it stopped are continued (those
              whose runner does not itself want the lock)
      after   the engine is up
    A child in any state but `holds` is stopped while another runner holds the lock (its runner keeps it so).
    freeze_others=False (the jobs' engines have a fixed KV cache, --kv-cache-gib: no profiling to disturb): only a
    child that `wants` the lock is stopped; the others run on while an engine starts; and once an engine of the same
    phase (train, eval) has started on this machine (a marker file: vLLM's compile cache is warm), a start skips the
    lock altogether."""
    BEGIN = re.compile(r"^(INFO|WARNING|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d", re.M)  # vLLM's logger format
    READY = re.compile(r"init engine \(|^episodes:|\repisodes:", re.M)  # vLLM's own line; evaluate.py's bar
    TIMEOUT = 300  # seconds: a start that never says it is ready releases the gate anyway

    def __init__(self, scratch, name, freeze_others=True):
        self.freeze_others, self.scratch, self.warm_path = freeze_others, scratch, None
        self.lock_path = os.path.join(scratch, "engine.lock")
        self.holder_path = self.lock_path + ".holder"
        self.registry = os.path.join(scratch, "engine.runners")
        os.makedirs(self.registry, exist_ok=True)
        self.entry = os.path.join(self.registry, str(os.getpid()))
        self.name, self.fd, self.state, self.since, self.stopped_others = name, None, "before", None, []
        self.frozen_since, self.frozen_s, self.root = None, 0.0, None

    def _set_state(self, state):
        self.state = state
        write_json(self.entry, {"root": self.root, "state": state})

    def reset(self, root, phase="train"):
        """A new child process (of the job's phase: train, eval): its engine start is ahead of it."""
        self.release()
        self.root, self.frozen_since, self.frozen_s = root, None, 0.0
        self.warm_path = os.path.join(self.scratch, f"engine.warm.{phase}")
        self._set_state("before")

    def _others(self):
        """{runner pid: registry entry} of the other live runners."""
        out = {}
        for name in os.listdir(self.registry):
            if name.isdigit() and int(name) != os.getpid() and pid_alive(int(name)):
                e = read_json(os.path.join(self.registry, name))
                if e and e.get("root"):
                    out[int(name)] = e
        return out

    def _other_holder(self):
        h = read_json(self.holder_path)
        if not h or h.get("pid") == os.getpid():
            return None
        if not pid_alive(h["pid"]):
            try:
                os.remove(self.holder_path)  # a dead holder: the OS released its lock already
            except OSError:
                pass
            return None
        return h

    def _try_take(self):
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd, self.since = fd, time.time()
        write_json(self.holder_path, {"pid": os.getpid(), "job": self.name, "since": now()})
        self.stopped_others = [e["root"] for e in self._others().values()] if self.freeze_others else []
        for root in self.stopped_others:  # now, not at their runners' next poll
            signal_tree(root, signal.SIGSTOP, keep_env_workers=True)
        return True

    def release(self):
        if self.fd is None:
            return
        try:
            os.remove(self.holder_path)
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
        waiting = {e["root"] for e in self._others().values() if e.get("state") == "wants"}
        for root in self.stopped_others:
            if root not in waiting:
                signal_tree(root, signal.SIGCONT, keep_env_workers=True)
        self.stopped_others = []

    def _stop(self, stop):
        if stop and self.frozen_since is None:
            signal_tree(self.root, signal.SIGSTOP, keep_env_workers=True)
            self.frozen_since = time.time()
        elif not stop and self.frozen_since is not None:
            signal_tree(self.root, signal.SIGCONT, keep_env_workers=True)
            self.frozen_s += time.time() - self.frozen_since
            self.frozen_since = None

    def frozen_seconds(self):
        """Seconds this child has been stopped so far (the stop under way counted)."""
        return self.frozen_s + (time.time() - self.frozen_since if self.frozen_since else 0.0)

    def poll(self, log_text, ready_file=None):
        """One look at the child's log so far; stops or continues the child's process tree."""
        if self.state == "before" and not self.freeze_others and os.path.exists(self.warm_path):
            self._set_state("after")  # an engine of this phase started here before: the compile cache is warm
        if self.state == "before" and self.BEGIN.search(log_text):
            self._set_state("wants")
        if self.state == "wants" and self._try_take():
            self._set_state("holds")
        if self.state == "holds" and (self.READY.search(log_text) or (ready_file and os.path.exists(ready_file))
                                      or time.time() - self.since > self.TIMEOUT):
            self._set_state("after")
            self.release()
            if self.READY.search(log_text):
                open(self.warm_path, "w").close()
        self._stop(self.state == "wants" or (self.freeze_others and self.state != "holds"
                                             and self._other_holder() is not None))

    def done(self):
        """The child ended (or is being ended): release, continue, leave the registry."""
        self._stop(False)
        self.release()
        try:
            os.remove(self.entry)
        except OSError:
            pass


# ====================================================================================================
# The runner: one job, in its own process session

def runner(jobdir):
    """--job DIR: one job in its own process session (learning.py's run_job under the gate). A SIGTERM (the
    driver's kill_job) ends the child's tree first, continued if the gate had stopped it."""
    job = read_json(os.path.join(jobdir, "job.json"))
    fixed_kv = "--kv-cache-gib" in job.get("train_cmd", []) + (job["eval_cmd"] or [])  # no profiling: nothing to protect
    gate = EngineGate(os.path.dirname(jobdir.rstrip("/")), job["job_id"], freeze_others=not fixed_kv)

    def on_term(signum, frame):
        root = read_json(os.path.join(jobdir, "child.pid"))
        if root:
            tree = process_tree(root)
            for sig in (signal.SIGCONT, signal.SIGTERM):
                for p in tree:
                    try:
                        os.kill(p, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            for _ in range(40):
                if not any(pid_alive(p) for p in tree):
                    break
                time.sleep(0.25)
            for p in tree:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        gate.done()
        os._exit(143)
    signal.signal(signal.SIGTERM, on_term)
    return 0 if run_job(dict(job, dir=jobdir), gate=gate) else 1


# ====================================================================================================
# The driver: launch, attach, collect, write records

def runner_alive(job):
    st = read_json(os.path.join(job["dir"], "status.json"), {})
    pid = st.get("pid")
    if not pid or not pid_alive(pid):
        return False
    try:  # the pid is this job's runner, not a reused number
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return job["dir"].encode() in f.read()
    except OSError:
        return True


def launch(job):
    os.makedirs(job["dir"], exist_ok=True)
    write_json(os.path.join(job["dir"], "job.json"), job)
    with open(os.path.join(job["dir"], "runner.log"), "a") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--job", job["dir"]], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < 10 and read_json(os.path.join(job["dir"], "status.json"), {}).get("pid") != proc.pid:
        time.sleep(0.05)  # until the runner has written its pid (attach and kill look it up there)
    return proc


def kill_job(job, proc=None):
    """SIGTERM to the runner (it ends its child's tree and releases the gate); SIGKILL to what is left."""
    st = read_json(os.path.join(job["dir"], "status.json"), {})
    pid, root = st.get("pid"), read_json(os.path.join(job["dir"], "child.pid"))
    tree = process_tree(root) if root else []
    if pid and pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(120):
            if not pid_alive(pid) and (proc is None or proc.poll() is not None):
                break
            time.sleep(0.25)
    for p in ([pid] if pid else []) + tree:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
    if proc is not None:
        proc.wait()


def estimate(job, results, lanes):
    """Seconds a job will take: the median of finished runs of the same group and method, else EST."""
    if job["kind"] == "start_eval":
        return EST["eval_start"] + eval_seconds(job["env"], job["config"]["eval"], lanes)
    same = [r["compute"]["train_wall_s"] + (r["compute"]["eval_wall_s"] or 0) for r in read_jsonl(results.path["runs"])
            if r["group"] == job["group"] and r["method"] == job["method"] and r["compute"]["lanes"] == lanes
            and r["eval"].get("end")]  # a salvaged run has no end evaluation
    if same:
        return statistics.median(same)
    c = job["config"]
    scale = (c["tasks_per_update"] * c["group_size"] / 16 * c["max_steps"] / 15
             * (EST["lane_slowdown"] if lanes > 1 else 1))
    # in the run: its start and its end, with no engine start of their own; else one evaluate.py job
    one = eval_seconds(job["env"], c["eval"], lanes)
    evals = 2 * one if c["eval"].get("in_run") else EST["eval_start"] + one
    return EST["startup"] + c["updates"] * EST["per_update"][job["method"]] * scale + EST["save"] + evals


def eval_seconds(env_name, e, lanes):
    """One held-out evaluation's playing time (no engine start): its episodes at EST["eval_episode"] s each alone
    (~1 episode/s side by side, seen on the H200), at least EST["eval_min"] (the longest episode's steps). With
    --eval-limit 0, every task of each split: the env preset's count (ALFWorld 140 + 134), else 100 (Search's val)."""
    from envs import load_env
    P = load_env(env_name).PRESET
    splits = e["splits"].split(",") if e["splits"] else P["eval_splits"]
    episodes = sum(e["limit"] or P.get("eval_sizes", {}).get(s.strip(), 100) for s in splits) * e.get("samples", 1)
    return max(EST["eval_min"], episodes * EST["eval_episode"]) * (EST["lane_slowdown"] if lanes > 1 else 1)


def collect(job, results, start_eval_job, wait_for_start=False):
    """A finished job -> its record (a run gets the start evaluation joined in). Returns "on file", "waiting"
    (a run whose start evaluation is still under way, with wait_for_start) or "not done"."""
    done = read_json(os.path.join(job["dir"], "done.json"))
    if not done:
        return "not done"
    if job["kind"] == "start_eval":
        results.add("evals", done)
        return "on file"
    if start_eval_job is None:  # --eval-in-run: the record holds the run's own start evaluation
        add_run(done, results, None)
        return "on file"
    se = results.evals.get(job["eval_key"]) or read_json(os.path.join(start_eval_job["dir"], "done.json"))
    if se is None and wait_for_start:
        return "waiting"
    add_run(done, results, se)
    return "on file"


def progress(job):
    st = read_json(os.path.join(job["dir"], "status.json"), {})
    n = len(read_jsonl(os.path.join(job["dir"], "train", "metrics.jsonl"))) if job["kind"] == "run" else 0
    return (f"{job['job_id']}: {st.get('phase', '?')}"
            + (f", update {n}/{job['config']['updates']}" if job["kind"] == "run" else "")
            + f", stopped {st.get('frozen_s', 0):.0f} s, device peak {(st.get('device_peak_mib') or 0) / 1024:.1f} GiB")


def drive(args):
    """Plan, collect what a former call finished, attach to what it left running, start jobs while lanes are
    free (and, without --detach, only what the estimates say ends before the deadline), collect as they end."""
    t_start = time.time()
    deadline = t_start + args.deadline_s if args.deadline_s else None
    stamp = lambda: f"[{time.time() - t_start:5.0f}s]"
    cfg, start, group, start_eval, runs = plan_jobs(args, lanes=args.lanes)
    results = Results(args.results_dir)
    print(f"learning: env {args.env}, start {start['label']}, group {group}, methods {args.methods}, seeds "
          f"{args.seeds}, {cfg['updates']} updates of {cfg['tasks_per_update']} x {cfg['group_size']} episodes, "
          f"{cfg['max_steps']} steps, lr {cfg['lr']}; lanes {args.lanes}; results in {results.folder}", flush=True)
    # ---- what is on file, or finished in the scratch folder by a former call, is not run again
    todo = []
    start_done = (start_eval is None or start_eval["eval_key"] in results.ids["evals"]
                  or collect(start_eval, results, start_eval) == "on file")
    for job in runs:
        if job["run_id"] in results.ids["runs"] or collect(job, results, start_eval) == "on file":
            print(f"  {job['job_id']}: finished, on file (skipped)")
        else:
            todo.append(job)
    if todo and not start_done:  # the start's evaluation goes first, unless no run is left to compare with it
        todo.insert(0, start_eval)
    if args.dry_run:
        for job in todo:
            print(f"\n{job['job_id']} (estimate {estimate(job, results, args.lanes):.0f} s)")
            for k in ("train_cmd", "eval_cmd"):
                if job.get(k):
                    print(f"  {k}: {shlex.join(job[k])}")
        return 0
    # ---- attach to the jobs a former call left running (--detach); queue the rest
    running = {}  # job_id -> (job, Popen, or None when attached)
    for job in todo:
        if runner_alive(job):
            print(f"  attached to {progress(job)} (running since a former call)", flush=True)
            running[job["job_id"]] = (job, None)
    queue = [j for j in todo if j["job_id"] not in running]
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda s, f: stop.update(now=True))
    finished, failed, waiting, last_report = [], [], [], time.time()
    while not stop["now"]:
        # ---- ended jobs: a record (runs wait for the start evaluation while it runs), or a failure on file
        for jid, (job, proc) in list(running.items()):
            if (proc.poll() is None) if proc is not None else runner_alive(job):
                continue
            del running[jid]
            if read_json(os.path.join(job["dir"], "done.json")):
                results.add("attempts", attempt_record(job, "ok"))
                waiting.append(job)
                print(f"{stamp()} {jid}: done ({progress(job)})", flush=True)
            else:
                results.add("attempts", attempt_record(job, "failed"))
                failed.append(job)
                st = read_json(os.path.join(job["dir"], "status.json"), {})
                print(f"{stamp()} {jid}: FAILED in {st.get('failed_phase')} (rc {st.get('rc')}, "
                      f"{st.get('error_kind') or 'see the logs in ' + job['dir']})", flush=True)
        start_pending = start_eval is not None and (start_eval["job_id"] in running or start_eval in queue)
        for job in list(waiting):
            if collect(job, results, start_eval, wait_for_start=start_pending) == "on file":
                waiting.remove(job)
                finished.append(job)
        left = deadline - time.time() if deadline else float("inf")
        if left <= 0:
            break
        # ---- start what fits
        while queue and len(running) < args.lanes:
            job = queue.pop(0)
            est = estimate(job, results, args.lanes)
            if not args.detach and est > left:
                print(f"{stamp()} not started: {job['job_id']} (estimate {est:.0f} s > {left:.0f} s left)", flush=True)
                continue
            running[job["job_id"]] = (job, launch(job))
            print(f"{stamp()} started {job['job_id']} (estimate {est:.0f} s)", flush=True)
        if not running and not queue:
            break
        if time.time() - last_report > 60:
            last_report = time.time()
            for job, _ in running.values():
                print(f"{stamp()}   {progress(job)}", flush=True)
        time.sleep(1.0)
    # ---- the deadline (or SIGTERM): detach, or end the jobs (a killed job leaves no record)
    for job, proc in running.values():
        if args.detach:
            print(f"left running (the next call with this --scratch collects it): {progress(job)}")
        else:
            print(f"killed at the deadline, no record: {progress(job)}")
            kill_job(job, proc)
            results.add("attempts", attempt_record(job, "killed"))
    for job in waiting:  # the start evaluation did not come: the record goes without (the report joins it later)
        if collect(job, results, start_eval) == "on file":
            finished.append(job)
    for job in queue:
        print(f"not started: {job['job_id']}")
    summary(finished, results, time.time() - t_start)
    return 1 if failed else 0


def summary(finished, results, wall):
    runs = {r["run_id"]: r for r in read_jsonl(results.path["runs"])}
    print(f"\n{len(finished)} job(s) finished in this call ({wall:.0f} s); {len(runs)} run(s) on file in "
          f"{results.path['runs']}")
    for job in finished:
        if job.get("run_id") in runs:
            print("  " + run_summary(runs[job["run_id"]]))


def merge(args):
    results = Results(args.results_dir)
    for folder in args.merge:
        for kind in ("runs", "evals", "attempts"):
            path = os.path.join(folder, f"{kind}.jsonl")
            n = sum(results.add(kind, r) for r in read_jsonl(path))
            print(f"{path}: {n} new record(s) -> {results.path[kind]}")
    return 0


def salvage(args):
    """Records from the job folders that part L brought back ($OUT/L.tar.gz, or the folder it unpacks to) when
    the machine went away before the driver collected them (the device time ran out, the machine was released
    between calls). A finished job (done.json) -> its record, as the driver writes it. A run whose training
    finished (every update in metrics.jsonl) but whose end evaluation did not -> its record with eval.end None and
    the reason: its end weights went with the machine, so that evaluation can never be added, and the report
    counts such runs in the training curves only. Anything less -> an attempt record, "lost" (or "failed")."""
    results = Results(args.results_dir)
    for src in args.salvage:
        with tempfile.TemporaryDirectory() as tmp:
            root = src
            if os.path.isfile(src):
                try:
                    with tarfile.open(src) as tar:
                        tar.extractall(tmp, filter="data")
                except (tarfile.TarError, OSError) as e:
                    sys.exit(f"--salvage: {src}: not a readable tarball ({type(e).__name__})")
                root = tmp
            elif not os.path.isdir(src):
                sys.exit(f"--salvage: {src}: no such file or folder")
            base = os.path.join(root, "learning") if os.path.isdir(os.path.join(root, "learning")) else root
            jobs = [dict(j, dir=os.path.join(base, name)) for name in sorted(os.listdir(base))  # the folder here
                    if (j := read_json(os.path.join(base, name, "job.json")))]
            if not jobs:
                print(f"{src}: no job folders (learning/<job>/job.json) in it")
            for job in sorted(jobs, key=lambda j: j["kind"] == "run"):  # start evaluations first: runs join them
                jobdir = job["dir"]
                st = read_json(os.path.join(jobdir, "status.json"), {})
                kind, key = ("runs", "run_id") if job["kind"] == "run" else ("evals", "eval_key")
                if job[key] in results.ids[kind]:
                    print(f"{src}: {job['job_id']}: on file")
                    continue
                done = read_json(os.path.join(jobdir, "done.json"))
                if done is None and job["kind"] == "run" and train_complete(job, need_weights=False):
                    done = job_record(job, st, os.path.join(jobdir, "train"), None)
                    done["eval"]["end_missing"] = (f"the machine went away in phase {st.get('phase')!r}, before the "
                                                   "end evaluation finished (learning_remote.py --salvage)")
                if done is None:
                    outcome = "failed" if st.get("phase") == "failed" else "lost"
                    results.add("attempts", attempt_record(job, outcome))
                    n = len(read_jsonl(os.path.join(jobdir, "train", "metrics.jsonl")))
                    print(f"{src}: {job['job_id']}: {outcome} ({n} of {job['config'].get('updates')} updates), "
                          "attempt on file")
                    continue
                if job["kind"] == "run":
                    add_run(done, results, results.evals.get(job["eval_key"]))
                else:
                    results.add("evals", done)
                outcome = "salvaged" if job["kind"] == "run" and done["eval"]["end"] is None else "ok"
                results.add("attempts", attempt_record(job, outcome))
                print(f"{src}: {job['job_id']}: record on file ({outcome})")
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.job:
        return runner(os.path.abspath(args.job))
    if args.merge:
        return merge(args)
    if args.salvage:
        return salvage(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
