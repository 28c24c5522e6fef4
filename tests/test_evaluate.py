"""evaluate.py: deployment-time evaluation on real ALFWorld valid games, the training report, the data manifest.

Real parts: the real valid_seen/valid_unseen games through the worker pool, the scripted expert and the tiny
random Qwen2 with the real Qwen2.5 tokenizer, real matplotlib PNGs (and a real ImportError for the
text-only mode). Every expected number is recomputed here from the trajectories or the game files.
"""
import hashlib
import json
import os
import statistics

import pytest

from conftest import REPO, interrupt, run_script, side_by_side
from envs.alfworld import TASK_TYPES, TYPE_ORDER, list_games, task_id_of, walkthrough
from common.records import games_sha256, read_jsonl

COLUMNS = TYPE_ORDER + ["Avg", "All"]
TINY = ["--model", "tiny", "--splits", "valid_seen", "--limit", "3", "--samples", "2", "--max-steps", "3",
        "--max-new-tokens", "16", "--workers", "2"]


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory):
    """Both evaluations below, side by side (independent; ~1.4x faster than one after the other on 2 cores):
    the scripted expert on a seeded type-stratified subset, 6 games per split = one of each type; the tiny random
    model, 3 valid_seen games x 2 samples, 3 steps of 16 tokens. Returns {name: (out folder, result)}."""
    expert, tiny = tmp_path_factory.mktemp("eval") / "expert", tmp_path_factory.mktemp("eval") / "tiny"
    res = side_by_side(
        (run_script, ["evaluate.py", "--model", "expert", "--limit", "6", "--workers", "2", "--out", str(expert)]),
        (run_script, ["evaluate.py", *TINY, "--out", str(tiny)]))
    return {"expert": (expert, res[0]), "tiny": (tiny, res[1])}


@pytest.fixture(scope="module")
def expert_eval(evaluations):
    return evaluations["expert"]


@pytest.fixture(scope="module")
def tiny_eval(evaluations):
    """Its test resumes into this folder (the only test that uses it)."""
    return evaluations["tiny"]


def load(out):
    with open(out / "results.json") as f:
        results = json.load(f)
    with open(out / "manifest.json") as f:
        manifest = json.load(f)
    return results, manifest, read_jsonl(out / "trajectories.jsonl"), (out / "results.md").read_text()


@pytest.mark.slow
def test_expert_evaluation(expert_eval):
    out, res = expert_eval
    results, manifest, eps, md = load(out)
    assert len(eps) == 12 and len({e["uid"] for e in eps}) == 12
    for split in ("valid_seen", "valid_unseen"):
        mine = [e for e in eps if e["split"] == split]
        r = results["splits"][split]
        # one game of each type, all from this split's real game list
        assert sorted(TASK_TYPES[e["task_type"]] for e in mine) == sorted(TYPE_ORDER)
        assert {e["task_id"] for e in mine} <= {task_id_of(g) for g in list_games(split)}
        assert r["types_present"] == TYPE_ORDER and r["games"] == 6 and r["episodes"] == 6
        for t in TYPE_ORDER:
            assert r["success_pct"][t]["mean"] >= 95.0, (split, t, r["success_pct"][t])
        # the table is the trajectories' own numbers: success, length (the expert plays the walkthrough), invalid
        assert r["success_pct"]["All"]["mean"] == pytest.approx(100 * statistics.mean(e["success"] for e in mine))
        assert r["episode_length"]["All"] == pytest.approx(statistics.mean(e["length"] for e in mine))
        for e in mine:
            assert e["length"] == len(walkthrough(e["game_file"])) and e["success"]
        assert r["invalid_action_pct"]["All"] == 0.0
        assert r["success_pct"]["Avg"]["mean"] == pytest.approx(
            statistics.mean(r["success_pct"][t]["mean"] for t in TYPE_ORDER))
    # Markdown: the paper's order, the paper's rows for the default backbone, the conditions that differ
    assert "| | Pick | Look | Clean | Heat | Cool | Pick2 | Avg | All | score % | length | invalid % | inadmissible % |" in md
    seen, unseen = md.split("## valid_unseen")
    assert "| paper: Qwen2.5-3B-Instruct SEED | 100.0 | 100.0 | 100.0 | 100.0 | 70.6 | 80.0 | 91.8 |" in seen
    assert "GRPO" in seen and "75.0" in seen and "86.2" in unseen and "70.9" in unseen
    differences = md.split("## Conditions that differ from the paper")[1]
    assert "- model: this run `expert`" in differences and "- data: this run valid_seen 6 games" in differences
    assert "- steps:" not in differences and "- temperature:" not in differences  # the paper's values were used
    assert "8 x A800 80 GB" in differences
    # manifest: only --limit differs from the paper's evaluation settings; the game list is the one played
    assert set(manifest["diff_vs_paper"]) == {"limit"}
    played = [e["task_id"] for e in sorted(eps, key=lambda e: (e["split"] != "valid_seen", e["group"]))]
    assert manifest["games"]["sha256"] == games_sha256(played) and manifest["games"]["count"] == 12


@pytest.mark.slow
def test_tiny_evaluation_samples_and_resume(tiny_eval, tmp_path):
    out, res = tiny_eval
    results, manifest, eps, md = load(out)
    r = results["splits"]["valid_seen"]
    assert len(eps) == 6 and sorted(e["uid"][-3:] for e in eps) == ["#s0"] * 3 + ["#s1"] * 3
    assert r["types_present"] == ["Pick", "Look", "Clean"]  # 3 games: the first three types in turn
    # a valid, low number: recomputed from the episodes; lengths capped at 3 steps
    assert all(e["length"] <= 3 for e in eps)
    steps = [s for e in eps for s in e["steps"]]
    assert r["invalid_action_pct"]["All"] == pytest.approx(100 * sum(not s["valid"] for s in steps) / len(steps))
    assert r["invalid_action_pct"]["All"] > 50
    for k in (0, 1):
        sample = [e for e in eps if e["sample"] == k]
        assert r["success_pct"]["All"]["per_sample"][k] == pytest.approx(100 * statistics.mean(e["success"] for e in sample))
    assert 0 <= r["success_pct"]["All"]["mean"] < 50
    for c in ["Pick", "Look", "Clean", "Avg", "All"]:  # 2 samples: a mean and a 95% interval around it
        lo, hi = r["success_pct"][c]["ci95"]
        assert lo <= r["success_pct"][c]["mean"] <= hi and len(r["success_pct"][c]["per_sample"]) == 2
    assert r["success_pct"]["Heat"]["mean"] is None and r["success_pct"]["Heat"]["ci95"] is None
    assert "95% interval (t, over samples)" in md and "Avg is over the 3 task types present" in md
    # exactly the flags changed from the paper's settings
    assert set(manifest["diff_vs_paper"]) == {"splits", "limit", "max_steps", "max_new_tokens"}
    assert manifest["diff_vs_paper"]["max_steps"] == {"run": 3, "paper": 30}
    for what in ("- steps: this run 3; paper 30", "- response tokens: this run 16; paper 512", "- data: this run"):
        assert what in md

    # resume: drop the last episode and leave a torn line; only that episode is replayed, identically
    path = out / "trajectories.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])
    path.write_text("".join(lines[:-1]) + lines[-1][:40])
    again = run_script(["evaluate.py", *TINY, "--out", str(out)])
    assert "5 already in" in again.stdout and "1 to play" in again.stdout
    eps2 = read_jsonl(path)
    assert [e["uid"] for e in eps2] == [e["uid"] for e in eps]
    replayed = eps2[-1]
    assert [s["response"] for s in replayed["steps"]] == [s["response"] for s in last["steps"]]  # seeded per (uid, step)
    # nothing left to play: the tables are rebuilt, here beside another backbone's paper rows
    run_script(["evaluate.py", *TINY, "--paper-backbone", "Qwen2.5-7B-Instruct", "--out", str(out)])
    md7 = (out / "results.md").read_text()
    assert "| paper: Qwen2.5-7B-Instruct GRPO | - | - | - | - | - | - | 81.2 |" in md7
    assert "| paper: Qwen2.5-7B-Instruct SEED | - | - | - | - | - | - | 96.1 |" in md7 and "| 70.6 |" not in md7
    assert json.loads((out / "results.json").read_text())["splits"]["valid_seen"] == r
    # other settings into the same folder are refused, and nothing is written
    other = list(TINY)
    other[other.index("--max-steps") + 1] = "4"
    bad = run_script(["evaluate.py", *other, "--out", str(out)], check=False)
    assert bad.returncode != 0 and "other settings" in bad.stderr and len(read_jsonl(path)) == 6


# ---------------------------------------------------------------------------------------------------
# The training report

CURVE_KEYS = ["rollout/success_rate", "rollout/episode_length", "loss/opd", "opd/gate_mean", "opd/gate_active_ratio",
              "opd/teacher_gap_mean", "loss/kl", "opd/teacher_coverage", "rollout/invalid_rate"] + \
             [f"rollout/success/{t}" for t in TYPE_ORDER]
OPD_KEYS = {"loss/opd", "opd/gate_mean", "opd/gate_active_ratio", "opd/teacher_gap_mean", "opd/teacher_coverage",
            "skill/parse_rate"}


def write_metrics(run_dir, opd, updates=12, offset=0.0):
    """seed_rl.py's metrics.jsonl format; a GRPO run has null OPD/skill keys. Update 5 has a null Look rate
    and a NaN KL (both skipped), and the file ends with a torn line (a kill mid-write)."""
    run_dir.mkdir(parents=True)
    lines = []
    for u in range(1, updates + 1):
        m = {"update": u, "time": 1.7e9 + u, "rollout/episodes": 128, "rollout/env_failures": 0,
             "rollout/success_rate": offset + 0.03 * u, "rollout/return_mean": 10 * (offset + 0.03 * u),
             "rollout/episode_length": 28 - u, "rollout/invalid_rate": 0.3 / u, "rollout/truncated_rate": 0.0,
             **{f"rollout/success/{t}": offset + 0.01 * i + 0.02 * u for i, t in enumerate(TYPE_ORDER)},
             "skill/parse_rate": 0.9 if opd else None, "opd/teacher_coverage": 0.8 + 0.01 * u if opd else None,
             "loss/total": 0.1, "loss/pg": 0.01 * u, "loss/kl": 0.001 * u, "loss/opd": -0.3 + 0.02 * u if opd else None,
             "opd/gate_mean": 0.5 + 0.01 * u if opd else None, "opd/gate_active_ratio": 0.4 if opd else None,
             "opd/teacher_gap_mean": 0.1 if opd else None, "pg/clipfrac": 0.02, "grad_norm": 0.7,
             "tokens/response": 4000, "train/optimizer_steps": 2, "train/skipped_steps": 0,
             **{f"time/{k}": 1.0 + u for k in ("generate", "env", "analysis", "scoring", "train", "sync", "update")}}
        if u == 5:
            m["rollout/success/Look"], m["loss/kl"] = None, float("nan")
        lines.append(json.dumps(m))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"update": 13, "rollout/succ')


def expected_points(key, opd, updates=12):
    if key in OPD_KEYS and not opd:
        return None
    return updates - (key in ("rollout/success/Look", "loss/kl"))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_metrics(root / "grpo", opd=False)
    write_metrics(root / "seed", opd=True, offset=0.2)
    return root


def test_report_draws_every_curve(two_runs, tmp_path):
    from matplotlib.image import imread
    out = tmp_path / "report"
    res = run_script(["evaluate.py", "--report", str(two_runs / "grpo"), str(two_runs / "seed" / "metrics.jsonl"),
                      "--smooth", "3", "--out", str(out)])
    assert "torn last line" in res.stderr
    rep = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    assert rep["matplotlib"] and [r["label"] for r in rep["runs"]] == ["grpo", "seed"]
    panels = {pn["key"]: (fig, pn) for fig in rep["figures"] for pn in fig["panels"]}
    for key in CURVE_KEYS:
        fig, pn = panels[key]
        want = {label: expected_points(key, opd) for label, opd in (("grpo", False), ("seed", True))}
        assert pn["drawn"] == {k: v for k, v in want.items() if v is not None}, key
        assert pn["missing"] == [k for k, v in want.items() if v is None], key
        assert fig["file"] and f"![{fig['title']}]({fig['file']})" in md
    files = sorted({fig["file"] for fig in rep["figures"] if fig["file"]})
    assert sorted(p.name for p in out.glob("*.png")) == files and len(files) == len(rep["figures"])
    for name in files:
        raw = (out / name).read_bytes()
        assert raw[:8] == b"\x89PNG\r\n\x1a\n"
        img = imread(out / name)
        assert img.shape[0] > 200 and img.shape[1] > 300 and img.std() > 0.01  # a real, non-blank picture
    # the numbers behind the curves: the last value of each run, and the note that GRPO has no OPD curves
    assert "| `rollout/success_rate` | seed | 12 | 0.2300 | 0.5600 |" in md
    assert "loss/opd: no values (null or missing) in grpo" in md


def test_report_text_only_without_matplotlib(two_runs, tmp_path):
    """A `matplotlib` package that raises ImportError shadows the real one: the report must say it is
    text-only, draw nothing, and still give the numbers of every curve."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    out = tmp_path / "report"
    res = run_script(["evaluate.py", "--report", str(two_runs / "grpo"), str(two_runs / "seed"), "--out", str(out)],
                     env={"PYTHONPATH": os.pathsep.join([str(fake), REPO])})
    assert "text-only" in res.stdout
    rep = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    assert rep["matplotlib"] is False and not list(out.glob("*.png")) and "![" not in md
    assert "**Text-only report**" in md
    for key in CURVE_KEYS:
        assert f"| `{key}` | seed |" in md and f"| `{key}` | grpo |" in md


# ---------------------------------------------------------------------------------------------------
# The data manifest of the paper preset

def data_manifest(tmp_path, seed):
    out = tmp_path / f"dm{seed}"
    res = run_script(["evaluate.py", "--data-manifest", "--seed", str(seed), "--out", str(out)])
    return json.loads((out / "data_manifest.json").read_text()), res.stdout


def test_data_manifest(tmp_path):
    train_ids = {task_id_of(g) for g in list_games("train")}
    m0, text = data_manifest(tmp_path, 0)
    s1, rl = m0["stage1"], m0["rl_stream"]
    assert s1["count"] == 180 and s1["trajectories"] == 1440 and s1["unique"] == 180
    assert s1["per_type"] == {t: 30 for t in TASK_TYPES}
    assert rl["count"] == 2400 and rl["unique"] == 2400 and sum(rl["per_type"].values()) == 2400
    assert set(s1["task_ids"]) <= train_ids and set(rl["task_ids"]) <= train_ids
    assert s1["sha256"] == games_sha256(s1["task_ids"]) and rl["sha256"] == games_sha256(rl["task_ids"])
    assert s1["sha256"] == hashlib.sha256("\n".join(s1["task_ids"]).encode()).hexdigest()
    assert all(m0["checks"].values()) and "FAIL" not in text and s1["sha256"] in text
    # determinism for a seed; another seed gives other sets
    again, _ = data_manifest(tmp_path / "again", 0)
    assert again["stage1"]["task_ids"] == s1["task_ids"] and again["rl_stream"]["sha256"] == rl["sha256"]
    m1, _ = data_manifest(tmp_path, 1)
    assert m1["stage1"]["sha256"] != s1["sha256"] and m1["rl_stream"]["sha256"] != rl["sha256"]
    assert m1["stage1"]["per_type"] == s1["per_type"] and m1["rl_stream"]["count"] == 2400
    assert set(m1["stage1"]["task_ids"]) != set(s1["task_ids"])


def test_report_axes_lines_and_small_numbers(tmp_path, monkeypatch):
    """Updates are whole numbers on the x axis; rates sit on a fixed 0-1 axis; runs that coincide stay
    distinguishable (their own line style and marker); values too small for the summary's decimals are in
    scientific notation, not 0.0000."""
    import matplotlib.figure
    from common.report import write_report
    runs = tmp_path / "runs"
    for name in ("grpo", "seed"):
        (runs / name).mkdir(parents=True)
        rows = [{"update": u, "rollout/success_rate": 0.0, "rollout/invalid_rate": 0.02 + 0.001 * u,
                 "loss/opd": 3e-5 * u if name == "seed" else None, "loss/kl": 0.0} for u in (1, 2, 3)]
        (runs / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    axes = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, path, **kw):
        for ax in fig.axes:
            if ax.get_title():
                axes[ax.get_title()] = ax
        return real_savefig(fig, path, **kw)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    write_report([str(runs / "grpo"), str(runs / "seed")], str(tmp_path / "report"))
    for key in ("rollout/success_rate", "rollout/invalid_rate"):
        assert axes[key].get_ylim() == pytest.approx((-0.03, 1.03)), key
    assert axes["loss/opd"].get_ylim()[1] < 0.01  # not a rate: scaled to its values
    for ax in axes.values():
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    grpo, seed = axes["rollout/success_rate"].get_lines()  # the same values: both must stay visible
    assert list(grpo.get_ydata()) == list(seed.get_ydata())
    assert (grpo.get_linestyle(), grpo.get_marker()) != (seed.get_linestyle(), seed.get_marker())
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| seed | 3 | 0.000 | 0.000 | - | 0.022 | 6.00e-05 |" in md  # the OPD loss (last 10), not 0.0000
    assert "| `loss/opd` | seed | 3 | 3.00e-05 | 9.00e-05 |" in md


@pytest.mark.slow  # ~47 s on 2 cores: 6 expert episodes over an interrupted run and its rerun
def test_ctrl_c_saves_every_finished_episode_and_says_how_to_resume(tmp_path):
    """As collect.py: each episode is written when it ends; Ctrl-C keeps them and prints one line."""
    out = tmp_path / "eval"
    traj = out / "trajectories.jsonl"
    args = ["evaluate.py", "--model", "expert", "--splits", "valid_seen", "--limit", "6", "--workers", "2",
            "--out", str(out)]
    code, stdout, stderr = interrupt(args, str(traj), lines=1)
    saved = len(read_jsonl(traj))
    assert code == 130 and 1 <= saved < 6, (code, saved, stderr[-2000:])
    assert "Traceback" not in stderr + stdout and "KeyboardInterrupt" not in stderr + stdout
    assert stderr.strip().splitlines()[-1] == (f"interrupted: {saved} of 6 episodes are saved in {traj} ({saved} "
                                               "by this run); rerun the same command to resume")
    res = run_script(args)
    assert f"{saved} already in {traj}, {6 - saved} to play" in res.stdout
    assert sorted(e["uid"] for e in read_jsonl(traj)) == sorted(set(e["uid"] for e in read_jsonl(traj)))
    assert len(read_jsonl(traj)) == 6


def test_heldout_series_by_hand(tmp_path):
    """common/report.py's held-out curve from seed_rl.py's heldout.jsonl: per point, the share of episodes won and
    of steps invalid, env failures left out, an episode on file twice counted once (its last row)."""
    from common.report import heldout_series
    rows = [dict(uid="a", update=0, success=False, env_failure=None, steps=[{"valid": False}, {"valid": True}]),
            dict(uid="b", update=0, success=True, env_failure=None, steps=[{"valid": True}]),
            dict(uid="c", update=0, success=False, env_failure="worker died", steps=[]),
            dict(uid="a", update=2, success=True, env_failure=None, steps=[{"valid": True}]),
            dict(uid="b", update=2, success=True, env_failure=None, steps=[{"valid": True}] * 3),
            dict(uid="b", update=2, success=False, env_failure=None, steps=[{"valid": False}])]  # replayed: the last
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = heldout_series(str(path))
    assert got["heldout/success_rate"] == [(0, 0.5), (2, 0.5)]
    assert got["heldout/invalid_rate"] == [(0, 1 / 3), (2, 0.5)]
    assert heldout_series(str(tmp_path / "none.jsonl")) == {}
