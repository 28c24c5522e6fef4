"""prompts/: the agent step prompt, skill injection, action parsing, and the analysis JSON parser.

Pure-string tests (no env, no model): exact expected results for the parsing rules of docs/paper.md, a seeded
fuzz test that no string crashes either parser, and the structure of the step-1 / later-step prompts with
and without the episode-skill block.
"""
import json
import random
import re

import pytest

from envs.alfworld import CLOSING, ROLE, build_agent_prompt, extract_task
from prompts import MIN_SKILL_WORDS, action_to_execute, parse_action, parse_analysis, skill_block, target_json

ADM = ["go to desk 1", "go to shelf 2", "open drawer 1", "inventory", "look"]
REASONS = {"", "no_action_tags", "no_think_tags", "cjk"}
ANALYSIS_REASONS = {"", "empty", "no_json", "missing_keys", "not_strings", "skill_too_short"}


# ----------------------------------------------------------------------------------------------------
# Action parsing: exact results, the public code's rule (docs/paper.md, ALFWorld protocol; projection.py)

@pytest.mark.parametrize("text, expected", [
    # a valid step
    ("<think>The desk may hold the pen.</think>\n<action>go to desk 1</action>", ("go to desk 1", True, "")),
    # missing action tags: no action at all
    ("<think>I should go to the desk.</think> go to desk 1", ("", False, "no_action_tags")),
    ("", ("", False, "no_action_tags")),
    ("<think>x</think><action>go to desk 1", ("", False, "no_action_tags")),  # unclosed
    # missing think tags (either one): the action is still parsed, the step is invalid
    ("<action>go to desk 1</action>", ("go to desk 1", False, "no_think_tags")),
    ("I think so.</think><action>go to desk 1</action>", ("go to desk 1", False, "no_think_tags")),
    ("<think>I think so.<action>go to desk 1</action>", ("go to desk 1", False, "no_think_tags")),
    # the think tags are checked on the original text, case-sensitive (as the public code does)
    ("<THINK>x</THINK><action>look</action>", ("look", False, "no_think_tags")),
    # two action blocks: the FIRST "<action>" and the FIRST "</action>" count
    ("<think>a</think><action>go to desk 1</action> no wait <action>open drawer 1</action>",
     ("go to desk 1", True, "")),
    # a tag mentioned in the reasoning opens the block: the public slice runs from it to the first closing tag
    ("<think>I answer inside <action> tags.</think><action>look</action>",
     ("tags.</think><action>look", True, "")),
    # closing tag before the opening one: the public slice is empty and the step counts as valid
    ("<think>x</think></action>go<action>", ("", True, "")),
    # a CJK ideograph (U+4E00-U+9FFF) anywhere makes the step invalid; kana, hangul, full-width punctuation do not
    ("<think>我应该去桌子</think><action>go to desk 1</action>", ("go to desk 1", False, "cjk")),
    ("<think>ok</think><action>go to desk 1</action>カ", ("go to desk 1", True, "")),
    ("<think>ok</think><action>go to desk 1</action>한", ("go to desk 1", True, "")),
    ("<think>ok，</think><action>go to desk 1</action>", ("go to desk 1", True, "")),
    # the action: lower-cased and stripped (inner whitespace kept, as the public code does)
    ("<think>x</think><Action>  Go To DESK 1  </ACTION>", ("go to desk 1", True, "")),
    ("<think>x</think><action> go  to\tdesk 1 </action>", ("go  to\tdesk 1", True, "")),
    # admissibility is NOT validity: a well-formed inadmissible action is valid (the env says "Nothing happens.")
    ("<think>x</think><action>go to desk 7</action>", ("go to desk 7", True, "")),
    ("<think>x</think><action>   </action>", ("", True, "")),
    # the checks come in this order: action tags, think tags, CJK
    ("<action>去 desk</action>", ("去 desk", False, "no_think_tags")),
    ("<think>去</think><action>go to desk 7</action>", ("go to desk 7", False, "cjk")),
])
def test_parse_action_cases(text, expected):
    assert parse_action(text, ADM) == expected


def test_parse_action_without_the_think_rule():
    """Qwen3 with thinking off (prompts/chat.py requires_think_tags): the think rule is dropped, nothing else."""
    assert parse_action("<action>look</action>", ADM, require_think=False) == ("look", True, "")
    assert parse_action("<action>去</action>", ADM, require_think=False) == ("去", False, "cjk")
    assert parse_action("look", ADM, require_think=False) == ("", False, "no_action_tags")


def test_parse_action_non_string_input():
    assert parse_action(None, ADM) == ("", False, "no_action_tags")
    assert parse_action(12, ADM) == ("", False, "no_action_tags")


def test_action_to_execute_fallback_rules():
    # a parsed action is executed as is, admissible or not (the env answers "Nothing happens.")
    assert action_to_execute("<action>go to desk 7</action>", "go to desk 7") == "go to desk 7"
    assert action_to_execute("<action>go to desk 7</action>", "go to desk 7", fallback="look") == "go to desk 7"
    # no action: the configured fallback ...
    assert action_to_execute("I will go to the desk", "", fallback="look") == "look"
    # ... else the last 30 characters of the lower-cased response (the public code's rule)
    raw = "I  Think\n\n" + "x" * 30 + "   and then   GO to the desk now"
    tail = action_to_execute(raw, "")
    assert tail == raw.lower()[-30:] and len(tail) == 30
    assert action_to_execute("Go to desk 1", "") == "go to desk 1"
    # ... and never an empty command
    assert action_to_execute("", "") == "look"
    assert action_to_execute(" \n\t ", "") == "look"
    assert action_to_execute(None, "") == "look"


# ----------------------------------------------------------------------------------------------------
# Analysis parsing: exact results

SUMMARY = "The agent found the mug and heated it."
SKILL = "First find the mug, then heat it in the microwave before placing it."


def _obj(summary=SUMMARY, skill=SKILL, **extra):
    return json.dumps({"episode_summary": summary, "episode_skill": skill, **extra})


def test_parse_analysis_plain_json():
    assert parse_analysis(_obj()) == ({"episode_summary": SUMMARY, "episode_skill": SKILL}, "")


def test_parse_analysis_fenced_json_with_chatter():
    text = f"Sure! Here is my analysis:\n```json\n{_obj()}\n```\nLet me know if you need more."
    assert parse_analysis(text) == ({"episode_summary": SUMMARY, "episode_skill": SKILL}, "")
    assert parse_analysis(f"```\n{_obj()}\n```") == ({"episode_summary": SUMMARY, "episode_skill": SKILL}, "")


def test_parse_analysis_think_blocks_are_ignored():
    decoy = _obj(skill="Never do anything at all in this environment ever.")
    text = f"<think>Draft: {decoy}\nhmm, no.</think>\n{_obj()}"
    assert parse_analysis(text)[0]["episode_skill"] == SKILL
    # an answer that exists only inside the think block is not an answer
    assert parse_analysis(f"<think>{_obj()}</think> I am done.") == (None, "no_json")


def test_parse_analysis_two_objects_last_with_both_keys_wins():
    second = "Second: open the fridge first, then cool the apple there."
    text = f"{_obj()}\nCorrection:\n{_obj(skill=second)}"
    assert parse_analysis(text)[0]["episode_skill"] == second
    # a later object without both keys does not override an earlier complete one
    text = f"{_obj()} and {json.dumps({'episode_skill': 'only one key given in this object'})}"
    assert parse_analysis(text)[0]["episode_skill"] == SKILL


def test_parse_analysis_rejections():
    assert parse_analysis(json.dumps({"summary": SUMMARY, "skill": SKILL})) == (None, "missing_keys")
    assert parse_analysis(json.dumps({"episode_skill": SKILL})) == (None, "missing_keys")
    assert parse_analysis(_obj(skill=["go", "to", "desk", "1", "now"])) == (None, "not_strings")
    assert parse_analysis(_obj(summary=None)) == (None, "not_strings")
    assert parse_analysis(_obj(skill=7)) == (None, "not_strings")
    assert parse_analysis("no json here, just words") == (None, "no_json")
    assert parse_analysis("[1, 2, 3]") == (None, "no_json")  # JSON, but not an object
    assert parse_analysis('{"episode_summary": "x", "episode_skill": ') == (None, "no_json")  # cut off
    for empty in ("", "   \n ", None, 5):
        assert parse_analysis(empty) == (None, "empty")


def test_parse_analysis_skill_word_limit():
    assert MIN_SKILL_WORDS == 5
    # Stage 2's teacher mask takes any non-empty skill by default (the public code; seed_rl.py --min-skill-words)
    assert parse_analysis(_obj(skill="Open the fridge first."), min_words=1)[0]["episode_skill"] == "Open the fridge first."
    assert parse_analysis(_obj(skill="   "), min_words=1) == (None, "skill_too_short")
    assert parse_analysis(_obj(skill="Open the fridge first.")) == (None, "skill_too_short")  # 4 words
    assert parse_analysis(_obj(skill="  Open   the\nfridge  ")) == (None, "skill_too_short")
    rec, reason = parse_analysis(_obj(skill="Open  the fridge\n first, always."))  # 5 words, folded
    assert reason == "" and rec == {"episode_summary": SUMMARY, "episode_skill": "Open the fridge first, always."}
    # the SFT target is the canonical re-serialization and parses back to the same record
    assert parse_analysis(target_json(rec)) == (rec, "")


def test_parse_analysis_deep_nesting_does_not_raise():
    # json's C decoder raises RecursionError (not ValueError) on deep nesting
    assert parse_analysis('{"episode_skill": ' + "[" * 100_000) == (None, "no_json")
    assert parse_analysis("{" * 50_000 + _obj())[0]["episode_skill"] == SKILL


# ----------------------------------------------------------------------------------------------------
# Property-style: no string crashes the parsers, and results are well typed

PIECES = ["<think>", "</think>", "<action>", "</action>", "<THINK>", "</Action>", "<act", "ion>", "</", "<", ">",
          "think", "action", "{", "}", "[", "]", "(", ")", '"', "'", ":", ",", "\\", "\\u", "\\ud800", "```",
          "```json", "episode_skill", "episode_summary", '"episode_skill": "', '"episode_summary": "',
          "go to desk 1", "look", "inventory", "open drawer 1", "Go  To", " ", "  ", "\n", "\t", "\r",
          "中", "文字", "カ", "한국", "，", "😀", "🙂‍↔️", "\x00", "\x01", "\x1b[31m", "\x7f", "\u200b", "\ufeff",
          "\ud800", "a", "b", "the", "first", "then", "never", "1", "0.5", "null", "true", "-"]


def _random_strings(n, seed=1234):
    rng = random.Random(seed)
    for i in range(n):
        if i % 500 == 0:  # a few very long strings
            k = rng.choice([5_000, 20_000, 50_000])
        else:
            k = rng.randint(0, 40)
        yield "".join(rng.choice(PIECES) for _ in range(k))
    # plus valid-looking shapes the generator rarely hits
    yield "<think>" * 10_000 + "<action>look</action>" * 10_000
    yield "<action>" * 20_000
    yield '{"episode_summary": "' + "x " * 50_000 + '", "episode_skill": "' + "y " * 50_000 + '"}'


def test_parsers_never_raise_and_are_well_typed():
    n_valid = n_records = 0
    for text in _random_strings(3000):
        action, valid, reason = parse_action(text, ADM)
        assert isinstance(action, str) and isinstance(valid, bool) and reason in REASONS
        assert valid == (reason == "")
        assert action == action.strip() and action == action.lower()  # stripped, lower-cased
        if valid:
            assert "<think>" in text and "</think>" in text and not re.search(r"[\u4e00-\u9fff]", text)
            n_valid += 1
        executed = action_to_execute(text, action)
        assert isinstance(executed, str) and executed and len(executed) <= max(30, len(action))
        assert action_to_execute(text, action, fallback="look") == (action or "look")

        rec, why = parse_analysis(text)
        assert why in ANALYSIS_REASONS and (rec is None) == (why != "")
        if rec is not None:
            assert set(rec) == {"episode_summary", "episode_skill"}
            assert all(isinstance(v, str) for v in rec.values())
            assert len(rec["episode_skill"].split()) >= MIN_SKILL_WORDS
            n_records += 1
    assert n_valid > 0  # the generator does reach the valid branch
    assert n_records > 0


# ----------------------------------------------------------------------------------------------------
# The agent prompt

OBS1 = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
        "see a desk 1, a drawer 1, and a shelf 2.\n\nYour task is to: put some pen on shelf.")
TASK = extract_task(OBS1)
HIST = [(f"obs number {i}", f"act number {i}") for i in range(1, 8)]  # the observation/action of steps 1..7


def test_extract_task():
    assert TASK == "put some pen on shelf."
    assert extract_task("You see nothing.") == ""


def test_step1_prompt_fields():
    p = build_agent_prompt(OBS1, ADM, step=1)
    assert p.startswith(ROLE) and "expert agent" in p and "ALFRED embodied environment" in p
    assert f"Your current observation is: {OBS1}\n" in p
    assert "Your admissible actions in the current situation are: ['go to desk 1'\n 'go to shelf 2'\n " \
           "'open drawer 1'\n 'inventory'\n 'look']." in p  # one per line, as the public code lists them
    assert "'help'" not in p
    assert p.endswith(CLOSING) and "<think> </think>" in CLOSING and "<action> </action>" in CLOSING
    # step 1 has no task line (the task is inside the observation), no history, no step count
    assert "Your task is to: put" not in p.replace(OBS1, "")
    assert "Observation 1" not in p and "step(s)" not in p and "You are now at step" not in p


@pytest.mark.parametrize("step, k", [(2, 1), (4, 3), (8, 5), (8, 0)])
def test_later_step_prompt_fields(step, k):
    history = HIST[step - 1 - k: step - 1]  # the last k of steps 1..step-1
    p = build_agent_prompt("You arrive at desk 1.", ADM, step=step, task=TASK, history=history)
    assert p.startswith(f"{ROLE} Your task is to: {TASK}\n")
    assert f"already taken {step - 1} step(s)" in p
    assert f"most recent {k} observations" in p
    entries = re.findall(r"\[Observation (\d+): '(.*?)', Action (\d+): '(.*?)'\]", p)
    expected = [(str(i), f"obs number {i}", str(i), f"act number {i}") for i in range(step - k, step)]
    assert entries == expected
    assert f"You are now at step {step} and your current observation is: You arrive at desk 1.\n" in p
    assert "['go to desk 1'\n 'go to shelf 2'\n 'open drawer 1'\n 'inventory'\n 'look']" in p
    assert p.endswith(CLOSING)


@pytest.mark.parametrize("step", [1, 2, 6])
def test_skill_block_is_the_only_difference(step):
    skill = "First open the drawer, then take the pen and put it on the shelf."
    history = HIST[max(0, step - 1 - 5): step - 1]
    plain = build_agent_prompt("You see a drawer.", ADM, step=step, task=TASK, history=history)
    teach = build_agent_prompt("You see a drawer.", ADM, step=step, task=TASK, history=history, skill=skill)
    block = skill_block(skill)
    assert block.endswith(f"{skill}\n") and len(teach) == len(plain) + len(block)
    # where the block goes: right after the task line; before the closing instruction on step 1
    at = plain.index(CLOSING) if step == 1 else plain.index("\n") + 1
    if step > 1:
        assert plain[:at].startswith(ROLE) and plain[:at].rstrip("\n").endswith(f"Your task is to: {TASK}")
    assert teach == plain[:at] + block + plain[at:]
    # no skill (None or empty) is the plain prompt
    assert build_agent_prompt("You see a drawer.", ADM, step=step, task=TASK, history=history, skill="") == plain


def test_step1_skill_block_goes_after_the_task_line_of_the_observation():
    """At step 1 the task line is the first observation's own last line: the block goes right after it (the
    public code's seed/prompting.py), not after the action list."""
    skill = "First open the drawer, then take the pen and put it on the shelf."
    plain = build_agent_prompt(OBS1, ADM, step=1)
    teach = build_agent_prompt(OBS1, ADM, step=1, skill=skill)
    at = plain.index("Your task is to: put some pen on shelf.\n") + len("Your task is to: put some pen on shelf.\n")
    assert teach == plain[:at] + skill_block(skill) + plain[at:]
    assert teach.index(skill) < teach.index("Your admissible actions")
