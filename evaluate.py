"""Deployment-time evaluation on the chosen env's test splits; also the training report and the data manifest.

Evaluation is what the paper reports: the policy plays the env's evaluation splits with the PLAIN prompt: no
skill, no analyzer, no skill bank (SEED's skills are training-time tools only). Temperature 0.4, each env's
steps, history and lengths (ALFWorld: valid_seen, 140 games, in-distribution, and valid_unseen, 134 games,
out-of-distribution; 30 steps, the last 5 history entries).

    # 1 GPU (vLLM): all 274 games, the paper's settings; 4 samples per game for a mean and a 95% interval
    python evaluate.py --env alfworld --model runs/seed/hf/final --backend vllm --samples 4 --out runs/eval/seed
    # 8 GPUs: evaluation is small (274 games x 30 steps); one GPU is enough for a 3B/7B model. A model
    # that does not fit one GPU is split over several with tensor parallelism:
    python evaluate.py --env alfworld --model Qwen/Qwen2.5-7B-Instruct --backend vllm --tp 8 --out runs/eval/qwen7b
    # CPU demo: the scripted expert and a tiny random model, on a seeded type-stratified subset
    python evaluate.py --env alfworld --model expert --limit 12 --out runs/demo/eval-expert
    python evaluate.py --env alfworld --model tiny --limit 6 --max-steps 3 --max-new-tokens 16 --out runs/demo/eval-tiny

    # training dynamics of seed_rl.py runs (each labeled by its directory), e.g. GRPO beside SEED (common/report.py)
    python evaluate.py --report runs/grpo runs/seed --out runs/report
    # the paper preset's data: the Stage 1 task set and the RL task stream, counts and sha256
    python evaluate.py --env alfworld --data-manifest

Outputs of an evaluation (in --out): results.json and results.md (per split: success per summary column in the
paper's order, mean episode length, invalid-action rate, beside the paper's numbers for the same backbone and
the list of conditions that differ), trajectories.jsonl (every episode, written the moment it ends; the record
schema of common/rollout.py; append-only: a killed or interrupted run restarts where it stopped) and
manifest.json (common/records.py).
"""
import json
import os
import sys
import time

from envs import env_from_argv, env_parser, require_positive, require_split
from common.rollout import add_play_args, add_rollout_args
from common.records import check_resume, games_summary, read_jsonl, resumed_manifest, run_manifest, write_manifest

REPO = os.path.dirname(os.path.abspath(__file__))
PAPER_FILE = os.path.join(REPO, "common", "paper_results.json")
with open(PAPER_FILE) as f:
    PAPER_RESULTS = json.load(f)  # the paper's numbers, each with its source (only what docs/paper.md states)
S = {k: v["value"] for k, v in PAPER_RESULTS["settings"].items()}

env = env_from_argv()  # --env first: every default below is that env's paper preset
P = env.PRESET
# The paper's evaluation settings; argparse defaults equal these and the manifest diffs the run against them.
PAPER = dict(env=env.NAME, splits=",".join(P["eval_splits"]), limit=P["eval_limit"], temperature=S["temperature"],
             max_steps=P["max_steps"], history=P["history"], max_new_tokens=P["max_new_tokens"],
             max_prompt_tokens=P["max_prompt_tokens"], invalid_penalty=P["invalid_penalty"], invalid_rule="public")
COLUMNS = env.GROUPS + ["Avg", "All"]  # Avg: mean over the columns (the paper's average); All: over episodes

p, g = env_parser(__doc__, env)
g.add_argument("--splits", default=PAPER["splits"], help=f"comma-separated evaluation splits ({env.NAME}: "
               f"{', '.join(env.SPLITS)})")
g.add_argument("--limit", type=int, default=PAPER["limit"], help="tasks per split, as the env defines the subset "
               "(ALFWorld: a seeded subset that takes the task types in turn, so every type is present)")
g.add_argument("--samples", type=int, default=1, help="episodes per task; >1 reports the mean and a 95%% interval")
g.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="env worker processes")
env.add_args(g)
g = p.add_argument_group("rollout, policy and generation")
add_rollout_args(g, PAPER)
g.add_argument("--model", help="HF path or hub id | tiny | expert")
add_play_args(g, batch_episodes=128, tp=True)
g = p.add_argument_group("output and other modes")
g.add_argument("--paper-backbone", default="auto", help="paper rows to compare with: auto (from the model's "
               "name or config) | Qwen2.5-3B-Instruct | Qwen2.5-7B-Instruct | Qwen3-1.7B")
g.add_argument("--seed", type=int, default=0, help="task subset (--limit) and sampling")
g.add_argument("--out", help="output folder")
g.add_argument("--report", nargs="+", metavar="RUN", help="seed_rl.py run dirs or metrics.jsonl files: draw "
               "the training curves instead of evaluating")
g.add_argument("--smooth", type=int, default=1, help="--report: moving-average window over updates (1: raw)")
g.add_argument("--data-manifest", action="store_true", help="print the paper preset's Stage 1 set and RL task "
               "stream (counts per group, sha256) instead of evaluating")
args = p.parse_args()

# ---------------------------------------------------------------------------------------------------
# The other two modes, each one call: the training report (common/report.py), the preset's data manifest
if args.report:
    if not args.out:
        sys.exit("--report needs --out")
    from common.report import write_report
    write_report(args.report, args.out, args.smooth)
    sys.exit(0)
if args.data_manifest:
    lines, checks, manifest = env.data_manifest(args.seed, P["tasks_per_update"], P["updates"], P["collect_tasks"], args)
    print(f"data manifest, {env.NAME} paper preset, seed {args.seed}")
    print("\n".join(lines))
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if args.out:
        write_manifest(os.path.join(args.out, "data_manifest.json"),
                       dict(manifest, env=env.NAME, seed=args.seed, checks=checks,
                            paper_preset={k: P[k] for k in ("collect_tasks", "rollouts", "tasks_per_update", "updates")}))
        print(f"wrote {os.path.join(args.out, 'data_manifest.json')}")
    sys.exit(0 if all(checks.values()) else 1)


def pct(x):
    return None if x is None else round(100.0 * x, 2)


def cell(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


# ===================================================================================================
# Evaluation. Plan: the deterministic list of episodes, minus those already written.
if not args.model or not args.out:
    sys.exit("evaluation needs --model and --out (or use --report / --data-manifest)")

from common.backends import make_policy  # noqa: E402

from common.models import load_tokenizer  # noqa: E402
from common.stats import mean_ci  # noqa: E402
from common.rollout import format_summary, play_into_jsonl, summarize_episodes  # noqa: E402

splits = [s.strip() for s in args.splits.split(",") if s.strip()]
require_positive(args, "samples", "limit", "max_steps", "max_new_tokens", "workers", "batch_episodes", "tp")
if args.tp > 1 and (args.backend != "vllm" or args.model == "expert"):
    sys.exit("--tp (tensor parallelism) needs --backend vllm and a model")
if not splits:
    sys.exit(f"--splits {args.splits!r}: expected a comma-separated list of {env.NAME} splits")
for s in splits:
    require_split(env, "--splits", s)
if args.paper_backbone not in ["auto"] + S["backbones"]:
    sys.exit(f"--paper-backbone {args.paper_backbone!r}: expected auto or one of {S['backbones']}")


try:
    games = {s: env.eval_tasks(s, args.seed, args.limit, args) for s in splits}
except ValueError as e:  # an unknown split: the env names the known ones
    sys.exit(f"--splits: {e}")
for s in splits:
    if not games[s]:
        sys.exit(f"{env.NAME}: split {s!r} has no tasks (is the env's data complete?); nothing to evaluate")
plan = [dict(g, uid=f"{g['task_id']}#s{k}", group=gi, rollout=k, sample=k, seed=args.seed)
        for s in splits for gi, g in enumerate(games[s]) for k in range(args.samples)]

os.makedirs(args.out, exist_ok=True)
traj_path, manifest_path = os.path.join(args.out, "trajectories.jsonl"), os.path.join(args.out, "manifest.json")
tokenizer = load_tokenizer(args.model)
manifest = run_manifest("evaluate.py", args, paper=PAPER, model=args.model, tokenizer=tokenizer, split=splits,
                        games=[g for s in splits for g in games[s]], seeds={"seed": args.seed},
                        extra={"games_per_split": {s: games_summary(games[s]) for s in splits}})
old = check_resume(manifest_path, args, script="evaluate.py", out=args.out,  # refuse to mix two evaluations
                   identity={"games.sha256": manifest["games"]["sha256"]})

done_ids = {ep["uid"] for ep in read_jsonl(traj_path)}
todo = [e for e in plan if e["uid"] not in done_ids]
write_manifest(manifest_path, resumed_manifest(old, manifest, episodes_done=len(plan) - len(todo)))
print(f"evaluate {env.NAME}: {', '.join(f'{s} {len(games[s])} tasks' for s in splits)} x {args.samples} samples = "
      f"{len(plan)} episodes; {len(plan) - len(todo)} already in {traj_path}, {len(todo)} to play")

# ---------------------------------------------------------------------------------------------------
# Policy: scripted expert, HF generate, or vLLM. The plain prompt only: no skill at deployment.
policy = None  # nothing left to play: the tables are rebuilt from the file
if todo:
    policy = make_policy(args.model, tokenizer, backend=args.backend,
                         max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                         gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=args.kv_cache_gib,
                         seed=args.seed, **({"tensor_parallel_size": args.tp} if args.backend == "vllm" else {}))

# ---------------------------------------------------------------------------------------------------
# Play: up to --batch-episodes episodes at once, each at its own pace; each is appended the moment it ends
# (samples depend only on (seed, uid, step), so the order they end in changes nothing)
t_start = time.time()
timings, env_stats = play_into_jsonl(env, todo, policy, tokenizer, args, traj_path, len(plan) - len(todo),
                                     len(plan))

# ---------------------------------------------------------------------------------------------------
# Score: per split, success per type averaged over the samples (with a 95% interval when samples > 1),
# the type mean (the paper's "average success") and the rate over all episodes; length and invalid rate.
def mean_ci95(values):
    """Mean and the 95% Student-t interval of the mean over samples, clipped to 0-100 (None for one sample: no
    spread to measure). The interval covers the sampling noise of the policy (temperature 0.4) on these games."""
    ci = mean_ci(values)
    return ci["mean"], None if ci["lo"] is None else [max(0.0, ci["lo"]), min(100.0, ci["hi"])]


uids = {e["uid"] for e in plan}
records = [ep for ep in read_jsonl(traj_path) if ep["uid"] in uids]
results = {}
for s in splits:
    eps = [ep for ep in records if ep["split"] == s]
    overall = summarize_episodes(eps, env)
    per_sample = []  # one {column: success %} per sample
    for k in range(args.samples):
        summ = summarize_episodes([ep for ep in eps if ep["sample"] == k], env)
        row = {t: pct(summ[t]["success"]) for t in env.GROUPS + ["All"]}
        present = [row[t] for t in env.GROUPS if row[t] is not None]
        row["Avg"] = sum(present) / len(present) if present else None
        per_sample.append(row)
    success = {}
    for c in COLUMNS:
        vals = [row[c] for row in per_sample if row[c] is not None]
        m, ci = mean_ci95(vals) if vals else (None, None)
        success[c] = {"mean": None if m is None else round(m, 2), "ci95": None if ci is None else
                      [round(v, 2) for v in ci], "per_sample": [row[c] for row in per_sample],
                      "episodes": overall[c]["episodes"] if c != "Avg" else overall["All"]["episodes"]}
    results[s] = {"games": len(games[s]), "samples": args.samples, "episodes": len(eps),
                  "env_failures": overall["env_failures"],
                  "types_present": [t for t in env.GROUPS if overall[t]["episodes"]],
                  "success_pct": success,
                  "episode_length": {c: overall[c]["length"] for c in env.GROUPS + ["All"]},
                  "invalid_action_pct": {c: pct(overall[c]["invalid_rate"]) for c in env.GROUPS + ["All"]},
                  "inadmissible_action_pct": {c: pct(overall[c]["inadmissible_rate"]) for c in env.GROUPS + ["All"]},
                  "score_pct": {c: pct(overall[c]["score"]) for c in env.GROUPS + ["All"]},
                  "truncated_responses": sum(ep.get("truncated_responses", 0) for ep in eps),
                  "prompt_too_long": sum(bool(ep.get("prompt_too_long")) for ep in eps)}
    print(format_summary(overall, f"{s}: success per {env.NAME} group ({len(eps)} episodes)"))
    print(f"{s}: Avg (type mean) {cell(success['Avg']['mean'])}%"
          + (f", 95% interval {success['Avg']['ci95']}" if success["Avg"]["ci95"] else ""))

# ---------------------------------------------------------------------------------------------------
# Beside the paper: the rows of the same backbone, and every condition that differs
BACKBONES = S["backbones"]


def infer_backbone(model):
    """The paper backbone a model is (from its name, else its config's shape), or None."""
    name = model.lower().replace("_", "-")
    for b in BACKBONES:
        if b.lower().replace("-instruct", "") in name:
            return b
    cfg = os.path.join(model, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            c = json.load(f)
        shape = (c.get("model_type"), c.get("hidden_size"), c.get("num_hidden_layers"))
        return {("qwen2", 2048, 36): "Qwen2.5-3B-Instruct", ("qwen2", 3584, 28): "Qwen2.5-7B-Instruct",
                ("qwen3", 2048, 28): "Qwen3-1.7B"}.get(shape)
    return None


inferred = infer_backbone(args.model) if args.paper_backbone == "auto" else args.paper_backbone
backbone = inferred or BACKBONES[0]
paper_rows = [r for r in PAPER_RESULTS["results"] if r["env"] == env.NAME and r["backbone"] == backbone]

hw = manifest["hardware"]
differences = [
    f"model: this run `{args.model}`" + (f" ({inferred} backbone)" if inferred else " (not one of the paper's "
    f"backbones; the rows shown are the paper's {backbone} rows, for reference)")
    + f"; paper: {backbone} after its GRPO / SEED training (150 updates on 8 x A800)",
    f"hardware: this run {', '.join(hw['gpus']) or 'CPU only'} ({args.backend if args.model not in ('expert',) else 'scripted'}"
    f"{f', tp {args.tp}' if args.tp > 1 else ''}); paper: {S['hardware']}",
    "prompt wording: this project's own (docs/paper.md fixes the structure, fields and tags, not the words)",
]
for flag, what in (("max_steps", "steps"), ("history", "history"), ("temperature", "temperature"),
                   ("max_new_tokens", "response tokens"), ("max_prompt_tokens", "prompt tokens")):
    if getattr(args, flag) != PAPER[flag]:
        differences.append(f"{what}: this run {getattr(args, flag)}; paper {PAPER[flag]}")
sizes = P.get("eval_sizes", {})  # the paper's task count per split, where docs/paper.md states it
if any(len(games[s]) != sizes.get(s) for s in splits) or splits != P["eval_splits"]:
    differences.append(f"data: this run {', '.join(f'{s} {len(games[s])} games' for s in splits)}"
                       + (f" (a seeded subset, seed {args.seed})" if args.limit else "")
                       + "; paper: " + (", ".join(f"all {n} {s}" for s, n in sizes.items()) + " games" if sizes
                                        else "see docs/paper.md"))
if args.invalid_fallback:
    differences.append(f"invalid-step fallback action: this run '{args.invalid_fallback}'; paper: not stated")
unknown = [f"samples per game: this run {args.samples}; paper: not stated in docs/paper.md (see the notes in "
           "common/paper_results.json)",
           "inference engine and its sampling defaults: not stated in docs/paper.md (this run: temperature only, "
           "top_p 1, top_k off)"]

report = {"model": args.model, "backend": args.backend, "paper_backbone": backbone, "backbone_inferred": inferred,
          "settings": {k: getattr(args, k) for k in PAPER}, "samples": args.samples, "seed": args.seed,
          "splits": results, "paper_rows": paper_rows, "differences": differences, "unknown_conditions": unknown,
          "trajectories": traj_path, "manifest": manifest_path, "git": manifest["git"],
          "elapsed_s": round(time.time() - t_start, 1), "timings_s": {k: round(v, 1) for k, v in timings.items()},
          "env": {k: env_stats.get(k) for k in ("steps", "env_failures", "workers_replaced")}}
with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(report, f, indent=2)

# ---- Markdown: one table per split, this run above the paper's rows; then the conditions and sources
md = [f"# {env.NAME} evaluation: `{args.model}`", "",
      f"Plain prompt (no skill, no analyzer), temperature {args.temperature}, {args.max_steps} steps, history "
      f"{args.history}, {args.samples} sample(s) per game, seed {args.seed}; commit "
      f"{(manifest['git']['commit'] or '?')[:10]}{' (dirty)' if manifest['git']['dirty'] else ''}. Success in %. "
      "**Avg** is the mean over task types (the paper's average success: its SEED 3B per-type numbers average to "
      "its 91.8); **All** is the rate over all episodes. Score: the mean final score in % (WebShop's partial "
      "credit; for the other envs it equals success). Length in steps; invalid % and inadmissible % of steps "
      "(inadmissible: a well-formed action the env does not offer; it is valid under the public rule).", ""]
sources = []
for s in splits:
    r = results[s]
    sc = r["success_pct"]
    md += [f"## {s}: {r['games']} games x {r['samples']} sample(s) = {r['episodes']} episodes"
           f" ({r['env_failures']} env failures, excluded)", "",
           "| | " + " | ".join(COLUMNS) + " | score % | length | invalid % | inadmissible % |",
           "|---" * (len(COLUMNS) + 5) + "|",
           "| **this run** | " + " | ".join(cell(sc[c]["mean"]) for c in COLUMNS)
           + f" | {cell(r['score_pct']['All'])} | {cell(r['episode_length']['All'])} | "
           f"{cell(r['invalid_action_pct']['All'])} | {cell(r['inadmissible_action_pct']['All'])} |"]
    if args.samples > 1:
        md.append("| 95% interval (t, over samples) | " + " | ".join(
            "-" if sc[c]["ci95"] is None else f"{sc[c]['ci95'][0]:.1f}-{sc[c]['ci95'][1]:.1f}" for c in COLUMNS)
            + " | | | | |")
    md.append("| episodes | " + " | ".join(str(sc[c]["episodes"]) for c in COLUMNS) + " | | | | |")
    rows = {}
    for pr in paper_rows:
        if pr["split"] == s:
            col = "score" if pr["metric"] == "score" else "Avg" if pr["type"] == "Average" else pr["type"]
            rows.setdefault(pr["method"], {})[col] = pr["value"]
            if pr["source"] not in sources:
                sources.append(pr["source"])
    for method, vals in rows.items():
        md.append(f"| paper: {backbone} {method} | " + " | ".join(cell(vals.get(c)) for c in COLUMNS)
                  + f" | {cell(vals.get('score'))} | - | - | - |")
    if not rows:
        md.append(f"| paper: {backbone} | " + " | ".join("-" for _ in COLUMNS) + " | - | - | - | - |")
        md += ["", f"docs/paper.md states no {s} number for {backbone}."]
    if len(r["types_present"]) < len(env.GROUPS):
        md += ["", f"This run's Avg is over the {len(r['types_present'])} task types present "
               f"({', '.join(r['types_present'])}), not all {len(env.GROUPS)}."]
    md.append("")
other = [pr for pr in paper_rows if pr["split"] is None]
if other:
    md += [f"Other paper numbers for {backbone} ({env.NAME}, split not stated in docs/paper.md): "
           + "; ".join(f"{pr['method']} {pr['metric']} {pr['value']}" for pr in other) + ".", ""]
    sources += [src for src in dict.fromkeys(pr["source"] for pr in other) if src not in sources]
md += ["## Conditions that differ from the paper", ""] + [f"- {d}" for d in differences]
md += ["", "Not known (docs/paper.md does not state them):", ""] + [f"- {u}" for u in unknown]
md += ["", "## Sources of the paper's numbers", "", f"From `common/paper_results.json` ({PAPER_RESULTS['paper']}):", ""]
md += [f"- {src}" for src in sources]
md += ["", f"Trajectories: `{traj_path}`; manifest: `{manifest_path}`.", ""]
with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write("\n".join(md))
print(f"wrote {os.path.join(args.out, 'results.md')} and results.json; {len(todo)} episodes played in "
      f"{time.time() - t_start:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in timings.items() if v) or 'nothing to play'})")
