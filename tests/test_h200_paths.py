"""benchmarks/remote/h200.sh's job-starting command paths, run for real on CPU (issue 29). Parts L (ALFWorld, with
the START=bc warm start and the PROBE=1 plumbing check; Search) and Q have benchmarks/remote/commands.py build
their jobs' commands. Here h200.sh itself runs with a stand-in interpreter (tests/data/h200_shim.py) that records
what each part would start, as commands.py builds it; then those very commands run on CPU: the tiny model, sizes
shrunk by flags appended at the end (the scripts keep the last value of a flag), against the real ALFWorld games
and a live local retriever over the shared corpus. A wrong URL or flag in h200.sh or commands.py fails here
instead of on a GPU (part L was once only dry-run, and every Search job failed with HTTP 404: the URL lacked
/retrieve)."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, run_script, side_by_side
from test_search import REAL_CORPUS, start_server, stop

H200 = os.path.join(REPO, "benchmarks", "remote", "h200.sh")
SHIM = os.path.join(REPO, "tests", "data", "h200_shim.py")
CPU = ["--max-new-tokens", "8", "--workers", "1"]  # appended to every job: short responses, one env worker


def h200(part, run_dir, **knobs):
    """Run `bash h200.sh PART` with the shim as $PY, and a curl whose health check answers once the shim has
    recorded a retriever (so h200.sh starts one, and waits for it as for the real server). Returns
    [(commands.py job name, the built argv)] in the order h200.sh started them."""
    bin_dir = run_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "shim.jsonl"
    curl = bin_dir / "curl"
    curl.write_text(f"#!/bin/sh\ngrep -q '\"name\": \"retriever\"' {log} 2>/dev/null\n")
    curl.chmod(0o755)
    env = dict(os.environ, PY=f"{sys.executable} {SHIM}", RUN=str(run_dir), OUT=str(run_dir / "out"),
               QWEN_CODER_DIR="tiny", SEARCH_DATA=os.path.dirname(REAL_CORPUS), H200_SHIM_LOG=str(log),
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **knobs)
    res = subprocess.run(["bash", H200, part], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    recs = [json.loads(line) for line in open(log)] if log.exists() else []
    built = [(r["name"], r["built"]) for r in recs if "built" in r]
    assert built, f"h200.sh {part} started no job through commands.py:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return built


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def at_port(cmd, port):
    """The command with h200.sh's fixed retriever port (8000) swapped for the live test server's."""
    return [x.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for x in cmd]


def start_retriever(cmd, workdir):
    """h200.sh's retriever command on a free port (--port 0); returns (process, port)."""
    i = cmd.index("--port") + 1
    proc, url = start_server(None, workdir, cmd=cmd[:i] + ["0"] + cmd[i + 1:])
    return proc, re.match(r"http://127\.0\.0\.1:(\d+)/retrieve", url).group(1)


def run_built(cmd, *extra, timeout=600):
    """A built command, as the shim recorded it (the interpreter first), with flags appended."""
    assert cmd[0] == sys.executable
    return run_script([*cmd[1:], *extra], timeout=timeout)


def read(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def test_h200_parts_build_their_jobs_through_commands_py(tmp_path):
    """Fast: what h200.sh's parts L and Q start, and the flags that say what each job is."""
    bc = h200("L", tmp_path / "bc", START="bc", PROBE="1", BC_DATA="/x/expert.jsonl", BUDGET="400", KV_GIB="4",
              PACKING="off", SEED_RL_ARGS="--mini-batch 32 --micro-batch 8")
    # with KV_GIB the SFT does not wait for the probe's engine: the two start in either order, the driver last
    assert sorted(n for n, _ in bc[:2]) == ["bc-sft", "probe"] and bc[2][0] == "learning"
    probe, sft, learn = (dict(bc)[n] for n in ("probe", "bc-sft", "learning"))
    assert flag(probe, "--probe-action") == "admissible" and flag(probe, "--max-steps") == "1"
    assert flag(probe, "--kv-cache-gib") == "4.0"
    assert flag(probe, "--opd-coef") == "0" and flag(probe, "--model") == "tiny"
    assert flag(sft, "--bc-data") == "/x/expert.jsonl" and flag(sft, "--out") == str(tmp_path / "bc" / "bc")
    assert flag(learn, "--model") == flag(sft, "--out")  # START=bc: both arms start from the SFT
    assert flag(learn, "--env") == "alfworld" and "--detach" in learn and flag(learn, "--eval-limit") == "12"
    assert flag(learn, "--kv-cache-gib") == "4.0"  # KV_GIB: fixed KV caches, engine starts stop no other job
    assert "--seed-rl-args=--packing off --mini-batch 32 --micro-batch 8" in learn  # PACKING and SEED_RL_ARGS, one arg
    search = h200("L", tmp_path / "search", ENV="search", BUDGET="400")
    assert [n for n, _ in search] == ["retriever", "learning"]
    assert "--env-args=--retriever-url http://127.0.0.1:8000/retrieve" in search[1][1]
    assert flag(search[1][1], "--eval-limit") == "100"
    q = h200("Q", tmp_path / "q")
    assert [n for n, _ in q] == ["retriever", "search-eval", "search-train", "search-eval"]
    health = set(re.findall(r"curl -sf (http://127\.0\.0\.1:\d+)/health", open(H200).read()))
    assert health == {f"http://127.0.0.1:{flag(q[0][1], '--port')}"}  # h200.sh checks the port it serves on
    for _, cmd in q[1:] + search[1:]:  # every Search job asks the retriever's POST endpoint
        urls = [x.split()[-1] for x in cmd if x.startswith("--env-args=--retriever-url")] + \
               [cmd[i + 1] for i, x in enumerate(cmd) if x == "--retriever-url"]
        assert urls and all(u == f"{next(iter(health))}/retrieve" for u in urls), cmd


# ---- the same commands, run for real on CPU

@pytest.fixture(scope="module")
def bc_part(tmp_path_factory):
    """Part L with START=bc PROBE=1, as h200.sh builds it: an expert episode file (collect.py), then the warm
    start's SFT for real (1 epoch); meanwhile, as h200.sh runs it, the probe (it trains the base model, so it needs
    neither the episodes nor the SFT: side by side, the two take about the time of one on 2 cores; its metrics
    are checked in test_part_L_probe_runs_for_real). Returns (run folder, the built commands by name)."""
    run_dir = tmp_path_factory.mktemp("h200_L_bc")
    bc_data = run_dir / "expert.jsonl"
    cmds = dict(h200("L", run_dir, START="bc", PROBE="1", BC_DATA=str(bc_data), BC_EPOCHS="1", PROBE_UPDATES="1",
                     LANES="1", METHODS="grpo", SEEDS="0", UPDATES="1", TASKS="1", STEPS="2", EVAL_LIMIT="1",
                     BUDGET="900", KV_GIB="4"))

    def warm_start():
        run_script(["collect.py", "--env", "alfworld", "--model", "expert", "--tasks", "2", "--rollouts", "1",
                    "--workers", "1", "--out", str(bc_data)])
        run_built(cmds["bc-sft"], "--batch-size", "2", "--micro-batch", "1")

    side_by_side((warm_start,), (run_built, cmds["probe"], "--tasks-per-update", "1", "--group-size", "2", *CPU))
    assert (run_dir / "bc" / "config.json").exists()
    return run_dir, cmds


@pytest.mark.slow
def test_part_L_probe_runs_for_real(bc_part):
    run_dir, cmds = bc_part  # the probe ran in bc_part, beside the warm start's SFT
    rows = read(run_dir / "probe" / "metrics.jsonl")
    assert [r["update"] for r in rows] == [1] and "rollout/probe_rate" in rows[0]


@pytest.mark.slow
def test_part_L_alfworld_from_the_bc_start_runs_for_real(bc_part, tmp_path):
    run_dir, cmds = bc_part
    res = tmp_path / "results"  # never the checkout's results/learning
    run_built(cmds["learning"], "--group-size", "2", *CPU, "--results-dir", str(res), timeout=900)
    runs = read(res / "runs.jsonl")
    assert len(runs) == 1 and runs[0]["env"] == "alfworld" and runs[0]["method"] == "grpo"
    assert runs[0]["start"]["label"].startswith("sft(") and f"--model {run_dir / 'bc'}" in runs[0]["commands"]["train"]
    assert "--kv-cache-gib 4.0" in runs[0]["commands"]["train"]
    assert runs[0]["eval"]["start"]["all"]["episodes"] >= 1 and runs[0]["eval"]["end"]["all"]["episodes"] >= 1


@pytest.mark.slow
def test_part_L_search_runs_for_real_against_a_live_retriever(tmp_path):
    cmds = dict(h200("L", tmp_path / "run", ENV="search", LANES="1", METHODS="grpo", SEEDS="0", UPDATES="1",
                     TASKS="1", EVAL_LIMIT="1", BUDGET="900"))
    proc, port = start_retriever(cmds["retriever"], tmp_path)
    try:
        res = tmp_path / "results"
        # --eval-in-run (LEARN_ARGS): seed_rl.py plays the val question itself, through the same retriever flags
        run_built(at_port(cmds["learning"], port), "--group-size", "2", *CPU, "--results-dir", str(res),
                  "--eval-in-run", timeout=900)
        runs = read(res / "runs.jsonl")
        assert len(runs) == 1 and runs[0]["env"] == "search" and runs[0]["eval"]["start_in_run"]
        assert f"--retriever-url http://127.0.0.1:{port}/retrieve" in runs[0]["commands"]["train"]
        assert "--eval-splits val" in runs[0]["commands"]["train"]
        assert runs[0]["updates"][0]["env_failures"] == 0
        assert runs[0]["eval"]["start"]["splits"]["val"]["episodes"] == runs[0]["eval"]["end"]["all"]["episodes"] == 1
    finally:
        stop(proc)


@pytest.mark.slow
def test_part_Q_runs_for_real_against_a_live_retriever(tmp_path):
    run_dir = tmp_path / "run"
    cmds = h200("Q", run_dir, TASKS="1", UPDATES="1")
    (_, retr), (_, eval0), (_, train), (_, eval1) = cmds
    proc, port = start_retriever(retr, tmp_path)
    try:
        few = ["--backend", "hf", "--limit", "1", *CPU]
        # the start's evaluation and the training read nothing of each other (both start from the tiny model):
        # side by side, against the same live retriever. The training's self-analyses are cut at 16 tokens (a
        # size, like --max-new-tokens): the random model never ends one, and at the default 4096 they took ~80 s
        side_by_side((run_built, at_port(eval0, port), *few),
                     (run_built, at_port(train, port), "--group-size", "2", "--max-steps", "2",
                      "--analysis-max-new-tokens", "16", *CPU))
        final = run_dir / "search" / "seed" / "hf" / "final"
        assert (final / "config.json").exists()  # h200.sh evaluates it (else the start again)
        eval1 = at_port(eval1, port)
        eval1[eval1.index("--model") + 1] = str(final)
        run_built(eval1, *few)
        for d in ("eval0", "eval1"):
            r = json.load(open(run_dir / "search" / d / "results.json"))
            assert r["splits"]["val"]["episodes"] == 1 and r["splits"]["val"]["env_failures"] == 0
        assert read(run_dir / "search" / "seed" / "metrics.jsonl")[0]["rollout/env_failures"] == 0
    finally:
        stop(proc)
