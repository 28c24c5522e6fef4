"""common/backends.py ScriptedAnalyzer: the rule-based stand-in for the self-analysis, on hand-written episode
records (collect.py's record format, only the keys the analyzer reads). A failure's skill comes from that
episode's own steps (its invalid steps, the actions it repeated or that changed nothing, how far it got); a
success's is the order of actions that worked. Every answer goes through the analysis parser."""
import json

import pytest

from common.backends import ScriptedAnalyzer, scripted_analysis
from prompts.analysis import MIN_SKILL_WORDS, parse_analysis

ROOM = "You are in the middle of a room. Looking quickly around you, you see a countertop 1, a fridge 1, and a shelf 1."


def step(observation, action, valid=True, reason=""):
    return dict(observation=observation, action=action, valid=valid, invalid_reason=reason,
                response=f"<think>...</think><action>{action}</action>" if action else "gibberish")


def episode(task, steps, success=False):
    return dict(env="alfworld", task=task, steps=steps, length=len(steps), success=success)


def test_repeated_actions_that_change_nothing_are_named_with_their_counts():
    ep = episode("put a mug in coffeemachine.", [
        step(ROOM, "go to countertop 1"),
        step("You arrive at countertop 1. On the countertop 1, you see a mug 1.", "open countertop 1"),
        step("Nothing happens.", "open countertop 1"),
        step("Nothing happens.", "look"),
        # "look" answered with the very observation it was given: no change either
        step("You are facing the countertop 1. Next to it, you see nothing.", "look"),
        step("You are facing the countertop 1. Next to it, you see nothing.", "open countertop 1"),
    ])
    summary, skill = scripted_analysis(ep)
    assert skill == (
        "Never repeat 'open countertop 1' (3 times, nothing changed) or 'look' (2 times, nothing changed): when an "
        "action changes nothing, try one you have not tried yet. Never leave 'put a mug in coffeemachine' "
        "unfinished: the 6 steps ended after 'go to countertop 1'; get that far without detours, then go straight "
        "on to finish the task.")
    # 'open' x2 answered "Nothing happens.", the second 'look' its own observation again; the last step's effect
    # is not shown (the analysis prompt has no observation after it)
    assert summary == ("The agent did not complete 'put a mug in coffeemachine' in 6 steps: 0 invalid, 3 that "
                       "changed nothing; its last action was 'open countertop 1'.")


def test_an_action_repeated_with_effect_is_named_without_the_no_change_warning():
    ep = episode("put a mug in coffeemachine.", [
        step(ROOM, "go to countertop 1"),
        step("You arrive at countertop 1. On the countertop 1, you see a mug 1.", "go to shelf 1"),
        step("You arrive at shelf 1. On the shelf 1, you see nothing.", "go to countertop 1"),
    ])
    assert scripted_analysis(ep)[1] == (
        "Never repeat 'go to countertop 1' (2 times): going back over the same action wastes steps. Never leave "
        "'put a mug in coffeemachine' unfinished: the 3 steps ended after 'go to shelf 1'; get that far without "
        "detours, then go straight on to finish the task.")


def test_all_three_rules_at_once_and_a_repeated_action_is_never_called_progress():
    """A real ALFWorld episode (train, the expert's first 2 steps, then looping; the observations shortened)."""
    ep = episode("put a keychain in sidetable.", [
        step("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.", "go to dresser 1"),
        step("You arrive at dresser 1. On the dresser 1, you see a keychain 1.", "take keychain 1 from dresser 1"),
        step("You pick up the keychain 1 from the dresser 1.", "look"),
        step("You are facing the dresser 1. Next to it, you see nothing.", "open drawer 1"),
        step("Nothing happens.", "", valid=False, reason="no_action_tags"),
        step("Nothing happens.", "open drawer 1"),
        step("Nothing happens.", "look"),
    ])
    summary, skill = scripted_analysis(ep)
    assert skill == (
        "Never reply without one action inside <action> </action> tags: 1 of 7 steps was invalid. Never repeat "
        "'look' (2 times) or 'open drawer 1' (2 times, nothing changed): when an action changes nothing, try one "
        "you have not tried yet. Never leave 'put a keychain in sidetable' unfinished: the 7 steps ended after "
        "'go to dresser 1', then 'take keychain 1 from dresser 1'; get that far without detours, then go straight "
        "on to finish the task.")
    assert summary == ("The agent did not complete 'put a keychain in sidetable' in 7 steps: 1 invalid "
                       "(no_action_tags 1), 3 that changed nothing; its last action was 'look'.")


def test_invalid_steps_give_the_format_rules_of_their_reasons():
    ep = episode("heat some apple and put it in fridge.", [
        step(ROOM, "", valid=False, reason="no_action_tags"),
        step("Nothing happens.", "go to fridge 1", valid=False, reason="no_think_tags"),
        step("You arrive at fridge 1. The fridge 1 is closed.", "", valid=False, reason="no_action_tags"),
        step("Nothing happens.", "open fridge 1", valid=False, reason="cjk"),
    ])
    summary, skill = scripted_analysis(ep)
    assert skill == (
        "Never reply without one action inside <action> </action> tags, and never act without reasoning inside "
        "<think> </think> tags first, and never write Chinese characters (use English only): 4 of 4 steps were "
        "invalid. Make every step a valid action that changes something: none of the 4 steps on 'heat some apple "
        "and put it in fridge' did.")
    assert summary == ("The agent did not complete 'heat some apple and put it in fridge' in 4 steps: 4 invalid "
                       "(no_action_tags 2, no_think_tags 1, cjk 1), 2 that changed nothing; its last action was "
                       "'open fridge 1'.")
    # Search's reasons, and one no rule knows
    ep = dict(episode("who wrote hamlet?", [step("who wrote hamlet?", "", valid=False, reason="no_block"),
                                            step("Your previous response was invalid.", "answer[x]", valid=False,
                                                 reason="weird")]), env="search")
    assert scripted_analysis(ep)[1].startswith(
        "Never reply without exactly one <search> query </search> or <answer> answer </answer> block, and never "
        "repeat the 'weird' mistake: 2 of 2 steps were invalid.")


def test_a_clean_prefix_cut_by_the_step_limit_names_how_far_it_got():
    """collect.py --model expert --split train --tasks 6 --max-steps 3: the walkthrough's first 3 steps."""
    ep = episode("put a keychain in sidetable.", [
        step("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.", "go to dresser 1"),
        step("You arrive at dresser 1. On the dresser 1, you see a keychain 1, and a mug 1.",
             "take keychain 1 from dresser 1"),
        step("You pick up the keychain 1 from the dresser 1.", "go to sidetable 1"),
    ])
    summary, skill = scripted_analysis(ep)
    assert skill == (
        "Never leave 'put a keychain in sidetable' unfinished: the 3 steps ended after 'go to dresser 1', then "
        "'take keychain 1 from dresser 1', then 'go to sidetable 1'; get that far without detours, then go "
        "straight on to finish the task.")
    assert summary == ("The agent did not complete 'put a keychain in sidetable' in 3 steps: 0 invalid, 0 that "
                       "changed nothing; its last action was 'go to sidetable 1'.")
    # two episodes of the same env fail with different skills (the old failure answer was one fixed string)
    other = episode("put a clean butterknife in sidetable.", [
        step(ROOM, "go to countertop 1"), step("You arrive at countertop 1.", "take butterknife 1 from countertop 1")])
    assert scripted_analysis(other)[1] != skill
    # only the last 3 useful actions are quoted, each at most 60 characters
    long = episode("x", [step(f"obs {i}", f"search[{'q' * 70} {i}]") for i in range(5)])
    assert scripted_analysis(long)[1].count("'search[") == 3 and "..." in scripted_analysis(long)[1]


def test_success_is_unchanged():
    ep = episode("put a keychain in sidetable.", [
        step(ROOM, "go to dresser 1"), step("You arrive at dresser 1.", "", valid=False, reason="no_action_tags"),
        step("Nothing happens.", "take keychain 1 from dresser 1"),
        step("You pick up the keychain 1.", "move keychain 1 to sidetable 1")], success=True)
    assert scripted_analysis(ep) == (
        "The agent completed the task in 4 steps.",
        "Follow this order of actions: go to dresser 1, then take keychain 1 from dresser 1, then move keychain 1 "
        "to sidetable 1.")


def test_answers_are_json_that_the_analysis_parser_reads_back(tokenizer):
    eps = [episode("t", [step(ROOM, "")]), episode("t", [step(ROOM, "", valid=False, reason="no_action_tags")]),
           episode("t", []), episode("t", [step(ROOM, "look")], success=True)]
    gens = ScriptedAnalyzer(tokenizer).generate([[1]] * len(eps), contexts=eps)
    for ep, g in zip(eps, gens):
        rec, reason = parse_analysis(g.text)
        assert reason == "" and len(rec["episode_skill"].split()) >= MIN_SKILL_WORDS
        assert (rec["episode_summary"], rec["episode_skill"]) == scripted_analysis(ep)
        assert g.token_ids == tokenizer(g.text, add_special_tokens=False)["input_ids"] and g.finish_reason == "stop"
    assert json.loads(gens[2].text)["episode_skill"] == "Act at once on 't': the episode ended before any step."
    assert json.loads(gens[0].text)["episode_skill"].endswith("none of the 1 step on 't' did.")
