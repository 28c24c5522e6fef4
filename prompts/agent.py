"""What every env's agent prompt shares: the episode-skill block, and for the envs whose agent answers
`<think>...</think><action>...</action>` (ALFWorld, WebShop) the pieces of their step prompt (the history, the
admissible actions, the closing instruction) and the tag-based action parser.

Each env module builds its own step prompt (envs/alfworld.py: `build_agent_prompt`) and inserts
`skill_block(skill)` at its skill insertion point, so the plain and the skill-aware "teacher" prompt of Stage 2
differ by exactly that block.
"""
import re

SKILL_TITLE = "Episode-level skill (hindsight learned from an earlier attempt at this task; follow it):"


def skill_block(skill):
    return f"{SKILL_TITLE}\n{skill.strip()}\n"


def recent_steps(history, step, observation):
    """The middle of ALFWorld's and WebShop's step prompt from step 2 on (one template in the paper's public
    code): the steps taken so far, the last k (observation, action) pairs numbered by their step, then the
    current step and observation. history: the (observation, action) pairs of the k steps right before `step`,
    oldest first."""
    k = len(history)
    pairs = "\n".join(f"[Observation {step - k + i}: '{obs}', Action {step - k + i}: '{act}']"
                      for i, (obs, act) in enumerate(history))
    return (f"Before this step you have already taken {step - 1} step(s). Below are the most recent {k} "
            f"observations and the action you took after each:\n{pairs}\n"
            f"You are now at step {step} and your current observation is: {observation}\n")


def admissible_actions(admissible, *, bracket_lines):
    """The admissible actions of ALFWorld's and WebShop's step prompt, each quoted, then a blank line. Each env
    lays the list out as its public code does (env_manager.py build_text_obs): ALFWorld joins the actions with
    a newline and a space inside [...] (bracket_lines=False), WebShop puts '[' and ']' on lines of their own and
    a comma after every action (bracket_lines=True)."""
    intro = "Your admissible actions in the current situation are:"
    if bracket_lines:
        return intro + "\n[\n" + "\n".join(f"'{a}'," for a in admissible) + "\n].\n\n"
    return intro + " [" + "\n ".join(f"'{a}'" for a in admissible) + "].\n\n"


def closing_instruction(turn, choice, weigh=""):
    """The last sentences of ALFWorld's and WebShop's step prompt: reason in think tags, then give the action in
    action tags (what `parse_action` below checks). Each env words `turn`, `choice` and `weigh` for its task."""
    return (f"Now it is your turn to {turn}. First reason step by step about the current situation{weigh}; this "
            f"reasoning MUST be enclosed in <think> </think> tags. Then choose {choice} and give it inside "
            "<action> </action> tags.")


# ----------------------------------------------------------------------------------------------------
# Parsing: the rule of the paper's public code (its ALFWorld/WebShop projections; docs/paper.md, ALFWorld protocol).
# The action is the text between the FIRST "<action>" and the FIRST "</action>" of the lower-cased response,
# stripped. A step is invalid when the action tags are missing, the think tags are missing (checked on the
# original text, case-sensitive, as the public code does), or the response contains a CJK ideograph
# (U+4E00-U+9FFF). Admissibility is NOT validity: a well-formed inadmissible action is executed, the env
# answers "Nothing happens.", and it costs only the wasted step (the rollout loop records it as
# `admissible_action` False and can make it invalid with --invalid-rule strict, the stricter ablation).
# Invalid steps still execute something (see `action_to_execute`) and are penalized by the env's reward.

CJK_RE = re.compile(r"[\u4e00-\u9fff]")
FALLBACK_CHARS = 30  # without action tags the env runs the last 30 characters of the lower-cased response


def parse_action(text, admissible=None, require_think=True):
    """Returns (action, valid, reason): reason '' when valid, else the first failed check, in this order:
    'no_action_tags', 'no_think_tags', 'cjk'. action is '' when there are no action tags (and when the tags
    come in reverse order: the public code's slice is then empty, and the step still counts as valid).
    require_think=False drops the think rule (Qwen3 with thinking off: prompts/chat.py `requires_think_tags`).
    `admissible` is not consulted: the rollout loop records admissibility apart."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    lower = text.lower()
    start, end = lower.find("<action>"), lower.find("</action>")
    if start == -1 or end == -1:
        return "", False, "no_action_tags"
    action = lower[start + len("<action>"):end].strip()
    if require_think and (text.find("<think>") == -1 or text.find("</think>") == -1):
        return action, False, "no_think_tags"
    if CJK_RE.search(text):
        return action, False, "cjk"
    return action, True, ""


def action_to_execute(text, action, fallback=None, tail_chars=FALLBACK_CHARS, blank="look"):
    """What the env executes for a step: the parsed action when there is one (an inadmissible one gets
    "Nothing happens."); otherwise `fallback` if set (e.g. 'look'), else the last `tail_chars` characters of
    the lower-cased response (the public code's rule: 30 in ALFWorld, 20 in WebShop), which the env also
    answers with "Nothing happens."; for an empty or blank response `blank` ('look': never an empty command;
    None: the blank tail itself)."""
    if action:
        return action
    if fallback:
        return fallback
    tail = str(text or "").lower()[-tail_chars:]
    return tail if tail.strip() or blank is None else blank
