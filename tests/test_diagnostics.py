"""Why a learning curve is flat, and the warm start: the per-update diagnostics of seed_rl.py (groups without
task signal, the plumbing check's reward), the Search env's episode statistics, and behaviour cloning
(sft.py --bc-data) with the scripted analyzer's skill examples (annotate.py --analyzer scripted). Hand-computed
values throughout."""
import json
import math

from conftest import run_script, side_by_side
from envs import ENVS, load_env
from common.rollout import step_prompt
from seed_rl import grpo_advantages, group_signal, probe_returns


def test_group_signal_hand_computed():
    # group 0: returns 10, 0, 0, 0 -> mean 2.5, unbiased std sqrt((7.5^2 + 3 * 2.5^2) / 3) = 5,
    #          advantages 1.5, -0.5, -0.5, -0.5 -> mean |A| = 0.75
    # group 1: all lost (no signal); group 2: a single surviving episode (no signal)
    rets, gids = [10, 0, 0, 0, 0, 0, 0, 0, 10], [0, 0, 0, 0, 1, 1, 1, 1, 2]
    adv = grpo_advantages(rets, gids)
    assert [round(a, 6) for a in adv[:4]] == [1.5, -0.5, -0.5, -0.5]
    share, abs_mean = group_signal([dict(gid=g, ret=r, adv=a) for g, r, a in zip(gids, rets, adv)])
    assert math.isclose(share, 2 / 3)
    assert math.isclose(abs_mean, 0.75, rel_tol=1e-6)
    # no group with signal at all: share 1, no mean (the update line then says NO TASK SIGNAL)
    assert group_signal([dict(gid=0, ret=-0.1, adv=0.0), dict(gid=0, ret=-0.1, adv=0.0)]) == (1.0, None)


def test_probe_reward_replaces_the_env_return():
    eps = [dict(steps=[dict(action="Look ")], **{"return": 9.9}), dict(steps=[dict(action="go to desk 1")]),
           dict(steps=[dict(action="")]), dict(steps=[])]
    probe_returns(eps, "look")
    assert [e["return"] for e in eps] == [1.0, 0.0, 0.0, 0.0]
    assert [e["probe_hit"] for e in eps] == [True, False, False, False]
    # 'admissible': a valid first step whose action the env offered (invalid, inadmissible or no step: 0)
    eps = [dict(steps=[dict(action="go to desk 1", valid=True, admissible_action=True)]),
           dict(steps=[dict(action="go to desk 1", valid=False, admissible_action=True)]),
           dict(steps=[dict(action="fly", valid=True, admissible_action=False)]),
           dict(steps=[dict(action="x", valid=True, admissible_action=None)]), dict(steps=[])]
    probe_returns(eps, "admissible")
    assert [e["return"] for e in eps] == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_every_env_has_episode_stats():
    for name in ENVS:
        assert isinstance(load_env(name).episode_stats({"steps": []}), dict)


def test_search_episode_stats_hand_built():
    search = load_env("search")
    info = search.format_information([{"contents": '"Paris"\nParis is the capital of France.'}])
    ep = {"golden_answers": ["Paris", "the city of light"],
          "steps": [dict(executed="search[capital of france]", feedback=info),
                    dict(executed="invalid", feedback="..."),
                    dict(executed="answer[paris france]", feedback="You answered: paris france")]}
    assert search.episode_stats(ep) == {"searches": 1, "gold_retrieved": 1.0, "answered": 1.0, "answer_words": 2}
    # a gold that is only part of a word is not retrieved ("paris" inside "comparison")
    ep2 = {"golden_answers": ["paris"], "steps": [
        dict(executed="search[q]", feedback=search.format_information([{"contents": "a comparison"}]))]}
    assert search.episode_stats(ep2) == {"searches": 1, "gold_retrieved": 0.0, "answered": 0.0, "answer_words": None}


def test_expert_thought_names_no_plan_position(expert_trajectories):
    """The behaviour-cloning target may only say what the agent sees: the task and the action."""
    ep = json.loads(open(expert_trajectories).readline())
    st = ep["steps"][0]
    assert st["response"] == (f"<think>To {ep['task'].rstrip('.')}, my next step is: {st['action']}.</think>\n"
                              f"<action>{st['action']}</action>")


def test_bc_examples_and_scripted_skills_train_one_sft(expert_trajectories, tmp_path):
    eps = [json.loads(line) for line in open(expert_trajectories)]
    won_steps = sum(len(e["steps"]) for e in eps if e["success"])
    # the scripted analyzer: a success's skill is the order of its valid actions
    skills = tmp_path / "skills.jsonl"
    run_script(["annotate.py", "--trajectories", str(expert_trajectories), "--out", str(skills),
                "--analyzer", "scripted", "--model", "tiny"])
    sft_rows = [json.loads(line) for line in open(tmp_path / "skills.sft.jsonl")]
    assert len(sft_rows) == len(eps)
    by_uid = {e["uid"]: e for e in eps}
    row = sft_rows[0]
    acts = [s["action"] for s in by_uid[row["trajectory_uid"]]["steps"] if s["valid"]]
    assert json.loads(row["target"])["episode_skill"] == "Follow this order of actions: " + ", then ".join(acts) + "."
    # one SFT over both: the BC examples are every step of every won episode, prompts rebuilt exactly
    out = tmp_path / "sft"
    res = run_script(["sft.py", "--model", "tiny", "--bc-data", str(expert_trajectories), "--data",
                      str(tmp_path / "skills.sft.jsonl"), "--out", str(out), "--epochs", "1", "--batch-size", "8",
                      "--max-steps", "1", "--max-length", "4096"])
    assert f"{won_steps} step examples from {len(eps)} won of {len(eps)} episodes" in res.stdout
    assert f"data: {won_steps + len(sft_rows)} records" in res.stdout
    manifest = json.load(open(out / "seed_manifest.json"))
    assert manifest["data"]["bc_data"] == [str(expert_trajectories)]
    # the prompt of a BC example is the step's plain prompt, the same text the rollout generated from
    ep = eps[0]
    t = 2
    from common.models import load_tokenizer
    from prompts.chat import chat_prompt
    text, _ = chat_prompt(load_tokenizer("tiny"), step_prompt(ep, t, ep["steps"][t]["history_used"]))
    assert text == ep["steps"][t]["prompt"]


def test_sft_without_any_data_is_a_one_line_error(tmp_path):
    res = run_script(["sft.py", "--model", "tiny", "--out", str(tmp_path / "o")], check=False)
    assert res.returncode != 0 and "needs --data" in res.stderr and "Traceback" not in res.stderr
    res = run_script(["sft.py", "--model", "tiny", "--bc-data", str(tmp_path / "nope.jsonl"), "--out",
                      str(tmp_path / "o")], check=False)
    assert res.returncode != 0 and "--bc-data" in res.stderr and "no such file" in res.stderr


def test_bc_sft_does_not_depend_on_the_order_episodes_were_written(expert_trajectories, tmp_path):
    """collect.py --workers N appends episodes as they finish, so two collections of the same tasks differ in line
    order; the warm start must not (sft.py sorts the records by id before its seeded shuffle)."""
    lines = open(expert_trajectories).read().splitlines()
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("\n".join(reversed(lines)) + "\n")
    runs = [("a", expert_trajectories), ("b", reordered)]
    # the two trainings are independent: side by side (about the time of one on 2 cores)
    side_by_side(*[(run_script, ["sft.py", "--model", "tiny", "--bc-data", str(data), "--out", str(tmp_path / name),
                                 "--epochs", "1", "--batch-size", "8", "--max-steps", "2", "--max-length", "4096"])
                   for name, data in runs])
    losses = []
    for name, _ in runs:
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        losses.append([r["loss"] for r in rows if "loss" in r])
    assert len(losses[0]) == 2 and losses[0] == losses[1]
