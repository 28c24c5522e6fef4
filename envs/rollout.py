"""The multi-turn rollout loop: plays a batch of episodes, one batched generation call per step.

Each step of each live episode: build the plain prompt (last k history entries; the oldest dropped first
while the chat-templated prompt is over `max_prompt_tokens`), generate, parse the action, step the env,
and record everything a later stage needs to rebuild the same prompt (with or without a skill), score the
same response tokens, and serialize the episode for the analyzer.

Reward (SPEC.md): +10 at the step the game is won, -0.1 for an invalid step; return = sum; success = won.
An episode ends when won, when the env says done, after `max_steps`, or on an env failure (the failure is
recorded in `env_failure`; trainers drop such episodes from their groups).
"""
import time

from envs.alfworld import INVALID_PENALTY, WIN_REWARD
from envs.backends import sample_seed
from prompts import action_to_execute, build_agent_prompt, chat_prompt, extract_task, parse_action


def step_prompt(episode, t, k, skill=None):
    """The user message of step t (0-based) of a recorded episode, with its last k history entries."""
    steps = episode["steps"]
    obs, adm = (steps[t]["observation"], steps[t]["admissible"]) if t < len(steps) else \
        (episode["_obs"], episode["_admissible"])
    history = [(s["observation"], s["executed"]) for s in steps[max(0, t - k):t]] if k > 0 else []
    return build_agent_prompt(obs, adm, step=t + 1, task=episode["task"], history=history, skill=skill)


def fit_prompt(tokenizer, episode, t, history, max_prompt_tokens, skill=None):
    """Largest k <= history whose templated prompt fits. Returns (text, ids, k) or None if even k=0 is over."""
    for k in range(min(history, t), -1, -1):
        text, ids = chat_prompt(tokenizer, step_prompt(episode, t, k, skill))
        if len(ids) <= max_prompt_tokens:
            return text, ids, k
    return None


def new_episode(spec, state):
    ep = dict(spec)
    ep.update(steps=[], task="", env_failure=None, prompt_too_long=False, truncated_responses=0,
              history_truncations=0, **{"return": 0.0}, length=0, success=False, done=False)
    if "error" in state:
        ep.update(env_failure=state["error"], done=True)
    else:
        ep.update(task=extract_task(state["observation"]), _obs=state["observation"],
                  _admissible=state["admissible"])
    return ep


def play_episodes(specs, pool, policy, tokenizer, *, max_steps=30, history=5, max_prompt_tokens=2048,
                  max_new_tokens=512, temperature=0.4, invalid_fallback=None, progress=None):
    """specs: one dict per episode (ids: task_id, game_file, task_type, split, group, rollout, seed, ...).
    Returns (episodes, timings) where timings = seconds spent in {'reset','generate','parse','env'}."""
    timings = {"reset": 0.0, "generate": 0.0, "parse": 0.0, "env": 0.0}
    t0 = time.perf_counter()
    states = pool.reset([s["game_file"] for s in specs])
    timings["reset"] += time.perf_counter() - t0
    episodes = [new_episode(s, st) for s, st in zip(specs, states)]

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
            action, valid, reason = parse_action(g.text, ep["_admissible"])
            actions[i] = action_to_execute(g.text, action, invalid_fallback)
            parsed[i] = dict(step=t + 1, prompt=text, prompt_ids=list(ids), history_used=k,
                             response=g.text, response_ids=list(g.token_ids), response_logprobs=g.logprobs,
                             truncated=g.finish_reason == "length", action=action, executed=actions[i],
                             valid=valid, invalid_reason=reason, observation=ep["_obs"],
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
            reward = WIN_REWARD * st["won"] - INVALID_PENALTY * (not rec["valid"])
            rec.update(reward=reward, done=st["done"] or t + 1 == max_steps, won=st["won"],
                       feedback=st["observation"])
            ep["steps"].append(rec)
            ep["return"] += reward
            ep["truncated_responses"] += rec["truncated"]
            ep.update(length=len(ep["steps"]), success=st["won"], done=rec["done"],
                      _obs=st["observation"], _admissible=st["admissible"])
        if progress is not None:
            progress(sum(ep["done"] for ep in episodes), len(episodes))

    for ep in episodes:
        ep.pop("_obs", None)
        ep.pop("_admissible", None)
        ep.pop("done", None)
        ep["return"] = round(ep["return"], 6)
    return episodes, timings


def summarize_episodes(episodes):
    """Per task type (SPEC.md order) and All: episodes, success rate, mean length, invalid-action rate.
    Env failures are counted apart and excluded from the rates; episodes cut because even the history-free
    prompt was over the limit count as failures and are also counted apart ('prompt_too_long')."""
    from envs.alfworld import TASK_TYPES, TYPE_ORDER
    rows = {name: [] for name in TYPE_ORDER}
    failures = 0
    for ep in episodes:
        if ep.get("env_failure"):
            failures += 1
            continue
        rows[TASK_TYPES.get(ep["task_type"], ep["task_type"])].append(ep)
    rows["All"] = [ep for name in TYPE_ORDER for ep in rows[name]]
    out = {}
    for name, eps in rows.items():
        n_steps = sum(len(ep["steps"]) for ep in eps)
        out[name] = {"episodes": len(eps),
                     "success": sum(ep["success"] for ep in eps) / len(eps) if eps else None,
                     "length": sum(ep["length"] for ep in eps) / len(eps) if eps else None,
                     "invalid_rate": sum(not s["valid"] for ep in eps for s in ep["steps"]) / n_steps
                     if n_steps else None}
    out["env_failures"] = failures
    out["prompt_too_long"] = sum(bool(ep.get("prompt_too_long")) for ep in rows["All"])
    return out


def format_summary(summary, title="success per task type"):
    fmt = lambda v, pct=False: "-" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.1f}")
    lines = [title, f"{'type':<6} {'episodes':>8} {'success%':>8} {'length':>7} {'invalid%':>8}"]
    for name, r in summary.items():
        if name in ("env_failures", "prompt_too_long"):
            continue
        lines.append(f"{name:<6} {r['episodes']:>8} {fmt(r['success'], True):>8} {fmt(r['length']):>7} "
                     f"{fmt(r['invalid_rate'], True):>8}")
    lines.append(f"env failures (excluded): {summary['env_failures']}")
    if summary.get("prompt_too_long"):
        lines.append(f"episodes cut with a prompt over the limit (counted as failures): {summary['prompt_too_long']}")
    return "\n".join(lines)
