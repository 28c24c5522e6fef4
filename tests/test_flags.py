"""No flag silently ignored (issue 29): every flag of collect.py and evaluate.py, for each env, is either shown to
change what the env does (the tasks it draws, the rules it parses by) or is refused with one line naming the env,
or is listed here as env-independent (its code path has no env branch: the rollout loop, the engine, the output).
A new flag that is in none of these lists fails the walk."""
import argparse
import os
import runpy
import shutil
import sys

import pytest

from conftest import REPO

# flags whose effect does not depend on the env (the rollout loop, the engine, files, modes)
GENERIC = {"env", "model", "backend", "batch_episodes", "gpu_memory_utilization", "workers", "out", "seed", "shard",
           "rollouts", "tasks", "history", "max_new_tokens", "max_prompt_tokens", "max_steps", "temperature",
           "invalid_penalty", "limit", "samples", "tp", "paper_backbone", "report", "smooth", "data_manifest"}
SPLIT_FLAGS = {"split", "splits"}  # checked below for each env
# env flags whose effect is checked below, and flags refused for some env
SEARCH_TASK_FLAGS = {"retriever_url": "http://127.0.0.1:9/retrieve", "retriever_timeout": "3",
                     "retriever_retries": "1", "retriever_backoff": "0.1", "retriever_shape": "query", "topk": "5",
                     "search_empty_gold": "never"}
SEARCH_RULE_FLAGS = {"search_invalid_step": "nothing", "search_empty_block": "invalid", "search_stray_tags": "ignore"}
SEARCH_DATA_FLAGS = {"search_data", "train_file", "val_size", "test_files", "no_retriever_check"}
WEBSHOP_FLAGS = {"webshop_data", "webshop_index_cache"}
REFUSED_SOMEWHERE = {"invalid_rule", "invalid_fallback"}


class _Got(Exception):
    pass


def script_parser(script, env):
    """The argparse parser `script --env env` builds (its module code run up to parse_args)."""
    got, real = {}, argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        got["p"] = self
        raise _Got

    argv, argparse.ArgumentParser.parse_args = sys.argv, capture
    sys.argv = [script, "--env", env]
    try:
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    except _Got:
        pass
    finally:
        sys.argv, argparse.ArgumentParser.parse_args = argv, real
    return got["p"]


@pytest.mark.parametrize("script", ["collect.py", "evaluate.py"])
@pytest.mark.parametrize("env", ["alfworld", "webshop", "search"])
def test_every_flag_is_classified(script, env):
    dests = {a.dest for a in script_parser(script, env)._actions if a.dest != "help"}
    own = {"search": set(SEARCH_TASK_FLAGS) | set(SEARCH_RULE_FLAGS) | SEARCH_DATA_FLAGS, "webshop": WEBSHOP_FLAGS,
           "alfworld": set()}[env]
    unclassified = dests - GENERIC - SPLIT_FLAGS - REFUSED_SOMEWHERE - own
    assert not unclassified, f"{script} --env {env}: flags with no shown effect or refusal: {sorted(unclassified)}"
    assert own <= dests  # every env flag reaches the script


def search_args(*argv):
    p = script_parser("evaluate.py", "search")
    return p.parse_args(["--env", "search", "--no-retriever-check", *argv])


def test_search_flags_change_the_tasks_or_the_rules():
    from envs import search as S
    try:
        base = S.eval_tasks("val", 0, 2, search_args())
        for dest, value in SEARCH_TASK_FLAGS.items():
            tasks = S.eval_tasks("val", 0, 2, search_args(f"--{dest.replace('_', '-')}", value))
            assert tasks != base and [t["task_id"] for t in tasks] == [t["task_id"] for t in base], dest
        for dest, value in SEARCH_RULE_FLAGS.items():
            S.eval_tasks("val", 0, 2, search_args(f"--{dest.replace('_', '-')}", value))
            assert S.RULES[dest[len("search_"):]] == value, dest
        data = S.default_data_dir()
        bamboogle = os.path.join(data, "test", "bamboogle.jsonl.xz")
        for argv in (["--train-file", bamboogle], ["--val-size", "50"]):
            assert S.eval_tasks("val", 0, None, search_args(*argv)) != S.eval_tasks("val", 0, None, search_args()), argv
        assert {t["category"] for t in S.eval_tasks("test", 0, 1, search_args("--test-files", bamboogle))} == {"bamboogle"}
        with pytest.raises(SystemExit, match="127.0.0.1:9"):  # without --no-retriever-check the URL is checked
            S.eval_tasks("val", 0, 1, script_parser("evaluate.py", "search").parse_args(
                ["--retriever-url", "http://127.0.0.1:9/retrieve", "--retriever-timeout", "1"]))
    finally:
        S.configure(None)


def test_search_data_flag(tmp_path):
    from envs import search as S
    shutil.copytree(S.default_data_dir(), tmp_path / "s", ignore=shutil.ignore_patterns("corpus*"))
    os.replace(tmp_path / "s" / "test" / "bamboogle.jsonl.xz", tmp_path / "s" / "hotpotqa500.jsonl.xz")
    tasks = S.eval_tasks("val", 0, None, search_args("--search-data", str(tmp_path / "s")))
    assert {t["category"] for t in tasks} == {"bamboogle"} and len(tasks) == 100


def test_webshop_flags_and_split(tmp_path):
    from envs import webshop as W
    from envs.webshop.synthetic import write_catalog
    a, b = write_catalog(str(tmp_path / "a"), 80, seed=0), write_catalog(str(tmp_path / "b"), 80, seed=1)
    p = script_parser("collect.py", "webshop")
    ns = lambda *argv: p.parse_args(["--model", "expert", "--out", "x", "--webshop-data", a, *argv])
    base = W.stage1_tasks(0, 4, ns())
    assert {t["split"] for t in base} == {"train"} and all(t["goal_index"] >= W.TEST_GOALS for t in base)
    assert {t["data_dir"] for t in W.stage1_tasks(0, 4, ns("--webshop-data", b))} == {os.path.abspath(b)}
    assert {t["index_cache"] for t in W.stage1_tasks(0, 4, ns("--webshop-index-cache", str(tmp_path / "ix")))} == \
        {str(tmp_path / "ix")}
    test = W.stage1_tasks(0, 4, ns("--split", "test"))
    assert {t["split"] for t in test} == {"test"} and all(t["goal_index"] < W.TEST_GOALS for t in test)


def test_invalid_rule_and_fallback_change_alfworld_and_webshop_and_are_refused_for_search():
    from envs import alfworld, search, webshop
    for env in (alfworld, webshop):  # strict marks an inadmissible action invalid: the env has a list to check
        assert env.is_admissible("click[nothing]", ["click[buy now]"]) is False
        assert env.action_to_execute("no tags", "", "look") == "look"  # the fallback is what runs
    assert search.is_admissible("search[x]", []) is None
    for argv, message in [(["--invalid-rule", "strict"], "the search env has no admissible-action list"),
                          (["--invalid-fallback", "look"], "the search env runs only search")]:
        with pytest.raises(SystemExit, match=message):
            search.eval_tasks("val", 0, 1, search_args(*argv))
    search.configure(None)
