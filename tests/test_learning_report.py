"""benchmarks/learning_report.py: the statistics against hand-computed values (the t-interval and its quantile,
paired differences, the statement rule), then the whole report on a small runs.jsonl written here. Fast."""
import importlib.util
import json
import math
import os

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("learning_report", os.path.join(REPO, "benchmarks", "learning_report.py"))
lr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lr)

T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 9: 2.2622, 30: 2.0423}  # printed t tables


@pytest.mark.parametrize("df,want", sorted(T975.items()))
def test_mean_ci_half_width_is_the_printed_t_quantile(df, want):
    # n = df + 1 values 0..df: the half-width over sd / sqrt(n) is t(0.975, n - 1) of the printed table
    ci = lr.mean_ci(list(range(df + 1)))
    assert (ci["hi"] - ci["mean"]) / (ci["sd"] / math.sqrt(df + 1)) == pytest.approx(want, abs=1e-4)
    assert ci["mean"] - ci["lo"] == pytest.approx(ci["hi"] - ci["mean"])


def test_mean_ci_by_hand():
    # [1, 2, 3]: mean 2, sd 1, half-width t(0.975, 2) * 1 / sqrt(3) = 4.302653 / 1.732051 = 2.484138
    ci = lr.mean_ci([1, 2, 3])
    assert ci["n"] == 3 and ci["mean"] == 2.0 and ci["sd"] == pytest.approx(1.0)
    assert ci["lo"] == pytest.approx(-0.484138, abs=1e-5) and ci["hi"] == pytest.approx(4.484138, abs=1e-5)
    # [0.1, 0.0, 0.2]: mean 0.1, sd 0.1, half-width 0.2484138
    ci = lr.mean_ci([0.1, 0.0, 0.2])
    assert (ci["lo"], ci["hi"]) == (pytest.approx(-0.1484138, abs=1e-6), pytest.approx(0.3484138, abs=1e-6))
    # [2, 4]: mean 3, sd sqrt(2), half-width 12.7062 * sqrt(2) / sqrt(2) = 12.7062
    ci = lr.mean_ci([2, 4])
    assert (ci["lo"], ci["hi"]) == (pytest.approx(3 - 12.7062, abs=1e-3), pytest.approx(3 + 12.7062, abs=1e-3))
    # one value: a mean, no interval; None values are dropped; nothing: nothing
    assert lr.mean_ci([5.0, None]) == {"n": 1, "mean": 5.0, "sd": None, "lo": None, "hi": None}
    assert lr.mean_ci([])["mean"] is None


def test_paired_keeps_only_matched_seeds():
    seeds, d = lr.paired({0: 0.8, 1: 0.6, 2: 0.7, 4: None}, {0: 0.7, 1: 0.6, 3: 0.5, 4: 0.1})
    assert seeds == [0, 1] and d == [pytest.approx(0.1), pytest.approx(0.0)]


def ci(lo, hi, n=3):
    return {"n": n, "mean": (lo + hi) / 2, "sd": 1.0, "lo": lo, "hi": hi}


def test_difference_statement_rule():
    s = lr.difference_statement("invalid", [(1, ci(-0.1, 0.1)), (2, ci(-0.2, 0.05)), (3, ci(0.0, 0.3))])
    assert "includes 0 at every update" in s and "no difference shown" in s  # an end at exactly 0 includes 0
    s = lr.difference_statement("invalid", [(1, ci(-0.1, 0.1)), (2, ci(0.05, 0.2)), (3, ci(-0.4, -0.1))])
    assert "above 0 (SEED higher) at update(s) 2" in s and "below 0 (SEED lower) at update(s) 3" in s
    assert "at the other 1 update(s)" in s and "about 0.15 of them would exclude 0 by chance" in s
    one = {"n": 1, "mean": 0.2, "sd": None, "lo": None, "hi": None}
    assert "nothing can be said" in lr.difference_statement("invalid", [(1, one), (2, one)])
    s = lr.difference_statement("invalid", [(1, ci(-0.1, 0.1)), (2, one)])
    assert "no difference shown" in s and "No interval at update(s) 2" in s


def test_change_statement_rule():
    assert "lower (-35" in lr.change_statement("SEED", "invalid", lr.mean_ci([-40, -30, -35]))
    assert "higher (1.5" in lr.change_statement("SEED", "invalid", lr.mean_ci([1, 1.5, 2]))  # [0.258, 2.74]
    assert "no change shown" in lr.change_statement("SEED", "invalid", lr.mean_ci([1, 2, 3]))  # [-0.484, 4.48]
    assert "no change shown" in lr.change_statement("SEED", "invalid", lr.mean_ci([-1, 1, 0.5]))
    assert "nothing can be said" in lr.change_statement("SEED", "invalid", lr.mean_ci([-3]))
    assert "every seed gave the same value" in lr.change_statement("SEED", "success", lr.mean_ci([0, 0, 0]))
    assert "SEED higher (2" in lr.paired_statement("x", lr.mean_ci([1.5, 2, 2.5]))
    assert "nothing can be said" in lr.paired_statement("x", lr.mean_ci([2]))


# ---- the whole report on a small runs.jsonl: 3 seeds x 2 methods x 3 updates, one run of another group

INVALID = {("seed", 0): [0.8, 0.6, 0.4], ("seed", 1): [0.8, 0.7, 0.5], ("seed", 2): [0.8, 0.5, 0.3],
           ("grpo", 0): [0.8, 0.7, 0.6], ("grpo", 1): [0.8, 0.7, 0.7], ("grpo", 2): [0.8, 0.6, 0.6]}
END_INVALID = {("seed", 0): 40.0, ("seed", 1): 50.0, ("seed", 2): 45.0,
               ("grpo", 0): 60.0, ("grpo", 1): 70.0, ("grpo", 2): 62.0}
START = {"splits": {}, "all": {"episodes": 24, "success": 0.0, "avg": 0.0, "score": 0.0, "invalid": 80.0,
                               "inadmissible": 10.0, "length": 15.0}}


def record(method, seed, group="g1", lr_=1e-5, start=True):
    ups = [{"update": u + 1, "invalid": v, "inadmissible": 0.1, "return": -v, "success": 0.0, "length": 15.0,
            "kl": 0.001 * (u + 1), "time": 30.0 + u, "parse_rate": 0.5 if method == "seed" else None,
            "teacher_coverage": 0.4 if method == "seed" else None, "gate_mean": 0.48 if method == "seed" else None,
            "gate_active": 0.45 if method == "seed" else None} for u, v in enumerate(INVALID[(method, seed)])]
    end = {"splits": {"valid_seen": {"episodes": 12}}, "all": dict(START["all"], invalid=END_INVALID[(method, seed)])}
    return {"run_id": f"{method}-s{seed}-{group}", "method": method, "seed": seed, "group": group, "env": "alfworld",
            "eval_key": "k1", "config": {"env": "alfworld", "updates": 3, "tasks_per_update": 2, "group_size": 8,
                                         "max_steps": 15, "lr": lr_, "max_new_tokens": None, "seed_rl_args": [],
                                         "env_args": [], "eval": {"limit": 12, "splits": None, "seed": 0,
                                                                  "max_steps": 15}},
            "start": {"label": "base:test"}, "code": {"commit": "abc", "dirty": False}, "updates": ups,
            "eval": {"start": START if start else None, "end": end},
            "compute": {"lanes": 1, "train_wall_s": 400.0, "eval_wall_s": 60.0, "frozen_s": 0.0,
                        "device_peak_mib": 70000.0}}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("learning")
    with open(d / "runs.jsonl", "w") as f:
        for (m, s) in INVALID:  # seed 1 of SEED lacks its start evaluation: the report joins evals.jsonl
            f.write(json.dumps(record(m, s, start=(m, s) != ("seed", 1))) + "\n")
        f.write(json.dumps(record("seed", 0, group="g2", lr_=1e-6)) + "\n")  # another group: never pooled
    with open(d / "evals.jsonl", "w") as f:
        f.write(json.dumps({"eval_key": "k1", "summary": START}) + "\n")
    rep = lr.write_report(str(d), str(d / "report"))
    return d, rep


def test_report_pools_by_group_and_pairs_by_seed(report):
    d, rep = report
    assert rep["runs"] == 7 and [g["group"] for g in rep["groups"]] == ["g1", "g2"]
    g = rep["groups"][0]
    assert g["matched_seeds"] == [0, 1, 2] and g["seeds"] == {"seed": [0, 1, 2], "grpo": [0, 1, 2]}
    seed_u2 = g["curves"]["invalid"]["seed"][1]  # [0.6, 0.7, 0.5]: mean 0.6, sd 0.1
    assert seed_u2["mean"] == pytest.approx(0.6) and seed_u2["hi"] - seed_u2["mean"] == pytest.approx(0.2484138, abs=1e-6)
    d1, d2, d3 = g["diffs"]["invalid"]
    assert (d1["mean"], d1["lo"], d1["hi"]) == (0.0, 0.0, 0.0)  # update 1: the same episodes in both methods
    # update 2: diffs [-0.1, 0, -0.1]: mean -0.0667, sd 0.057735, half-width 4.302653 * 0.057735 / sqrt(3) = 0.143422
    assert d2["mean"] == pytest.approx(-0.0666667, abs=1e-6)
    assert (d2["lo"], d2["hi"]) == (pytest.approx(-0.210089, abs=1e-5), pytest.approx(0.076755, abs=1e-5))
    # update 3: diffs [-0.2, -0.2, -0.3]: mean -0.2333, same sd: [-0.376755, -0.089911], below 0
    assert (d3["lo"], d3["hi"]) == (pytest.approx(-0.376755, abs=1e-5), pytest.approx(-0.089911, abs=1e-5))
    ev = g["eval"]["all"]
    assert ev["start"]["invalid"] == 80.0
    # SEED end - start: [-40, -30, -35]: mean -35, sd 5, half-width 4.302653 * 5 / sqrt(3) = 12.42068
    es = ev["seed"]["invalid"]["end_minus_start"]
    assert es["mean"] == pytest.approx(-35.0) and es["lo"] == pytest.approx(-47.42068, abs=1e-4)
    assert ev["seed"]["invalid"]["per_seed"] == {0: 40.0, 1: 50.0, 2: 45.0}  # each run's end value (the figure's x)
    # SEED - GRPO at the end: [-20, -20, -17]: mean -19, sd sqrt(3), half-width 4.302653
    sg = ev["seed_minus_grpo"]["invalid"]
    assert (sg["lo"], sg["hi"]) == (pytest.approx(-23.302653, abs=1e-5), pytest.approx(-14.697347, abs=1e-5))


def test_report_statements_say_only_what_the_intervals_show(report):
    d, rep = report
    st = rep["groups"][0]["statements"]
    inv = next(s for s in st if s.startswith("training invalid-action rate, SEED - GRPO"))
    assert "below 0 (SEED lower) at update(s) 3" in inv and "includes 0 at the other 2 update(s)" in inv
    assert any(s.startswith("training success rate") and "no difference shown" in s for s in st)
    assert any(s.startswith("SEED, held-out invalid %") and "lower (-35 points" in s for s in st)
    assert any(s.startswith("held-out success % of the end policy") and "no difference shown" in s for s in st)
    assert any(s.startswith("held-out invalid % of the end policy") and "SEED lower (-19, 95% interval -23.3 to "
               "-14.7, 3 matched seeds)" in s for s in st)
    g2 = rep["groups"][1]
    assert g2["matched_seeds"] == [] and all("from 1 seed, no interval" in s for s in g2["statements"])
    md = (d / "report" / "report.md").read_text()
    assert "## Group `g1`" in md and "## Group `g2`" in md and inv in md
    assert "| 3 | 0.4 [0.152, 0.648] (n 3) |" in md  # SEED update 3: [0.4, 0.5, 0.3]
    pytest.importorskip("matplotlib")
    for name in ("g1_curves.png", "g1_diff.png", "g1_eval.png", "g2_curves.png"):
        assert (d / "report" / name).stat().st_size > 0


def test_exclude_leaves_a_run_out(report):
    d, _ = report
    rep = lr.write_report(str(d), str(d / "report_ex"), exclude={"grpo-s2-g1"}, draw=False)
    g = rep["groups"][0]
    assert g["matched_seeds"] == [0, 1] and g["seeds"]["grpo"] == [0, 1]


def test_a_run_without_its_end_evaluation_counts_in_the_curves_only(tmp_path):
    """learning_remote.py --salvage: a run whose end evaluation never came. Its training rows pool as usual; the held-out
    end rows count the other runs only, and the report names it."""
    runs = [record(m, s) for m, s in INVALID]
    lost = [r for r in runs if r["method"] == "seed" and r["seed"] == 2][0]
    lost["eval"] = {"start": START, "end": None, "end_missing": "the machine went away"}
    lost["compute"]["eval_wall_s"] = None
    with open(tmp_path / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in runs)
    g = lr.write_report(str(tmp_path), str(tmp_path / "report"), draw=False)["groups"][0]
    assert g["curves"]["invalid"]["seed"][2]["n"] == 3 and g["no_end_eval"] == {"seed-s2-g1": "the machine went away"}
    es = g["eval"]["all"]["seed"]["invalid"]["end_minus_start"]  # SEED end - start over seeds 0, 1: [-40, -30]
    assert es["n"] == 2 and es["mean"] == pytest.approx(-35.0)
    assert g["eval"]["all"]["seed_minus_grpo"]["invalid"]["n"] == 2  # paired: seeds 0 and 1
    assert g["cost"]["seed"]["eval_wall_s"]["n"] == 2
    md = (tmp_path / "report" / "report.md").read_text()
    assert "without an end evaluation (in the training curves only" in md and "seed-s2-g1 (the machine went away)" in md
    lost_all = [dict(r, eval={"start": START, "end": None}) for r in runs if r["method"] == "seed"]
    stmt = lr.analyze_group(lost_all)["statements"]
    assert any("held-out invalid %" in s and "no end evaluation on file (3 run(s) without one)" in s for s in stmt)


def test_a_start_made_twice_pairs_each_run_with_its_own_start(tmp_path):
    """The same recipe's start made on two machines (the BC SFT again: other weights, so benchmarks/learning.py gives
    it another eval_key): one group, but each run's end is compared with the evaluation of its own start."""
    starts = {"ka": dict(START, all=dict(START["all"], invalid=80.0), per_task={"t1": [0], "t2": [0]}),
              "kb": dict(START, all=dict(START["all"], invalid=60.0), per_task={"t1": [1], "t2": [0]})}
    ends = {0: ("ka", 40.0, {"t1": [1], "t2": [1]}), 1: ("kb", 50.0, {"t1": [1], "t2": [0]})}
    with open(tmp_path / "runs.jsonl", "w") as f:
        for seed, (key, invalid, per_task) in ends.items():
            r = record("grpo", seed)
            r["eval_key"], r["eval"]["start"] = key, starts[key]
            r["eval"]["end"] = dict(r["eval"]["end"], all=dict(r["eval"]["end"]["all"], invalid=invalid),
                                    per_task=per_task)
            f.write(json.dumps(r) + "\n")
    rep = lr.write_report(str(tmp_path), str(tmp_path / "report"))
    g = rep["groups"][0]
    assert g["start_per_run"] and not g["start_in_run"]
    ev = g["eval"]["all"]
    assert ev["start"]["invalid"] == 70.0  # the mean of the two starts
    # end - own start: 40 - 80 and 50 - 60 (mean -25); against the first start alone it would be -40, -30
    assert ev["grpo"]["invalid"]["end_minus_start"]["mean"] == pytest.approx(-25.0)
    # by task: starts pooled t1 0.5, t2 0; ends pooled t1 1, t2 0.5: +50 points on both (the first start alone: 100, 50)
    ci = g["paired_tasks"]["grpo_end_minus_start"]
    assert (ci["mean"], ci["lo"], ci["hi"]) == (50.0, 50.0, 50.0)
    assert "each start made is evaluated once" in open(tmp_path / "report" / "report.md").read()


def test_paired_bootstrap_by_task_hand_values():
    paired_bootstrap, task_means, task_statement = lr.paired_bootstrap, lr.task_means, lr.task_statement
    start = task_means({"a": [0], "b": [0], "c": [1], "d": [0], "only_start": [1]})
    end = task_means({"a": [1, 1], "b": [1, 0], "c": [1, 1], "d": [0, 0]})  # 2 samples per task
    ci = paired_bootstrap(start, end)
    # differences in points: a +100, b +50, c 0, d 0 -> mean 37.5 over the 4 shared tasks
    assert ci["n"] == 4 and abs(ci["mean"] - 37.5) < 1e-9
    assert 0.0 <= ci["lo"] < 37.5 < ci["hi"] <= 100.0
    assert (ci["lower"], ci["higher"]) == (0, 2)  # a and b rose, c and d stayed
    assert [paired_bootstrap({"a": 1.0, "b": 0.0, "c": 0.5}, {"a": 0.0, "b": 1.0, "c": 0.5})[k]
            for k in ("mean", "lower", "higher")] == [0.0, 1, 1]  # one lost, one gained: a flat mean
    # every task moved by the same amount: the interval is that point
    same = paired_bootstrap({"a": 0.0, "b": 0.5}, {"a": 0.25, "b": 0.75})
    assert (same["mean"], same["lo"], same["hi"]) == (25.0, 25.0, 25.0)
    assert "higher" in task_statement("x", "y", same)
    assert paired_bootstrap({"a": 0.0}, {"a": 1.0})["mean"] is None  # one shared task: no interval
    assert "nothing can be said" in task_statement("x", "y", paired_bootstrap({"a": 0.0}, {"a": 1.0}))
