"""The training report of seed_rl.py runs: one figure per metric family, one line per run, and the numbers
behind every curve in report.md (evaluate.py --report calls `write_report`).

One curve per (metric, run); the reading guide asks for success rate, episode length, OPD loss and gate
statistics, KL, teacher coverage and the invalid-action rate per update. Env-agnostic: the per-group success
panel takes whatever `rollout/success/<group>` keys the runs logged (ALFWorld's task types, Search's sources).
"""
import json
import math
import os
import sys

from common.records import read_jsonl


def cell(x, digits=1):
    """x with `digits` decimals; a value too small for them in scientific notation (an OPD loss of 5e-05 is
    not "0.0000")."""
    if x is None:
        return "-"
    return f"{x:.2e}" if x != 0 and abs(x) < 10 ** (1 - digits) else f"{x:.{digits}f}"


# metrics that are rates (shares of episodes, steps or tokens): drawn on a fixed 0-1 axis, so a flat curve at
# 0.02 does not fill the panel as if it moved
RATES = ("rollout/success_rate", "rollout/success/", "heldout/", "rollout/invalid_rate", "rollout/inadmissible_rate",
         "rollout/truncated_rate", "skill/parse_rate", "opd/teacher_coverage", "opd/gate_mean",
         "opd/gate_active_ratio", "pg/clipfrac")
# one look per run (line style, marker, hollow or filled), so where two runs coincide both stay visible
STYLES = [dict(linestyle="-", marker="o", markersize=7, markerfacecolor="none"),
          dict(linestyle="--", marker="s", markersize=4),
          dict(linestyle=":", marker="^", markersize=6, markerfacecolor="none"),
          dict(linestyle="-.", marker="x", markersize=5)]


FIGURES = [  # (file stem, title, [metric keys], one panel per key)
    ("success", "Success rate of the training rollouts", ["rollout/success_rate", "rollout/return_mean"]),
    ("success_per_group", "Success rate per task type / data source", None),  # keys: from the runs
    # drawn only for runs with --eval-every (heldout.jsonl beside metrics.jsonl); x = updates done (0: the start)
    ("heldout", "Held-out tasks, plain prompt (seed_rl.py --eval-every)", ["heldout/success_rate",
                                                                          "heldout/invalid_rate"]),
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



def heldout_series(path):
    """seed_rl.py's heldout.jsonl -> {heldout/success_rate, heldout/invalid_rate: [(updates done, value)]} over
    the episodes without an env failure (a point replayed on resume: each episode once)."""
    points = {}
    for r in read_jsonl(path) if os.path.isfile(path) else []:
        if isinstance(r, dict) and not r.get("env_failure"):
            points.setdefault(r["update"], {})[r["uid"]] = r
    out = {}
    for u, eps in sorted(points.items()):
        steps = [st for ep in eps.values() for st in ep["steps"]]
        won = sum(bool(ep["success"]) for ep in eps.values())
        out.setdefault("heldout/success_rate", []).append((u, won / len(eps)))
        if steps:
            out.setdefault("heldout/invalid_rate", []).append((u, sum(not st["valid"] for st in steps) / len(steps)))
    return out


def write_report(paths, out, smooth=1):
    """paths: seed_rl.py run dirs or metrics.jsonl files (each labeled by its directory); writes report.md,
    report.json and the figures into `out`."""
    os.makedirs(out, exist_ok=True)
    notes = []
    try:  # optional: without matplotlib the report is text-only
        import matplotlib
        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        plt = None
        notes.append("matplotlib is not installed: this report is text-only (no figures). "
                     "`pip install matplotlib` (requirements.txt) and re-run for the PNG files.")

    # ---- read the runs: label = the run's directory name
    runs = []
    for path in paths:
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
        series.update(heldout_series(os.path.join(os.path.dirname(file), "heldout.jsonl")))
        if skipped:
            notes.append(f"{label}: {skipped} lines of {file} are not JSON objects (skipped)")
        updates = max((x for pts in series.values() for x, _ in pts), default=0)
        runs.append({"label": label, "file": file, "series": series, "updates": int(updates)})
        print(f"report: {label}: {updates:.0f} updates from {file}")

    def moving_average(ys, w):
        """Trailing moving average (window w; the first points average what exists)."""
        return [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]

    def tail_mean(pts, n=10):
        return sum(y for _, y in pts[-n:]) / len(pts[-n:]) if pts else None

    # ---- one PNG per figure, one panel per metric, one line per run
    groups = sorted({k for r in runs for k in r["series"] if k.startswith("rollout/success/")},
                    key=lambda k: min(list(r["series"]).index(k) for r in runs if k in r["series"]))
    figures = []
    for stem, title, keys in FIGURES:
        if stem == "heldout" and not any(k in r["series"] for r in runs for k in keys):
            continue  # no run evaluated held-out tasks
        keys = groups if keys is None else keys
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
                for i, r in enumerate(runs):
                    pts = r["series"].get(pn["key"])
                    if not pts:
                        continue
                    xs, ys = [x for x, _ in pts], [y for _, y in pts]
                    style = dict(STYLES[i % len(STYLES)])
                    if len(xs) >= 30:  # markers would hide the line; the line style still tells the runs apart
                        style.pop("marker"), style.pop("markerfacecolor", None)
                    if smooth > 1:  # raw points faint, the moving average on top
                        line, = ax.plot(xs, ys, alpha=0.25, linewidth=0.8, linestyle=style["linestyle"])
                        ax.plot(xs, moving_average(ys, smooth), color=line.get_color(), label=r["label"], **style)
                    else:
                        ax.plot(xs, ys, label=r["label"], **style)
                if not pn["drawn"]:
                    ax.text(0.5, 0.5, "no data in any run", ha="center", va="center", transform=ax.transAxes)
                if pn["key"].startswith(RATES):
                    ax.set_ylim(-0.03, 1.03)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # updates are whole numbers
                ax.set_title(pn["key"], fontsize=9)
                ax.set_xlabel("update", fontsize=8)
                ax.tick_params(labelsize=7)
                ax.grid(alpha=0.3)
                if pn["drawn"]:
                    ax.legend(fontsize=7)
            for ax in list(axes.flat)[len(panels):]:
                ax.axis("off")
            fig.suptitle(title + (f" (moving average over {smooth} updates)" if smooth > 1 else ""),
                         fontsize=10)
            fig.tight_layout()
            fig_rec["file"] = stem + ".png"
            fig.savefig(os.path.join(out, fig_rec["file"]), dpi=110)
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
            fig.savefig(os.path.join(out, rec["file"]), dpi=110)
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
        md += [f"| {g['label']} | {g['examples']} | {g['tokens']} | {cell(g['mean'], 4)} | {cell(g['p05'], 3)} | "
               f"{cell(g['median'], 4)} | {cell(g['p95'], 3)} | {cell(g['positive'], 3)} |" for g in gaps]
        md.append("")
    if notes:
        md += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"matplotlib": plt is not None, "smooth": smooth,
                   "runs": [{k: r[k] for k in ("label", "file", "updates")} for r in runs],
                   "figures": figures, "gaps": gaps, "notes": notes}, f, indent=2)
    print(f"report: {sum(1 for fr in figures if fr['file'])} figures, {os.path.join(out, 'report.md')}"
          + ("" if plt is not None else " (text-only: matplotlib is not installed)"))

