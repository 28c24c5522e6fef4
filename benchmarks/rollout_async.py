"""Rollout without lockstep (issue 19): the old lockstep schedule and the per-episode loop side by side, one run.

    # one H200, the real 0.5B model (staged with ../shared/tools/device), ~8 minutes, every part:
    python benchmarks/rollout_async.py --model $QWEN_CODER_DIR --json $OUT/rollout_async.json
    # only some parts, e.g. a second block for what the budget cut:   --parts b,update_lockstep
    # CPU smoke run: the tiny random model through HF generate, every part at toy sizes (~4 min on 2 cores)
    python benchmarks/rollout_async.py --model tiny --backend hf --group-size 2 --big-tasks 2 --max-steps 2 \\
        --max-new-tokens 8 --update-max-steps 2 --workers 2 --budget 900 \\
        --update-flags "--analysis-max-new-tokens 16" --json /tmp/rollout_async.json

Parts, in this order (each measured on the same episodes with both schedules, same seeds, same weights):
  a       seed_rl.py's rollout on one GPU: --tasks x --group-size episodes (2 x 8, the paper's per-GPU share),
          --max-steps turns (30), temperature 1, 512 new tokens, sampled-token log-probs, the engine built as
          seed_rl.py builds it (so its compile cache serves the update runs)
  update  seed_rl.py --updates N (default 5; torchrun, 1 process), SEED and GRPO (--opd-coef 0) with the
          per-episode loop: the update time with the self-analysis overlapped, and SEED / GRPO per update and
          on the mean (the goal: <= 1.1x)
  update_lockstep  seed_rl.py --updates N --lockstep, SEED: the same update with the old schedule
  b       as a with --big-tasks x --group-size episodes (16 x 8 on one GPU)
Each part is a child process (a and b, when next to each other, share one child and one engine start), started
only while at least 90 s of the budget (--budget seconds for the whole command) are left and stopped when the
budget runs out; the JSON is rewritten after every measurement, so a part cut short keeps what it measured
(seed_rl.py writes each update's metrics as it ends), and what was skipped is listed.

Reported per schedule: wall time of the rollout; GPU busy share (the time with requests in flight on the
engine, over the wall time); the loop's phases (they sum to the wall time: waiting for the engine, for the env
workers, and its own prompt/parse work) and each resource's busy time (they overlap); response tokens and
tokens per busy second; how many episodes came out identical in both schedules (the same seeds; bf16 results
depend a little on which requests share a forward, so sampled episodes can part ways). And the ratio
per-episode / lockstep (the goal for a: <= 0.75). For the update runs: time/update and its phases per update
from seed_rl.py's metrics. Not a test: timings are reported, never asserted.
"""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", required=True, help="HF model folder (vLLM loads from disk) | tiny (with --backend hf)")
p.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
p.add_argument("--parts", default="a,update,update_lockstep,b", help="comma-separated, run in this order")
p.add_argument("--budget", type=float, default=480, help="seconds for the whole command; a part that would not "
               "fit is skipped and recorded as such")
p.add_argument("--tasks", type=int, default=2, help="part a: tasks (GRPO groups)")
p.add_argument("--big-tasks", type=int, default=16, help="part b: tasks")
p.add_argument("--group-size", type=int, default=8, help="episodes per task")
p.add_argument("--max-steps", type=int, default=30, help="parts a and b: turns per episode")
p.add_argument("--max-new-tokens", type=int, default=512)
p.add_argument("--update-max-steps", type=int, default=15, help="update runs: turns per episode (15: the issue's "
               "seed_rl.py measurement; three start-ups and 6 updates of 30 turns would not fit the budget)")
p.add_argument("--updates", type=int, default=5, help="update runs: updates each (issue 31: SEED / GRPO over 5 or "
               "more, per update)")
p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="env worker processes")
p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="as seed_rl.py's default")
p.add_argument("--update-flags", default="", help="more seed_rl.py flags for the update runs (CPU smoke run: "
               "--analysis-max-new-tokens 16)")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--work", default="/tmp/seed-rollout-async", help="scratch folder (seed_rl.py outputs, logs)")
p.add_argument("--json", required=True, help="results file (rewritten after every measurement)")
p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run rollout parts in this process
args = p.parse_args()
MIN_LEFT = 90  # seconds a part needs at least (an engine start and some work); less: skipped, and recorded


# ====================================================================================================
# Rollout parts (a child process: one engine, one env pool)

def rollout_child(parts, out_path):
    import torch
    import envs.alfworld as alfworld
    from common.backends import HFBackend, VLLMBackend
    from common.models import load_model, load_tokenizer
    from envs.pool import EnvPool
    from common.rollout import play_episodes

    res = {"parts": {}}
    t0 = time.perf_counter()
    tok = load_tokenizer(args.model)
    if args.backend == "vllm":  # exactly as seed_rl.py builds its engine (max_model_len from its defaults)
        eng = VLLMBackend(args.model, tok, max_model_len=max(16384, 2048 + args.max_new_tokens), seed=args.seed,
                          gpu_memory_utilization=args.gpu_memory_utilization, want_logprobs=True)
    else:
        on_gpu = torch.cuda.is_available()
        eng = HFBackend(load_model(args.model, seed=args.seed, device="cuda" if on_gpu else "cpu",
                                   dtype=torch.bfloat16 if on_gpu else torch.float32), tok, want_logprobs=True)
    eng.generate([[9707, 11, 1879]] * 4, max_new_tokens=8, temperature=1.0, seeds=[1, 2, 3, 4])  # warm-up
    res["engine_start_s"] = time.perf_counter() - t0
    with EnvPool("envs.alfworld:make_game", num_workers=args.workers) as pool:
        for part in parts:
            n_tasks = args.tasks if part == "a" else args.big_tasks
            tasks = alfworld.rl_tasks(args.seed, n_tasks)  # seed_rl.py's update 1 (part a: its first 2 tasks)
            specs = [dict(t, uid=f"u0/g{g}/r{r}", group=g, rollout=r, seed=args.seed, update=0)
                     for g, t in enumerate(tasks) for r in range(args.group_size)]
            out = res["parts"][part] = {"episodes": len(specs), "max_steps": args.max_steps}
            runs = {}
            for schedule in (["lockstep", "per_episode"] if part == "a" else ["per_episode", "lockstep"]):
                if args.backend == "vllm":  # no prompt KV carried from one schedule to the other
                    eng.llm.reset_prefix_cache()
                eps, tm = play_episodes(alfworld, specs, pool, eng, tok, max_steps=args.max_steps, history=5,
                                        max_prompt_tokens=2048, max_new_tokens=args.max_new_tokens,
                                        temperature=1.0, lockstep=schedule == "lockstep")
                runs[schedule] = eps
                out[schedule] = summary(eps, tm)
                print(f"[{part}] {schedule}: {format_run(out[schedule])}", flush=True)
                if len(runs) == 2:
                    out["ratio_wall"] = out["per_episode"]["wall_s"] / out["lockstep"]["wall_s"]
                    out["same_episodes"] = same(runs["lockstep"], runs["per_episode"])
                    print(f"[{part}] per-episode / lockstep wall: {out['ratio_wall']:.3f}; "
                          f"{json.dumps(out['same_episodes'])}", flush=True)
                write(out_path, res)
    return res


def summary(eps, tm):
    tokens = sum(len(s["response_ids"]) for ep in eps for s in ep["steps"])
    steps = sum(len(ep["steps"]) for ep in eps)
    return {"wall_s": tm["wall"], "gpu_busy_share": tm["busy_gpu"] / tm["wall"],
            "phases_s": {k: tm[k] for k in ("reset", "generate", "analysis", "env", "parse")},
            "busy_s": {k[5:]: tm[k] for k in tm if k.startswith("busy_")},
            "steps": steps, "response_tokens": tokens,
            "tokens_per_busy_s": tokens / tm["busy_gpu"] if tm["busy_gpu"] else None,
            "success_rate": sum(ep["success"] for ep in eps) / len(eps),
            "env_failures": sum(bool(ep["env_failure"]) for ep in eps),
            "truncated_responses": sum(ep["truncated_responses"] for ep in eps)}


def same(a, b):
    """How far the two schedules' episodes agree (same uid, same seeds)."""
    by = {ep["uid"]: ep for ep in b}
    ident = sum([s["response_ids"] for s in ep["steps"]] == [s["response_ids"] for s in by[ep["uid"]]["steps"]]
                for ep in a)
    first = sum(bool(ep["steps"]) and bool(by[ep["uid"]]["steps"]) and
                ep["steps"][0]["response_ids"] == by[ep["uid"]]["steps"][0]["response_ids"] for ep in a)
    return {"identical_episodes": ident, "identical_first_responses": first, "episodes": len(a)}


def format_run(r):
    ph = ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items() if v >= 0.05)
    return (f"wall {r['wall_s']:.1f}s, GPU busy {100 * r['gpu_busy_share']:.0f}%, {r['response_tokens']} tokens, "
            f"{r['steps']} steps | phases: {ph} | busy: env {r['busy_s']['env']:.1f}s, gpu {r['busy_s']['gpu']:.1f}s")


def write(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


if args.child:
    rollout_child(args.child.split(","), args.json)
    raise SystemExit(0)


# ====================================================================================================
# The driver: parts in order, each a child process with a timeout from the budget

T0 = time.monotonic()
left = lambda: args.budget - (time.monotonic() - T0)
os.makedirs(args.work, exist_ok=True)
env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           PYTHONUNBUFFERED="1")
results = {"model": args.model, "backend": args.backend, "budget_s": args.budget, "seed": args.seed,
           "args": vars(args), "rollout": {}, "update": {}, "skipped": []}


def run(name, cmd, timeout):
    """A child process, its output to the log and to this console; returns (exit code, seconds)."""
    log = os.path.join(args.work, f"{name}.log")
    t0 = time.monotonic()
    print(f"== {name} (timeout {timeout:.0f}s): {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the child, its env workers, torchrun's worker
            proc.wait()
            code = "timeout"
    dt = time.monotonic() - t0
    with open(log) as f:
        tail = f.read()[-1500:]
    print(tail if code != 0 else "\n".join(tail.splitlines()[-6:]), flush=True)
    print(f"== {name}: exit {code} in {dt:.0f}s; {left():.0f}s of the budget left", flush=True)
    return code, dt


def rollout(parts):
    path = os.path.join(args.work, f"rollout_{'_'.join(parts)}.json")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", ",".join(parts), "--json", path]
    code, dt = run("rollout_" + "_".join(parts), cmd, left() - 5)
    got = json.load(open(path)) if os.path.exists(path) else {"parts": {}}
    for part in parts:
        results["rollout"][part] = got["parts"].get(part, {"incomplete": f"exit {code}"})
        results["rollout"][part]["engine_start_s"] = got.get("engine_start_s")
    write(args.json, results)


def update_flags(extra):
    """--update-flags, without the analysis and OPD flags for the GRPO run (seed_rl.py refuses them there)."""
    flags = args.update_flags.split()
    if "--opd-coef" in extra:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from common.records import OPD_ONLY_FLAGS, drop_flags
        flags = drop_flags(flags, {"--" + f.replace("_", "-") for f in OPD_ONLY_FLAGS})
    return flags


def update(name, extra):
    out = os.path.join(args.work, name)
    subprocess.run(["rm", "-rf", out])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "seed_rl.py",
           "--env", "alfworld", "--model", args.model, "--tasks-per-update", str(args.tasks), "--group-size",
           str(args.group_size), "--updates", str(args.updates), "--max-steps", str(args.update_max_steps), "--max-new-tokens",
           str(args.max_new_tokens), "--workers", str(args.workers), "--save-every", "0", "--seed", str(args.seed),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--backend", args.backend,
           "--out", out, *update_flags(extra), *extra]
    code, dt = run(name, cmd, left() - 5)
    rows = []
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    keys = ["update", "sync", "rollout", "generate", "env", "analysis", "sleep", "scoring", "train", "busy_gpu",
            "busy_generate", "busy_analysis", "busy_env", "loop", "loop_idle"]
    results["update"][name] = {"exit": code, "process_s": dt, "flags": extra, "updates": [
        dict({k: r.get(f"time/{k}") for k in keys}, skill_parse_rate=r.get("skill/parse_rate"),
             tokens=r.get("tokens/response"), success=r.get("rollout/success_rate")) for r in rows]}
    ratios = {}
    if mean_update("seed") and mean_update("grpo"):
        ratios["seed_over_grpo_update"] = mean_update("seed") / mean_update("grpo")
        # per update: the same tasks and seeds in both runs (the same episodes at update 1; the policies part after)
        ratios["seed_over_grpo_per_update"] = [s["update"] / g["update"] for s, g in zip(
            results["update"]["seed"]["updates"], results["update"]["grpo"]["updates"]) if s["update"] and g["update"]]
    if mean_update("seed") and mean_update("seed_lockstep"):
        ratios["seed_over_seed_lockstep_update"] = mean_update("seed") / mean_update("seed_lockstep")
    results["update_ratios"] = ratios
    write(args.json, results)


def mean_update(name):
    """Mean time/update of a run's completed updates (None if none completed)."""
    ts = [u["update"] for u in results["update"].get(name, {}).get("updates", []) if u["update"] is not None]
    return sum(ts) / len(ts) if ts else None


parts = [x for x in args.parts.split(",") if x]
for i, part in enumerate(parts):
    if part in ("a", "b"):
        if part in results["rollout"]:  # already played with the part before it (one child, one engine start)
            continue
        group = [part] + ([parts[i + 1]] if i + 1 < len(parts) and parts[i + 1] in ("a", "b") else [])
        if left() < MIN_LEFT and part != "a":  # part a always runs: it is the first goal
            results["skipped"].append(f"rollout {'+'.join(group)}: {left():.0f}s of the budget left")
            continue
        rollout(group)
    elif part in ("update", "update_lockstep"):
        runs = [("seed", []), ("grpo", ["--opd-coef", "0"])] if part == "update" else [("seed_lockstep", ["--lockstep"])]
        for name, extra in runs:
            if left() < MIN_LEFT:
                results["skipped"].append(f"seed_rl.py {name}: {left():.0f}s of the budget left")
                continue
            update(name, extra)
    else:
        raise SystemExit(f"unknown part {part!r}")
    write(args.json, results)
results["total_s"] = time.monotonic() - T0
write(args.json, results)

# ---- the table
print("\n== rollout: lockstep vs per-episode (same episodes, same seeds)")
for part, r in results["rollout"].items():
    if "lockstep" in r and "per_episode" in r:
        print(f"{part}: {r['episodes']} episodes x {r['max_steps']} steps | lockstep {r['lockstep']['wall_s']:.1f}s "
              f"(GPU busy {100 * r['lockstep']['gpu_busy_share']:.0f}%) | per-episode {r['per_episode']['wall_s']:.1f}s "
              f"(GPU busy {100 * r['per_episode']['gpu_busy_share']:.0f}%) | ratio {r['ratio_wall']:.3f}")
    else:
        print(f"{part}: incomplete {r}")
print("== seed_rl.py updates (time/update per update, s)")
for name, r in results["update"].items():
    print(f"{name}: exit {r['exit']}, " + ", ".join(
        f"update {k + 1} {u['update']:.1f} (rollout {u['rollout']:.1f}, analysis {u['analysis']:.1f})"
        for k, u in enumerate(r["updates"]) if u["update"] is not None))
print("ratios:", json.dumps(results.get("update_ratios", {})), "| skipped:", results["skipped"] or "none")
print(f"total {results['total_s']:.0f}s; wrote {args.json}")
