"""Deployment-time evaluation on ALFWorld, the training report, and the data manifest.

Evaluation is what the paper reports: the policy plays valid_seen (140 games, in-distribution) and
valid_unseen (134 games, out-of-distribution) with the PLAIN prompt: no skill, no analyzer, no skill bank
(SEED's skills are training-time tools only). Temperature 0.4, 30 steps, the last 5 history entries.

    # 1 GPU (vLLM): all 274 games, the paper's settings; 4 samples per game for a mean and a 95% interval
    python evaluate.py --model runs/seed/final --backend vllm --samples 4 --out runs/eval/seed
    # 8 GPUs: evaluation is small (274 games x 30 steps); one GPU is enough for a 3B/7B model. A model
    # that does not fit one GPU is split over several with tensor parallelism:
    python evaluate.py --model Qwen/Qwen2.5-7B-Instruct --backend vllm --tp 8 --out runs/eval/qwen7b
    # CPU demo: the scripted expert and a tiny random model, on a seeded type-stratified subset
    python evaluate.py --model expert --limit 12 --out runs/demo/eval-expert
    python evaluate.py --model tiny --limit 6 --max-steps 3 --max-new-tokens 16 --out runs/demo/eval-tiny

    # training dynamics of seed_rl.py runs (each labeled by its directory), e.g. GRPO beside SEED
    python evaluate.py --report runs/grpo runs/seed --out runs/report
    # the paper preset's data: the Stage 1 task set and the RL task stream, counts and sha256
    python evaluate.py --data-manifest

Outputs of an evaluation (in --out): results.json and results.md (per split: success per task type in the
paper's order, mean episode length, invalid-action rate, beside the paper's numbers for the same backbone and
the list of conditions that differ), trajectories.jsonl (every episode, the format of collect.py;
append-only: a killed run restarts where it stopped) and manifest.json (envs/records.py).
"""
import argparse
import json
import math
import os
import sys
import time

from envs.alfworld import TASK_TYPES, TYPE_ORDER, rl_task_stream, select_games
from envs.records import (append_jsonl, games_summary, open_jsonl_for_append, read_jsonl, run_manifest,
                          write_manifest)

REPO = os.path.dirname(os.path.abspath(__file__))
PAPER_FILE = os.path.join(REPO, "envs", "paper_results.json")
with open(PAPER_FILE) as f:
    PAPER_RESULTS = json.load(f)  # the paper's numbers, each with its source (only what SPEC.md states)
S = {k: v["value"] for k, v in PAPER_RESULTS["settings"].items()}

# The paper's evaluation settings; argparse defaults equal these and the manifest diffs the run against them.
PAPER = dict(env="alfworld", splits=",".join(S["eval_splits"]), limit=None, temperature=S["temperature"],
             max_steps=S["max_steps"], history=S["history"], max_new_tokens=S["max_new_tokens"],
             max_prompt_tokens=S["max_prompt_tokens"])
COLUMNS = TYPE_ORDER + ["Avg", "All"]  # Avg: mean over task types (the paper's average); All: over episodes

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--env", default=PAPER["env"], choices=["alfworld"])
p.add_argument("--model", help="HF path or hub id | tiny | expert")
p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
p.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size (GPUs per engine)")
p.add_argument("--splits", default=PAPER["splits"], help="comma-separated: valid_seen,valid_unseen[,train]")
p.add_argument("--limit", type=int, default=PAPER["limit"],
               help="games per split: a seeded subset that takes the task types in turn, so every type is present")
p.add_argument("--samples", type=int, default=1, help="episodes per game; >1 reports the mean and a 95%% interval")
p.add_argument("--temperature", type=float, default=PAPER["temperature"])
p.add_argument("--max-steps", type=int, default=PAPER["max_steps"])
p.add_argument("--history", type=int, default=PAPER["history"])
p.add_argument("--max-new-tokens", type=int, default=PAPER["max_new_tokens"])
p.add_argument("--max-prompt-tokens", type=int, default=PAPER["max_prompt_tokens"])
p.add_argument("--invalid-fallback", default=None, help="action executed when a response has no action tags")
p.add_argument("--paper-backbone", default="auto", help="paper rows to compare with: auto (from the model's "
               "name or config) | Qwen2.5-3B-Instruct | Qwen2.5-7B-Instruct | Qwen3-1.7B")
p.add_argument("--seed", type=int, default=0, help="game subset (--limit) and sampling")
p.add_argument("--batch-episodes", type=int, default=128, help="episodes played together (one generate call per step)")
p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="env worker processes")
p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
p.add_argument("--report", nargs="+", metavar="RUN", help="seed_rl.py run dirs or metrics.jsonl files: draw "
               "the training curves instead of evaluating")
p.add_argument("--smooth", type=int, default=1, help="--report: moving-average window over updates (1: raw)")
p.add_argument("--data-manifest", action="store_true", help="print the paper preset's Stage 1 set and RL task "
               "stream (counts per type, sha256) instead of evaluating")
p.add_argument("--out", help="output folder")
args = p.parse_args()


def pct(x):
    return None if x is None else round(100.0 * x, 2)


def cell(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


# ===================================================================================================
# Mode 1: the data manifest of the paper preset (Table 3: SFT 180 tasks x 8 rollouts; RL 2,400 instances)
if args.data_manifest:
    stage1 = select_games("train", args.seed, tasks_per_type=S["sft_tasks_per_type"])
    stream = rl_task_stream(args.seed, S["rl_tasks_per_update"], S["rl_updates"])
    s1, rl = games_summary(stage1), games_summary(stream)
    n_traj = len(stage1) * S["sft_rollouts"]
    print(f"data manifest, paper preset, seed {args.seed}")
    print(f"{'type':<6} {'stage1 tasks':>12} {'x' + str(S['sft_rollouts']) + ' trajectories':>16} {'RL stream':>10}")
    for t, name in TASK_TYPES.items():
        print(f"{name:<6} {s1['per_type'].get(t, 0):>12} {s1['per_type'].get(t, 0) * S['sft_rollouts']:>16} "
              f"{rl['per_type'].get(t, 0):>10}")
    print(f"{'total':<6} {s1['count']:>12} {n_traj:>16} {rl['count']:>10}")
    overlap = len({g["task_id"] for g in stage1} & {g["task_id"] for g in stream})
    print(f"stage 1 set : splits {s1['per_split']}, {s1['unique']} distinct, game-list sha256 {s1['sha256']}")
    print(f"RL stream   : splits {rl['per_split']}, {rl['unique']} distinct, game-list sha256 {rl['sha256']} "
          f"({S['rl_tasks_per_update']} tasks x {S['rl_updates']} updates; {overlap} of its games are also in "
          f"the stage 1 set)")
    # Checks against the paper's Table 3 (as SPEC.md states it)
    checks = {
        f"stage 1 tasks = {6 * S['sft_tasks_per_type']} ({S['sft_tasks_per_type']} per type)":
            s1["count"] == 6 * S["sft_tasks_per_type"] and
            all(s1["per_type"].get(t) == S["sft_tasks_per_type"] for t in TASK_TYPES),
        f"stage 1 trajectories = {6 * S['sft_tasks_per_type'] * S['sft_rollouts']}":
            n_traj == 6 * S["sft_tasks_per_type"] * S["sft_rollouts"],
        f"RL task instances = {S['rl_task_instances']}": rl["count"] == S["rl_task_instances"],
        # the split as the game file's own folder says (task ids are '<split>/<task>/<trial>'), not a label
        "every game from the train split": {g["task_id"].split("/")[0] for g in stage1 + stream} == {"train"},
    }
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if args.out:
        manifest = {"seed": args.seed, "paper_preset": {k: S[k] for k in ("sft_tasks_per_type", "sft_rollouts",
                    "rl_tasks_per_update", "rl_updates", "rl_task_instances")},
                    "stage1": dict(s1, trajectories=n_traj, task_ids=[g["task_id"] for g in stage1]),
                    "rl_stream": dict(rl, overlap_with_stage1=overlap, task_ids=[g["task_id"] for g in stream]),
                    "checks": checks}
        write_manifest(os.path.join(args.out, "data_manifest.json"), manifest)
        print(f"wrote {os.path.join(args.out, 'data_manifest.json')}")
    sys.exit(0 if all(checks.values()) else 1)

# ===================================================================================================
# Mode 2: the training report. One curve per (metric, run); the reading guide asks for success rate,
# episode length, OPD loss and gate statistics, KL, teacher coverage and the invalid-action rate per update.
FIGURES = [  # (file stem, title, [metric keys], one panel per key)
    ("success", "Success rate of the training rollouts", ["rollout/success_rate", "rollout/return_mean"]),
    ("success_per_type", "Success rate per task type", [f"rollout/success/{t}" for t in TYPE_ORDER]),
    ("episode_length", "Episode length (steps)", ["rollout/episode_length"]),
    ("invalid_rate", "Invalid-action rate", ["rollout/invalid_rate"]),
    ("opd_loss", "OPD loss", ["loss/opd"]),
    ("opd_gate", "OPD gate statistics", ["opd/gate_mean", "opd/gate_active_ratio", "opd/teacher_gap_mean"]),
    ("kl", "KL to the reference (k3)", ["loss/kl"]),
    ("teacher_coverage", "Teacher coverage and skill parse rate", ["opd/teacher_coverage", "skill/parse_rate"]),
    ("optimization", "Policy loss, total loss, clip fraction, grad norm",
     ["loss/pg", "loss/total", "pg/clipfrac", "grad_norm"]),
    ("time", "Seconds per update and phase", ["time/update", "time/generate", "time/env", "time/analysis",
                                               "time/scoring", "time/train", "time/sync"]),
]


def number(v):
    """A finite float, or None (null, missing, NaN, a string, a bool: not a point of a curve)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


if args.report:
    if not args.out:
        sys.exit("--report needs --out")
    os.makedirs(args.out, exist_ok=True)
    notes = []
    try:  # optional: without matplotlib the report is text-only
        import matplotlib
        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
        notes.append("matplotlib is not installed: this report is text-only (no figures). "
                     "`pip install matplotlib` (requirements.txt) and re-run for the PNG files.")

    # ---- read the runs: label = the run's directory name
    runs = []
    for path in args.report:
        file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            sys.exit(f"--report: no metrics file at {file}")
        label = os.path.basename(os.path.dirname(os.path.abspath(file))) or file
        while label in [r["label"] for r in runs]:
            label += "'"
        series, skipped = {}, 0
        for n, rec in enumerate(read_jsonl(file)):
            if not isinstance(rec, dict):
                skipped += 1
                continue
            x = number(rec.get("update"))
            x = n + 1 if x is None else x
            for k, v in rec.items():
                if number(v) is not None:
                    series.setdefault(k, []).append((x, number(v)))
        if skipped:
            notes.append(f"{label}: {skipped} lines of {file} are not JSON objects (skipped)")
        updates = max((x for pts in series.values() for x, _ in pts), default=0)
        runs.append({"label": label, "file": file, "series": series, "updates": int(updates)})
        print(f"report: {label}: {updates:.0f} updates from {file}")

    def smooth(ys, w):
        """Trailing moving average (window w; the first points average what exists)."""
        return [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]

    def tail_mean(pts, n=10):
        return sum(y for _, y in pts[-n:]) / len(pts[-n:]) if pts else None

    # ---- one PNG per figure, one panel per metric, one line per run
    figures = []
    for stem, title, keys in FIGURES:
        panels = []
        for key in keys:
            drawn = {r["label"]: len(r["series"][key]) for r in runs if r["series"].get(key)}
            missing = [r["label"] for r in runs if not r["series"].get(key)]
            if missing:
                notes.append(f"{key}: no values (null or missing) in {', '.join(missing)}"
                             + (" (a GRPO run has no OPD/skill metrics)" if key.startswith(("opd/", "skill/", "loss/opd"))
                                else ""))
            panels.append({"key": key, "drawn": drawn, "missing": missing})
        fig_rec = {"file": None, "title": title, "panels": panels}
        if plt is not None and any(pn["drawn"] for pn in panels):
            ncols = min(3, len(keys))
            nrows = math.ceil(len(keys) / ncols)
            fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.2 * nrows), squeeze=False)
            for ax, pn in zip(axes.flat, panels):
                for r in runs:
                    pts = r["series"].get(pn["key"])
                    if not pts:
                        continue
                    xs, ys = [x for x, _ in pts], [y for _, y in pts]
                    if args.smooth > 1:  # raw points faint, the moving average on top
                        line, = ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
                        ax.plot(xs, smooth(ys, args.smooth), color=line.get_color(), label=r["label"])
                    else:
                        ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=r["label"])
                if not pn["drawn"]:
                    ax.text(0.5, 0.5, "no data in any run", ha="center", va="center", transform=ax.transAxes)
                ax.set_title(pn["key"], fontsize=9)
                ax.set_xlabel("update", fontsize=8)
                ax.tick_params(labelsize=7)
                ax.grid(alpha=0.3)
                if pn["drawn"]:
                    ax.legend(fontsize=7)
            for ax in list(axes.flat)[len(panels):]:
                ax.axis("off")
            fig.suptitle(title + (f" (moving average over {args.smooth} updates)" if args.smooth > 1 else ""),
                         fontsize=10)
            fig.tight_layout()
            fig_rec["file"] = stem + ".png"
            fig.savefig(os.path.join(args.out, fig_rec["file"]), dpi=110)
            plt.close(fig)
        elif plt is not None:
            notes.append(f"{stem}.png not drawn: none of {', '.join(keys)} has a value in any run")
        figures.append(fig_rec)

    # ---- the signal itself: the same sampled tokens scored under the plain and the skill prompt
    #      (seed_rl.py dumps examples.jsonl beside metrics.jsonl: plain_lp, teacher_lp, gap per token)
    gaps = []
    for r in runs:
        ex_file = os.path.join(os.path.dirname(r["file"]), "examples.jsonl")
        exs = [e for e in read_jsonl(ex_file) if isinstance(e, dict) and e.get("gap")] if os.path.isfile(ex_file) else []
        if not exs:
            continue
        plain = [x for e in exs for x in e["plain_lp"]]
        teach = [x for e in exs for x in e["teacher_lp"]]
        gap = sorted(x for e in exs for x in e["gap"])
        q = lambda f: gap[min(len(gap) - 1, int(f * len(gap)))]
        rec = {"label": r["label"], "examples": len(exs), "tokens": len(gap), "mean": sum(gap) / len(gap),
               "p05": q(0.05), "median": q(0.5), "p95": q(0.95), "positive": sum(g > 0 for g in gap) / len(gap),
               "file": None}
        if plt is not None:
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
            a1.hist(gap, bins=60, color="tab:blue")
            a1.set_title("gap = teacher_lp - plain_lp per token", fontsize=9)
            a1.set_yscale("log")
            a2.scatter(plain, teach, s=3, alpha=0.4)
            lo = min(plain + teach)
            a2.plot([lo, 0], [lo, 0], color="gray", linewidth=0.8)
            a2.set_xlabel("plain-prompt log-prob", fontsize=8)
            a2.set_ylabel("skill-prompt log-prob", fontsize=8)
            a2.set_title("same sampled tokens, two contexts", fontsize=9)
            fig.suptitle(f"{r['label']}: {len(gap)} response tokens of {len(exs)} dumped steps", fontsize=10)
            fig.tight_layout()
            rec["file"] = f"gap_{r['label']}.png"
            fig.savefig(os.path.join(args.out, rec["file"]), dpi=110)
            plt.close(fig)
        gaps.append(rec)

    # ---- Markdown: runs, figures, and the numbers behind every curve (the whole report when text-only)
    md = ["# Training report", "", f"Runs (labeled by directory): {', '.join(r['label'] for r in runs)}. "
          "Metrics per update from seed_rl.py's metrics.jsonl; 'last 10' is the mean of the last 10 updates "
          "that have the metric.", ""]
    md += ["| run | updates | success (last 10) | best success | episode length (last 10) | invalid rate (last 10) "
           "| OPD loss (last 10) | file |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        sr = r["series"]
        best = max((y for _, y in sr.get("rollout/success_rate", [])), default=None)
        md.append(f"| {r['label']} | {r['updates']} | {cell(tail_mean(sr.get('rollout/success_rate')), 3)} | "
                  f"{cell(best, 3)} | {cell(tail_mean(sr.get('rollout/episode_length')), 2)} | "
                  f"{cell(tail_mean(sr.get('rollout/invalid_rate')), 3)} | {cell(tail_mean(sr.get('loss/opd')), 4)} | "
                  f"`{r['file']}` |")
    md.append("")
    if plt is None:
        md += ["**Text-only report**: " + notes[0], ""]
    for fig_rec in figures:
        md += [f"## {fig_rec['title']}", ""]
        if fig_rec["file"]:
            md += [f"![{fig_rec['title']}]({fig_rec['file']})", ""]
        md += ["| metric | run | points | first | last | min | max | last 10 |", "|---|---|---|---|---|---|---|---|"]
        for pn in fig_rec["panels"]:
            for r in runs:
                pts = r["series"].get(pn["key"], [])
                ys = [y for _, y in pts]
                md.append(f"| `{pn['key']}` | {r['label']} | {len(pts)} | " + (" | ".join(
                    cell(v, 4) for v in (ys[0], ys[-1], min(ys), max(ys), tail_mean(pts))) if pts else
                    "- | - | - | - | - (no values)") + " |")
        md.append("")
    if gaps:
        md += ["## Plain vs skill-context scores of the same sampled tokens (examples.jsonl)", ""]
        md += [f"![gap {g['label']}]({g['file']})" for g in gaps if g["file"]] + [""]
        md += ["| run | steps | tokens | mean gap | p05 | median | p95 | gap > 0 (= gate > 0.5) |",
               "|---|---|---|---|---|---|---|---|"]
        md += [f"| {g['label']} | {g['examples']} | {g['tokens']} | {g['mean']:.4f} | {g['p05']:.3f} | "
               f"{g['median']:.4f} | {g['p95']:.3f} | {g['positive']:.3f} |" for g in gaps]
        md.append("")
    if notes:
        md += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump({"matplotlib": plt is not None, "smooth": args.smooth,
                   "runs": [{k: r[k] for k in ("label", "file", "updates")} for r in runs],
                   "figures": figures, "gaps": gaps, "notes": notes}, f, indent=2)
    print(f"report: {sum(1 for fr in figures if fr['file'])} figures, {os.path.join(args.out, 'report.md')}"
          + ("" if plt is not None else " (text-only: matplotlib is not installed)"))
    sys.exit(0)

# ===================================================================================================
# Mode 3 (the default): evaluation. Plan: the deterministic list of episodes, minus those already written.
if not args.model or not args.out:
    sys.exit("evaluation needs --model and --out (or use --report / --data-manifest)")
import torch  # noqa: E402  (here: --report and --data-manifest run without torch)
from tqdm import tqdm  # noqa: E402

from envs.backends import ExpertPolicy, HFBackend, VLLMBackend, load_model, load_tokenizer  # noqa: E402
from envs.pool import EnvPool  # noqa: E402
from envs.rollout import format_summary, play_episodes, summarize_episodes  # noqa: E402

splits = [s.strip() for s in args.splits.split(",") if s.strip()]
if args.samples < 1 or (args.limit is not None and args.limit < 1):
    sys.exit("--samples and --limit must be >= 1")
if args.tp > 1 and (args.backend != "vllm" or args.model == "expert"):
    sys.exit("--tp (tensor parallelism) needs --backend vllm and a model")
if not splits or not set(splits) <= {"train", "valid_seen", "valid_unseen"}:
    sys.exit(f"--splits {args.splits!r}: expected a comma-separated subset of valid_seen,valid_unseen,train")
if args.paper_backbone not in ["auto"] + S["backbones"]:
    sys.exit(f"--paper-backbone {args.paper_backbone!r}: expected auto or one of {S['backbones']}")


def eval_games(split, limit, seed):
    """All games of the split (sorted), or `limit` of them: seeded picks of each type taken in turn
    (Pick, Look, Clean, Heat, Cool, Pick2, Pick, ...) so a small subset still covers every type."""
    if limit is None:
        return select_games(split, seed)
    by_type = {}
    for g in select_games(split, seed, tasks_per_type=math.ceil(limit / len(TASK_TYPES))):
        by_type.setdefault(g["task_type"], []).append(g)
    out = []
    for i in range(max(map(len, by_type.values()))):
        out += [by_type[t][i] for t in TASK_TYPES if i < len(by_type.get(t, []))]
    return out[:limit]


games = {s: eval_games(s, args.limit, args.seed) for s in splits}
plan = [dict(g, uid=f"{g['task_id']}#s{k}", group=gi, rollout=k, sample=k, seed=args.seed)
        for s in splits for gi, g in enumerate(games[s]) for k in range(args.samples)]

os.makedirs(args.out, exist_ok=True)
traj_path, manifest_path = os.path.join(args.out, "trajectories.jsonl"), os.path.join(args.out, "manifest.json")
tokenizer = load_tokenizer(args.model)
manifest = run_manifest("evaluate.py", args, paper=PAPER, model=args.model, tokenizer=tokenizer, split=splits,
                        games=[g for s in splits for g in games[s]], seeds={"seed": args.seed},
                        extra={"games_per_split": {s: games_summary(games[s]) for s in splits}})
KEY = ("env", "model", "splits", "limit", "samples", "seed", "temperature", "max_steps", "history",
       "max_new_tokens", "max_prompt_tokens", "invalid_fallback")
if os.path.exists(manifest_path):  # resuming: refuse to mix two different evaluations in one folder
    with open(manifest_path) as f:
        old = json.load(f)["args"]
    diff = {k: (old.get(k), getattr(args, k)) for k in KEY if old.get(k) != getattr(args, k)}
    if diff:
        sys.exit(f"{args.out} holds an evaluation with other settings {diff}; use another --out")
write_manifest(manifest_path, manifest)

done_ids = {ep["uid"] for ep in read_jsonl(traj_path)}
todo = [e for e in plan if e["uid"] not in done_ids]
print(f"evaluate: {', '.join(f'{s} {len(games[s])} games' for s in splits)} x {args.samples} samples = "
      f"{len(plan)} episodes; {len(plan) - len(todo)} already in {traj_path}, {len(todo)} to play")

# ---------------------------------------------------------------------------------------------------
# Policy: scripted expert, HF generate, or vLLM. The plain prompt only: no skill at deployment.
if todo:
    if args.model == "expert":
        policy = ExpertPolicy(tokenizer)
    elif args.backend == "vllm":
        policy = VLLMBackend(args.model, tokenizer, max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                             gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                             enable_sleep_mode=False, tensor_parallel_size=args.tp)
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        policy = HFBackend(load_model(args.model, dtype=dtype, device=device, seed=args.seed), tokenizer)

# ---------------------------------------------------------------------------------------------------
# Play in batches; append each episode as soon as its batch ends (samples depend only on (seed, uid, step))
t_start, timings, env_stats = time.time(), {}, {"steps": 0, "env_failures": 0, "workers_replaced": 0}
if todo:
    out = open_jsonl_for_append(traj_path)
    bar = tqdm(total=len(todo), desc="episodes", unit="ep")
    with EnvPool("envs.alfworld:make_alfworld_game", num_workers=min(args.workers, len(todo))) as pool:
        for b in range(0, len(todo), args.batch_episodes):
            batch = todo[b:b + args.batch_episodes]

            def show(done, total, start=b):  # the bar moves as episodes of the batch end, step by step
                bar.n = start + done
                bar.refresh()

            episodes, tm = play_episodes(batch, pool, policy, tokenizer, max_steps=args.max_steps,
                                         history=args.history, max_prompt_tokens=args.max_prompt_tokens,
                                         max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                         invalid_fallback=args.invalid_fallback, progress=show)
            for k, v in tm.items():
                timings[k] = timings.get(k, 0.0) + v
            for ep in episodes:
                append_jsonl(out, ep)
            show(len(batch), len(batch))
        env_stats = dict(pool.stats)
    bar.close()
    out.close()

# ---------------------------------------------------------------------------------------------------
# Score: per split, success per type averaged over the samples (with a 95% interval when samples > 1),
# the type mean (the paper's "average success") and the rate over all episodes; length and invalid rate.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_ci(values):
    """Mean and the 95% Student-t interval of the mean over samples (None for one sample: no spread to
    measure). The interval covers the sampling noise of the policy (temperature 0.4) on these games."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, None
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    t = T975[n - 2] if n - 1 <= len(T975) else 1.96 + 2.5 / (n - 1)  # beyond the table: a close fit
    h = t * sd / math.sqrt(n)
    return m, [max(0.0, m - h), min(100.0, m + h)]


uids = {e["uid"] for e in plan}
records = [ep for ep in read_jsonl(traj_path) if ep["uid"] in uids]
results = {}
for s in splits:
    eps = [ep for ep in records if ep["split"] == s]
    overall = summarize_episodes(eps)
    per_sample = []  # one {column: success %} per sample
    for k in range(args.samples):
        summ = summarize_episodes([ep for ep in eps if ep["sample"] == k])
        row = {t: pct(summ[t]["success"]) for t in TYPE_ORDER + ["All"]}
        present = [row[t] for t in TYPE_ORDER if row[t] is not None]
        row["Avg"] = sum(present) / len(present) if present else None
        per_sample.append(row)
    success = {}
    for c in COLUMNS:
        vals = [row[c] for row in per_sample if row[c] is not None]
        m, ci = mean_ci(vals) if vals else (None, None)
        success[c] = {"mean": None if m is None else round(m, 2), "ci95": None if ci is None else
                      [round(v, 2) for v in ci], "per_sample": [row[c] for row in per_sample],
                      "episodes": overall[c]["episodes"] if c != "Avg" else overall["All"]["episodes"]}
    results[s] = {"games": len(games[s]), "samples": args.samples, "episodes": len(eps),
                  "env_failures": overall["env_failures"],
                  "types_present": [t for t in TYPE_ORDER if overall[t]["episodes"]],
                  "success_pct": success,
                  "episode_length": {c: overall[c]["length"] for c in TYPE_ORDER + ["All"]},
                  "invalid_action_pct": {c: pct(overall[c]["invalid_rate"]) for c in TYPE_ORDER + ["All"]},
                  "truncated_responses": sum(ep.get("truncated_responses", 0) for ep in eps),
                  "prompt_too_long": sum(bool(ep.get("prompt_too_long")) for ep in eps)}
    print(format_summary(overall, f"{s}: success per task type ({len(eps)} episodes)"))
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
paper_rows = [r for r in PAPER_RESULTS["results"] if r["env"] == "alfworld" and r["backbone"] == backbone]

hw = manifest["hardware"]
differences = [
    f"model: this run `{args.model}`" + (f" ({inferred} backbone)" if inferred else " (not one of the paper's "
    f"backbones; the rows shown are the paper's {backbone} rows, for reference)")
    + f"; paper: {backbone} after its GRPO / SEED training (150 updates on 8 x A800)",
    f"hardware: this run {', '.join(hw['gpus']) or 'CPU only'} ({args.backend if args.model not in ('expert',) else 'scripted'}"
    f"{f', tp {args.tp}' if args.tp > 1 else ''}); paper: {S['hardware']}",
    "prompt wording: this project's own (SPEC.md fixes the structure, fields and tags, not the words)",
]
for flag, what in (("max_steps", "steps"), ("history", "history"), ("temperature", "temperature"),
                   ("max_new_tokens", "response tokens"), ("max_prompt_tokens", "prompt tokens")):
    if getattr(args, flag) != PAPER[flag]:
        differences.append(f"{what}: this run {getattr(args, flag)}; paper {PAPER[flag]}")
data_diff = [f"{s} {len(games[s])} of {S['eval_games'].get(s, '?')} games" for s in splits
             if len(games[s]) != S["eval_games"].get(s)]
if data_diff or splits != S["eval_splits"]:
    differences.append(f"data: this run {', '.join(f'{s} {len(games[s])} games' for s in splits)}"
                       + (f" (a seeded type-stratified subset, seed {args.seed})" if args.limit else "")
                       + f"; paper: all {S['eval_games']['valid_seen']} valid_seen and "
                       f"{S['eval_games']['valid_unseen']} valid_unseen games")
if args.invalid_fallback:
    differences.append(f"invalid-step fallback action: this run '{args.invalid_fallback}'; paper: not stated")
unknown = [f"samples per game: this run {args.samples}; paper: not stated in SPEC.md (see the notes in "
           "envs/paper_results.json)",
           "inference engine and its sampling defaults: not stated in SPEC.md (this run: temperature only, "
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
md = [f"# ALFWorld evaluation: `{args.model}`", "",
      f"Plain prompt (no skill, no analyzer), temperature {args.temperature}, {args.max_steps} steps, history "
      f"{args.history}, {args.samples} sample(s) per game, seed {args.seed}; commit "
      f"{(manifest['git']['commit'] or '?')[:10]}{' (dirty)' if manifest['git']['dirty'] else ''}. Success in %. "
      "**Avg** is the mean over task types (the paper's average success: its SEED 3B per-type numbers average to "
      "its 91.8); **All** is the rate over all episodes. Length in steps; invalid % of steps.", ""]
sources = []
for s in splits:
    r = results[s]
    sc = r["success_pct"]
    md += [f"## {s}: {r['games']} games x {r['samples']} sample(s) = {r['episodes']} episodes"
           f" ({r['env_failures']} env failures, excluded)", "",
           "| | " + " | ".join(COLUMNS) + " | length | invalid % |", "|---" * (len(COLUMNS) + 3) + "|",
           "| **this run** | " + " | ".join(cell(sc[c]["mean"]) for c in COLUMNS)
           + f" | {cell(r['episode_length']['All'])} | {cell(r['invalid_action_pct']['All'])} |"]
    if args.samples > 1:
        md.append("| 95% interval (t, over samples) | " + " | ".join(
            "-" if sc[c]["ci95"] is None else f"{sc[c]['ci95'][0]:.1f}-{sc[c]['ci95'][1]:.1f}" for c in COLUMNS)
            + " | | |")
    md.append("| episodes | " + " | ".join(str(sc[c]["episodes"]) for c in COLUMNS) + " | | |")
    rows = {}
    for pr in paper_rows:
        if pr["split"] == s:
            rows.setdefault(pr["method"], {})["Avg" if pr["type"] == "Average" else pr["type"]] = pr["value"]
            if pr["source"] not in sources:
                sources.append(pr["source"])
    for method, vals in rows.items():
        md.append(f"| paper: {backbone} {method} | " + " | ".join(cell(vals.get(c)) for c in COLUMNS) + " | - | - |")
    if not rows:
        md.append(f"| paper: {backbone} | " + " | ".join("-" for _ in COLUMNS) + " | - | - |")
        md += ["", f"SPEC.md states no {s} number for {backbone}."]
    if len(r["types_present"]) < len(TYPE_ORDER):
        md += ["", f"This run's Avg is over the {len(r['types_present'])} task types present "
               f"({', '.join(r['types_present'])}), not all {len(TYPE_ORDER)}."]
    md.append("")
other = [pr for pr in paper_rows if pr["split"] is None]
if other:
    md += [f"Other paper numbers for {backbone} (ALFWorld, split not stated in SPEC.md): "
           + "; ".join(f"{pr['method']} {pr['value']}" for pr in other) + ".", ""]
    sources += [src for src in dict.fromkeys(pr["source"] for pr in other) if src not in sources]
md += ["## Conditions that differ from the paper", ""] + [f"- {d}" for d in differences]
md += ["", "Not known (SPEC.md does not state them):", ""] + [f"- {u}" for u in unknown]
md += ["", "## Sources of the paper's numbers", "", f"From `envs/paper_results.json` ({PAPER_RESULTS['paper']}):", ""]
md += [f"- {src}" for src in sources]
md += ["", f"Trajectories: `{traj_path}`; manifest: `{manifest_path}`.", ""]
with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write("\n".join(md))
print(f"wrote {os.path.join(args.out, 'results.md')} and results.json; {len(todo)} episodes played in "
      f"{time.time() - t_start:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in timings.items()) or 'nothing to play'})")
