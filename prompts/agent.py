"""What every env's agent prompt shares: the episode-skill block, and the tag-based action parser of the
envs whose agent answers `<think>...</think><action>...</action>` (ALFWorld, WebShop).

Each env module builds its own step prompt (envs/alfworld.py: `build_agent_prompt`) and inserts
`skill_block(skill)` at its skill insertion point, so the plain and the skill-aware "teacher" prompt of Stage 2
differ by exactly that block.
"""
import re

SKILL_TITLE = "Episode-level skill (hindsight learned from an earlier attempt at this task; follow it):"


def skill_block(skill):
    return f"{SKILL_TITLE}\n{skill.strip()}\n"


# ----------------------------------------------------------------------------------------------------
# Parsing. The action is the text of the LAST <action>...</action>, stripped and lower-cased. A step is
# invalid when the action tags or the think tags are missing, the text contains CJK characters, or the
# action is not admissible. Invalid steps still execute something (see `action_to_execute`) and are
# penalized by the environment wrapper.

# The block's text may not contain another "<action>": a tag mentioned in the reasoning ("I answer with
# <action> tags") must not swallow the real block that follows it.
ACTION_RE = re.compile(r"<action>((?:(?!<action>).)*?)</action>", re.DOTALL | re.IGNORECASE)
THINK_OPEN_RE = re.compile(r"<think>", re.IGNORECASE)
THINK_CLOSE_RE = re.compile(r"</think>", re.IGNORECASE)
# CJK unified ideographs (+ext. A, compatibility), CJK punctuation, kana, hangul, full-width forms.
CJK_RE = re.compile(r"[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")


def parse_action(text, admissible):
    """Returns (action, valid, reason). action is '' when there are no action tags; reason '' when valid.

    Reasons, checked in this order: 'no_action_tags', 'no_think_tags', 'cjk', 'not_admissible'.
    """
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    found = ACTION_RE.findall(text)
    action = " ".join(found[-1].split()).lower() if found else ""
    if not found:
        return action, False, "no_action_tags"
    if not (THINK_OPEN_RE.search(text) and THINK_CLOSE_RE.search(text)):
        return action, False, "no_think_tags"
    if CJK_RE.search(text):
        return action, False, "cjk"
    if action not in set(admissible):
        return action, False, "not_admissible"
    return action, True, ""


def action_to_execute(text, action, fallback=None):
    """What the env executes for a step: the parsed action when there is one (an inadmissible one gets
    "Nothing happens."); otherwise `fallback` if set (e.g. 'look'), else the raw text's last 50
    characters (whitespace folded), which the env also answers with "Nothing happens."."""
    if action:
        return action
    if fallback:
        return fallback
    tail = " ".join(str(text or "").split())[-50:]
    return tail or "look"
