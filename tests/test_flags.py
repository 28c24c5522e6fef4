"""No flag silently ignored (issue 29): every flag of collect.py, evaluate.py, seed_rl.py, sft.py and annotate.py,
for each env, is either shown to change what the env does (the tasks it draws, the rules it parses by) or is
refused with one line naming the env or the setting that makes it moot, or is listed here as env-independent (its
code path has no env branch: the rollout loop, the trainer, the engine, the output). A new flag that is in none
of these lists fails the walk. Nothing here loads a model or plays an episode: each script is stopped where its
arguments are validated."""
import argparse
import functools
import os
import runpy
import shutil
import sys

import pytest

from conftest import REPO

# flags whose effect does not depend on the env (the rollout loop, the engine, files, modes)
GENERIC = {"env", "model", "backend", "batch_episodes", "gpu_memory_utilization", "kv_cache_gib", "workers", "out",
           "seed", "shard", "rollouts", "tasks", "history", "max_new_tokens", "max_prompt_tokens", "max_steps", "temperature",
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


def script_parser(script, env, *extra):
    """The argparse parser `script --env env *extra` builds (its module code run up to parse_args; env None: no
    --env)."""
    got, real = {}, argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        got["p"] = self
        raise _Got

    argv, argparse.ArgumentParser.parse_args = sys.argv, capture
    sys.argv = [script, *(["--env", env] if env else []), *extra]
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



# ---------------------------------------------------------------------------------------------------
# seed_rl.py, sft.py, annotate.py

# env-independent: the trainer (the update's math, batching, schedule), the engine, the rollout loop (steps, history,
# lengths, sampling, penalty: common/rollout.py, the same code for every env; no env caps the steps), the output
SEED_RL_GENERIC = {
    "env", "model", "updates", "tasks_per_update", "group_size", "workers", "lockstep", "backend",
    "gpu_memory_utilization", "kv_cache_gib", "lr", "warmup_ratio", "mini_batch", "micro_tokens", "packing", "clip_eps",
    "dual_clip", "grad_clip", "kl_coef", "opd_coef", "adv_mode", "adv_norm", "activation_checkpointing", "fused", "seed",
    "save_every", "out", "log_to", "max_steps", "history", "max_prompt_tokens", "max_new_tokens", "temperature", "invalid_penalty",
    # the dumps: plain-vs-skill scores for SEED; with --opd-coef 0 (GRPO) the sampled steps and their plain scores
    "dump_examples", "eval_every"}
SFT_GENERIC = {"model", "data", "bc_data", "out", "epochs", "lr", "max_length", "batch_size", "micro_batch",
               "warmup_ratio", "weight_decay", "grad_clip", "packing", "activation_checkpointing", "save_every",
               "save_dtype", "max_steps", "resume", "seed", "log_to", "fused"}  # the SFT loop has no env branch
# annotate.py: what every analyzer uses (the files, the model name, the answer budget, the retries of unparsable
# answers, the validation split); the analyzer-specific flags are refused for the other analyzers (below)
ANNOTATE_GENERIC = {"analyzer", "trajectories", "out", "model", "max_new_tokens", "parse_retries", "retry_failed",
                    "val_fraction", "seed", "sft"}
# shown to change the env's tasks or rules (test_seed_rl_env_flags_change_the_train_tasks), or its preset
SEED_RL_ENV = {"alfworld": set(), "webshop": WEBSHOP_FLAGS,
               "search": set(SEARCH_TASK_FLAGS) | set(SEARCH_RULE_FLAGS) | SEARCH_DATA_FLAGS - {"test_files"}}
SFT_ENV = {"env"}  # the preset's max length (test_sft_env_is_the_data_env)
ANNOTATE_ENV = {"env"}  # every trajectory must be of that env (annotate.py refuses another's)
# refused where they would change nothing: flag -> [(env, argv, the one line's start)]; each case is run below
GRPO = ["--opd-coef", "0"]
GRPO_WHY = "with --opd-coef 0 (GRPO) no episode is analyzed and there is no OPD term, so it would change nothing"
SEED_RL_REFUSED = {
    "analyzer_model": [("alfworld", [*GRPO, "--analyzer-model", "scripted"], "--analyzer-model: " + GRPO_WHY)],
    "analysis_max_new_tokens": [("webshop", [*GRPO, "--analysis-max-new-tokens", "16"],
                                 "--analysis-max-new-tokens: " + GRPO_WHY)],
    "analysis_max_len": [("alfworld", [*GRPO, "--analysis-max-len", "4096"], "--analysis-max-len: " + GRPO_WHY)],
    "analysis_loop_stop": [("alfworld", [*GRPO, "--analysis-loop-stop", "512"], "--analysis-loop-stop: " + GRPO_WHY)],
    "min_skill_words": [("alfworld", [*GRPO, "--min-skill-words", "5"], "--min-skill-words: " + GRPO_WHY)],
    "opd_beta": [("alfworld", [*GRPO, "--opd-beta", "2"], "--opd-beta: " + GRPO_WHY)],
    "serial_scoring": [("alfworld", [*GRPO, "--serial-scoring"], "--serial-scoring: " + GRPO_WHY)],
    "ref_model": [("alfworld", ["--kl-coef", "0", "--ref-model", "tiny"],
                   "--ref-model: with --kl-coef 0 there is no KL term and no reference model")],
    "allow_group_of_one": [("alfworld", ["--allow-group-of-one"],
                            "--allow-group-of-one: it applies to --group-size 1 only, not 8")],
    "micro_batch": [("alfworld", ["--micro-tokens", "4096", "--micro-batch", "4"],
                     "--micro-batch: with --micro-tokens 4096 the micro-batches are filled by tokens")],
    "test_files": [("search", ["--test-files", "x.jsonl"], "--test-files: seed_rl.py trains on the search env's "
                    "train split")],
    "probe_action": [("search", ["--probe-action", "look"], "--probe-action 'look': the search env parses only "
                      "search[query] or answer[text]")],
    "invalid_rule": [("search", ["--invalid-rule", "strict"], "--invalid-rule strict: the search env has no "
                      "admissible-action list")],
    "invalid_fallback": [("search", ["--invalid-fallback", "look"], "--invalid-fallback 'look': the search env runs "
                          "only search")],
    # the held-out evaluation's settings, without --eval-every (tests/test_seed_rl.py plays them)
    **{dest: [("alfworld", [f"--{dest.replace('_', '-')}", value], f"--{dest.replace('_', '-')}: with --eval-every 0 "
               "there is no held-out evaluation")]
       for dest, value in [("eval_splits", "valid_seen"), ("eval_limit", "3"), ("eval_samples", "2"),
                           ("eval_temperature", "1.0"), ("eval_max_steps", "5"), ("eval_seed", "1")]},
    **{dest: [("alfworld", ["--no-activation-checkpointing", flag, value], "--checkpoint-policy/--checkpoint-every "
               "choose how layers are recomputed, and --no-activation-checkpointing recomputes none")]
       for dest, flag, value in [("checkpoint_policy", "--checkpoint-policy", "selective"),
                                 ("checkpoint_every", "--checkpoint-every", "2")]},
}
SFT_REFUSED = {"val_fraction": [("alfworld", ["--val-fraction", "0.2"],
                                 "--val-fraction: it splits --bc-data episodes only")]}
HTTP = {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "KEY", "concurrency": "2", "timeout": "5",
        "http_retries": "1", "backoff": "1", "max_wait": "5"}
LOCAL = {"backend": "vllm", "batch_size": "4", "max_model_len": "4096", "gpu_memory_utilization": "0.5"}
ANNOTATE_REFUSED = {dest: [("alfworld", ["--analyzer", a, f"--{dest.replace('_', '-')}", v],
                            f"--{dest.replace('_', '-')}: --analyzer {a} sends no HTTP request")
                           for a in ("local", "scripted")] for dest, v in HTTP.items()}
for dest, v in LOCAL.items():
    ANNOTATE_REFUSED[dest] = [("alfworld", ["--analyzer", "openai", "--base-url", "http://127.0.0.1:9/v1",
                                            f"--{dest.replace('_', '-')}", v],
                               f"--{dest.replace('_', '-')}: --analyzer openai runs no local model")]
for dest, v in [("backend", "vllm"), ("gpu_memory_utilization", "0.5"), ("temperature", "0.7")]:
    ANNOTATE_REFUSED.setdefault(dest, []).append(
        ("alfworld", ["--analyzer", "scripted", f"--{dest.replace('_', '-')}", v],
         f"--{dest.replace('_', '-')}: --analyzer scripted runs no model"))
ANNOTATE_REFUSED["trace"] = [("alfworld", ["--trace", "sft-0", "--sft", "x.jsonl", "--model", "tiny"],
                              "--env, --trajectories, --model: --trace prints one SFT example and exits")]
CLASSES = {"seed_rl.py": (SEED_RL_GENERIC, lambda env: SEED_RL_ENV[env], SEED_RL_REFUSED),
           "sft.py": (SFT_GENERIC, lambda env: SFT_ENV, SFT_REFUSED),
           "annotate.py": (ANNOTATE_GENERIC, lambda env: ANNOTATE_ENV, ANNOTATE_REFUSED)}


@pytest.mark.parametrize("script", sorted(CLASSES))
@pytest.mark.parametrize("env", ["alfworld", "webshop", "search"])
def test_every_training_flag_is_classified(script, env):
    generic, env_flags, refused = CLASSES[script]
    dests = {a.dest for a in script_parser(script, env)._actions if a.dest != "help"}
    unclassified = dests - generic - env_flags(env) - set(refused)
    assert not unclassified, f"{script} --env {env}: flags with no shown effect or refusal: {sorted(unclassified)}"
    assert env_flags(env) <= dests
    assert not generic & set(refused) and not generic & env_flags(env)  # one category each


class _Validated(Exception):
    """The script got past its argument validation (where a refused run stops)."""


@functools.lru_cache(maxsize=1)
def _seed_rl():
    return runpy.run_path(os.path.join(REPO, "seed_rl.py"), run_name="seed_rl_flags")


def seed_rl_args(env, *argv):
    """seed_rl.py's parse_args (its validation included) for `--env env --model tiny *argv`."""
    old, sys.argv = sys.argv, ["seed_rl.py", "--env", env, "--model", "tiny", *argv]
    try:
        return _seed_rl()["parse_args"]()[0]
    finally:
        sys.argv = old


MISSING = os.path.join(REPO, "no-such-file.jsonl")
URL = "http://127.0.0.1:9/v1"


def stop_line(script, env, argv, monkeypatch):
    """The one line `script --env env *argv` stops with at argument validation; None: it passed. seed_rl.py: its
    parse_args, then (Search) the env's check of the flags that the task functions run before any model loads;
    sft.py: up to init_distributed; annotate.py: up to reading --trajectories (a missing file here)."""
    import common.training
    from envs import load_env
    try:
        if script == "seed_rl.py":
            args = seed_rl_args(env, *argv)
            if env == "search":
                load_env(env).configure(args)
                load_env(env).configure(None)
            return None
        monkeypatch.setattr(common.training, "init_distributed", lambda: (_ for _ in ()).throw(_Validated()))
        if script == "sft.py":
            base = ["--model", "tiny", "--out", "x", "--data", MISSING]
        elif "--trace" in argv:
            base = ["--trajectories", MISSING]
        else:
            analyzer = argv[argv.index("--analyzer") + 1] if "--analyzer" in argv else "openai"
            base = ["--trajectories", MISSING, "--out", "x.jsonl", "--model", "tiny"] + \
                (["--base-url", URL] if analyzer == "openai" else [])
        monkeypatch.setattr(sys, "argv", [script, "--env", env, *base, *argv])
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    except _Validated:
        return None
    except SystemExit as e:
        if script == "annotate.py" and str(e.code) == f"--trajectories {MISSING}: no such file":
            return None  # past the validation
        return str(e.code)
    raise AssertionError(f"{script} ran past its validation")


CASES = [(script, dest, *case) for script, (_, _, refused) in sorted(CLASSES.items())
         for dest, cases in sorted(refused.items()) for case in cases]


@pytest.mark.parametrize("script,dest,env,argv,message", CASES, ids=[f"{c[0]}:{c[1]}:{c[2]}" for c in CASES])
def test_refused_in_one_line_naming_the_env_or_setting(script, dest, env, argv, message, monkeypatch):
    line = stop_line(script, env, argv, monkeypatch)
    assert line is not None and line.startswith(message) and "\n" not in line, (argv, line)


@pytest.mark.parametrize("script,env,argv", [
    ("seed_rl.py", "alfworld", []), ("seed_rl.py", "alfworld", GRPO), ("seed_rl.py", "alfworld", ["--kl-coef", "0"]),
    ("seed_rl.py", "alfworld", ["--analyzer-model", "scripted", "--min-skill-words", "5", "--ref-model", "tiny"]),
    ("seed_rl.py", "alfworld", ["--group-size", "1", "--allow-group-of-one"]),
    ("seed_rl.py", "alfworld", ["--micro-tokens", "4096"]), ("seed_rl.py", "alfworld", ["--analysis-loop-stop", "2"]),
    ("seed_rl.py", "alfworld", ["--checkpoint-policy", "selective", "--checkpoint-every", "2"]), ("seed_rl.py", "alfworld", ["--probe-action", "look"]),
    ("seed_rl.py", "webshop", [*GRPO, "--probe-action", "click[buy now]"]),
    ("seed_rl.py", "search", ["--probe-action", "Answer[yes]", "--no-retriever-check"]),
    ("sft.py", "alfworld", []), ("sft.py", "alfworld", ["--bc-data", "missing.jsonl", "--val-fraction", "0.2"]),
    ("annotate.py", "alfworld", []), ("annotate.py", "alfworld", ["--concurrency", "4", "--timeout", "9"]),
    ("annotate.py", "alfworld", ["--analyzer", "local", "--batch-size", "4", "--backend", "hf"]),
    ("annotate.py", "alfworld", ["--analyzer", "scripted", "--batch-size", "4", "--max-model-len", "4096"]),
])
def test_the_same_flags_pass_where_they_apply(script, env, argv, monkeypatch):
    assert stop_line(script, env, argv, monkeypatch) is None


@pytest.mark.parametrize("value", ["1", "-4"])
def test_a_loop_stop_that_could_never_fire_is_one_line(value, monkeypatch):
    """--analysis-loop-stop WINDOW: a window of 1 token holds no block written twice, a negative one nothing."""
    line = stop_line("seed_rl.py", "alfworld", ["--analysis-loop-stop", value], monkeypatch)
    assert line == (f"--analysis-loop-stop {value}: expected 0 (off) or a WINDOW of at least 2 tokens (a loop is a "
                    "block written twice or more; e.g. 512)")


def test_seed_rl_env_flags_change_the_train_tasks(tmp_path):
    """seed_rl.py's env flags reach the task stream it trains on (setup: env.rl_tasks(seed, n, args))."""
    from envs import search as S
    from envs import webshop as W
    from envs.webshop.synthetic import write_catalog
    try:
        base = S.rl_tasks(0, 2, seed_rl_args("search", "--no-retriever-check"))
        for dest, value in SEARCH_TASK_FLAGS.items():
            tasks = S.rl_tasks(0, 2, seed_rl_args("search", "--no-retriever-check", f"--{dest.replace('_', '-')}",
                                                  value))
            assert tasks != base and [t["task_id"] for t in tasks] == [t["task_id"] for t in base], dest
        for dest, value in SEARCH_RULE_FLAGS.items():
            S.rl_tasks(0, 2, seed_rl_args("search", "--no-retriever-check", f"--{dest.replace('_', '-')}", value))
            assert S.RULES[dest[len("search_"):]] == value, dest
        assert {t["max_steps"] for t in S.rl_tasks(0, 2, seed_rl_args("search", "--no-retriever-check",
                                                                        "--max-steps", "2"))} == {2}
        bamboogle = os.path.join(S.default_data_dir(), "test", "bamboogle.jsonl.xz")
        for argv in (["--train-file", bamboogle], ["--val-size", "50"]):
            assert S.rl_tasks(0, 20, seed_rl_args("search", "--no-retriever-check", *argv)) != \
                S.rl_tasks(0, 20, seed_rl_args("search", "--no-retriever-check")), argv
        with pytest.raises(SystemExit, match="127.0.0.1:9"):  # without --no-retriever-check the URL is checked
            S.rl_tasks(0, 1, seed_rl_args("search", "--retriever-url", "http://127.0.0.1:9/retrieve",
                                          "--retriever-timeout", "1"))
    finally:
        S.configure(None)
    a, b = write_catalog(str(tmp_path / "a"), 80, seed=0), write_catalog(str(tmp_path / "b"), 80, seed=1)
    ns = lambda *argv: seed_rl_args("webshop", "--webshop-data", a, *argv)
    assert {t["data_dir"] for t in W.rl_tasks(0, 4, ns("--webshop-data", b))} == {os.path.abspath(b)}
    assert {t["index_cache"] for t in W.rl_tasks(0, 4, ns("--webshop-index-cache", str(tmp_path / "ix")))} == \
        {str(tmp_path / "ix")}
    assert {t["split"] for t in W.rl_tasks(0, 4, ns())} == {"train"}


def test_sft_env_is_the_data_env(tmp_path, monkeypatch):
    """sft.py --env sets the preset (max length); it must be the data's env, which is also the default."""
    assert script_parser("sft.py", "alfworld").get_default("max_length") == 8192
    assert script_parser("sft.py", "webshop").get_default("max_length") == 12288
    data = tmp_path / "ws.sft.jsonl"
    data.write_text('{"env": "webshop", "id": "a", "split": "train", "prompt": "p", "target": "t"}\n')
    assert script_parser("sft.py", None, "--data", str(data)).get_default("max_length") == 12288  # the data's env
    line = stop_line("sft.py", "alfworld", ["--data", str(data)], monkeypatch)
    assert line == f"--env alfworld: {data} holds webshop records; drop --env (the data's env is the default)"
    assert stop_line("sft.py", "webshop", ["--data", str(data)], monkeypatch) is None


def test_drivers_give_the_grpo_arm_no_analysis_flags():
    """benchmarks/learning.py and rollout_async.py give both arms one flag string; GRPO's leaves out the flags that
    seed_rl.py refuses with --opd-coef 0 (common/records.py OPD_ONLY_FLAGS)."""
    from common.records import drop_flags
    assert drop_flags(["--analyzer-model", "scripted", "--lr", "1", "--opd-beta=2", "--lockstep", "--x"],
                      {"--analyzer-model", "--opd-beta", "--lockstep"}) == ["--lr", "1", "--x"]
    assert drop_flags(["--report", "a/", "b/", "--invalid-penalty", "-0.1"],  # two values; a negative one
                      {"--report"}) == ["--invalid-penalty", "-0.1"]
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import learning
    p = learning.build_parser()
    args = learning.finish_args(p, p.parse_args(["--model", "tiny", "--launcher", "python", "--seed-rl-args",
                                                 "--analyzer-model scripted --min-skill-words 5 --kl-coef 0 "
                                                 "--analysis-loop-stop 512"]))
    cfg = dict(env="alfworld", updates=1, tasks_per_update=2, group_size=2, max_steps=2, lr=1e-5, max_new_tokens=8,
               env_args=[])
    seed, grpo = (learning.train_command(args, cfg, "tiny", m, 0, "out", 1) for m in ("seed", "grpo"))
    assert seed[-8:] == ["--analyzer-model", "scripted", "--min-skill-words", "5", "--kl-coef", "0",
                         "--analysis-loop-stop", "512"]
    assert grpo[-4:] == ["--opd-coef", "0", "--kl-coef", "0"] and "--analyzer-model" not in grpo
    sys.argv, argv = ["seed_rl.py", *grpo[grpo.index("--env"):]], sys.argv
    try:
        _seed_rl()["parse_args"]()  # the GRPO command passes seed_rl.py's validation
    finally:
        sys.argv = argv


def test_annotate_env_must_be_the_trajectories_env(tmp_path, monkeypatch):
    """annotate.py --env: the analysis prompt is each trajectory's own env's; given, every trajectory must be of it."""
    traj = tmp_path / "traj.jsonl"
    traj.write_text('{"uid": "u1", "env": "webshop", "steps": []}\n')
    argv = ["annotate.py", "--trajectories", str(traj), "--out", str(tmp_path / "a.jsonl"), "--model", "tiny",
            "--analyzer", "scripted", "--env", "alfworld"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match=f"^{traj}: trajectory u1 is of env 'webshop', not --env alfworld$"):
        runpy.run_path(os.path.join(REPO, "annotate.py"), run_name="__main__")
