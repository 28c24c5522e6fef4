"""The learning benchmark (issue 21): does the loop improve a policy, and how does SEED's curve compare with GRPO's?

SEED and GRPO (`seed_rl.py --opd-coef 0`) start from the same weights with matched seeds (same task stream,
same sampling seeds: update 1 plays the same episodes in both) and run a fixed number of updates. For each seed
and method this runs the real `seed_rl.py` in a subprocess, then `evaluate.py` of its end policy on held-out
tasks with the plain prompt; the start is evaluated once per start weights (shared by every run from them; a start
made again from the same recipe, other weights, is evaluated again when a run needs it). One small JSONL
record per finished run goes to results/learning/runs.jsonl; at the end `benchmarks/learning_report.py` pools
every record on file into results/learning/report/.

    # one GPU: SEED and GRPO of seeds 0, 1, 2, one run at a time (a rerun skips the runs on file)
    python benchmarks/learning.py --model $QWEN_CODER_DIR
    # Search, once a retriever answers (python -m envs.retriever); env flags go to seed_rl.py and evaluate.py
    python benchmarks/learning.py --env search --model $QWEN_CODER_DIR \\
        --env-args "--retriever-url http://127.0.0.1:8000/retrieve"
    # CPU smoke: the tiny random model, written once to a folder so every run starts from the same weights
    python benchmarks/learning.py --model tiny --updates 2 --seeds 0,1 --tasks-per-update 2 --group-size 2 \\
        --max-steps 2 --max-new-tokens 8 --eval-limit 1 --workers 1 --seed-rl-args "--analyzer-model scripted" \\
        --results-dir /tmp/learning-smoke --scratch /tmp/learning-smoke/scratch
    # the report again (e.g. with --exclude RUN_ID)
    python benchmarks/learning_report.py --results-dir /tmp/learning-smoke

On your own machine this file is all you need. benchmarks/remote/ holds what splits the same runs into short calls
of a lent GPU that keeps /tmp only briefly (jobs side by side under an engine-start gate, detached runners,
salvage of a machine that went away); it imports the plan, the commands and the records from here.

A record of results/learning/runs.jsonl (one line per finished run):

| field | what |
| --- | --- |
| run_id, group | `<method>-s<seed>-<group>`; group = hash of env + config + start label (the report pools by it) |
| method, seed, env | seed / grpo; seed_rl.py's --seed (task stream, sampling, mini-batch order) |
| config | updates, tasks per update, group size, max steps, lr, extra seed_rl.py flags that change the math, evaluation settings |
| start | label (how the report names it), model path, its manifest-style info and the sha256 of its weight files |
| code | git commit, dirty flag, diff sha256 (of the tree that launched the run); launcher_commit when SEED_CODE_COMMIT is set (a remote copy's .git can be stale) |
| commands | the exact train and evaluation command lines, and the driver's |
| updates | per update: return, success, score, invalid, inadmissible, length, truncated, parse_rate, analysis_tokens, analysis_capped, teacher_coverage, gate_mean, gate_active, gap_mean, kl, pg, opd_loss, grad_norm, tokens, env_failures, time and its phases, memory |
| eval | start and end: per split and pooled ("all"): success %, Avg %, score %, invalid %, inadmissible %, length, episodes |
| compute | lanes (jobs side by side: 1 here), GPU shares, workers, wall seconds (train, eval), seconds stopped by benchmarks/remote's gate (0 here), device memory peak (nvidia-smi, the whole device) |

results/learning/evals.jsonl holds the start evaluations (one per start label and evaluation settings, reused by
later runs); results/learning/attempts.jsonl one line per job attempt that ended (ok, failed), with its exit code,
the device memory peak and the error kind (out of memory, vLLM's profiling race). Each job folder under --scratch
keeps its evaluation's eval/actions.jsonl: per held-out episode its task and outcome and, per step, the action, its
validity and admissibility, the env's feedback and the response (evaluate.py's trajectories less the prompts).
"""
import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from envs import HelpFormatter  # noqa: E402
from common.records import (OPD_ONLY_FLAGS, append_jsonl, drop_flags, git_state, model_info,  # noqa: E402
                            open_jsonl_for_append, read_jsonl, sha256_file)

# -----------------------------------------------------------------------------
# 0. What a run is, and what its record keeps

METHODS = {"seed": [], "grpo": ["--opd-coef", "0"]}  # GRPO: no analysis, no teacher pass (docs/paper.md, Baselines)
# The settings where the base model shows format learning within 10 updates on one GPU
LEARNING_PRESETS = {
    "alfworld": dict(updates=10, tasks_per_update=2, group_size=8, max_steps=15, lr=1e-5),
    "webshop": dict(updates=10, tasks_per_update=2, group_size=8, max_steps=15, lr=1e-5),
    "search": dict(updates=10, tasks_per_update=8, group_size=8, max_steps=4, lr=1e-5),
}
EVAL_SPLITS = {"search": "val"}  # held-out hotpot questions (fixed split); other envs: evaluate.py's default
# seed_rl.py flags that change only how the work is computed, not its result: kept out of the config key
COMPUTE_FLAGS = {"--workers", "--gpu-memory-utilization", "--kv-cache-gib", "--micro-batch", "--micro-tokens", "--packing",
                 "--save-every", "--dump-examples", "--backend", "--activation-checkpointing",
                 "--no-activation-checkpointing", "--batch-episodes"}
# per-update metric (short name in the record) <- seed_rl.py's metrics.jsonl key
UPDATE_KEYS = {
    "return": "rollout/return_mean", "success": "rollout/success_rate", "score": "rollout/score_mean",
    "invalid": "rollout/invalid_rate", "inadmissible": "rollout/inadmissible_rate",
    "length": "rollout/episode_length", "truncated": "rollout/truncated_rate", "parse_rate": "skill/parse_rate",
    "analysis_tokens": "skill/analysis_tokens_mean", "analysis_capped": "skill/analysis_capped",
    "teacher_coverage": "opd/teacher_coverage", "gate_mean": "opd/gate_mean", "gate_active": "opd/gate_active_ratio",
    "gap_mean": "opd/teacher_gap_mean", "kl": "loss/kl", "pg": "loss/pg", "opd_loss": "loss/opd",
    "grad_norm": "grad_norm", "tokens": "tokens/response", "env_failures": "rollout/env_failures",
    "time": "time/update", "time_generate": "time/generate", "time_env": "time/env", "time_analysis": "time/analysis",
    "time_loop": "time/loop", "loop_share": "rollout/loop_share",
    "loop_idle_share": "rollout/loop_idle_share", "time_scoring": "time/scoring",
    "time_train": "time/train", "time_sync": "time/sync",
    "mem_engine_awake_gib": "mem/device_used_gib_engine_awake", "mem_trainer_peak_gib": "mem/trainer_peak_gib",
    "mem_rollout_peak_gib": "mem/rollout_peak_gib",
    # why a curve is flat (seed_rl.py update_metrics): groups without task signal, the policy's exploration
    "zero_var_groups": "adv/zero_var_group_share", "abs_adv": "adv/abs_mean_signal_groups",
    "entropy": "policy/entropy_mc", "response_tokens": "rollout/response_tokens_mean", "clipfrac": "pg/clipfrac",
    "probe": "rollout/probe_rate", "searches": "env/searches", "gold_retrieved": "env/gold_retrieved",
    "answer_words": "env/answer_words",
}
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


def on_gpu_machine():
    return shutil.which("nvidia-smi") is not None


def gpu_memory_used_mib():
    """(used, total) device memory on GPU 0 (all processes), MiB; None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
        used, total = (float(x) for x in out.split(","))
        return used, total
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


# -----------------------------------------------------------------------------
# 1. Arguments (benchmarks/remote/learning_remote.py adds its own to the same parser)

def build_parser(description=__doc__):
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
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
    g.add_argument("--eval-samples", type=int, default=1, help="evaluate.py --samples: episodes per held-out task "
                   "(several: the paired comparison by task averages over sampling noise)")
    g.add_argument("--eval-max-steps", type=int, default=None, help="default: the training --max-steps")
    g.add_argument("--eval-args", default="", help="more evaluate.py flags, one string (--eval-args='...')")
    g.add_argument("--eval-in-run", action="store_true", help="evaluate inside each seed_rl.py run (--eval-every "
                   "UPDATES: the start and the end policy on the same held-out tasks, with the run's own engine) "
                   "instead of evaluate.py jobs: no second engine start and no end weights per run, and every run "
                   "pairs its own start and end; a config of its own in the report")
    g = p.add_argument_group("compute")
    g.add_argument("--gpu-util-train", type=float, default=None, help="seed_rl.py's vLLM share of the GPU "
                   "(default 0.4 with one job at a time, 0.2 side by side)")
    g.add_argument("--gpu-util-eval", type=float, default=None, help="evaluate.py's vLLM share (default 0.3 with "
                   "one job at a time, 0.15 side by side)")
    g.add_argument("--kv-cache-gib", type=float, default=0.0, help="seed_rl.py's and evaluate.py's --kv-cache-gib: "
                   "a fixed vLLM KV cache (0: vLLM sizes it by profiling); benchmarks/remote then starts engines "
                   "without stopping the other jobs")
    g.add_argument("--workers", type=int, default=None, help="env workers per job (default: the CPU cores)")
    g.add_argument("--backend", default="auto", choices=["auto", "vllm", "hf"], help="evaluate.py's engine "
                   "(auto: vllm where vLLM and nvidia-smi exist); seed_rl.py picks its own")
    g.add_argument("--launcher", default="auto", choices=["auto", "torchrun", "python"], help="how seed_rl.py is "
                   "started (auto: torchrun with one process on a GPU machine; python on CPU)")
    g.add_argument("--save-every", type=int, default=None, help="seed_rl.py checkpoints (default: only the final)")
    g.add_argument("--keep-checkpoints", action="store_true", help="keep trainer checkpoints and end weights")
    g.add_argument("--python", default=sys.executable, help="interpreter for seed_rl.py and evaluate.py")
    g.add_argument("--seed-rl-script", default=os.path.join(REPO, "seed_rl.py"), help=argparse.SUPPRESS)
    g.add_argument("--evaluate-script", default=os.path.join(REPO, "evaluate.py"), help=argparse.SUPPRESS)
    g = p.add_argument_group("files")
    g.add_argument("--results-dir", default=os.path.join(REPO, "results", "learning"),
                   help="runs.jsonl, evals.jsonl, attempts.jsonl, and the report in report/")
    g.add_argument("--scratch", default=os.environ.get("LEARNING_SCRATCH", "/tmp/seed-learning"),
                   help="job folders (seed_rl.py outputs, logs); big files are deleted as soon as they are used")
    g.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    return p


def finish_args(p, args, need_model=True):
    """The env preset fills the learning settings left unset; methods and seeds become lists."""
    if need_model and not args.model:
        p.error("--model is needed")
    for k, v in LEARNING_PRESETS[args.env].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {bad}; known: {', '.join(METHODS)}")
    args.seeds = [int(s) for s in args.seeds.replace(" ", ",").split(",") if s.strip()]
    if args.eval_in_run:
        moot = [f for f, v in (("--eval-args", args.eval_args), ("--gpu-util-eval", args.gpu_util_eval)) if v]
        if moot:
            p.error(f"{', '.join(moot)}: evaluate.py's, and --eval-in-run runs no evaluate.py")
    return args


# -----------------------------------------------------------------------------
# 2. The plan: the config key, the start, every job's commands

def math_flags(arg_string):
    """The flags of a seed_rl.py argument string that change the result (COMPUTE_FLAGS and their values removed)."""
    return drop_flags(shlex.split(arg_string), COMPUTE_FLAGS)


def make_config(args):
    """The settings that define what a run computes (the report pools runs with equal config, env and start)."""
    return {"env": args.env, "updates": args.updates, "tasks_per_update": args.tasks_per_update,
            "group_size": args.group_size, "max_steps": args.max_steps, "lr": args.lr,
            "max_new_tokens": args.max_new_tokens, "seed_rl_args": math_flags(args.seed_rl_args),
            "env_args": shlex.split(args.env_args),
            "eval": {"limit": args.eval_limit, "splits": args.eval_splits or EVAL_SPLITS.get(args.env),
                     "seed": args.eval_seed, "max_steps": args.eval_max_steps or args.max_steps,
                     "max_new_tokens": args.max_new_tokens, "args": shlex.split(args.eval_args),
                     # only when not the default: the config keys (group hashes) of the records on file stay
                     **({"in_run": True} if args.eval_in_run else {}),
                     **({"samples": args.eval_samples} if args.eval_samples != 1 else {})}}


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


def eval_command(args, cfg, model, out, workers, lanes=1):
    """evaluate.py of one policy on the held-out tasks, plain prompt (its --out folder gets results.json)."""
    e = cfg["eval"]
    util = args.gpu_util_eval or (0.3 if lanes == 1 else 0.15)
    backend = args.backend if args.backend != "auto" else (
        "vllm" if on_gpu_machine() and _has_module("vllm") else "hf")
    cmd = [args.python, args.evaluate_script, "--env", cfg["env"], "--model", model,
           *(["--limit", str(e["limit"])] if e["limit"] else []),  # 0: every task of the splits
           "--seed", str(e["seed"]), "--max-steps", str(e["max_steps"]), "--workers", str(workers),
           "--samples", str(e.get("samples", 1)),
           "--backend", backend, "--out", out]
    if backend == "vllm":
        cmd += ["--gpu-memory-utilization", str(util)] + kv_cache_flag(args)
    if e["splits"]:
        cmd += ["--splits", e["splits"]]
    if e["max_new_tokens"]:
        cmd += ["--max-new-tokens", str(e["max_new_tokens"])]
    return cmd + e["args"] + cfg["env_args"]


def train_command(args, cfg, start_model, method, seed, out, workers, lanes=1):
    """seed_rl.py of one (method, seed); its end weights land in <out>/hf/final for the evaluation."""
    launcher = args.launcher if args.launcher != "auto" else ("torchrun" if on_gpu_machine() else "python")
    head = [args.python] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
                            if launcher == "torchrun" else [])
    util = args.gpu_util_train or (0.4 if lanes == 1 else 0.2)
    cmd = head + [args.seed_rl_script, "--env", cfg["env"], "--model", start_model, "--updates", str(cfg["updates"]),
                  "--tasks-per-update", str(cfg["tasks_per_update"]), "--group-size", str(cfg["group_size"]),
                  "--max-steps", str(cfg["max_steps"]), "--lr", str(cfg["lr"]), "--seed", str(seed),
                  "--workers", str(workers), "--gpu-memory-utilization", str(util),
                  "--save-every", str(args.save_every or cfg["updates"]), "--dump-examples", "2", "--out", out]
    cmd += kv_cache_flag(args)
    if cfg["max_new_tokens"]:
        cmd += ["--max-new-tokens", str(cfg["max_new_tokens"])]
    extra = shlex.split(args.seed_rl_args)  # GRPO: without the analysis and OPD flags (seed_rl.py refuses them)
    if method == "grpo":
        extra = drop_flags(extra, {"--" + f.replace("_", "-") for f in OPD_ONLY_FLAGS})
    e = cfg.get("eval") or {}
    if e.get("in_run"):  # seed_rl.py evaluates the start (update 0) and the end (update `updates`) itself
        cmd += ["--eval-every", str(cfg["updates"]), "--eval-limit", str(e["limit"]), "--eval-seed", str(e["seed"]),
                "--eval-max-steps", str(e["max_steps"]), "--eval-samples", str(e.get("samples", 1)),
                *(["--eval-splits", e["splits"]] if e["splits"] else [])]
    return cmd + METHODS[method] + extra + cfg["env_args"]


def kv_cache_flag(args):
    return ["--kv-cache-gib", str(args.kv_cache_gib)] if args.kv_cache_gib else []


def _has_module(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def plan_jobs(args, lanes=1):
    """(config, start, group, start-eval job (None with --eval-in-run), run jobs): each job a dict (JSON-able:
    benchmarks/remote writes it to its folder for a detached runner). lanes: how many jobs share the GPU at once
    (GPU shares, workers)."""
    os.makedirs(args.scratch, exist_ok=True)
    start_model = materialize_tiny(args.scratch) if args.model == "tiny" else args.model
    start = describe_start(start_model, args.model, args.start_label)
    cfg = make_config(args)
    group = short_hash({"env": args.env, "config": cfg, "start": start["label"]})
    # the start's evaluation belongs to its weights, not only to its label: a start made again from the same recipe
    # (the BC SFT on a fresh machine) is another policy, so it gets its own evaluation, and the report compares each
    # run's end with its own start's (the group, by label, still pools the runs of one recipe)
    eval_key = short_hash({"env": args.env, "eval": cfg["eval"], "env_args": cfg["env_args"], "start": start["label"],
                           "weights": start["weights_sha256"]})
    cores = os.cpu_count() or 2
    workers = args.workers or max(1, min(cfg["tasks_per_update"] * cfg["group_size"], cores // max(1, lanes)))
    eval_workers = args.workers or max(1, min(8, cores // max(1, lanes)))
    common = dict(group=group, env=args.env, config=cfg, start=start, code=git_state(), lanes=lanes,
                  keep_checkpoints=args.keep_checkpoints, driver=[sys.executable] + sys.argv,
                  results_dir=os.path.abspath(args.results_dir))
    d = os.path.join(args.scratch, f"starteval-{eval_key}")
    start_eval = None if args.eval_in_run else dict(
        common, kind="start_eval", job_id=f"starteval-{eval_key}", eval_key=eval_key, dir=d,
        eval_cmd=eval_command(args, cfg, start_model, os.path.join(d, "eval"), eval_workers, lanes))
    runs = []
    for seed in args.seeds:  # seed-major: the two methods of a seed finish together (the paired comparison)
        for method in args.methods:
            run_id = f"{method}-s{seed}-{group}"
            d = os.path.join(args.scratch, run_id)
            train_out = os.path.join(d, "train")
            runs.append(dict(common, kind="run", job_id=run_id, run_id=run_id, method=method, seed=seed, dir=d,
                             eval_key=eval_key,
                             train_cmd=train_command(args, cfg, start_model, method, seed, train_out, workers, lanes),
                             eval_cmd=None if args.eval_in_run else eval_command(
                                 args, cfg, os.path.join(train_out, "hf", "final"), os.path.join(d, "eval"),
                                 eval_workers, lanes)))
    return cfg, start, group, start_eval, runs


# -----------------------------------------------------------------------------
# 3. One job: train (runs only), then evaluate

def run_child(cmd, log_path, status, status_path, phase, gate=None, ready_file=None):
    """Run one command, its output to log_path, sampling device memory every 2 s; returns its exit code. status
    keeps running totals over attempts: <phase>_wall_s, frozen_s, the device peak. gate: benchmarks/remote's
    engine-start gate (it may stop this child while another job's engine starts); None runs the child plainly."""
    with open(log_path, "a") as log:
        log.write(f"\n== {now()} {shlex.join(cmd)}\n")
        log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # its own session only under the gate (which signals the child's tree); plainly, Ctrl-C reaches it
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=gate is not None)
    with open(os.path.join(os.path.dirname(log_path), "child.pid"), "w") as f:
        f.write(str(proc.pid))
    if gate:
        gate.reset(proc.pid, phase)
    wall0, frozen0, t0 = status.get(f"{phase}_wall_s", 0.0), status.get("frozen_s", 0.0), time.time()

    def note():
        status[f"{phase}_wall_s"] = wall0 + time.time() - t0
        if gate:
            status["frozen_s"] = frozen0 + gate.frozen_seconds()
        write_json(status_path, status)

    last_mem, pos, text = 0.0, 0, ""
    try:
        while proc.poll() is None:
            if gate:  # the gate reads this child's log (only the new part each time)
                with open(log_path, errors="replace") as f:
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
        if gate:
            gate.done()
    note()
    return proc.returncode


def train_complete(job, need_weights=True):
    """Every update in metrics.jsonl, and (need_weights) the end weights saved for the evaluation, or with
    --eval-in-run the run's end evaluation on file (the same episodes as its start's)."""
    out, n = os.path.join(job["dir"], "train"), job["config"]["updates"]
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    if sorted(r["update"] for r in rows) != list(range(1, n + 1)):
        return False
    if not need_weights:
        return True
    if job["config"]["eval"].get("in_run"):
        held = read_jsonl(os.path.join(out, "heldout.jsonl"))
        start, end = ({r["uid"] for r in held if r["update"] == u} for u in (0, n))
        return bool(start) and start <= end
    return os.path.isfile(os.path.join(out, "hf", "final", "config.json"))


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


def run_job(job, gate=None):
    """Train (runs only), evaluate, then <dir>/done.json: the record, less the start evaluation. Returns the
    record, or None when a phase failed (status.json says which, with its exit code and error kind). A job folder
    left by an earlier attempt resumes: finished training is not redone, a seed_rl.py checkpoint is resumed, a
    finished evaluation is kept; anything else starts afresh."""
    jobdir = job["dir"]
    os.makedirs(jobdir, exist_ok=True)
    status_path = os.path.join(jobdir, "status.json")
    status = read_json(status_path, {})
    status.update(pid=os.getpid(), started=status.get("started") or now(), attempts=status.get("attempts", 0) + 1)
    write_json(status_path, status)

    def phase(name, cmd, done, ready_file=None):
        status["phase"] = name
        write_json(status_path, status)
        log = os.path.join(jobdir, f"{name}.log")
        rc = run_child(cmd, log, status, status_path, name, gate, ready_file)
        if rc != 0 or not done():
            status.update(phase="failed", failed_phase=name, rc=rc, error_kind=error_kind(log), ended=now())
            write_json(status_path, status)
            return False
        return True

    train_out = os.path.join(jobdir, "train")
    if job["kind"] == "run" and not train_complete(job):
        if not os.path.isfile(os.path.join(train_out, "checkpoint", "state.json")):
            shutil.rmtree(train_out, ignore_errors=True)  # no checkpoint to resume: start afresh (no stale metrics)
            status["train_wall_s"] = 0.0
        if not phase("train", job["train_cmd"], lambda: train_complete(job),
                     ready_file=os.path.join(train_out, "seed_manifest.json")):
            return None
    if job["kind"] == "run" and not job["keep_checkpoints"]:
        shutil.rmtree(os.path.join(train_out, "checkpoint"), ignore_errors=True)  # fp32 weights + AdamW: GBs
    results = None if job["eval_cmd"] is None else os.path.join(jobdir, "eval", "results.json")
    if results and not os.path.isfile(results) and not phase("eval", job["eval_cmd"], lambda: os.path.isfile(results)):
        return None
    if results:
        write_actions(os.path.dirname(results))
    done = job_record(job, status, train_out, results, host_cpus=os.cpu_count())
    write_json(os.path.join(jobdir, "done.json"), done)
    if job["kind"] == "run" and not job["keep_checkpoints"]:
        shutil.rmtree(os.path.join(train_out, "hf"), ignore_errors=True)  # the end weights, once evaluated
    status.update(phase="done", ended=now())
    write_json(status_path, status)
    return done


def write_actions(eval_dir):
    """evaluate.py's trajectories.jsonl (each step's prompt and token ids: ~10 MB per 274 games) -> actions.jsonl
    beside it: what the policy did in each held-out episode, step by step, small enough for part L's tarball, so
    that a change in held-out behaviour (e.g. more inadmissible actions) can be read after a GPU run."""
    src = os.path.join(eval_dir, "trajectories.jsonl")
    if not os.path.isfile(src):
        return
    ep_keys = ("task_id", "split", "category", "success", "length", "env_failure")
    step_keys = ("action", "valid", "invalid_reason", "admissible_action", "feedback", "response")
    with open(os.path.join(eval_dir, "actions.jsonl"), "w") as f:  # rewritten whole: derived from the source
        for ep in read_jsonl(src):
            slim = {k: ep.get(k) for k in ep_keys}
            slim["steps"] = [{k: s.get(k) for k in step_keys} for s in ep.get("steps", [])]
            f.write(json.dumps(slim) + "\n")


# -----------------------------------------------------------------------------
# 4. The records: evaluate.py's and seed_rl.py's outputs -> one line each

def eval_summary(results_path):
    """evaluate.py's results.json -> per split and pooled over splits (weighted by episodes), in %."""
    r = read_json(results_path)
    if not r:
        return None
    out = {"splits": {}, "elapsed_s": r.get("elapsed_s"), "model": r.get("model")}
    for s, x in r["splits"].items():
        sp = x["success_pct"]
        out["splits"][s] = {"episodes": x["episodes"], "success": sp["All"]["mean"], "avg": sp["Avg"]["mean"],
                            "score": x["score_pct"]["All"], "invalid": x["invalid_action_pct"]["All"],
                            "inadmissible": x["inadmissible_action_pct"]["All"], "length": x["episode_length"]["All"],
                            "per_group": {c: v["mean"] for c, v in sp.items() if c not in ("All", "Avg")}}
    return pool_summary(out, read_jsonl(os.path.join(os.path.dirname(results_path), "trajectories.jsonl")))


def heldout_summary(path, env_name, update):
    """seed_rl.py's heldout.jsonl rows of one evaluation point -> eval_summary's shape (per split, pooled,
    per task); None when the point is not on file."""
    from common.rollout import summarize_episodes
    from envs import load_env
    env = load_env(env_name)
    rows = {r["uid"]: r for r in read_jsonl(path) if r["update"] == update}.values()  # a replayed point: once each
    if not rows:
        return None
    pct = lambda x: None if x is None else round(100.0 * x, 3)
    out = {"splits": {}, "elapsed_s": None, "model": f"seed_rl.py policy after {update} updates"}
    for split in sorted({r["split"] for r in rows}):
        summ = summarize_episodes([r for r in rows if r["split"] == split], env)
        groups = {g: pct(summ[g]["success"]) for g in env.GROUPS if summ[g]["episodes"]}
        out["splits"][split] = {"episodes": summ["All"]["episodes"], "success": pct(summ["All"]["success"]),
                                "avg": round(sum(groups.values()) / len(groups), 3) if groups else None,
                                "score": pct(summ["All"]["score"]), "invalid": pct(summ["All"]["invalid_rate"]),
                                "inadmissible": pct(summ["All"]["inadmissible_rate"]), "length": summ["All"]["length"],
                                "per_group": groups}
    return pool_summary(out, rows)


def pool_summary(out, episodes):
    """Completes a summary from its per-split figures (out["splits"]): "all", the splits pooled (weighted by
    episodes), and "per_task", each task's episodes' success (0/1, one per sample), so that two policies
    evaluated on the same tasks are compared task by task (learning_report.py's paired bootstrap)."""
    out["all"] = {"episodes": sum(v["episodes"] for v in out["splits"].values())}
    for k in ("success", "avg", "score", "invalid", "inadmissible", "length"):
        vals = [(v[k], v["episodes"]) for v in out["splits"].values() if v[k] is not None]
        w = sum(e for _, e in vals)
        out["all"][k] = round(sum(x * e for x, e in vals) / w, 3) if w else None
    out["per_task"] = {}
    for ep in episodes:
        if not ep.get("env_failure"):
            out["per_task"].setdefault(ep["task_id"], []).append(int(bool(ep["success"])))
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


def job_record(job, status, train_out, results_json, host_cpus=None):
    """The record of a finished job (less the start evaluation, joined by add_run): the run's per-update rows
    from seed_rl.py's metrics.jsonl and its end evaluation (None where results_json is None: remote --salvage)."""
    compute = {"lanes": job["lanes"], "train_wall_s": round(status.get("train_wall_s", 0.0), 1),
               "eval_wall_s": round(status.get("eval_wall_s", 0.0), 1) if results_json else None,
               "frozen_s": round(status.get("frozen_s", 0.0), 1),
               "device_peak_mib": status.get("device_peak_mib"), "device_total_mib": status.get("device_total_mib"),
               "attempts": status.get("attempts"), "host_cpus": host_cpus}
    common = {"group": job["group"], "env": job["env"], "config": job["config"], "start": job["start"],
              "code": job["code"], "finished": now()}
    in_run = job["config"]["eval"].get("in_run")
    end = eval_summary(results_json) if results_json else None
    if in_run:  # seed_rl.py's own evaluations of the start (update 0) and the end policy
        held = os.path.join(train_out, "heldout.jsonl")
        start, end = heldout_summary(held, job["env"], 0), heldout_summary(held, job["env"], job["config"]["updates"])
    if job["kind"] != "run":
        return dict(eval_key=job["eval_key"], **common, command=shlex.join(job["eval_cmd"]), summary=end,
                    compute=compute)
    man = read_json(os.path.join(train_out, "seed_manifest.json"), {})
    cmd = job["train_cmd"]
    compute.update(gpu_util_train=float(cmd[cmd.index("--gpu-memory-utilization") + 1]),
                   workers=int(cmd[cmd.index("--workers") + 1]),
                   gpus=(man.get("hardware") or {}).get("gpus"), packages=man.get("packages"))
    return dict(run_id=job["run_id"], method=job["method"], seed=job["seed"], **common, eval_key=job["eval_key"],
                commands={"train": shlex.join(job["train_cmd"]), "driver": shlex.join(job["driver"]),
                          "eval_end": "seed_rl.py --eval-every (in the train command)" if in_run
                          else shlex.join(job["eval_cmd"])},
                train_manifest_git=man.get("git"), updates=update_rows(os.path.join(train_out, "metrics.jsonl")),
                eval=dict(end=end, **({"start": start, "start_in_run": True} if in_run else {})), compute=compute)


def attempt_record(job, outcome):
    """One line of attempts.jsonl: how a job attempt ended (ok, failed; remote: killed, lost, salvaged)."""
    st = read_json(os.path.join(job["dir"], "status.json"), {})
    return {"attempt_id": f"{job['job_id']}#{st.get('attempts', 0)}@{st.get('started')}", "job_id": job["job_id"],
            "kind": job["kind"], "group": job["group"], "method": job.get("method"), "seed": job.get("seed"),
            "lanes": job["lanes"], "outcome": outcome, "phase": st.get("failed_phase") or st.get("phase"),
            "rc": st.get("rc"), "error_kind": st.get("error_kind"), "train_wall_s": st.get("train_wall_s"),
            "eval_wall_s": st.get("eval_wall_s"), "frozen_s": st.get("frozen_s"),
            "device_peak_mib": st.get("device_peak_mib"), "device_total_mib": st.get("device_total_mib"),
            "updates_done": len(read_jsonl(os.path.join(job["dir"], "train", "metrics.jsonl"))), "ended": now(),
            "code": job["code"]}


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


def add_run(done, results, se):
    """A run's record -> runs.jsonl, with its start evaluation se joined in (None: the report joins evals.jsonl
    by eval_key later; --eval-in-run: the run's own, already in the record)."""
    if done["eval"].get("start_in_run"):
        done["commands"]["eval_start"] = "seed_rl.py --eval-every (in the train command), before update 1"
    else:
        done["eval"]["start"] = se["summary"] if se else None
        done["commands"]["eval_start"] = se["command"] if se else None
    results.add("runs", done)


def run_summary(r):
    """One line about a finished run's record: its pace, cost and how its end policy did."""
    t = [u["time"] for u in r["updates"] if u.get("time") is not None]
    end = ((r["eval"] or {}).get("end") or {}).get("all", {})
    c = r["compute"]
    return (f"{r['run_id']}: median {statistics.median(t) if t else 0:.1f} s/update; train {c['train_wall_s']:.0f} s"
            f" + eval {c['eval_wall_s'] or 0:.0f} s (stopped by the gate {c['frozen_s']:.0f} s); lanes {c['lanes']}, "
            f"device peak {(c['device_peak_mib'] or 0) / 1024:.1f} of {(c['device_total_mib'] or 0) / 1024:.0f} GiB; "
            f"invalid rate update 1 {r['updates'][0]['invalid']} -> {len(r['updates'])} {r['updates'][-1]['invalid']};"
            f" end eval: invalid {end.get('invalid')}%, success {end.get('success')}%")


# -----------------------------------------------------------------------------
# 5. The runner: the start evaluation, then every (seed, method) in turn, then the report

def main(argv=None):
    p = build_parser()
    args = finish_args(p, p.parse_args(argv))
    t0 = time.time()
    cfg, start, group, start_eval, runs = plan_jobs(args)
    results = Results(args.results_dir)
    print(f"learning: env {args.env}, start {start['label']}, group {group}, methods {args.methods}, seeds "
          f"{args.seeds}, {cfg['updates']} updates of {cfg['tasks_per_update']} x {cfg['group_size']} episodes, "
          f"{cfg['max_steps']} steps, lr {cfg['lr']}; results in {results.folder}", flush=True)
    todo = [job for job in runs if job["run_id"] not in results.ids["runs"]]
    for job in runs:
        if job not in todo:
            print(f"  {job['job_id']}: finished, on file (skipped)")
    need_start = start_eval is not None and start_eval["eval_key"] not in results.evals and bool(todo)
    if args.dry_run:
        for job in ([start_eval] if need_start else []) + todo:
            print(f"\n{job['job_id']}")
            for k in ("train_cmd", "eval_cmd"):
                if job.get(k):
                    print(f"  {k}: {shlex.join(job[k])}")
        return 0
    failed = 0
    # the start's evaluation first: every run's record joins it (a failed one: the runs go on, the report joins
    # a later call's evaluation by eval_key)
    for job in ([start_eval] if need_start else []) + todo:
        print(f"[{time.time() - t0:5.0f}s] {job['job_id']}: running (logs in {job['dir']})", flush=True)
        done = run_job(job)
        results.add("attempts", attempt_record(job, "ok" if done else "failed"))
        if done is None:
            failed += 1
            st = read_json(os.path.join(job["dir"], "status.json"), {})
            print(f"[{time.time() - t0:5.0f}s] {job['job_id']}: FAILED in {st.get('failed_phase')} (rc {st.get('rc')}, "
                  f"{st.get('error_kind') or 'see the logs in ' + job['dir']})", flush=True)
        elif job["kind"] == "start_eval":
            results.add("evals", done)
        else:
            add_run(done, results, results.evals.get(job["eval_key"]))  # --eval-in-run: its own start
            print(f"[{time.time() - t0:5.0f}s] {run_summary(done)}", flush=True)
    # the report pools every record on file, this call's and earlier ones'
    import learning_report
    out = os.path.join(args.results_dir, "report")
    report = learning_report.write_report(args.results_dir, out)
    print(f"\n{len(todo)} run(s) in this call, {failed} failed, {time.time() - t0:.0f} s; {report['runs']} on file; "
          f"report: {os.path.join(out, 'report.md')}")
    for g in report["groups"]:
        if g["group"] == group:
            print("\n".join(f"  - {s}" for s in g["statements"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
