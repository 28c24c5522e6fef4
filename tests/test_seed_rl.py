"""seed_rl.py end to end on CPU, real ALFWorld games, a tiny model: 2 updates in 1 and 2 processes (gloo),
a kill in the middle of a checkpoint save followed by a resume, and a resume with other settings refused."""
import json
import os
import shutil
import signal

import pytest

from conftest import run_script, side_by_side

FLAGS = ["--env", "alfworld", "--model", "tiny", "--updates", "2", "--tasks-per-update", "2", "--group-size", "2",
         "--max-steps", "2", "--max-new-tokens", "8", "--analyzer-model", "scripted", "--save-every", "1",
         "--workers", "1"]
# a random model writes no JSON: the scripted analyzer stands in for the self-analysis (see seed_rl.py)

LOSS_KEYS = ["loss/pg", "loss/kl", "loss/opd", "loss/total", "opd/gate_mean", "opd/gate_active_ratio",
             "opd/teacher_gap_mean", "opd/teacher_coverage", "skill/parse_rate", "grad_norm", "tokens/response",
             "rollout/success_rate", "rollout/return_mean", "rollout/episode_length", "rollout/invalid_rate"]


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def close(a, b, rel=1e-4, abs_=1e-7):
    return all((a[k] is None and b[k] is None) or a[k] == pytest.approx(b[k], rel=rel, abs=abs_) for k in LOSS_KEYS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run in 1 process and in 2 (torchrun, gloo), side by side: neither reads the other, and the 1-process
    run leaves one core free most of the time (~55 s at once against 41 + 39 s one after the other on 2 cores).
    Returns (1-process folder, 2-process folder); read only."""
    one, two = tmp_path_factory.mktemp("seed1"), tmp_path_factory.mktemp("seed2")
    side_by_side((run_script, ["seed_rl.py", *FLAGS, "--out", str(one)], 900),
                 (run_script, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "seed_rl.py",
                               *FLAGS, "--out", str(two)], 900))
    return str(one), str(two)


@pytest.fixture(scope="module")
def one_process(runs):
    return runs[0]


def test_one_process_run_logs_every_metric_and_a_nonzero_opd_signal(one_process):
    m = metrics(one_process)
    assert [r["update"] for r in m] == [1, 2]
    for r in m:
        assert r["rollout/episodes"] == 4 and r["train/optimizer_steps"] == 1 and r["train/skipped_steps"] == 0
        assert r["opd/teacher_coverage"] == 1.0 and r["skill/parse_rate"] == 1.0
        assert not [k for k in r if k.startswith("skill/fail/")]  # every episode has its skill: no failure reason
        # the scripted analyzer's answers: whole JSON objects, none stopped at the cap
        assert r["skill/analysis_capped"] == 0.0
        assert 0 < r["skill/analysis_tokens_mean"] <= r["skill/analysis_tokens_max"]
        assert r["loss/opd"] != 0.0 and 0.0 < r["opd/gate_mean"] < 1.0
        assert r["tokens/response"] == 4 * 2 * 8  # 4 episodes x 2 steps x 8 tokens (every response cut)
        # the HF engine's sampled-token log-probs equal the trainer's old log-probs (fp32, same weights)
        assert r["check/engine_lp_absdiff_max"] < 1e-4
        for phase in ("sync", "generate", "env", "loop", "analysis", "scoring", "train", "update"):
            assert r[f"time/{phase}"] >= 0.0
        # the rollout's phases sum to its wall time; the loop's own share of it (issue 31) is one of them
        parts = sum(r[f"time/{p}"] for p in ("generate", "analysis", "env", "loop"))
        assert parts == pytest.approx(r["time/rollout"], rel=1e-6)
        assert r["rollout/loop_share"] == pytest.approx(r["time/loop"] / r["time/rollout"])
        assert 0.0 < r["rollout/loop_share"] < 1.0
        # HF's work is done when its poll returns, so all of the loop's work left the engine idle (Clock)
        assert r["rollout/loop_idle_share"] == pytest.approx(r["rollout/loop_share"], abs=1e-3)
    # the dump shows the same sampled tokens scored under both contexts
    with open(os.path.join(one_process, "examples.jsonl")) as f:
        ex = json.loads(f.readline())
    assert len(ex["tokens"]) == len(ex["plain_lp"]) == len(ex["teacher_lp"]) == len(ex["gap"]) == 8
    assert ex["gap"][0] == pytest.approx(ex["teacher_lp"][0] - ex["plain_lp"][0])
    # the losses and rollout statistics recorded before the env-interface refactor (tests/test_fingerprint.py)
    from test_fingerprint import load_fingerprint
    # (rel 1e-3: the OPD terms are differences of two log-probs of size ~10, so float32 rounding, which differs
    # between CPUs' vector units, moves them by ~1e-4 relative; a wrong term moves them by far more)
    for got, want in zip(m, load_fingerprint()["seed_rl_updates"]):
        assert close(got, want, rel=1e-3, abs_=1e-6), {k: (got[k], want[k]) for k in LOSS_KEYS if got[k] != want[k]}
    # HF checkpoints that transformers loads
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(os.path.join(one_process, "hf", "final"))


@pytest.mark.slow  # ~26 s on 2 cores: one GRPO update
def test_grpo_dumps_what_the_policy_writes(tmp_path):
    """--opd-coef 0 (GRPO): no teacher pass, so examples.jsonl holds sampled steps with their plain scores,
    the env's verdict and the episode's advantage (what a collapsing run needs read); no gap (the report skips it)."""
    out = tmp_path / "grpo"
    run_script(["seed_rl.py", *[f for f in FLAGS if f not in ("--analyzer-model", "scripted")], "--opd-coef", "0",
                "--updates", "1", "--dump-examples", "4", "--out", str(out)], timeout=900)
    with open(out / "examples.jsonl") as f:
        ex = [json.loads(line) for line in f]
    assert len(ex) == 4 and all(e["update"] == 1 and e["teacher_lp"] is None and e["gap"] is None for e in ex)
    for e in ex:
        assert len(e["tokens"]) == len(e["plain_lp"]) > 0 and all(lp <= 0.0 for lp in e["plain_lp"])
        assert isinstance(e["valid"], bool) and isinstance(e["advantage"], float)
    # the dumped steps are spread over the update: both groups' episodes, not the first episode's steps. GRPO's
    # advantages of a group of two are equal and opposite (both 0 when the two returns are equal, as for this
    # random model's invalid episodes)
    adv = {e["uid"]: e["advantage"] for e in ex}
    assert {u.split("/")[1] for u in adv} == {"g0", "g1"}, sorted(adv)
    for g in ("g0", "g1"):
        pair = [a for u, a in adv.items() if u.split("/")[1] == g]
        assert len(pair) < 2 or pair[0] == pytest.approx(-pair[1], abs=1e-6)


@pytest.mark.slow  # ~13 s on 2 cores: one SEED update
def test_self_analysis_stopped_at_the_cap_is_counted(tmp_path):
    """The tiny random policy as its own analyzer never writes an end token: every answer stops at
    --analysis-max-new-tokens, is counted as capped, and gives no skill (the metrics that say why SEED's rollout
    waits for its analyses and why skills fail to parse)."""
    out = tmp_path / "capped"
    run_script(["seed_rl.py", *[f for f in FLAGS if f not in ("--analyzer-model", "scripted")], "--updates", "1",
                "--analysis-max-new-tokens", "6", "--out", str(out)], timeout=900)
    (r,) = metrics(out)
    assert r["skill/analysis_capped"] == 1.0 and r["skill/analysis_tokens_mean"] == r["skill/analysis_tokens_max"] == 6
    assert r["skill/parse_rate"] == 0.0 and r["opd/teacher_coverage"] == 0.0
    # and why, per episode: an answer came back (not 'no_answer'), but the random model's six greedy tokens decode
    # to nothing printable
    assert {k: v for k, v in r.items() if k.startswith("skill/fail/")} == {"skill/fail/empty": 1.0}


@pytest.mark.slow  # ~13 s on 2 cores: one SEED update
def test_a_looping_self_analysis_ends_at_its_loop_and_is_dumped(tmp_path):
    """--analysis-loop-stop 4: the tiny random policy's greedy answers repeat one token over and over, so each
    ends within a few tokens instead of at --analysis-max-new-tokens; analyses.jsonl holds the answers."""
    from common.backends import loop_end
    from common.models import load_tokenizer
    out = tmp_path / "looped"
    run_script(["seed_rl.py", *[f for f in FLAGS if f not in ("--analyzer-model", "scripted")], "--updates", "1",
                "--analysis-max-new-tokens", "64", "--analysis-loop-stop", "4", "--out", str(out)], timeout=900)
    (r,) = metrics(out)
    assert r["skill/analysis_loop_stopped"] == 1.0 and r["skill/analysis_capped"] == 0.0
    assert r["skill/analysis_tokens_max"] < 64
    with open(out / "analyses.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 4 and all(x["update"] == 1 and x["finish"] == "repetition" for x in rows)
    tok = load_tokenizer("tiny")
    for x in rows:  # the dumped text is the answer that ended where its loop completed (nothing parsed from it)
        ids = tok(x["text"], add_special_tokens=False)["input_ids"]
        assert x["tokens"] <= 12 and x["skill"] is None and x["skill_fail"] in ("empty", "no_json")
        assert ids == [] or loop_end(ids, 4) in (None, len(ids))


def test_two_processes_match_one_process(runs):
    m1, m2 = metrics(runs[0]), metrics(runs[1])
    assert m2[0]["rollout/episodes"] == 4  # both ranks' groups are counted
    assert close(m1[0], m2[0]), {k: (m1[0][k], m2[0][k]) for k in LOSS_KEYS}
    assert close(m1[1], m2[1], rel=1e-3, abs_=1e-6)


@pytest.mark.slow  # ~65 s on 2 idle cores: the killed run plays 2 updates, the resumed one 1
def test_kill_mid_save_then_resume_matches_uninterrupted(one_process, tmp_path):
    """SIGKILL inside update 2's checkpoint save, at the step that used to leave no checkpoint at all: the old
    one renamed away, the new one not yet in place ($SEED_KILL_AT, common/checkpoints.py kill_point). The same
    command resumes from `checkpoint.old` (update 1) and its update 2 equals the uninterrupted run's. The resume
    scores the plain prompts after the rollout (--serial-scoring, a flag a resume may change), the uninterrupted
    run on its side thread beside the self-analyses: the same scores, so the same update."""
    out = tmp_path / "seedk"
    killed = run_script(["seed_rl.py", *FLAGS, "--out", str(out)], timeout=900, check=False,
                        env={"SEED_KILL_AT": "retired"}, start_new_session=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint.old",
                                                                                          "checkpoint.tmp"]
    assert [r["update"] for r in metrics(out)] == [1]
    res = run_script(["seed_rl.py", *FLAGS, "--serial-scoring", "--out", str(out)], timeout=900)
    assert f"resumed from {out / 'checkpoint.old'} after update 1" in res.stdout
    m, ref = metrics(out), metrics(one_process)
    assert [r["update"] for r in m] == [1, 2]  # exactly one line per update
    assert close(m[1], ref[1], rel=1e-6, abs_=1e-9), {k: (m[1][k], ref[1][k]) for k in LOSS_KEYS}
    assert m[1]["time/plain_scoring_hidden"] == 0.0 < m[1]["time/plain_scoring"]  # serial: none of it hidden
    assert 0.0 <= ref[1]["time/plain_scoring_hidden"] <= ref[1]["time/plain_scoring"]
    # the dumps were cut to update 1 and update 2 written again: the same rows as the uninterrupted run's
    for name in ("analyses.jsonl", "examples.jsonl"):
        got = (out / name).read_text().splitlines()
        with open(os.path.join(one_process, name)) as f:
            want = f.read().splitlines()
        assert [json.loads(x)["update"] for x in got] == [1] * 4 + [2] * 4
        assert [json.loads(x)["uid"] for x in got] == [json.loads(x)["uid"] for x in want]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    with open(out / "seed_manifest.json") as f:
        manifest = json.load(f)
    assert [e["update"] for e in manifest["resumes"]] == [1]
    assert manifest["resumes"][0]["changed"] == {"serial_scoring": {"then": False, "now": True}}


def test_report_from_a_real_two_update_run(one_process, tmp_path):
    """evaluate.py --report on the metrics of the real CPU run above: every curve the reading guide names,
    and the plain-vs-skill gap figure drawn from the run's examples.jsonl."""
    out = tmp_path / "report"
    run_script(["evaluate.py", "--report", one_process, "--out", str(out)], timeout=300)
    report = json.loads((out / "report.json").read_text())
    drawn = {pn["key"] for fig in report["figures"] for pn in fig["panels"] if pn["drawn"]}
    for key in ("rollout/success_rate", "rollout/episode_length", "loss/opd", "opd/gate_mean",
                "opd/gate_active_ratio", "loss/kl", "opd/teacher_coverage", "rollout/invalid_rate"):
        assert key in drawn, key
    for fig in report["figures"]:
        if fig["file"]:
            assert (out / fig["file"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (gap,) = report["gaps"]
    assert gap["tokens"] > 0 and (out / gap["file"]).exists()
    assert "gap_" in (out / "report.md").read_text()


def test_resume_with_other_settings_is_refused_before_any_model_loads(one_process, tmp_path):
    """Another --lr and --opd-coef into a run's folder: one line naming both, nothing written. (--opd-coef 0.02, not 0:
    with 0 the flag walk refuses --analyzer-model first, tests/test_flags.py)"""
    out = tmp_path / "seed"
    out.mkdir()
    shutil.copy(os.path.join(one_process, "seed_manifest.json"), out / "seed_manifest.json")
    before = (out / "seed_manifest.json").read_bytes()
    res = run_script(["seed_rl.py", *FLAGS, "--lr", "2e-6", "--opd-coef", "0.02", "--out", str(out)], check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "was written with other settings" in line and "--lr 1e-06 then, 2e-06 now" in line
    assert "--opd-coef 0.01 then, 0.02 now" in line and "--updates" in line.split("these may change")[1]
    assert sorted(os.listdir(out)) == ["seed_manifest.json"] and (out / "seed_manifest.json").read_bytes() == before


def test_a_resume_may_change_updates_but_not_the_tasks_nor_the_warm_up(tmp_path):
    """--updates may change on resume (common/records.py): the updates both runs play keep their tasks; a changed
    seed's stream, or a warm-up that --updates would lengthen, is refused."""
    import argparse
    from envs import alfworld
    from common.records import run_manifest
    from seed_rl import check_resumed_stream
    flags = dict(seed=0, tasks_per_update=2, updates=3, warmup_ratio=0.0, out=str(tmp_path))
    old = run_manifest("seed_rl.py", argparse.Namespace(**flags), games=alfworld.rl_tasks(0, 6))
    for updates in (3, 5, 2):  # the same, longer, shorter: the common updates play the same tasks
        args = argparse.Namespace(**dict(flags, updates=updates))
        check_resumed_stream(old, alfworld.rl_tasks(0, 2 * updates), alfworld, args)
    with pytest.raises(SystemExit, match="the task stream differs"):
        check_resumed_stream(old, alfworld.rl_tasks(1, 6), alfworld, argparse.Namespace(**dict(flags, seed=1)))
    warm = run_manifest("seed_rl.py", argparse.Namespace(**dict(flags, warmup_ratio=0.5)), games=alfworld.rl_tasks(0, 6))
    with pytest.raises(SystemExit, match="moves the lr warm-up"):
        check_resumed_stream(warm, alfworld.rl_tasks(0, 10), alfworld,
                             argparse.Namespace(**dict(flags, updates=5, warmup_ratio=0.5)))


def heldout(out):
    with open(os.path.join(out, "heldout.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # ~100 s on 2 idle cores: 2 processes play 1 update + 2 evaluation points, then a resume 1 + 1
def test_heldout_eval_in_two_processes_changes_no_update_and_resumes_without_duplicates(one_process, tmp_path):
    """--eval-every 1: the start and every later policy play the same held-out episodes (evaluate.py's uids), split
    over the ranks and gathered into one heldout.jsonl; playing them changes nothing in training (update 1 equals
    the run without evaluation); a resume with more updates plays only the points not on file."""
    from envs import alfworld
    out = str(tmp_path / "heldout")
    ev = ["--eval-every", "1", "--eval-splits", "valid_seen", "--eval-limit", "3"]
    run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "seed_rl.py",
                *[f if f != "2" or FLAGS[i - 1] != "--updates" else "1" for i, f in enumerate(FLAGS)], *ev,
                "--out", out], timeout=900)
    rows = heldout(out)
    want = {f"{g['task_id']}#s0" for g in alfworld.eval_tasks("valid_seen", 0, 3)}
    for u in (0, 1):
        assert {r["uid"] for r in rows if r["update"] == u} == want
    assert len(rows) == 6 and all(len(r["steps"]) == r["length"] <= 2 for r in rows)
    (m,) = metrics(out)
    assert m["time/heldout"] > 0 and close(m, metrics(one_process)[0])  # rank 1 played its share too
    res = run_script(["seed_rl.py", *FLAGS, *ev, "--out", out], timeout=900)  # --updates 2: one more update
    assert "held-out after 0 updates" not in res.stdout and "held-out after 2 updates" in res.stdout
    rows = heldout(out)
    assert len(rows) == 9 and len({(r["update"], r["uid"]) for r in rows}) == 9
    assert [r["update"] for r in metrics(out)] == [1, 2]
    # the training report draws the held-out curve: 3 points (updates done 0, 1, 2)
    run_script(["evaluate.py", "--report", out, "--out", str(tmp_path / "report")], timeout=300)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    (fig,) = [f for f in report["figures"] if f["file"] == "heldout.png"]
    assert fig["panels"][0]["drawn"] == {"heldout": 3} and fig["panels"][1]["drawn"] == {"heldout": 3}
