"""The hindsight-analysis prompt and its JSON parser (docs/paper.md, Stage 1 step 2; reused by Stage 2).

One wording serves every stage: annotate.py sends it to an external analyzer, sft.py trains the policy on
(this prompt, the analyzer's JSON), and seed_rl.py asks the evolving policy itself with it.
"""
import json
import re

ANALYSIS_TEMPLATE = """You are reviewing one episode of {description}. Write a hindsight skill: one short instruction that will help the agent on its next attempt at tasks like this one.

Task: {task}
Outcome: {outcome}

Trajectory:
{trajectory}

How to write the skill:
- If the episode succeeded, state the workflow: the decision rule and the order of actions that worked.
- If it failed, state avoidance rules: the core mistake and the warning signs that should have stopped it.
- Address the agent directly ("First ...", "Never ..."), in one to three sentences. It is a policy-facing instruction, not a retrospective of this episode.

Answer with a single JSON object and nothing else:
{{"episode_summary": "<what happened, in one or two sentences>", "episode_skill": "<the skill>"}}"""

STRICT_REMINDER = """

IMPORTANT: your previous answer could not be used ({reason}). Reply with exactly one JSON object, with no code fences and no text before or after it, with exactly the two string keys "episode_summary" and "episode_skill"; the skill must be at least 5 words."""

MIN_SKILL_WORDS = 5
# Bound on the analysis prompt, in characters (~4 per token), per env (its PRESET["analysis_max_chars"]): a
# 30-step ALFWorld episode with 512-token responses would be ~16k tokens; 24,000 characters keep prompt +
# answer inside SFT's 8,192-token limit. Every stage uses the episode's env's bound, so the policy is trained
# (sft.py) on exactly the prompts it later answers (seed_rl.py).
ANALYSIS_MAX_CHARS = 24_000
_ENV_BOUND = object()


def outcome_text(episode):
    n = episode["length"]
    return f"SUCCESS (the task was completed in {n} steps)" if episode["success"] else \
        f"FAILURE (the task was not completed in {n} steps)"


def serialize_steps(steps, max_response_chars=None):
    out = []
    for i, s in enumerate(steps, start=1):
        resp = s["response"]
        if max_response_chars is not None and len(resp) > max_response_chars:
            resp = resp[: max_response_chars // 2] + " [...] " + resp[-max_response_chars // 2:]
        out.append(f"Step {s.get('step', i)}\nObservation: {s['observation']}\nResponse: {resp}\n"
                   f"Action valid: {'yes' if s['valid'] else 'no'}")
    return "\n\n".join(out)


def build_analysis_prompt(episode, env, *, max_chars=_ENV_BOUND, reminder=None):
    """The analysis prompt for a collected episode (collect.py's record format), describing its env (the env
    module: its ENV_DESCRIPTION and PRESET["analysis_max_chars"]; the caller passes it, so prompts/ never
    imports envs/, which imports prompts/).

    max_chars bounds the prompt (default: the episode's env's bound; None: no bound): first each response is
    shortened, then the oldest steps are dropped (said in the prompt), never silently.
    reminder: None, or the reason of the previous parse failure (adds the stricter reminder).
    """
    if max_chars is _ENV_BOUND:
        max_chars = env.PRESET["analysis_max_chars"]
    steps = episode["steps"]
    fill = lambda traj: ANALYSIS_TEMPLATE.format(description=env.ENV_DESCRIPTION, task=episode.get("task", ""),
                                                 outcome=outcome_text(episode), trajectory=traj)
    prompt = fill(serialize_steps(steps))
    if max_chars is not None and len(prompt) > max_chars:
        prompt = fill(serialize_steps(steps, max_response_chars=400))
        drop = 0
        while len(prompt) > max_chars and drop < len(steps) - 1:
            drop += 1
            traj = f"[the first {drop} steps are omitted for length]\n\n" + serialize_steps(steps[drop:], 400)
            prompt = fill(traj)
    if reminder:
        prompt += STRICT_REMINDER.format(reason=reminder)
    return prompt


_FENCE_RE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)
# Only a LEADING reasoning block is dropped (a skill may itself mention <think> tags). Anchored at the
# start, the scan is linear (unanchored, ".*?" over a long run of unclosed "<think>" is quadratic).
_THINK_RE = re.compile(r"^\s*<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def _json_objects(text):
    """Every top-level JSON object that parses inside `text`, in order."""
    dec = json.JSONDecoder()
    i, out = 0, []
    while True:
        i = text.find("{", i)
        if i < 0:
            return out
        try:
            obj, end = dec.raw_decode(text, i)
        except (ValueError, RecursionError):  # deep nesting ('{"a": [[[[...') raises RecursionError
            i += 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        i = end


def parse_analysis(text, min_words=MIN_SKILL_WORDS):
    """Returns (record, reason): record = {"episode_summary", "episode_skill"} or None with a reason:
    'empty', 'no_json', 'missing_keys', 'not_strings', 'skill_too_short'. Never raises."""
    if not isinstance(text, str) or not text.strip():
        return None, "empty"
    text = _THINK_RE.sub("", text)
    candidates = [o for block in _FENCE_RE.findall(text) for o in _json_objects(block)] + _json_objects(text)
    if not candidates:
        return None, "no_json"
    with_keys = [o for o in candidates if "episode_skill" in o and "episode_summary" in o]
    if not with_keys:
        return None, "missing_keys"
    obj = with_keys[-1]
    summary, skill = obj["episode_summary"], obj["episode_skill"]
    if not isinstance(summary, str) or not isinstance(skill, str):
        return None, "not_strings"
    summary, skill = " ".join(summary.split()), " ".join(skill.split())
    if len(skill.split()) < max(1, min_words):
        return None, "skill_too_short"
    return {"episode_summary": summary, "episode_skill": skill}, ""


def target_json(record):
    """The SFT target: the parsed answer re-serialized (canonical, no fences or chatter)."""
    return json.dumps({"episode_summary": record["episode_summary"], "episode_skill": record["episode_skill"]},
                      ensure_ascii=False)
