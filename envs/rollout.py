"""The multi-turn rollout loop: plays a batch of episodes, one batched generation call per step.

Env-agnostic: it calls only the env interface (envs/__init__.py). Each step of each live episode: build the
plain prompt (last k history entries; the oldest dropped first while the chat-templated prompt is over
`max_prompt_tokens`), generate, parse the action, step the env, and record everything a later stage needs to
rebuild the same prompt (with or without a skill), score the same response tokens, and serialize the episode
for the analyzer (the record schema: envs/records.py).

Reward: the env's (`env.reward`: ALFWorld +10 at the step the game is won, minus the invalid-step penalty);
return = sum; success = won. An episode ends when won, when the env says done, after `max_steps`, or on an
env failure (the failure is recorded in `env_failure`; trainers drop such episodes from their groups).

The episode record (built here: `new_episode`, `play_episodes`; one JSON line per episode in collect.py's and
evaluate.py's outputs). Readers: annotate.py (A), sft.py via annotate's SFT file (S), seed_rl.py (R),
evaluate.py and the summaries (E).

| key | meaning | read by |
| --- | --- | --- |
| env | the env module's NAME ("alfworld", ...): which prompt, parser and analysis wording apply | A R E |
| task_id, split, category | the task (stable id), its split, its summary column (a GROUPS entry) | A E |
| ...task fields | whatever the env's task dict holds (ALFWorld: game_file, task_type) | the env |
| uid, group, rollout, seed | episode id; GRPO group and index inside it; the run seed (sampling seeds) | A R E |
| task | the instruction text shown on the task line | A R |
| steps | one record per step, below | A R E |
| return, length, success, score | sum of step rewards; steps played; won; final score in [0, 1] | A R E |
| env_failure | None, or why the env broke (the episode is dropped from training and summaries) | A R E |
| prompt_too_long, history_truncations, truncated_responses | counters of the length limits | E |

| step key | meaning | read by |
| --- | --- | --- |
| step | 1-based step number | A |
| prompt, prompt_ids, history_used | the plain prompt exactly as generated from (text, token ids, history entries k) | R |
| response, response_ids, response_logprobs, truncated | the sampled response (text, token ids incl. the stop token, the engine's log-probs, cut at the limit) | A R |
| action, executed, valid, invalid_reason | the parsed action, what the env ran, the validity rule's verdict | A E |
| admissible_action | the action was in the admissible list (None: the env gives none); its own metric | E R |
| observation, admissible | what the agent saw before acting (rebuilds the prompt with a skill) | A R |
| reward, done, won, score, feedback | the env's answer to the step | A E |
"""
import time

from envs import load_env
from prompts.chat import chat_prompt, requires_think_tags


def sample_seed(*parts):
    """A stable 63-bit seed from (run seed, episode id, step, ...)."""
    import hashlib
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def step_prompt(episode, t, k, skill=None):
    """The user message of step t (0-based) of a recorded episode, with its last k history entries, built by
    the episode's own env."""
    env = load_env(episode.get("env", "alfworld"))  # records written before envs had names are ALFWorld's
    steps = episode["steps"]
    obs, adm = (steps[t]["observation"], steps[t]["admissible"]) if t < len(steps) else \
        (episode["_obs"], episode["_admissible"])
    history = steps[max(0, t - k):t] if k > 0 else []
    return env.build_prompt(episode["task"], obs, adm, t + 1, history, skill)


def fit_prompt(tokenizer, episode, t, history, max_prompt_tokens, skill=None):
    """Largest k <= history whose templated prompt fits. Returns (text, ids, k) or None if even k=0 is over."""
    for k in range(min(history, t), -1, -1):
        text, ids = chat_prompt(tokenizer, step_prompt(episode, t, k, skill))
        if len(ids) <= max_prompt_tokens:
            return text, ids, k
    return None


def new_episode(env, spec, state):
    ep = dict(spec)
    ep.update(env=env.NAME, steps=[], task="", env_failure=None, prompt_too_long=False, truncated_responses=0,
              history_truncations=0, **{"return": 0.0}, length=0, success=False, score=0.0, done=False)
    if "error" in state:
        ep.update(env_failure=state["error"], done=True)
    else:
        ep.update(task=state.get("task", ""), _obs=state["observation"], _admissible=state["admissible"])
    return ep


def play_episodes(env, specs, pool, policy, tokenizer, *, max_steps=30, history=5, max_prompt_tokens=2048,
                  max_new_tokens=512, temperature=0.4, invalid_fallback=None, invalid_penalty=None,
                  invalid_rule="public", progress=None):
    """env: the env module; specs: one task dict per episode (its task fields plus group, rollout, seed, uid).
    invalid_rule: 'public' (the env's validity rule, as the paper's public code) or 'strict' (a well-formed
    action that is not admissible is invalid too: the stricter ablation). Either way each step records whether
    its action was admissible (`admissible_action`, the env's `is_admissible`; None where that does not apply).
    Returns (episodes, timings) where timings = seconds spent in {'reset','generate','parse','env'}."""
    invalid_penalty = env.PRESET["invalid_penalty"] if invalid_penalty is None else invalid_penalty
    # Qwen3 with thinking off writes no <think> block of its own (the empty one is in the prompt): no think rule
    require_think = requires_think_tags(tokenizer)
    timings = {"reset": 0.0, "generate": 0.0, "parse": 0.0, "env": 0.0}
    t0 = time.perf_counter()
    states = pool.reset(specs)  # each worker builds its game from the task dict (env.make_game)
    timings["reset"] += time.perf_counter() - t0
    episodes = [new_episode(env, s, st) for s, st in zip(specs, states)]

    for t in range(max_steps):
        live = [i for i, ep in enumerate(episodes) if not ep["done"]]
        if not live:
            break
        # ---- prompts (plain: no skill), oldest history dropped first when over the limit
        t0 = time.perf_counter()
        prompts, ready = [], []
        for i in live:
            ep = episodes[i]
            fit = fit_prompt(tokenizer, ep, t, history, max_prompt_tokens)
            if fit is None:  # cannot happen with ALFWorld at 2,048 tokens; never crash on it
                ep.update(prompt_too_long=True, done=True)
                continue
            ep["history_truncations"] += fit[2] < min(history, t)
            prompts.append(fit)
            ready.append(i)
        timings["parse"] += time.perf_counter() - t0
        if not ready:
            break
        # ---- generate
        t0 = time.perf_counter()
        gens = policy.generate([ids for _, ids, _ in prompts], max_new_tokens=max_new_tokens,
                               temperature=temperature, contexts=[episodes[i] for i in ready],
                               seeds=[sample_seed(episodes[i].get("seed", 0), episodes[i].get("uid", i), t)
                                      for i in ready])
        timings["generate"] += time.perf_counter() - t0
        # ---- parse
        t0 = time.perf_counter()
        actions, parsed = {}, {}
        for i, (text, ids, k), g in zip(ready, prompts, gens):
            ep = episodes[i]
            action, valid, reason = env.parse_action(g.text, ep["_admissible"], require_think=require_think)
            admissible = env.is_admissible(action, ep["_admissible"])  # None: the env has no such list
            if invalid_rule == "strict" and valid and admissible is False:
                valid, reason = False, "not_admissible"
            actions[i] = env.action_to_execute(g.text, action, invalid_fallback)
            parsed[i] = dict(step=t + 1, prompt=text, prompt_ids=list(ids), history_used=k,
                             response=g.text, response_ids=list(g.token_ids), response_logprobs=g.logprobs,
                             truncated=g.finish_reason == "length", action=action, executed=actions[i],
                             valid=valid, invalid_reason=reason, admissible_action=admissible, observation=ep["_obs"],
                             admissible=list(ep["_admissible"]))
        timings["parse"] += time.perf_counter() - t0
        # ---- env
        t0 = time.perf_counter()
        results = pool.step(actions)
        timings["env"] += time.perf_counter() - t0
        for i, rec in parsed.items():
            ep, st = episodes[i], results[i]
            if "error" in st:
                ep.update(env_failure=st["error"], done=True)
                continue
            reward = env.reward(st, rec["valid"], invalid_penalty)
            rec.update(reward=reward, done=st["done"] or t + 1 == max_steps, won=st["won"],
                       score=st.get("score", float(st["won"])), feedback=st["observation"])
            ep["steps"].append(rec)
            ep["return"] += reward
            ep["truncated_responses"] += rec["truncated"]
            ep.update(length=len(ep["steps"]), success=st["won"], score=rec["score"], done=rec["done"],
                      _obs=st["observation"], _admissible=st["admissible"])
        if progress is not None:
            progress(sum(ep["done"] for ep in episodes), len(episodes))

    for ep in episodes:
        ep.pop("_obs", None)
        ep.pop("_admissible", None)
        ep.pop("done", None)
        ep["return"] = round(ep["return"], 6)
    return episodes, timings


def summarize_episodes(episodes, env=None):
    """Per summary column (the env's GROUPS, in order) and All: episodes, success rate, mean final score, mean
    length, invalid-action rate. Env failures are counted apart and excluded from the rates; episodes cut
    because even the history-free prompt was over the limit count as failures and are also counted apart
    ('prompt_too_long')."""
    if env is None:
        env = load_env(episodes[0].get("env", "alfworld") if episodes else "alfworld")
    rows = {name: [] for name in env.GROUPS}
    failures = 0
    for ep in episodes:
        if ep.get("env_failure"):
            failures += 1
            continue
        rows.setdefault(ep.get("category", "?"), []).append(ep)
    rows["All"] = [ep for name in list(rows) for ep in rows[name]]
    out = {}
    for name, eps in rows.items():
        n_steps = sum(len(ep["steps"]) for ep in eps)
        mean = lambda xs: sum(xs) / len(xs) if xs else None
        out[name] = {"episodes": len(eps),
                     "success": mean([ep["success"] for ep in eps]),
                     "score": mean([ep.get("score", float(ep["success"])) for ep in eps]),
                     "length": mean([ep["length"] for ep in eps]),
                     "invalid_rate": sum(not s["valid"] for ep in eps for s in ep["steps"]) / n_steps
                     if n_steps else None,
                     "inadmissible_rate": inadmissible_rate(eps)}
    out["env_failures"] = failures
    out["prompt_too_long"] = sum(bool(ep.get("prompt_too_long")) for ep in rows["All"])
    return out


def inadmissible_rate(episodes):
    """Share of steps whose parsed action is not in the env's admissible list (a step without action tags counts:
    what runs is then not an admissible action either), over the steps where the env gives such a list; None when
    it never does (Search). With the public validity rule these steps are valid: they only waste a step."""
    flags = [s.get("admissible_action") for ep in episodes for s in ep["steps"]]
    flags = [f for f in flags if f is not None]
    return sum(not f for f in flags) / len(flags) if flags else None


def format_summary(summary, title="success per task type"):
    fmt = lambda v, pct=False: "-" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.1f}")
    # the mean score is shown only where it says more than success (WebShop's partial credit)
    scored = any(r["score"] != r["success"] for k, r in summary.items() if isinstance(r, dict))
    w = max([6] + [len(k) for k, r in summary.items() if isinstance(r, dict)])  # "2wikimultihopqa", "electronics"
    lines = [title, f"{'group':<{w}} {'episodes':>8} {'success%':>8}" + (f" {'score%':>7}" if scored else "")
             + f" {'length':>7} {'invalid%':>8} {'inadm.%':>7}"]
    for name, r in summary.items():
        if name in ("env_failures", "prompt_too_long"):
            continue
        lines.append(f"{name:<{w}} {r['episodes']:>8} {fmt(r['success'], True):>8}"
                     + (f" {fmt(r['score'], True):>7}" if scored else "")
                     + f" {fmt(r['length']):>7} {fmt(r['invalid_rate'], True):>8} "
                     f"{fmt(r.get('inadmissible_rate'), True):>7}")
    lines.append(f"env failures (excluded): {summary['env_failures']}")
    if summary.get("prompt_too_long"):
        lines.append(f"episodes cut with a prompt over the limit (counted as failures): {summary['prompt_too_long']}")
    return "\n".join(lines)


def add_rollout_args(group, paper, temperature_help="sampling temperature"):
    """The rollout's flags, shared by collect.py, seed_rl.py and evaluate.py (defaults: the script's `paper`,
    which comes from the env's preset)."""
    group.add_argument("--max-steps", type=int, default=paper["max_steps"], help="steps (turns) per episode")
    group.add_argument("--history", type=int, default=paper["history"], help="history entries in the prompt")
    group.add_argument("--max-prompt-tokens", type=int, default=paper["max_prompt_tokens"],
                       help="prompt limit: the oldest history entries are dropped to fit")
    group.add_argument("--max-new-tokens", type=int, default=paper["max_new_tokens"], help="response tokens per step")
    group.add_argument("--temperature", type=float, default=paper["temperature"], help=temperature_help)
    group.add_argument("--invalid-penalty", type=float, default=paper["invalid_penalty"],
                       help="reward of an invalid step")
    group.add_argument("--invalid-fallback", default=None, help="action executed when a response has no action tags "
                       "(default: the env's rule, e.g. ALFWorld's last 30 characters of the lower-cased response)")
    group.add_argument("--invalid-rule", default="public", choices=["public", "strict"],
                       help="public: the env's validity rule, as the paper's public code (tags, CJK); strict: an "
                       "inadmissible action is invalid too (the stricter ablation)")
