"""The learning report: every kept run of results/learning/runs.jsonl, SEED beside GRPO, with honest intervals.

    python benchmarks/learning_report.py                      # results/learning -> results/learning/report/
    python benchmarks/learning_report.py --results-dir /tmp/learning-smoke --out /tmp/learning-smoke/report

Runs are pooled by group (env + config + start label, benchmarks/learning.py); groups are never mixed. Per group:
- per method and update, the mean over seeds and its 95% Student-t interval (n - 1 degrees of freedom);
- per update, the paired difference SEED - GRPO over the matched seeds (the seeds both methods ran: same task
  stream and sampling seeds, so update 1 plays the same episodes in both), its mean and 95% t-interval;
- per method, the change from the first to the last update of each run, and from the start to the end policy on
  the held-out tasks (plain prompt), each over seeds with its interval; SEED - GRPO at the end, paired;
- statements that say only what those intervals support (`difference_statement`, `change_statement`);
- figures (matplotlib; without it the report is text only), report.md and report.json.
Every kept run counts: to drop one, delete its line from runs.jsonl. `--exclude RUN_ID` leaves one out here.
"""
import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common.records import read_jsonl  # noqa: E402
from common.stats import bootstrap_mean_ci, mean_ci  # noqa: E402

# (key in the record's per-update rows, label): the curves; the first six also as SEED - GRPO differences
CURVES = [("invalid", "invalid-action rate"), ("inadmissible", "inadmissible-action rate"),
          ("return", "mean return"), ("success", "success rate (EM for Search)"), ("length", "episode length"),
          ("kl", "KL to the reference"), ("parse_rate", "skill parse rate"), ("teacher_coverage", "teacher coverage"),
          ("gate_mean", "OPD gate mean"), ("gate_active", "OPD gate active ratio")]
DIFFS = CURVES[:6]
RATES = {"invalid", "inadmissible", "success", "parse_rate", "teacher_coverage", "gate_mean", "gate_active"}
EVAL_KEYS = [("invalid", "invalid %"), ("inadmissible", "inadmissible %"), ("success", "success %"),
             ("score", "score %"), ("length", "episode length")]
METHOD_ORDER = ["seed", "grpo"]
LABEL = {"seed": "SEED", "grpo": "GRPO"}
LEVEL = 0.95


# ====================================================================================================
# Statistics (pure functions; tests/test_learning_report.py checks them against hand-computed values)

def paired(a, b):
    """a, b: {seed: value}. The seeds where both have a value, and the differences a - b, in seed order."""
    seeds = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None)
    return seeds, [a[s] - b[s] for s in seeds]


def task_means(per_task):
    """{task_id: [0/1 per sample]} -> {task_id: mean success}."""
    return {t: sum(v) / len(v) for t, v in (per_task or {}).items() if v}


def paired_bootstrap(a, b, n_boot=10_000, level=LEVEL, seed=0):
    """a, b: {task_id: value} (e.g. mean success of a policy on that held-out task). The tasks both hold, the
    mean of b - a over them (in %), and a percentile bootstrap interval that resamples the tasks with
    replacement: the two policies are compared on the same items, so task difficulty cancels. The interval
    covers the sampling of tasks and of episodes, not the variation between training runs (the seed intervals
    elsewhere cover that). Returns {n, mean, sd, lo, hi} like mean_ci (sd: of the per-task differences), and
    lower / higher: how many tasks b scored below / above a. A flat mean can hide many tasks lost and as many
    gained; between two evaluations of one policy, that many change by sampling alone."""
    tasks = sorted(t for t in a if t in b)
    ci = bootstrap_mean_ci([100.0 * (b[t] - a[t]) for t in tasks], level=level, n_boot=n_boot, seed=seed)
    return dict(ci, lower=sum(b[t] < a[t] for t in tasks), higher=sum(b[t] > a[t] for t in tasks))


def task_statement(who, what, ci):
    """The plain statement about a paired-by-task difference (percentage points): change_statement's rule."""
    return change_statement(who, what, ci, " points", none="fewer than 2 shared held-out tasks on file, nothing "
                            "can be said", over="task", interval="95% bootstrap interval")


def pooled_task_means(runs, which="end"):
    """Per held-out task, the `which` (end, or a run's own start: --eval-in-run) policies' success averaged over
    the runs (seeds) that evaluated it."""
    acc = {}
    for r in runs:
        for t, v in task_means((r["eval"].get(which) or {}).get("per_task")).items():
            acc.setdefault(t, []).append(v)
    return {t: sum(v) / len(v) for t, v in acc.items()}


def side(ci):
    """Where an interval lies: 'above' 0, 'below' 0, 'includes 0', or None (no interval)."""
    if ci["lo"] is None:
        return None
    return "above" if ci["lo"] > 0 else "below" if ci["hi"] < 0 else "includes 0"


def fmt(x, digits=3):
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def fmt_ci(ci, digits=3):
    if ci["mean"] is None:
        return "-"
    if ci["lo"] is None:
        return f"{fmt(ci['mean'], digits)} (n 1)"
    return f"{fmt(ci['mean'], digits)} [{fmt(ci['lo'], digits)}, {fmt(ci['hi'], digits)}] (n {ci['n']})"


def _updates(us):
    return ", ".join(str(u) for u in us)


def difference_statement(label, per_update):
    """The plain statement about SEED - GRPO of one metric over updates. per_update: [(update, mean_ci of the
    paired differences)]. The rule, word for word what the intervals allow:
      - no update has 2 matched seeds: nothing can be said;
      - every interval includes 0: "no difference shown";
      - otherwise the updates where the interval lies above 0 and below 0 are named, the rest said to include 0,
        and the count that chance alone would give (5% of the intervals) is stated beside it.
    Updates without an interval (fewer than 2 matched seeds there) are named as such."""
    sides = {u: side(ci) for u, ci in per_update}
    with_ci = [u for u, s in sides.items() if s is not None]
    n = max((ci["n"] for _, ci in per_update), default=0)
    if not with_ci:
        return (f"{label}, SEED - GRPO: fewer than 2 matched seeds at every update, so no interval: nothing can be "
                "said about a difference.")
    missing = [u for u, s in sides.items() if s is None]
    tail = f" No interval at update(s) {_updates(missing)} (fewer than 2 matched seeds)." if missing else ""
    above = [u for u in with_ci if sides[u] == "above"]
    below = [u for u in with_ci if sides[u] == "below"]
    if not above and not below:
        return (f"{label}, SEED - GRPO: the 95% interval includes 0 at every update ({len(with_ci)} updates, up to "
                f"{n} matched seeds): no difference shown.{tail}")
    parts = ([f"above 0 (SEED higher) at update(s) {_updates(above)}"] if above else []) + \
            ([f"below 0 (SEED lower) at update(s) {_updates(below)}"] if below else [])
    rest = len(with_ci) - len(above) - len(below)
    return (f"{label}, SEED - GRPO: the 95% interval lies {' and '.join(parts)}; it includes 0 at the other {rest} "
            f"update(s) (up to {n} matched seeds). These are {len(with_ci)} separate intervals: with no true "
            f"difference about {0.05 * len(with_ci):.2g} of them would exclude 0 by chance alone.{tail}")


def paired_statement(label, ci):
    """The plain statement about one paired SEED - GRPO difference (e.g. the end evaluation), same rule."""
    if ci["mean"] is None or ci["lo"] is None:
        return f"{label}, SEED - GRPO: fewer than 2 matched seeds, no interval: nothing can be said."
    rng = f"{fmt(ci['mean'])}, 95% interval {fmt(ci['lo'])} to {fmt(ci['hi'])}, {ci['n']} matched seeds{_flat(ci)}"
    s = side(ci)
    if s == "includes 0":
        return f"{label}, SEED - GRPO: the interval includes 0 ({rng}): no difference shown."
    return f"{label}, SEED - GRPO: SEED {'higher' if s == 'above' else 'lower'} ({rng})."


def _flat(ci, over="seed"):
    return f"; every {over} gave the same value" if ci["sd"] == 0 else ""


def change_statement(who, what, ci, unit="", none="no runs", over="seed", interval="95% interval"):
    """The plain statement about one change (e.g. end - start evaluation), over seeds (or, for the paired-by-task
    bootstrap, over="task"): higher / lower only when the interval excludes 0; otherwise "no change shown"; with
    fewer than 2, no interval."""
    if ci["mean"] is None:
        return f"{who}, {what}: {none}."
    if ci["lo"] is None:
        return f"{who}, {what}: {fmt(ci['mean'])}{unit} from 1 {over}, no interval: nothing can be said."
    rng = (f"{fmt(ci['mean'])}{unit}, {interval} {fmt(ci['lo'])} to {fmt(ci['hi'])}, {ci['n']} {over}s"
           f"{_flat(ci, over)}")
    s = side(ci)
    if s == "includes 0":
        return f"{who}, {what}: the interval includes 0 ({rng}): no change shown."
    return f"{who}, {what}: {'higher' if s == 'above' else 'lower'} ({rng})."


# ====================================================================================================
# Pooling the runs

def load_runs(results_dir, exclude=()):
    runs = [r for r in read_jsonl(os.path.join(results_dir, "runs.jsonl")) if r["run_id"] not in exclude]
    evals = {e["eval_key"]: e for e in read_jsonl(os.path.join(results_dir, "evals.jsonl"))}
    for r in runs:  # a record written before its start evaluation came: join it now
        if r["eval"].get("start") is None and r.get("eval_key") in evals:
            r["eval"]["start"] = evals[r["eval_key"]]["summary"]
    return runs


def series(run, key):
    """{update: value} of one run."""
    return {u["update"]: u.get(key) for u in run["updates"]}


def eval_value(summary, key, split="all"):
    if not summary:
        return None
    part = summary["all"] if split == "all" else summary["splits"].get(split, {})
    return part.get(key)


def code_label(code):
    """The commit a run's record names: the launcher's (SEED_CODE_COMMIT) where git's view of the copy is stale."""
    git = (code["commit"] or "?")[:10] + (" (dirty)" if code["dirty"] else "")
    sent = code.get("launcher_commit")
    if not sent or (sent == code["commit"] and not code["dirty"]):
        return git
    return f"{sent[:10]} (sent; the copy's git said {git})"


def analyze_group(runs):
    """The numbers of one group: curves, differences, changes, evaluations, cost (a JSON-able dict)."""
    first = runs[0]
    by = {}
    for r in runs:
        by.setdefault(r["method"], {})[r["seed"]] = r
    methods = [m for m in METHOD_ORDER if m in by] + sorted(m for m in by if m not in METHOD_ORDER)
    n_updates = first["config"]["updates"]
    updates = list(range(1, n_updates + 1))
    out = {"group": first["group"], "env": first["env"], "config": first["config"], "start": first["start"]["label"],
           "methods": methods, "seeds": {m: sorted(by[m]) for m in methods},
           "commits": sorted({code_label(r["code"]) for r in runs}),
           "runs": sorted(r["run_id"] for r in runs), "curves": {}, "diffs": {}, "train_change": {},
           "eval": {}, "statements": []}
    both = "seed" in by and "grpo" in by
    out["matched_seeds"] = sorted(set(by["seed"]) & set(by["grpo"])) if both else []
    # ---- curves per method, and the paired difference per update
    out["per_seed"] = {}  # each run's own curve (thin lines in the figure: with 2-3 seeds they say more than a band)
    for key, _ in CURVES:
        out["curves"][key] = {m: [mean_ci([series(r, key).get(u) for r in by[m].values()]) for u in updates]
                              for m in methods}
        out["per_seed"][key] = {m: {s: [series(r, key).get(u) for u in updates] for s, r in sorted(by[m].items())}
                                for m in methods}
    if both:
        for key, label in DIFFS:
            per = []
            for u in updates:
                _, d = paired({s: series(r, key).get(u) for s, r in by["seed"].items()},
                              {s: series(r, key).get(u) for s, r in by["grpo"].items()})
                per.append(mean_ci(d))
            out["diffs"][key] = per
            out["statements"].append(difference_statement(f"training {label}", list(zip(updates, per))))
    # ---- within each run: last update - first update (different tasks, the same for both methods of a seed)
    for key, label in DIFFS[:3]:
        out["train_change"][key] = {}
        for m in methods:
            d = [series(r, key).get(n_updates) - series(r, key).get(1) for r in by[m].values()
                 if series(r, key).get(n_updates) is not None and series(r, key).get(1) is not None]
            ci = mean_ci(d)
            out["train_change"][key][m] = ci
            out["statements"].append(change_statement(LABEL.get(m, m), f"training {label}, update {n_updates} minus "
                                                       "update 1 within each run", ci))
    # ---- held-out evaluation: start and end, pooled over splits. The start: one shared evaluation, or with
    # --eval-in-run each run's own (the same weights and episodes' seeds; shown as their mean), and each run's
    # end is then compared with its own start
    starts = [r["eval"].get("start") for r in runs if r["eval"].get("start")]
    in_run = any(r["eval"].get("start_in_run") for r in runs)
    # each run's end is compared with its own start's evaluation where the starts were evaluated apart: inside each
    # run (--eval-in-run), or once per start made (the recipe made again, e.g. the BC SFT on another machine: its
    # weights differ, so benchmarks/learning.py gives it another eval_key)
    per_run = in_run or len({r.get("eval_key") for r in runs}) > 1
    out["start_in_run"], out["start_per_run"] = in_run, per_run
    splits = sorted({s for r in runs for s in ((r["eval"].get("end") or {}).get("splits") or {})})
    for split in ["all"] + splits:
        ev = {"start": {k: (mean_ci([eval_value(x, k, split) for x in starts])["mean"] if per_run
                            else eval_value(starts[0], k, split)) if starts else None for k, _ in EVAL_KEYS}}
        for m in methods:
            ev[m] = {}
            for k, _ in EVAL_KEYS:
                ends = {s: eval_value(r["eval"].get("end"), k, split) for s, r in by[m].items()}
                own = {s: eval_value(r["eval"].get("start"), k, split) if per_run else ev["start"][k]
                       for s, r in by[m].items()}
                ev[m][k] = {"end": mean_ci(list(ends.values())), "per_seed": ends,
                            "end_minus_start": mean_ci([v - own[s] for s, v in ends.items()
                                                        if v is not None and own[s] is not None])}
        if both:
            for k, _ in EVAL_KEYS:
                _, d = paired(ev["seed"][k]["per_seed"], ev["grpo"][k]["per_seed"])
                ev.setdefault("seed_minus_grpo", {})[k] = mean_ci(d)
        out["eval"][split] = ev
    # ---- held-out success paired by task (the same games/questions for the start and every end policy):
    # end (averaged over seeds) - start per method, and SEED - GRPO over the matched seeds
    start_tasks = task_means(starts[0].get("per_task")) if starts else {}
    out["paired_tasks"] = {}
    for m in (methods if start_tasks else []):  # records from before per-task outcomes were kept: none
        ci = paired_bootstrap(pooled_task_means(by[m].values(), "start") if per_run else start_tasks,
                              pooled_task_means(by[m].values()))
        out["paired_tasks"][f"{m}_end_minus_start"] = ci
        out["statements"].append(task_statement(LABEL.get(m, m), f"held-out success of the end policies (mean over "
                                                f"{len(by[m])} seeds) minus the start, paired by task", ci))
    if both and start_tasks:
        matched = [s for s in by["seed"] if s in by["grpo"]]
        ci = paired_bootstrap(pooled_task_means([by["grpo"][s] for s in matched]),
                              pooled_task_means([by["seed"][s] for s in matched]))
        out["paired_tasks"]["seed_minus_grpo"] = ci
        out["statements"].append(task_statement("held-out success", f"SEED - GRPO end policies (mean over "
                                                f"{len(matched)} matched seeds), paired by task", ci))
    ev = out["eval"]["all"]
    # runs whose end evaluation never came (learning_remote.py --salvage): in the training curves only
    out["no_end_eval"] = {r["run_id"]: r["eval"].get("end_missing", "?") for r in runs if not r["eval"].get("end")}
    for k, label in EVAL_KEYS[:3]:
        for m in methods:
            lost = sum(1 for r in by[m].values() if r["run_id"] in out["no_end_eval"])
            out["statements"].append(change_statement(
                LABEL.get(m, m), f"held-out {label}, end policy minus the start", ev[m][k]["end_minus_start"],
                " points" if "%" in label else "", none=f"no end evaluation on file ({lost} run(s) without one)"))
        if both:
            out["statements"].append(paired_statement(f"held-out {label} of the end policy", ev["seed_minus_grpo"][k]))
    # ---- cost: seconds per update, walls, the gate, device memory
    out["cost"] = {}
    for m in methods:
        rs = list(by[m].values())
        med = [sorted(t)[len(t) // 2] for t in ([u["time"] for u in r["updates"] if u.get("time") is not None]
                                                 for r in rs) if t]
        c = [r["compute"] for r in rs]
        out["cost"][m] = {"runs": len(rs), "lanes": sorted({x["lanes"] for x in c}),
                          "s_per_update": mean_ci(med), "train_wall_s": mean_ci([x["train_wall_s"] for x in c]),
                          "eval_wall_s": mean_ci([x["eval_wall_s"] for x in c]),
                          "stopped_s": mean_ci([x["frozen_s"] for x in c]),
                          "device_peak_gib": max([(x["device_peak_mib"] or 0) / 1024 for x in c], default=None),
                          "episodes_per_update": first["config"]["tasks_per_update"] * first["config"]["group_size"]}
    return out


# ====================================================================================================
# Figures and the markdown

def figures(g, out_dir):
    """<group>_curves.png, <group>_diff.png, <group>_eval.png; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return []
    colors = {"seed": "tab:blue", "grpo": "tab:orange"}
    ups = list(range(1, g["config"]["updates"] + 1))
    files = []

    def band(ax, cis, color, label):
        m = [c["mean"] for c in cis]
        ax.plot(ups, [float("nan") if v is None else v for v in m], color=color, marker="o", ms=3, label=label)
        lo = [float("nan") if c["lo"] is None else c["lo"] for c in cis]
        hi = [float("nan") if c["hi"] is None else c["hi"] for c in cis]
        ax.fill_between(ups, lo, hi, color=color, alpha=0.2, linewidth=0)

    c = g["config"]
    title = f"{g['env']}, start {g['start']}, {c['tasks_per_update']}x{c['group_size']} episodes/update"
    fig, axes = plt.subplots(2, 5, figsize=(20, 7.5), squeeze=False)
    for ax, (key, label) in zip(axes.flat, CURVES):
        for m in g["methods"]:
            if any(c["mean"] is not None for c in g["curves"][key][m]):
                band(ax, g["curves"][key][m], colors.get(m), f"{LABEL.get(m, m)} (n {len(g['seeds'][m])})")
                for vals in g["per_seed"][key][m].values():
                    ax.plot(ups, [float("nan") if v is None else v for v in vals], color=colors.get(m), lw=0.7,
                            alpha=0.45)
        if key in RATES:  # a t-interval of a rate can pass 0 or 1 (few seeds); the tables keep its numbers
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("update")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"Training curves: mean over seeds (thick), each run (thin), 95% t-interval shaded; rates "
                 f"on [0, 1] ({title})")
    fig.tight_layout()
    files.append(f"{g['group']}_curves.png")
    fig.savefig(os.path.join(out_dir, files[-1]), dpi=110)
    plt.close(fig)
    if g["diffs"]:
        fig, axes = plt.subplots(2, 3, figsize=(14, 7.5), squeeze=False)
        for ax, (key, label) in zip(axes.flat, DIFFS):
            band(ax, g["diffs"][key], "tab:green", f"SEED - GRPO (n {len(g['matched_seeds'])} matched seeds)")
            ax.axhline(0.0, color="black", lw=0.8)
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("update")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Paired difference SEED - GRPO per update, 95% t-interval ({title})")
        fig.tight_layout()
        files.append(f"{g['group']}_diff.png")
        fig.savefig(os.path.join(out_dir, files[-1]), dpi=110)
        plt.close(fig)
    ev = g["eval"]["all"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), squeeze=False)
    for ax, (key, label) in zip(axes.flat, EVAL_KEYS[:3]):
        xs, names = [0], ["start"]
        if ev["start"][key] is not None:
            ax.plot([0], [ev["start"][key]], "ks")
        for i, m in enumerate(g["methods"], start=1):
            c = ev[m][key]["end"]
            xs.append(i)
            names.append(f"{LABEL.get(m, m)} end")
            if c["mean"] is not None:
                err = [[c["mean"] - c["lo"]], [c["hi"] - c["mean"]]] if c["lo"] is not None else None
                ax.errorbar([i], [c["mean"]], yerr=err, fmt="o", color=colors.get(m), capsize=5)
            seeds = [v for v in ev[m][key]["per_seed"].values() if v is not None]  # each run's own value
            ax.plot([i + 0.12] * len(seeds), seeds, "x", color=colors.get(m), ms=5, alpha=0.7)
        ax.set_xticks(xs, names)
        ax.set_ylim(-5, 105)  # percentages; a 3-seed t-interval can pass 0 or 100 (the tables keep its numbers)
        ax.set_title(f"held-out {label}", fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle("Held-out evaluation, plain prompt: the start and the end policies (mean and 95% t-interval over seeds; "
                 "x: each run; on [0, 100])")
    fig.tight_layout()
    files.append(f"{g['group']}_eval.png")
    fig.savefig(os.path.join(out_dir, files[-1]), dpi=110)
    plt.close(fig)
    return files


def group_markdown(g, figs):
    c = g["config"]
    e = c["eval"]
    tasks = f"{e['limit']} tasks per split" if e["limit"] else "every task of each split"  # limit 0: all
    md = [f"## Group `{g['group']}`: {g['env']}, start `{g['start']}`", "",
          f"- settings: {c['updates']} updates of {c['tasks_per_update']} tasks x {c['group_size']} episodes, "
          f"{c['max_steps']} steps, lr {c['lr']}"
          + (f", max new tokens {c['max_new_tokens']}" if c.get("max_new_tokens") else "")
          + (f", seed_rl.py {' '.join(c['seed_rl_args'])}" if c["seed_rl_args"] else "")
          + (f", env {' '.join(c['env_args'])}" if c["env_args"] else ""),
          f"- evaluation: plain prompt, {tasks} ({e['splits'] or 'the env default splits'}), "
          f"eval seed {e['seed']}, {e['max_steps']} steps; " + (
              "each run evaluates its own start" if g.get("start_in_run") else
              "each start made is evaluated once, and each run compared with its own" if g.get("start_per_run") else
              "the start is evaluated once and shared by every run"),
          "- seeds: " + "; ".join(f"{LABEL.get(m, m)} {g['seeds'][m]}" for m in g["methods"])
          + f"; matched (both methods): {g['matched_seeds']}",
          f"- code: {', '.join(g['commits'])}; runs: {', '.join(g['runs'])}"]
    if g["no_end_eval"]:
        md.append(f"- without an end evaluation (in the training curves only; the held-out rows count the other "
                  f"runs): {', '.join(f'{k} ({v})' for k, v in sorted(g['no_end_eval'].items()))}")
    md += ["",
          "### What the intervals show", ""] + [f"- {s}" for s in g["statements"]] + [""]
    for f in figs:
        md += [f"![{f}]({f})", ""]
    ups = list(range(1, c["updates"] + 1))
    md += ["### Training, per update (mean over seeds [95% interval] (n seeds))", ""]
    for key, label in DIFFS:
        cols = [LABEL.get(m, m) for m in g["methods"]] + (["SEED - GRPO (matched)"] if g["diffs"] else [])
        md += [f"**{label}**", "", "| update | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for i, u in enumerate(ups):
            row = [fmt_ci(g["curves"][key][m][i]) for m in g["methods"]]
            if g["diffs"]:
                row.append(fmt_ci(g["diffs"][key][i]))
            md.append(f"| {u} | " + " | ".join(row) + " |")
        md.append("")
    if "seed" in g["methods"]:
        keys = CURVES[6:]
        md += ["**SEED's own signal**", "", "| update | " + " | ".join(l for _, l in keys) + " |",
               "|---" * (len(keys) + 1) + "|"]
        for i, u in enumerate(ups):
            md.append(f"| {u} | " + " | ".join(fmt_ci(g["curves"][k]["seed"][i]) for k, _ in keys) + " |")
        md.append("")
    md += ["### Held-out evaluation (plain prompt, no skill)", ""]
    if g.get("start_in_run"):
        md += ["Evaluated inside each run (`seed_rl.py --eval-every`): \"start\" is the mean of the runs' own start "
               "evaluations, and end - start pairs each run with its own start.", ""]
    elif g.get("start_per_run"):
        md += ["The start was made more than once (the same recipe, other weights): \"start\" is the mean of the "
               "starts' evaluations, and end - start pairs each run with the evaluation of its own start.", ""]
    for split, ev in g["eval"].items():
        cols = (["start"] + [f"{LABEL.get(m, m)} end" for m in g["methods"]]
                + [f"{LABEL.get(m, m)} end - start" for m in g["methods"]]
                + (["SEED - GRPO, end"] if "seed_minus_grpo" in ev else []))
        md += [f"**{'pooled over splits' if split == 'all' else split}**", "", "| | " + " | ".join(cols) + " |",
               "|---" * (len(cols) + 1) + "|"]
        for k, label in EVAL_KEYS:
            row = [fmt(ev["start"][k])] + [fmt_ci(ev[m][k]["end"]) for m in g["methods"]] + \
                  [fmt_ci(ev[m][k]["end_minus_start"]) for m in g["methods"]]
            if "seed_minus_grpo" in ev:
                row.append(fmt_ci(ev["seed_minus_grpo"][k]))
            md.append(f"| {label} | " + " | ".join(row) + " |")
        md.append("")
    if any(ci["mean"] is not None for ci in g.get("paired_tasks", {}).values()):
        md += ["**held-out success paired by task (percentage points; percentile bootstrap over tasks)**", "",
               "| comparison | mean [95% interval] (n tasks) | tasks lower / higher |", "|---|---|---|"]
        md += [f"| {k.replace('_', ' ')} | {fmt_ci(ci)} | {ci.get('lower', '-')} / {ci.get('higher', '-')} |"
               for k, ci in g["paired_tasks"].items()] + [""]
    md += ["### Cost", "", "| method | runs | lanes | s per update (median per run) | train wall s | eval wall s | "
           "stopped by the gate s | device peak GiB | episodes per minute of training |", "|---" * 9 + "|"]
    for m in g["methods"]:
        x = g["cost"][m]
        spu = x["s_per_update"]["mean"]
        md.append(f"| {LABEL.get(m, m)} | {x['runs']} | {x['lanes']} | {fmt_ci(x['s_per_update'])} | "
                  f"{fmt_ci(x['train_wall_s'])} | {fmt_ci(x['eval_wall_s'])} | {fmt_ci(x['stopped_s'])} | "
                  f"{fmt(x['device_peak_gib'])} | {fmt(60 * x['episodes_per_update'] / spu) if spu else '-'} |")
    md.append("")
    return md


def write_report(results_dir, out, exclude=(), draw=True):
    runs = load_runs(results_dir, exclude)
    os.makedirs(out, exist_ok=True)
    groups = {}
    for r in runs:
        groups.setdefault(r["group"], []).append(r)
    analyses = [analyze_group(rs) for _, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    rel = os.path.relpath(results_dir, REPO)
    md = ["# Learning benchmark: SEED beside GRPO", "",
          f"{len(runs)} run(s) from `{os.path.join(rel, 'runs.jsonl')}` in {len(analyses)} group(s) (env + "
          "settings + start; groups are never pooled with each other). Produced by `benchmarks/learning.py`; this "
          "file by `benchmarks/learning_report.py`.", "",
          "How to read it: every interval is a 95% Student-t interval over seeds (n - 1 degrees of freedom). "
          "SEED - GRPO is paired by seed: the two methods of a seed start from the same weights and play the same "
          "task stream with the same sampling seeds, so their update 1 is the same episodes (up to engine noise). "
          "A statement says 'higher' or 'lower' only where an interval excludes 0; the per-update intervals are "
          "separate, not corrected for looking at many updates. 'Update N minus update 1' compares different tasks "
          "(each update draws new ones; the same for both methods of a seed). The start of the held-out evaluation "
          "is one evaluation shared by all runs: its own sampling noise is not inside the end - start intervals.", ""]
    report = {"results_dir": rel, "runs": len(runs), "groups": []}
    for g in analyses:
        figs = figures(g, out) if draw else []
        md += group_markdown(g, figs)
        report["groups"].append(dict(g, figures=figs))
    if not analyses:
        md.append("No runs on file.")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", default=os.path.join(REPO, "results", "learning"),
                   help="folder with runs.jsonl (and evals.jsonl)")
    p.add_argument("--out", default=None, help="report folder (default: <results-dir>/report)")
    p.add_argument("--exclude", nargs="*", default=[], metavar="RUN_ID", help="runs to leave out of this report")
    args = p.parse_args(argv)
    out = args.out or os.path.join(args.results_dir, "report")
    report = write_report(args.results_dir, out, set(args.exclude))
    print(f"{report['runs']} run(s), {len(report['groups'])} group(s) -> {os.path.join(out, 'report.md')}")
    for g in report["groups"]:
        print(f"\ngroup {g['group']} ({g['env']}, start {g['start']}):")
        for s in g["statements"]:
            print(f"  - {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
