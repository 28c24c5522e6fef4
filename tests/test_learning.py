"""benchmarks/learning.py (the plain runner) and benchmarks/remote/learning_remote.py (its remote driver and
runners) with stand-ins for seed_rl.py and evaluate.py (tests/data/fake_*.py: the same flags and output files, no
model), so the bookkeeping is tested in seconds: one record per finished run, finished runs skipped, a killed run
leaves no record and no processes, the engine gate keeps two jobs' engine starts apart, --detach leaves jobs
running for the next call, --merge dedupes. The last test runs the real seed_rl.py and evaluate.py with the tiny
model (slow)."""
import json
import os
import sys

import pytest

from conftest import REPO, run_script

DATA = os.path.join(REPO, "tests", "data")
PLAIN, REMOTE = "benchmarks/learning.py", "benchmarks/remote/learning_remote.py"


def read(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture
def fake(tmp_path):
    """A start model folder and a driver command line that uses the stand-ins."""
    start = tmp_path / "start"
    start.mkdir()
    (start / "config.json").write_text('{"model_type": "qwen2"}')
    (start / "model.safetensors").write_text("weights")
    res, scratch = tmp_path / "results", tmp_path / "scratch"
    # the driver's report without its figures (~3 s of matplotlib per driver call, ~30 calls here): a `matplotlib`
    # that raises ImportError shadows the real one, the report's own text-only path. The figures are drawn and
    # checked in tests/test_learning_report.py, and by the real driver in test_real_scripts_tiny_model below.
    hide = tmp_path / "no_matplotlib"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")

    def drive(*extra, env=None, timeout=120, check=True, script=REMOTE):
        args = [script, "--model", str(start), "--updates", "3", "--launcher", "python",
                "--backend", "hf", "--seed-rl-script", os.path.join(DATA, "fake_seed_rl.py"),
                "--evaluate-script", os.path.join(DATA, "fake_evaluate.py"), "--results-dir", str(res),
                "--scratch", str(scratch), *extra]
        return run_script(args, timeout=timeout, check=check, env=dict(env or {}, **drive.no_figures))
    drive.res, drive.scratch = res, scratch
    drive.no_figures = {"PYTHONPATH": os.pathsep.join([REPO, str(hide)])}
    return drive


def test_one_record_per_finished_run_and_finished_runs_are_skipped(fake):
    out = fake("--methods", "seed,grpo", "--seeds", "0,1", script=PLAIN).stdout
    runs = read(fake.res / "runs.jsonl")
    assert sorted(r["run_id"].split("-s")[0] + str(r["seed"]) for r in runs) == ["grpo0", "grpo1", "seed0", "seed1"]
    assert len({r["group"] for r in runs}) == 1 and len(read(fake.res / "evals.jsonl")) == 1
    for r in runs:
        assert [u["update"] for u in r["updates"]] == [1, 2, 3]
        assert r["start"]["label"] == "base:start" and len(r["start"]["weights_sha256"]) == 1
        assert r["code"]["commit"] and "dirty" in r["code"]
        assert r["eval"]["start"]["all"]["invalid"] == 81.0 and r["eval"]["end"]["all"]["invalid"] == 41.0
        assert ("--opd-coef 0" in r["commands"]["train"]) == (r["method"] == "grpo")
        assert f"--seed {r['seed']} " in r["commands"]["train"] and r["commands"]["eval_start"]
        assert (r["updates"][0]["parse_rate"] is None) == (r["method"] == "grpo")
        assert r["compute"]["lanes"] == 1 and r["compute"]["gpu_util_train"] == 0.4
        assert not os.path.exists(os.path.join(fake.scratch, r["run_id"], "train", "hf"))  # end weights removed
        # each evaluation's actions, slimmed from its trajectories (part L's tarball carries them)
        acts = read(os.path.join(fake.scratch, r["run_id"], "eval", "actions.jsonl"))
        assert [a["task_id"] for a in acts] == ["t0", "t1"] and [a["success"] for a in acts] == [False, True]
        assert acts[0]["steps"] == [{"action": "go to desk 1", "valid": True, "invalid_reason": None,
                                     "admissible_action": False, "feedback": "Nothing happens.",
                                     "response": "<action>go to desk 1</action>"}]
    assert "4 run(s) in this call, 0 failed" in out and len(read(fake.res / "attempts.jsonl")) == 5
    assert (fake.res / "report" / "report.md").exists()  # the report of every record on file
    # again, plus a new seed of one method: the four are skipped, only the new one runs
    out = fake("--methods", "grpo,seed", "--seeds", "0,1,2", "--methods", "grpo", script=PLAIN).stdout
    assert out.count("finished, on file (skipped)") == 2 and "grpo-s2-" in out and "1 run(s) in this call" in out
    assert len(read(fake.res / "runs.jsonl")) == 5 and len(read(fake.res / "evals.jsonl")) == 1
    # a different setting is another group (and another start evaluation), never the same run id
    fake("--methods", "grpo", "--seeds", "0", "--lr", "1e-6", script=PLAIN)
    runs = read(fake.res / "runs.jsonl")
    assert len(runs) == 6 and len({r["group"] for r in runs}) == 2 and len(read(fake.res / "evals.jsonl")) == 1


def test_plain_runner_a_failed_run_leaves_no_record_and_says_why(fake, tmp_path):
    bad = tmp_path / "fail.py"
    bad.write_text("import sys\nprint('torch.OutOfMemoryError: CUDA out of memory')\nsys.exit(3)\n")
    p = fake("--methods", "grpo,seed", "--seeds", "0", "--seed-rl-script", str(bad), script=PLAIN, check=False)
    assert p.returncode == 1 and "FAILED in train (rc 3, out_of_memory)" in p.stdout
    assert "2 run(s) in this call, 2 failed" in p.stdout
    assert read(fake.res / "runs.jsonl") == [] and len(read(fake.res / "evals.jsonl")) == 1  # the start's is kept
    assert sorted(a["outcome"] for a in read(fake.res / "attempts.jsonl")) == ["failed", "failed", "ok"]


def test_a_run_killed_at_the_deadline_leaves_no_record_and_no_process(fake):
    fake("--methods", "grpo", "--seeds", "0")  # on file: its time is the estimate for the next (about 1 s)
    out = fake("--methods", "grpo", "--seeds", "1", "--deadline-s", "2.5", env={"FAKE_SLEEP": "1.5"}).stdout
    assert "killed at the deadline, no record" in out
    assert [r["seed"] for r in read(fake.res / "runs.jsonl")] == [0]
    killed = [a for a in read(fake.res / "attempts.jsonl") if a["outcome"] == "killed"]
    assert len(killed) == 1 and killed[0]["seed"] == 1 and killed[0]["phase"] == "train"
    job = os.path.join(fake.scratch, killed[0]["job_id"])
    with open(os.path.join(job, "status.json")) as f:
        pid = json.load(f)["pid"]
    with open(os.path.join(job, "child.pid")) as f:
        child = int(f.read())
    sys.path.insert(0, os.path.join(REPO, "benchmarks", "remote"))
    from learning_remote import pid_alive  # gone, or a zombie that only waits for its reaper
    assert not pid_alive(pid) and not pid_alive(child)  # the runner and seed_rl.py
    # the rerun starts training afresh: exactly updates 1..3 (the killed attempt's rows are not kept)
    out = fake("--methods", "grpo", "--seeds", "1").stdout
    r = [r for r in read(fake.res / "runs.jsonl") if r["seed"] == 1]
    assert len(r) == 1 and [u["update"] for u in r[0]["updates"]] == [1, 2, 3] and r[0]["compute"]["attempts"] == 2


def test_the_engine_gate_keeps_engine_starts_apart(fake):
    """Two jobs side by side, each starting an engine (a 1.5 s 'profiling window'): while one is in its window,
    the other's process does not run at all (no beat), and each job records the seconds it was stopped. Under
    torchrun, as on the GPU: its worker runs in a session of its own, so the gate stops process trees; but not
    the env workers in them (their beats go on: the env pool's deadlines are wall-clock)."""
    fake("--methods", "seed,grpo", "--seeds", "0", "--lanes", "2", "--launcher", "torchrun",
         env={"FAKE_VLLM": "1.5", "FAKE_SLEEP": "1.5", "FAKE_BARRIER": f"{fake.res.parent}/barrier:2"}, timeout=180)
    runs = read(fake.res / "runs.jsonl")
    assert len(runs) == 2 and all(r["compute"]["frozen_s"] > 0.5 for r in runs)
    assert all(r["compute"]["lanes"] == 2 and r["compute"]["gpu_util_train"] == 0.2 for r in runs)
    beats = {}
    for r in runs:
        with open(os.path.join(fake.scratch, r["run_id"], "train", "beats")) as f:
            beats[r["run_id"]] = [(k, float(t)) for k, t in (line.split() for line in f)]
    (a, ba), (b, bb) = beats.items()
    for mine, other in ((ba, bb), (bb, ba)):
        w = [t for k, t in mine if k == "W"]
        assert w and max(w) - min(w) > 1.0
        assert not [t for k, t in other if k != "E" and min(w) < t < max(w)], "the other job ran in this engine start"
    first, second = sorted((ba, bb), key=lambda b: min(t for k, t in b if k == "W"))
    w = [t for k, t in second if k == "W"]  # in the second engine start, the first job's env worker beat on
    assert len([t for k, t in first if k == "E" and min(w) < t < max(w)]) > 10


def test_with_a_fixed_kv_cache_engine_starts_stay_apart_but_nobody_else_stops(fake):
    """--kv-cache-gib: the engines do not profile the free memory, so a job that is already running runs on while
    another job's engine starts; the engine starts themselves still take turns (vLLM's compile cache is written by
    the first). The flag reaches seed_rl.py, and is a compute flag (the same group as without it)."""
    fake("--methods", "seed,grpo", "--seeds", "0", "--lanes", "2", "--launcher", "torchrun", "--kv-cache-gib", "2",
         env={"FAKE_VLLM": "1.5", "FAKE_SLEEP": "1.5", "FAKE_BARRIER": f"{fake.res.parent}/barrier:2"}, timeout=180)
    runs = read(fake.res / "runs.jsonl")
    assert len(runs) == 2 and all("--kv-cache-gib 2.0" in r["commands"]["train"] for r in runs)
    beats = {}
    for r in runs:
        with open(os.path.join(fake.scratch, r["run_id"], "train", "beats")) as f:
            beats[r["run_id"]] = [(k, float(t)) for k, t in (line.split() for line in f)]
    first, second = sorted(beats.values(), key=lambda b: min(t for k, t in b if k == "W"))
    w1, w2 = ([t for k, t in b if k == "W"] for b in (first, second))
    assert max(w1) < min(w2)  # one engine start at a time
    # while the second engine starts, the first job trains on (its update beats), unlike the freezing gate above
    assert len([t for k, t in first if k == "R" and min(w2) < t < max(w2)]) > 10
    frozen = sorted(r["compute"]["frozen_s"] for r in runs)
    assert frozen[0] < 0.5 and frozen[1] > 0.5  # only the job that waited for its turn was stopped
    fake("--methods", "seed,grpo", "--seeds", "0", "--lanes", "2", "--launcher", "torchrun")
    assert len(read(fake.res / "runs.jsonl")) == 2  # without the flag: the same runs, on file (skipped)


def test_with_a_fixed_kv_cache_a_warm_machine_starts_engines_side_by_side(fake):
    """Once an engine of a phase has started on the machine (a former call's job, same --scratch: vLLM's compile cache
    is warm), later engine starts of that phase skip the gate: two new jobs start their engines at the same time and
    neither is stopped."""
    env = {"FAKE_VLLM": "1.5", "FAKE_SLEEP": "0.2"}
    fake("--methods", "grpo", "--seeds", "0", "--launcher", "torchrun", "--kv-cache-gib", "2", env=env, timeout=180)
    assert sorted(p.name for p in fake.scratch.glob("engine.warm.*")) == ["engine.warm.train"]
    fake("--methods", "seed,grpo", "--seeds", "1", "--lanes", "2", "--launcher", "torchrun", "--kv-cache-gib", "2",
         env=dict(env, FAKE_BARRIER=f"{fake.res.parent}/barrier:2"), timeout=180)
    runs = [r for r in read(fake.res / "runs.jsonl") if r["seed"] == 1]
    assert len(runs) == 2 and all(r["compute"]["frozen_s"] < 0.3 for r in runs)
    windows = []
    for r in runs:
        with open(os.path.join(fake.scratch, r["run_id"], "train", "beats")) as f:
            w = [float(t) for k, t in (line.split() for line in f) if k == "W"]
        windows.append((min(w), max(w)))
    (a0, a1), (b0, b1) = windows
    assert a0 < b1 and b0 < a1  # the two engine starts overlap


def test_detach_leaves_jobs_running_for_the_next_call(fake):
    out = fake("--methods", "seed,grpo", "--seeds", "0", "--lanes", "2", "--deadline-s", "1.5", "--detach",
               env={"FAKE_SLEEP": "1.0"}).stdout
    assert "left running" in out and read(fake.res / "runs.jsonl") == []
    out = fake("--methods", "seed,grpo", "--seeds", "0", "--lanes", "2").stdout
    assert len(read(fake.res / "runs.jsonl")) == 2


def test_two_learning_rates_in_one_call_share_the_start_evaluation(fake):
    """Two drivers, one --lr each, on one --scratch (h200.sh part L called twice in a call): side by side, one
    evaluation of the shared start, two groups whose runs both compare with it."""
    for lr in ("3e-6", "1e-6"):
        out = fake("--methods", "grpo", "--seeds", "0", "--lanes", "2", "--lr", lr, "--deadline-s", "1.5", "--detach",
                   env={"FAKE_SLEEP": "1.0"}).stdout
        assert "left running" in out
    for lr in ("3e-6", "1e-6"):
        fake("--methods", "grpo", "--seeds", "0", "--lanes", "2", "--lr", lr)
    runs, evals = read(fake.res / "runs.jsonl"), read(fake.res / "evals.jsonl")
    assert sorted(r["config"]["lr"] for r in runs) == [1e-6, 3e-6] and len({r["group"] for r in runs}) == 2
    assert len(evals) == 1 and {r["eval_key"] for r in runs} == {evals[0]["eval_key"]}


@pytest.mark.parametrize("script", [PLAIN, REMOTE])
def test_a_start_made_again_gets_its_own_evaluation_only_when_runs_need_it(fake, script):
    """The start's evaluation is keyed by its weights too: the same label with other weights (the BC SFT made again
    on another machine) is evaluated again, but only when a run is left to compare with it."""
    fake("--methods", "grpo", "--seeds", "0", "--start-label", "bc", script=script)
    assert len(read(fake.res / "evals.jsonl")) == 1
    (fake.res.parent / "start" / "model.safetensors").write_text("other weights")
    fake("--methods", "grpo", "--seeds", "0", "--start-label", "bc", script=script)  # its run is on file
    assert len(read(fake.res / "evals.jsonl")) == 1
    fake("--methods", "grpo", "--seeds", "0,1", "--start-label", "bc", script=script)  # seed 1 is new
    evals, runs = read(fake.res / "evals.jsonl"), read(fake.res / "runs.jsonl")
    assert len(evals) == 2 and len({e["eval_key"] for e in evals}) == 2 and len({r["group"] for r in runs}) == 1
    assert sorted(r["eval_key"] for r in runs) == sorted(e["eval_key"] for e in evals)  # each run, its own start


def test_merge_appends_only_new_records(fake, tmp_path):
    fake("--methods", "grpo", "--seeds", "0,1")
    home = tmp_path / "home"
    for _ in range(2):
        run_script([REMOTE, "--merge", str(fake.res), "--results-dir", str(home)])
    assert len(read(home / "runs.jsonl")) == 2 and len(read(home / "evals.jsonl")) == 1


def test_salvage_records_what_a_lost_machine_brought_back(fake, tmp_path):
    """Part L's tarball of job folders after the machine went away: a run whose training finished but whose end
    evaluation did not gets a record without it (and its reason); a run cut off in training only a 'lost' attempt;
    a finished start evaluation its record. Salvaging twice adds nothing."""
    import shutil
    import tarfile
    fake("--methods", "grpo", "--seeds", "0,1")
    jobs = {p.name.split("-")[0] + p.name.split("-")[1]: p for p in fake.scratch.iterdir() if (p / "job.json").exists()}
    a, b = jobs["grpos0"], jobs["grpos1"]
    for d, phase, keep in ((a, "eval", 3), (b, "train", 2)):
        (d / "done.json").unlink()
        shutil.rmtree(d / "eval", ignore_errors=True)
        st = json.loads((d / "status.json").read_text())
        (d / "status.json").write_text(json.dumps(dict(st, phase=phase)))
        rows = (d / "train" / "metrics.jsonl").read_text().splitlines()[:keep]
        (d / "train" / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    tarball = tmp_path / "L.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        for d in jobs.values():
            tar.add(d, arcname=f"learning/{d.name}")
    home = tmp_path / "home"
    for _ in range(2):
        run_script([REMOTE, "--salvage", str(tarball), "--results-dir", str(home)])
    runs, attempts = read(home / "runs.jsonl"), read(home / "attempts.jsonl")
    assert [r["seed"] for r in runs] == [0] and len(read(home / "evals.jsonl")) == 1
    r = runs[0]
    assert [u["update"] for u in r["updates"]] == [1, 2, 3] and r["eval"]["end"] is None
    assert "end evaluation" in r["eval"]["end_missing"] and r["eval"]["start"]["all"]["invalid"] == 81.0
    assert r["compute"]["eval_wall_s"] is None and r["compute"]["train_wall_s"] > 0
    assert sorted((x["seed"], x["outcome"], x["updates_done"]) for x in attempts if x["kind"] == "run") == \
        [(0, "salvaged", 3), (1, "lost", 2)]
    assert len(attempts) == 3  # and the start evaluation's, once
    # bad input: one line, no traceback
    (tmp_path / "bad.tar.gz").write_text("not a tarball")
    for path, said in ((tmp_path / "bad.tar.gz", "not a readable tarball"), (tmp_path / "nowhere", "no such file")):
        p = run_script([REMOTE, "--salvage", str(path), "--results-dir", str(home)], check=False)
        assert p.returncode == 1 and said in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("script", [PLAIN, REMOTE])
def test_eval_in_run_records_each_runs_own_start_and_end_and_runs_no_evaluate(fake, script):
    """--eval-in-run: seed_rl.py gets --eval-every <updates>; no evaluate.py job (no start evaluation, no eval
    phase); each record holds its run's own start and end (from heldout.jsonl), and the report pairs them."""
    out = fake("--methods", "seed,grpo", "--seeds", "0,1", "--eval-in-run", "--eval-limit", "2",
               script=script).stdout
    runs = read(fake.res / "runs.jsonl")
    assert len(runs) == 4 and read(fake.res / "evals.jsonl") == [] and "starteval" not in out
    for r in runs:
        assert "--eval-every 3 --eval-limit 2" in r["commands"]["train"] and r["eval"]["start_in_run"]
        assert r["eval"]["start"]["all"]["success"] == 50.0 * r["seed"] and r["eval"]["end"]["all"]["success"] == 50.0
        assert r["eval"]["end"]["per_task"]["valid_seen/t0"] == [1] and r["config"]["eval"]["in_run"]
        assert not (fake.scratch / r["run_id"] / "eval").exists()
    run_script(["benchmarks/learning_report.py", "--results-dir", str(fake.res)], env=fake.no_figures)
    rep = json.loads((fake.res / "report" / "report.json").read_text())
    (g,) = rep["groups"]
    # each run against its own start: seed 0 +50, seed 1 0 points
    assert g["start_in_run"] and g["eval"]["all"]["grpo"]["success"]["end_minus_start"]["mean"] == 25.0
    # per task, the ends' mean minus the starts' mean: t0 0 -> 1 (+100), t1 0.5 -> 0 (-50), in both splits
    assert g["paired_tasks"]["seed_end_minus_start"]["mean"] == 25.0
    again = fake("--methods", "seed,grpo", "--seeds", "0,1", "--eval-in-run", "--eval-limit", "2", script=script)
    assert again.stdout.count("finished, on file (skipped)") == 4


def test_eval_in_run_refuses_evaluate_flags(fake):
    res = fake("--eval-in-run", "--eval-args", "--samples 2", script=PLAIN, check=False)
    assert res.returncode != 0 and "--eval-args: evaluate.py's, and --eval-in-run runs no evaluate.py" in res.stderr


def test_math_flags_keep_only_what_changes_the_result():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import learning
    assert learning.math_flags("--packing off --analyzer-model scripted --workers=4 --kl-coef 0 "
                               "--no-activation-checkpointing --micro-batch 8") == ["--analyzer-model", "scripted",
                                                                                    "--kl-coef", "0"]


@pytest.mark.slow
def test_real_scripts_tiny_model(tmp_path):
    """The real seed_rl.py and evaluate.py, tiny model, real ALFWorld games: 1 seed x 2 methods x 1 update."""
    res = tmp_path / "results"
    run_script([PLAIN, "--model", "tiny", "--updates", "1", "--seeds", "0", "--tasks-per-update",
                "2", "--group-size", "2", "--max-steps", "2", "--max-new-tokens", "8", "--eval-limit", "1",
                "--workers", "1", "--seed-rl-args", "--analyzer-model scripted", "--results-dir", str(res),
                "--scratch", str(tmp_path / "scratch")], timeout=900)
    runs = {r["method"]: r for r in read(res / "runs.jsonl")}
    assert set(runs) == {"seed", "grpo"} and runs["seed"]["start"]["label"] == "tiny(seed 0)"
    s, g = runs["seed"]["updates"][0], runs["grpo"]["updates"][0]
    assert s["parse_rate"] == 1.0 and s["teacher_coverage"] == 1.0 and g["parse_rate"] is None
    assert s["invalid"] == g["invalid"] and s["return"] == g["return"]  # update 1: the same episodes
    for r in runs.values():
        assert r["eval"]["start"]["all"]["episodes"] == 2 and r["eval"]["end"]["all"]["episodes"] == 2
        acts = read(tmp_path / "scratch" / r["run_id"] / "eval" / "actions.jsonl")  # the real trajectories, slimmed
        assert len(acts) == 2 and all(a["steps"] and "admissible_action" in a["steps"][0] for a in acts)
    rep = run_script(["benchmarks/learning_report.py", "--results-dir", str(res)]).stdout
    assert "SEED - GRPO" in rep and (res / "report" / "report.md").exists()


def test_eval_estimate_scales_with_the_panel():
    """The driver's time estimate for a held-out evaluation grows with its episodes (by hand: EST's 0.5 s each
    alone, at least 50 s, x1.9 side by side), so a 274-game panel is not budgeted like 24 games."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks", "remote"))
    from learning_remote import eval_seconds
    all_games = {"limit": 0, "splits": None}
    assert eval_seconds("alfworld", all_games, 1) == pytest.approx((140 + 134) * 0.5)
    assert eval_seconds("alfworld", dict(all_games, samples=2), 3) == pytest.approx(274 * 0.5 * 2 * 1.9)
    assert eval_seconds("alfworld", {"limit": 12, "splits": None}, 1) == 50  # 24 episodes: the floor
    assert eval_seconds("search", {"limit": 0, "splits": "val", "samples": 4}, 1) == pytest.approx(100 * 4 * 0.5)
