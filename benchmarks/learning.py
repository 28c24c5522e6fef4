"""The learning benchmark (issue 21): does the loop improve a policy, and how does SEED's curve compare with GRPO's?

SEED and GRPO (`seed_rl.py --opd-coef 0`) start from the same weights with matched seeds (same task stream,
same sampling seeds: update 1 plays the same episodes in both) and run a fixed number of updates. Each run is
the real `seed_rl.py` in a subprocess; then `evaluate.py` plays held-out tasks with the plain prompt, once for
the start (shared by every run of that start) and once for each run's end policy. One small JSONL record per
finished run goes to results/learning/runs.jsonl; `benchmarks/learning_report.py` pools them all.

    # one H200 (part L of benchmarks/h200.sh wraps this): SEED and GRPO of seed 0 side by side
    python benchmarks/learning.py --model $QWEN_CODER_DIR --seeds 0 --lanes 2 --deadline-s 500
    # later stretches of GPU time: more seeds (finished runs are skipped), one method, one at a time
    python benchmarks/learning.py --model $QWEN_CODER_DIR --seeds 1,2 --methods grpo --lanes 1 --deadline-s 500
    # Search, once a retriever answers (env flags go to both seed_rl.py and evaluate.py)
    python benchmarks/learning.py --env search --model $QWEN_CODER_DIR --seeds 0 --env-args "--retriever-url URL"
    # CPU smoke: the tiny random model, written once to a folder so every run starts from the same weights
    python benchmarks/learning.py --model tiny --updates 2 --seeds 0,1 --tasks-per-update 2 --group-size 2 \\
        --max-steps 2 --max-new-tokens 8 --eval-limit 1 --workers 1 --seed-rl-args "--analyzer-model scripted" \\
        --results-dir /tmp/learning-smoke --scratch /tmp/learning-smoke/scratch
    python benchmarks/learning_report.py --results-dir /tmp/learning-smoke
    # bring the records of a GPU call home (dedupes by run id)
    python benchmarks/learning.py --merge /path/to/returned/learning
    # the machine went away before the driver collected its jobs: records from the job folders part L returned
    python benchmarks/learning.py --salvage /path/to/returned/L.tar.gz

Units of work. A *job* is one run (train, then evaluate the end policy) or one start evaluation. Each job has a
folder under --scratch and is executed by a *runner* (this file with --job DIR) in its own process session, so
that it survives the driver: with --detach the driver returns at its deadline and the jobs run on; the next
call (same machine, same --scratch) re-attaches to them and collects what finished. A finished job leaves
done.json; the driver turns it into a record. A job killed on the way leaves no record: its rerun starts
training afresh (or resumes seed_rl.py's own checkpoint, with --save-every), and evaluate.py resumes itself. A machine
that goes away takes its jobs with it; --salvage records what the returned job folders hold (a run whose training
finished, without its end evaluation; the rest as lost attempts).

Side by side on one GPU (--lanes 2): every process gets a share of the GPU (vLLM's gpu_memory_utilization).
vLLM sizes its KV cache at start-up from how the device's free memory changes while it profiles, and asserts
that free memory did not grow; another process waking, sleeping or allocating meanwhile breaks that (vLLM:
"Error in memory profiling ... other processes sharing the same container release GPU memory"). So the runners
share one gate: while one process starts an engine (from its first vLLM log line to "init engine ... took"),
the other jobs' processes are stopped (SIGSTOP) and then continued. The stopped seconds are recorded.

A record of results/learning/runs.jsonl (one line per finished run):

| field | what |
| --- | --- |
| run_id, group | `<method>-s<seed>-<group>`; group = hash of env + config + start label (the report pools by it) |
| method, seed, env | seed / grpo; seed_rl.py's --seed (task stream, sampling, mini-batch order) |
| config | updates, tasks per update, group size, max steps, lr, extra seed_rl.py flags that change the math, evaluation settings |
| start | label (how the report names it), model path, its manifest-style info and the sha256 of its weight files |
| code | git commit, dirty flag, diff sha256 (of the tree that launched the run); launcher_commit when SEED_CODE_COMMIT is set (the GPU copy's .git can be stale) |
| commands | the exact train and evaluation command lines, and the driver's |
| updates | per update: return, success, score, invalid, inadmissible, length, truncated, parse_rate, teacher_coverage, gate_mean, gate_active, gap_mean, kl, pg, opd_loss, grad_norm, tokens, env_failures, time and its phases, memory |
| eval | start and end: per split and pooled ("all"): success %, Avg %, score %, invalid %, inadmissible %, length, episodes |
| compute | lanes, GPU shares, workers, wall seconds (train, eval), seconds stopped by the gate, device memory peak (nvidia-smi, the whole device) |

results/learning/evals.jsonl holds the start evaluations (one per start label and evaluation settings, reused by
later calls); results/learning/attempts.jsonl one line per job attempt that ended (ok, failed, killed), with its
exit code, the device memory peak and the error kind (out of memory, vLLM's profiling race), so whether two
runs fit side by side is on file even when they did not.
"""
import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from envs import HelpFormatter  # noqa: E402
from common.records import (OPD_ONLY_FLAGS, append_jsonl, drop_flags, git_state, model_info,  # noqa: E402
                            open_jsonl_for_append, read_jsonl, sha256_file)

METHODS = {"seed": [], "grpo": ["--opd-coef", "0"]}  # GRPO: no analysis, no teacher pass (docs/paper.md, Baselines)
# The settings where the base model shows format learning within 10 updates on one GPU
LEARNING_PRESETS = {
    "alfworld": dict(updates=10, tasks_per_update=2, group_size=8, max_steps=15, lr=1e-5),
    "webshop": dict(updates=10, tasks_per_update=2, group_size=8, max_steps=15, lr=1e-5),
    "search": dict(updates=10, tasks_per_update=8, group_size=8, max_steps=4, lr=1e-5),
}
EVAL_SPLITS = {"search": "val"}  # held-out hotpot questions (fixed split); other envs: evaluate.py's default
# seed_rl.py flags that change only how the work is computed, not its result: kept out of the config key
COMPUTE_FLAGS = {"--workers", "--gpu-memory-utilization", "--micro-batch", "--micro-tokens", "--packing",
                 "--save-every", "--dump-examples", "--backend", "--activation-checkpointing",
                 "--no-activation-checkpointing", "--batch-episodes"}
# per-update metric (short name in the record) <- seed_rl.py's metrics.jsonl key
UPDATE_KEYS = {
    "return": "rollout/return_mean", "success": "rollout/success_rate", "score": "rollout/score_mean",
    "invalid": "rollout/invalid_rate", "inadmissible": "rollout/inadmissible_rate",
    "length": "rollout/episode_length", "truncated": "rollout/truncated_rate", "parse_rate": "skill/parse_rate",
    "teacher_coverage": "opd/teacher_coverage", "gate_mean": "opd/gate_mean", "gate_active": "opd/gate_active_ratio",
    "gap_mean": "opd/teacher_gap_mean", "kl": "loss/kl", "pg": "loss/pg", "opd_loss": "loss/opd",
    "grad_norm": "grad_norm", "tokens": "tokens/response", "env_failures": "rollout/env_failures",
    "time": "time/update", "time_generate": "time/generate", "time_env": "time/env", "time_analysis": "time/analysis",
    "time_scoring": "time/scoring", "time_train": "time/train", "time_sync": "time/sync",
    "mem_engine_awake_gib": "mem/device_used_gib_engine_awake", "mem_trainer_peak_gib": "mem/trainer_peak_gib",
    # why a curve is flat (seed_rl.py update_metrics): groups without task signal, the policy's exploration
    "zero_var_groups": "adv/zero_var_group_share", "abs_adv": "adv/abs_mean_signal_groups",
    "entropy": "policy/entropy_mc", "response_tokens": "rollout/response_tokens_mean", "clipfrac": "pg/clipfrac",
    "probe": "rollout/probe_rate", "searches": "env/searches", "gold_retrieved": "env/gold_retrieved",
    "answer_words": "env/answer_words",
}
# Time model for planning under a deadline (seconds), until runs of the same group are on file. Alone (fifth
# session, results/2026-12-03-rollout-async-trainer-profile), at 15 steps of 2 x 8 episodes: SEED 18-22 s and GRPO 15-17.5 s per update,
# vLLM's engine start with compilation ~75 s, the end evaluation ~95 s. Side by side (sixth session,
# results/2026-12-03-learning-alfworld-base-partial): per update, median over a run, SEED 42-44 s at --lanes 2 (two SEED runs) and 35-38 s
# at --lanes 3, GRPO 24-27 s at --lanes 3: ~1.5-2.1x alone, so 1.9; two end evaluations side by side had not
# finished after 147 s (the gate stops one while the other's engine starts), so the evaluation slows by as much.
EST = dict(startup=100, save=30, eval=95, per_update={"seed": 20.0, "grpo": 16.5}, lane_slowdown=1.9)
ERROR_KINDS = [("out_of_memory", r"CUDA out of memory|OutOfMemoryError|No available memory for the cache blocks"),
               ("vllm_profiling_race", r"Error in memory profiling"),
               ("vllm_sleep_check", r"Memory usage increased after sleeping"),  # before common/backends.py's fallback
               ("vllm_free_memory", r"Free memory on device .* is less than desired"),
               ("retriever", r"retriever")]


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def short_hash(obj, n=10):
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:n]


def write_json(path, obj):
    """Atomically (temp file + rename): a kill never leaves half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


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


def gpu_memory_used_mib():
    """Device memory in use on GPU 0 (all processes), MiB; None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
        used, total = (float(x) for x in out.split(","))
        return used, total
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


# ====================================================================================================
# The plan: config, start, jobs

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--env", default="alfworld", choices=sorted(LEARNING_PRESETS), help="benchmark")
    g.add_argument("--model", help="the start: an HF folder (the base model or a Stage 1 SFT checkpoint) | tiny")
    g.add_argument("--start-label", default=None, help="how the report names the start (default: from the "
                   "folder: 'base:<name>', or 'sft(<base>; data <sha>; <n> epochs)' for an sft.py checkpoint)")
    g.add_argument("--methods", default="seed,grpo", help="comma-separated: seed, grpo")
    g.add_argument("--seeds", default="0,1,2", help="comma-separated seed_rl.py --seed values (matched across methods)")
    g = p.add_argument_group("learning settings (default: the env's learning preset, LEARNING_PRESETS)")
    for k in ("updates", "tasks_per_update", "group_size", "max_steps"):
        g.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"seed_rl.py --{k.replace('_', '-')}")
    g.add_argument("--lr", type=float, default=None, help="seed_rl.py --lr")
    g.add_argument("--max-new-tokens", type=int, default=None, help="response tokens per step, train and eval "
                   "(default: the env preset's)")
    g.add_argument("--seed-rl-args", default="", help="more seed_rl.py flags, one string (write "
                   "--seed-rl-args='--flag value'); those that change the math join the config key, compute-only "
                   "ones (COMPUTE_FLAGS) do not")
    g.add_argument("--env-args", default="", help="env flags for seed_rl.py and evaluate.py, one string "
                   "(--env-args='--retriever-url URL')")
    g = p.add_argument_group("evaluation of the start and end policies (plain prompt, held-out tasks)")
    g.add_argument("--eval-limit", type=int, default=12, help="evaluate.py --limit: tasks per split (0: all of "
                   "them, e.g. ALFWorld's 140 + 134 valid games)")
    g.add_argument("--eval-splits", default=None, help="evaluate.py --splits (default: ALFWorld valid_seen,"
                   "valid_unseen; Search val)")
    g.add_argument("--eval-seed", type=int, default=0, help="evaluate.py --seed: the same tasks for every run")
    g.add_argument("--eval-max-steps", type=int, default=None, help="default: the training --max-steps")
    g.add_argument("--eval-args", default="", help="more evaluate.py flags, one string (--eval-args='...')")
    g = p.add_argument_group("compute and scheduling")
    g.add_argument("--lanes", type=int, default=1, help="jobs at a time on the one GPU (2: two seed_rl.py side by "
                   "side)")
    g.add_argument("--gpu-util-train", type=float, default=None, help="seed_rl.py's vLLM share of the GPU "
                   "(default 0.4 with one lane, 0.2 with more)")
    g.add_argument("--gpu-util-eval", type=float, default=None, help="evaluate.py's vLLM share (default 0.3 with "
                   "one lane, 0.15 with more)")
    g.add_argument("--workers", type=int, default=None, help="env workers per job (default: cores / lanes)")
    g.add_argument("--backend", default="auto", choices=["auto", "vllm", "hf"], help="evaluate.py's engine "
                   "(auto: vllm where vLLM and nvidia-smi exist); seed_rl.py picks its own")
    g.add_argument("--launcher", default="auto", choices=["auto", "torchrun", "python"], help="how seed_rl.py is "
                   "started (auto: torchrun with one process on a GPU machine, as benchmarks/h200.sh; python on CPU)")
    g.add_argument("--save-every", type=int, default=None, help="seed_rl.py checkpoints (default: only the final)")
    g.add_argument("--deadline-s", type=float, default=None, help="stop after this many seconds: no job is started "
                   "that would not end by then (estimates), and running jobs are killed at it unless --detach")
    g.add_argument("--detach", action="store_true", help="at the deadline leave the jobs running (their own process "
                   "sessions) for the next call on the same machine to collect; starts jobs while lanes are free")
    g.add_argument("--keep-checkpoints", action="store_true", help="keep trainer checkpoints and end weights")
    g.add_argument("--python", default=sys.executable, help="interpreter for seed_rl.py and evaluate.py")
    g.add_argument("--seed-rl-script", default=os.path.join(REPO, "seed_rl.py"), help=argparse.SUPPRESS)
    g.add_argument("--evaluate-script", default=os.path.join(REPO, "evaluate.py"), help=argparse.SUPPRESS)
    g = p.add_argument_group("files and other modes")
    g.add_argument("--results-dir", default=os.path.join(REPO, "results", "learning"),
                   help="runs.jsonl, evals.jsonl, attempts.jsonl")
    g.add_argument("--scratch", default=os.environ.get("LEARNING_SCRATCH", "/tmp/seed-learning"),
                   help="job folders (seed_rl.py outputs, logs); big files are deleted as soon as they are used")
    g.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    g.add_argument("--merge", nargs="+", metavar="DIR", help="append the records of returned results folders "
                   "(runs.jsonl, evals.jsonl, attempts.jsonl) to --results-dir, skipping those already there")
    g.add_argument("--salvage", nargs="+", metavar="PATH", help="records from part L's returned job folders "
                   "(L.tar.gz or its unpacked folder) that no driver collected: finished jobs, and runs whose training "
                   "finished but whose end evaluation did not (recorded without it); the rest as lost attempts")
    g.add_argument("--job", metavar="DIR", help=argparse.SUPPRESS)  # internal: run one job (the runner)
    args = p.parse_args(argv)
    if not (args.job or args.merge or args.salvage) and not args.model:
        p.error("--model is needed")
    for k, v in LEARNING_PRESETS[args.env].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {bad}; known: {', '.join(METHODS)}")
    args.seeds = [int(s) for s in args.seeds.replace(" ", ",").split(",") if s.strip()]
    return args


def math_flags(arg_string):
    """The flags of a seed_rl.py argument string that change the result (COMPUTE_FLAGS and their values removed)."""
    return drop_flags(shlex.split(arg_string), COMPUTE_FLAGS)


def on_gpu_machine():
    return shutil.which("nvidia-smi") is not None


def make_config(args):
    """The settings that define what a run computes (the report pools runs with equal config, env and start)."""
    env_args = shlex.split(args.env_args)
    return {"env": args.env, "updates": args.updates, "tasks_per_update": args.tasks_per_update,
            "group_size": args.group_size, "max_steps": args.max_steps, "lr": args.lr,
            "max_new_tokens": args.max_new_tokens, "seed_rl_args": math_flags(args.seed_rl_args),
            "env_args": env_args,
            "eval": {"limit": args.eval_limit, "splits": args.eval_splits or EVAL_SPLITS.get(args.env),
                     "seed": args.eval_seed, "max_steps": args.eval_max_steps or args.max_steps,
                     "max_new_tokens": args.max_new_tokens, "args": shlex.split(args.eval_args)}}


def materialize_tiny(scratch):
    """The tiny random Qwen2 of the CPU demos, written once as a folder, so every run starts from the same
    weights (`--model tiny` inside seed_rl.py would draw them from the run's --seed)."""
    path = os.path.join(scratch, "start-tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from common.models import load_model, load_tokenizer
        tmp = path + ".tmp"
        load_model("tiny", seed=0).save_pretrained(tmp)
        load_tokenizer("tiny").save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return path


def describe_start(model_path, requested, label=None):
    """The start: its label (the report's grouping), path, manifest-style info and weight sha256."""
    info = model_info(model_path)
    folder = info.get("resolved_path") or model_path
    weights = {n: sha256_file(os.path.join(folder, n)) for n in sorted(os.listdir(folder))
               if n.endswith((".safetensors", ".bin"))} if os.path.isdir(folder) else {}
    if label is None:
        man = read_json(os.path.join(folder, "seed_manifest.json"), {}) if os.path.isdir(folder) else {}
        if requested == "tiny":
            label = "tiny(seed 0)"
        elif man.get("script") == "sft.py":
            a = man.get("args", {})
            label = (f"sft({os.path.basename(str(a.get('model', '?')).rstrip('/'))}; data "
                     f"{(man.get('data') or {}).get('sha256', '?')[:8]}; {a.get('epochs', '?')} epochs)")
        else:
            label = "base:" + os.path.basename(os.path.abspath(model_path).rstrip("/")).lower()
    return {"label": label, "model": requested if requested == "tiny" else os.path.abspath(model_path),
            "info": info, "weights_sha256": weights}


def eval_command(args, cfg, model, out, workers):
    e = cfg["eval"]
    util = args.gpu_util_eval or (0.3 if args.lanes == 1 else 0.15)
    backend = args.backend if args.backend != "auto" else (
        "vllm" if on_gpu_machine() and _has_module("vllm") else "hf")
    cmd = [args.python, args.evaluate_script, "--env", cfg["env"], "--model", model,
           *(["--limit", str(e["limit"])] if e["limit"] else []),  # 0: every task of the splits
           "--seed", str(e["seed"]), "--max-steps", str(e["max_steps"]), "--workers", str(workers),
           "--backend", backend, "--out", out]
    if backend == "vllm":
        cmd += ["--gpu-memory-utilization", str(util)]
    if e["splits"]:
        cmd += ["--splits", e["splits"]]
    if e["max_new_tokens"]:
        cmd += ["--max-new-tokens", str(e["max_new_tokens"])]
    return cmd + e["args"] + cfg["env_args"]


def train_command(args, cfg, start_model, method, seed, out, workers):
    launcher = args.launcher if args.launcher != "auto" else ("torchrun" if on_gpu_machine() else "python")
    head = [args.python] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
                            if launcher == "torchrun" else [])
    util = args.gpu_util_train or (0.4 if args.lanes == 1 else 0.2)
    cmd = head + [args.seed_rl_script, "--env", cfg["env"], "--model", start_model, "--updates", str(cfg["updates"]),
                  "--tasks-per-update", str(cfg["tasks_per_update"]), "--group-size", str(cfg["group_size"]),
                  "--max-steps", str(cfg["max_steps"]), "--lr", str(cfg["lr"]), "--seed", str(seed),
                  "--workers", str(workers), "--gpu-memory-utilization", str(util),
                  "--save-every", str(args.save_every or cfg["updates"]), "--dump-examples", "2", "--out", out]
    if cfg["max_new_tokens"]:
        cmd += ["--max-new-tokens", str(cfg["max_new_tokens"])]
    extra = shlex.split(args.seed_rl_args)  # GRPO: without the analysis and OPD flags (seed_rl.py refuses them)
    if method == "grpo":
        extra = drop_flags(extra, {"--" + f.replace("_", "-") for f in OPD_ONLY_FLAGS})
    return cmd + METHODS[method] + extra + cfg["env_args"]


def _has_module(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def plan_jobs(args):
    """(config, start, group, start-eval job, run jobs): every job as a dict that the runner executes."""
    os.makedirs(args.scratch, exist_ok=True)
    start_model = materialize_tiny(args.scratch) if args.model == "tiny" else args.model
    start = describe_start(start_model, args.model, args.start_label)
    cfg = make_config(args)
    group = short_hash({"env": args.env, "config": cfg, "start": start["label"]})
    eval_key = short_hash({"env": args.env, "eval": cfg["eval"], "env_args": cfg["env_args"], "start": start["label"]})
    code = git_state()
    cores = os.cpu_count() or 2
    workers = args.workers or max(1, min(cfg["tasks_per_update"] * cfg["group_size"], cores // max(1, args.lanes)))
    eval_workers = args.workers or max(1, min(8, cores // max(1, args.lanes)))
    common = dict(group=group, env=args.env, config=cfg, start=start, code=code, lanes=args.lanes,
                  keep_checkpoints=args.keep_checkpoints, driver=[sys.executable] + sys.argv,
                  results_dir=os.path.abspath(args.results_dir))
    d = os.path.join(args.scratch, f"starteval-{eval_key}")
    start_eval = dict(common, kind="start_eval", job_id=f"starteval-{eval_key}", eval_key=eval_key, dir=d,
                      eval_cmd=eval_command(args, cfg, start_model, os.path.join(d, "eval"), eval_workers))
    runs = []
    for seed in args.seeds:  # seed-major: the two methods of a seed finish together (the paired comparison)
        for method in args.methods:
            run_id = f"{method}-s{seed}-{group}"
            d = os.path.join(args.scratch, run_id)
            train_out = os.path.join(d, "train")
            runs.append(dict(common, kind="run", job_id=run_id, run_id=run_id, method=method, seed=seed, dir=d,
                             eval_key=eval_key,
                             train_cmd=train_command(args, cfg, start_model, method, seed, train_out, workers),
                             eval_cmd=eval_command(args, cfg, os.path.join(train_out, "hf", "final"),
                                                   os.path.join(d, "eval"), eval_workers)))
    return cfg, start, group, start_eval, runs


# ====================================================================================================
# The runner: one job (train, then evaluate), in its own process session

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
    A child in any state but `holds` is stopped while another runner holds the lock (its runner keeps it so)."""
    BEGIN = re.compile(r"^(INFO|WARNING|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d", re.M)  # vLLM's logger format
    READY = re.compile(r"init engine \(|^episodes:|\repisodes:", re.M)  # vLLM's own line; evaluate.py's bar
    TIMEOUT = 300  # seconds: a start that never says it is ready releases the gate anyway

    def __init__(self, scratch, name):
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

    def reset(self, root):
        """A new child process: its engine start is ahead of it."""
        self.release()
        self.root, self.frozen_since, self.frozen_s = root, None, 0.0
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
        self.stopped_others = [e["root"] for e in self._others().values()]
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

    def poll(self, log_text, ready_file=None):
        """One look at the child's log so far; stops or continues the child's process tree."""
        if self.state == "before" and self.BEGIN.search(log_text):
            self._set_state("wants")
        if self.state == "wants" and self._try_take():
            self._set_state("holds")
        if self.state == "holds" and (self.READY.search(log_text) or (ready_file and os.path.exists(ready_file))
                                      or time.time() - self.since > self.TIMEOUT):
            self._set_state("after")
            self.release()
        self._stop(self.state == "wants" or (self.state != "holds" and self._other_holder() is not None))

    def done(self):
        """The child ended (or is being ended): release, continue, leave the registry."""
        self._stop(False)
        self.release()
        try:
            os.remove(self.entry)
        except OSError:
            pass


def run_child(cmd, log_path, gate, status, status_path, phase, ready_file=None):
    """Run one command in its own process group with the gate applied, sampling device memory; returns rc.
    status keeps running totals over attempts: <phase>_wall_s, frozen_s (stopped by the gate), device peak."""
    with open(log_path, "a") as log:
        log.write(f"\n== {now()} {shlex.join(cmd)}\n")
        log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    with open(os.path.join(os.path.dirname(log_path), "child.pid"), "w") as f:
        f.write(str(proc.pid))
    gate.reset(proc.pid)
    wall0, frozen0, t0 = status.get(f"{phase}_wall_s", 0.0), status.get("frozen_s", 0.0), time.time()

    def note():
        status[f"{phase}_wall_s"] = wall0 + time.time() - t0
        status["frozen_s"] = frozen0 + gate.frozen_s + (time.time() - gate.frozen_since if gate.frozen_since else 0)
        write_json(status_path, status)

    last_mem, pos, text = 0.0, 0, ""
    try:
        while proc.poll() is None:
            with open(log_path, errors="replace") as f:  # only the new part; the gate reads this child's log
                f.seek(pos)
                text = (text + f.read())[-200_000:]
                pos = f.tell()
            gate.poll(text, ready_file)
            if time.time() - last_mem >= 2.0:
                last_mem = time.time()
                m = gpu_memory_used_mib()
                if m:
                    status["device_peak_mib"] = max(status.get("device_peak_mib") or 0, m[0])
                    status["device_total_mib"] = m[1]
                note()
            time.sleep(0.25)
    finally:
        gate.done()
    note()
    return proc.returncode


def train_complete(job, need_weights=True):
    """Every update in metrics.jsonl, and (need_weights) the end weights saved for the evaluation."""
    out = os.path.join(job["dir"], "train")
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    return (sorted(r["update"] for r in rows) == list(range(1, job["config"]["updates"] + 1))
            and (not need_weights or os.path.isfile(os.path.join(out, "hf", "final", "config.json"))))


def eval_summary(results_path):
    """evaluate.py's results.json -> per split and pooled over splits (weighted by episodes), in %."""
    r = read_json(results_path)
    if not r:
        return None
    out = {"splits": {}, "elapsed_s": r.get("elapsed_s"), "model": r.get("model")}
    keys = ("success", "avg", "score", "invalid", "inadmissible", "length")
    for s, x in r["splits"].items():
        sp = x["success_pct"]
        out["splits"][s] = {"episodes": x["episodes"], "success": sp["All"]["mean"], "avg": sp["Avg"]["mean"],
                            "score": x["score_pct"]["All"], "invalid": x["invalid_action_pct"]["All"],
                            "inadmissible": x["inadmissible_action_pct"]["All"], "length": x["episode_length"]["All"],
                            "per_group": {c: v["mean"] for c, v in sp.items() if c not in ("All", "Avg")}}
    n = sum(v["episodes"] for v in out["splits"].values())
    out["all"] = {"episodes": n}
    # per task: its episodes' success (0/1, one per sample), so that two policies evaluated on the same tasks
    # are compared task by task (learning_report.py's paired bootstrap)
    per_task = {}
    for ep in read_jsonl(os.path.join(os.path.dirname(results_path), "trajectories.jsonl")):
        if not ep.get("env_failure"):
            per_task.setdefault(ep["task_id"], []).append(int(bool(ep["success"])))
    out["per_task"] = per_task
    for k in keys:
        vals = [(v[k], v["episodes"]) for v in out["splits"].values() if v[k] is not None]
        w = sum(e for _, e in vals)
        out["all"][k] = round(sum(x * e for x, e in vals) / w, 3) if w else None
    return out


def update_rows(metrics_path):
    rows = {r["update"]: r for r in read_jsonl(metrics_path)}  # a resumed run: the last line of an update counts
    out = []
    for u in sorted(rows):
        r = rows[u]
        row = {"update": u}
        for short, key in UPDATE_KEYS.items():
            v = r.get(key)
            row[short] = round(v, 6) if isinstance(v, float) else v
        row["success_by_group"] = {k.split("/", 2)[2]: v for k, v in r.items()
                                   if k.startswith("rollout/success/") and v is not None}
        out.append(row)
    return out


def error_kind(log_path):
    try:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-50_000:]
    except OSError:
        return None
    for kind, pat in ERROR_KINDS:
        if re.search(pat, tail):
            return kind
    return None


def job_record(job, status, train_out, results_json, host_cpus=None):
    """The record of a finished job (less the start evaluation, which the driver joins): the run's per-update
    rows from seed_rl.py's metrics.jsonl and its end evaluation (None where results_json is None: --salvage)."""
    compute = {"lanes": job["lanes"], "train_wall_s": round(status.get("train_wall_s", 0.0), 1),
               "eval_wall_s": round(status.get("eval_wall_s", 0.0), 1) if results_json else None,
               "frozen_s": round(status.get("frozen_s", 0.0), 1),
               "device_peak_mib": status.get("device_peak_mib"), "device_total_mib": status.get("device_total_mib"),
               "attempts": status.get("attempts"), "host_cpus": host_cpus}
    common = {"group": job["group"], "env": job["env"], "config": job["config"], "start": job["start"],
              "code": job["code"], "finished": now()}
    end = eval_summary(results_json) if results_json else None
    if job["kind"] != "run":
        return dict(eval_key=job["eval_key"], **common, command=shlex.join(job["eval_cmd"]), summary=end,
                    compute=compute)
    man = read_json(os.path.join(train_out, "seed_manifest.json"), {})
    cmd = job["train_cmd"]
    compute.update(gpu_util_train=float(cmd[cmd.index("--gpu-memory-utilization") + 1]),
                   workers=int(cmd[cmd.index("--workers") + 1]),
                   gpus=(man.get("hardware") or {}).get("gpus"), packages=man.get("packages"))
    return dict(run_id=job["run_id"], method=job["method"], seed=job["seed"], **common, eval_key=job["eval_key"],
                commands={"train": shlex.join(job["train_cmd"]), "eval_end": shlex.join(job["eval_cmd"]),
                          "driver": shlex.join(job["driver"])},
                train_manifest_git=man.get("git"), updates=update_rows(os.path.join(train_out, "metrics.jsonl")),
                eval={"end": end}, compute=compute)


def run_job(jobdir):
    """The runner: train (runs only), evaluate, then done.json (the record, less the start evaluation)."""
    job = read_json(os.path.join(jobdir, "job.json"))
    status_path = os.path.join(jobdir, "status.json")
    status = read_json(status_path, {})
    status.update(pid=os.getpid(), started=status.get("started") or now(), attempts=status.get("attempts", 0) + 1)
    write_json(status_path, status)
    gate = EngineGate(os.path.dirname(jobdir.rstrip("/")), job["job_id"])

    def on_term(signum, frame):  # the driver ends this job: the child's group first (continued, then ended)
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

    def fail(phase, rc, log):
        status.update(phase="failed", failed_phase=phase, rc=rc, error_kind=error_kind(log), ended=now())
        write_json(status_path, status)
        sys.exit(1)

    train_out = os.path.join(jobdir, "train")
    if job["kind"] == "run" and not train_complete(job):
        if not os.path.isfile(os.path.join(train_out, "checkpoint", "state.json")):
            shutil.rmtree(train_out, ignore_errors=True)  # no checkpoint to resume: start afresh (no stale metrics)
            status["train_wall_s"] = 0.0
        status["phase"] = "train"
        write_json(status_path, status)
        log = os.path.join(jobdir, "train.log")
        rc = run_child(job["train_cmd"], log, gate, status, status_path, "train",
                       ready_file=os.path.join(train_out, "seed_manifest.json"))
        if rc != 0 or not train_complete(job):
            fail("train", rc, log)
    if job["kind"] == "run" and not job["keep_checkpoints"]:
        shutil.rmtree(os.path.join(train_out, "checkpoint"), ignore_errors=True)  # fp32 weights + AdamW: GBs
    results = os.path.join(jobdir, "eval", "results.json")
    if not os.path.isfile(results):
        status["phase"] = "eval"
        write_json(status_path, status)
        log = os.path.join(jobdir, "eval.log")
        rc = run_child(job["eval_cmd"], log, gate, status, status_path, "eval")
        if rc != 0 or not os.path.isfile(results):
            fail("eval", rc, log)
    done = job_record(job, status, train_out, results, host_cpus=os.cpu_count())
    write_json(os.path.join(jobdir, "done.json"), done)
    if job["kind"] == "run" and not job["keep_checkpoints"]:
        shutil.rmtree(os.path.join(train_out, "hf"), ignore_errors=True)  # the end weights, once evaluated
    status.update(phase="done", ended=now())
    write_json(status_path, status)


# ====================================================================================================
# The driver: launch, attach, collect, write records

class Results:
    """The three JSONL files of --results-dir; records are appended once (by run id / eval key / attempt id)."""

    def __init__(self, folder):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self.path = {k: os.path.join(folder, f"{k}.jsonl") for k in ("runs", "evals", "attempts")}
        self.ids = {"runs": {r["run_id"] for r in read_jsonl(self.path["runs"])},
                    "evals": {r["eval_key"] for r in read_jsonl(self.path["evals"])},
                    "attempts": {r["attempt_id"] for r in read_jsonl(self.path["attempts"])}}
        self.evals = {r["eval_key"]: r for r in read_jsonl(self.path["evals"])}

    def add(self, kind, rec):
        key = {"runs": "run_id", "evals": "eval_key", "attempts": "attempt_id"}[kind]
        if rec[key] in self.ids[kind]:
            return False
        with open_jsonl_for_append(self.path[kind]) as f:
            append_jsonl(f, rec)
        self.ids[kind].add(rec[key])
        if kind == "evals":
            self.evals[rec["eval_key"]] = rec
        return True


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
        return EST["startup"] * 0.5 + EST["eval"]
    same = [r["compute"]["train_wall_s"] + r["compute"]["eval_wall_s"] for r in read_jsonl(results.path["runs"])
            if r["group"] == job["group"] and r["method"] == job["method"] and r["compute"]["lanes"] == lanes
            and r["compute"]["eval_wall_s"] is not None]  # a salvaged run has no end evaluation
    if same:
        return statistics.median(same)
    c = job["config"]
    scale = (c["tasks_per_update"] * c["group_size"] / 16 * c["max_steps"] / 15
             * (EST["lane_slowdown"] if lanes > 1 else 1))
    return (EST["startup"] + c["updates"] * EST["per_update"][job["method"]] * scale + EST["save"]
            + EST["eval"] * (EST["lane_slowdown"] if lanes > 1 else 1))


def attempt_record(job, outcome):
    st = read_json(os.path.join(job["dir"], "status.json"), {})
    return {"attempt_id": f"{job['job_id']}#{st.get('attempts', 0)}@{st.get('started')}", "job_id": job["job_id"],
            "kind": job["kind"], "group": job["group"], "method": job.get("method"), "seed": job.get("seed"),
            "lanes": job["lanes"], "outcome": outcome, "phase": st.get("failed_phase") or st.get("phase"),
            "rc": st.get("rc"), "error_kind": st.get("error_kind"), "train_wall_s": st.get("train_wall_s"),
            "eval_wall_s": st.get("eval_wall_s"), "frozen_s": st.get("frozen_s"),
            "device_peak_mib": st.get("device_peak_mib"), "device_total_mib": st.get("device_total_mib"),
            "updates_done": len(read_jsonl(os.path.join(job["dir"], "train", "metrics.jsonl"))), "ended": now(),
            "code": job["code"]}


def collect(job, results, start_eval_job, wait_for_start=False):
    """A finished job -> its record (a run gets the start evaluation joined in). Returns "on file", "waiting"
    (a run whose start evaluation is still under way, with wait_for_start) or "not done"."""
    done = read_json(os.path.join(job["dir"], "done.json"))
    if not done:
        return "not done"
    if job["kind"] == "start_eval":
        results.add("evals", done)
        return "on file"
    se = results.evals.get(job["eval_key"]) or read_json(os.path.join(start_eval_job["dir"], "done.json"))
    if se is None and wait_for_start:
        return "waiting"
    add_run(done, results, se)
    return "on file"


def add_run(done, results, se):
    """A run's record -> runs.jsonl, with its start evaluation se joined in (None: the report joins evals.jsonl
    by eval_key later)."""
    done["eval"]["start"] = se["summary"] if se else None
    done["commands"]["eval_start"] = se["command"] if se else None
    results.add("runs", done)


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
    cfg, start, group, start_eval, runs = plan_jobs(args)
    results = Results(args.results_dir)
    print(f"learning: env {args.env}, start {start['label']}, group {group}, methods {args.methods}, seeds "
          f"{args.seeds}, {cfg['updates']} updates of {cfg['tasks_per_update']} x {cfg['group_size']} episodes, "
          f"{cfg['max_steps']} steps, lr {cfg['lr']}; lanes {args.lanes}; results in {results.folder}", flush=True)
    # ---- what is on file, or finished in the scratch folder by a former call, is not run again
    todo = []
    if start_eval["eval_key"] not in results.ids["evals"] and collect(start_eval, results, start_eval) != "on file":
        todo.append(start_eval)
    for job in runs:
        if job["run_id"] in results.ids["runs"] or collect(job, results, start_eval) == "on file":
            print(f"  {job['job_id']}: finished, on file (skipped)")
        else:
            todo.append(job)
    if args.dry_run:
        for job in todo:
            print(f"\n{job['job_id']} (estimate {estimate(job, results, args.lanes):.0f} s)")
            for k in ("train_cmd", "eval_cmd"):
                if k in job:
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
        start_pending = start_eval["job_id"] in running or start_eval in queue
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
        r = runs.get(job.get("run_id"))
        if not r:
            continue
        t = [u["time"] for u in r["updates"] if u.get("time") is not None]
        end = ((r["eval"] or {}).get("end") or {}).get("all", {})
        c = r["compute"]
        print(f"  {r['run_id']}: median {statistics.median(t) if t else 0:.1f} s/update; train "
              f"{c['train_wall_s']:.0f} s + eval {c['eval_wall_s']:.0f} s (stopped by the gate {c['frozen_s']:.0f} s); "
              f"lanes {c['lanes']}, device peak {(c['device_peak_mib'] or 0) / 1024:.1f} of "
              f"{(c['device_total_mib'] or 0) / 1024:.0f} GiB; invalid "
              f"rate update 1 {r['updates'][0]['invalid']} -> {len(r['updates'])} {r['updates'][-1]['invalid']}; end "
              f"eval: invalid {end.get('invalid')}%, success {end.get('success')}%")


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
                                                   "end evaluation finished (learning.py --salvage)")
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
        run_job(os.path.abspath(args.job))
        return 0
    if args.merge:
        return merge(args)
    if args.salvage:
        return salvage(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
