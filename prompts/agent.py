"""The per-step agent prompt, the episode-skill block, and action parsing (SPEC.md: "Agent prompt").

Every step of an episode is its own (prompt, response) sample. The prompt is one user message:
  step 1      role, current observation, admissible actions, closing instruction
  step t > 1  role + task line, steps taken so far, the last k (observation, action) pairs, current step
              number and observation, admissible actions, closing instruction
The skill-aware "teacher" prompt of Stage 2 is the same prompt with an episode-skill block inserted right
after the task line (step 1 has no task line of its own: the block goes before the closing instruction).
Both prompts are built by the one function below, so they differ by exactly that block.
"""
import re

ROLE = "You are an expert agent operating in the ALFRED embodied environment."

CLOSING = (
    "Now it is your turn to act. First reason step by step about the current situation; this reasoning "
    "MUST be enclosed in <think> </think> tags. Then choose exactly one admissible action for this step "
    "and give it inside <action> </action> tags."
)

SKILL_TITLE = "Episode-level skill (hindsight learned from an earlier attempt at this task; follow it):"


def skill_block(skill):
    return f"{SKILL_TITLE}\n{skill.strip()}\n"


def quote_actions(admissible):
    return ", ".join(f"'{a}'" for a in admissible)


def format_history(history, first_index):
    """history: [(observation, action), ...] oldest first; first_index: the step number of history[0]."""
    return "\n".join(f"[Observation {first_index + i}: '{obs}', Action {first_index + i}: '{act}']"
                     for i, (obs, act) in enumerate(history))


def build_agent_prompt(observation, admissible, *, step, task=None, history=(), skill=None):
    """The user message for one step.

    step: 1-based index of the step being decided. history: the (observation, action) pairs of the most
    recent earlier steps that fit (oldest first; the caller chooses how many). skill: None for the plain
    prompt, a string for the skill-augmented teacher prompt.
    """
    actions = quote_actions(admissible)
    block = skill_block(skill) if skill else ""
    if step == 1:
        return (f"{ROLE}\n"
                f"Your current observation is: {observation}\n"
                f"Your admissible actions in the current situation are: [{actions}].\n\n"
                f"{block}{CLOSING}")
    k = len(history)
    return (f"{ROLE} Your task is to: {task}\n"
            f"{block}"
            f"Before this step you have already taken {step - 1} step(s). Below are the most recent {k} "
            f"observations and the action you took after each:\n{format_history(history, step - k)}\n"
            f"You are now at step {step} and your current observation is: {observation}\n"
            f"Your admissible actions in the current situation are: [{actions}].\n\n"
            f"{CLOSING}")


def extract_task(first_observation):
    """ALFWorld's first observation ends with 'Your task is to: <task>'; '' when absent."""
    m = re.search(r"Your task is to:\s*(.+)", first_observation)
    return m.group(1).strip().rstrip(".") + "." if m else ""


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
