"""The multi-turn rollout loop: plays a set of episodes, each at its own pace.

Env-agnostic: it calls only the env interface (envs/__init__.py). Each episode is its own flow: reset; then,
step after step, build the plain prompt (last k history entries; the oldest dropped first while the
chat-templated prompt is over `max_prompt_tokens`), submit it to the engine, and when that response is in,
parse the action and send it to the env workers without waiting; when the env answers, the next prompt. The
engine batches whatever requests are in flight (vLLM: token by token), so no episode waits for another's long
response, and the GPU generates while the env workers step. SEED's self-analysis of an episode goes to the
same engine the moment that episode ends. `lockstep=True` keeps the old schedule (every live episode
generates, then every env steps) for comparison. Every record needed later is kept: what rebuilds the same
prompt (with or without a skill), the same response tokens to score, and the episode for the analyzer (the
record schema below). Sampling seeds depend on (run seed, episode id, step) only, so the episodes are the
same whatever order they end in.

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
| analysis | the self-analysis answer (text; None: not analyzed), only where an analyzer was given (seed_rl.py) | R |
| analysis_tokens, analysis_finish | its length in tokens; how it ended ('stop', 'length': the max-new-tokens cap, 'repetition') | R |

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
import collections
import functools
import time

from envs import load_env
from prompts.chat import ChatPrompts, chat_prompt, requires_think_tags


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


def fit_prompt(tokenizer, episode, t, history, max_prompt_tokens, skill=None, chat=None):
    """Largest k <= history whose templated prompt fits. Returns (text, ids, k) or None if even k=0 is over.
    chat: the tokenizer's ChatPrompts (the loop's: same text and ids, less CPU), else chat_prompt."""
    chat = chat or functools.partial(chat_prompt, tokenizer)
    for k in range(min(history, t), -1, -1):
        text, ids = chat(step_prompt(episode, t, k, skill))
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
                  invalid_rule="public", max_live=None, lockstep=False, analyzer=None, analysis_prompt=None,
                  analysis_max_new_tokens=4096, analysis_loop_stop=None, on_episode=None, on_played=None,
                  progress=None):
    """Play one episode per spec; each episode is its own flow (reset -> prompt -> generate -> parse -> env
    step -> prompt ...), and moves on as soon as its own response or env answer is in.

    env: the env module; specs: one task dict per episode (its task fields plus group, rollout, seed, uid);
    pool: an EnvPool (at least min(len(specs), max_live) slots are used); policy: a backend (common/backends.py).
    max_live: episodes in play at once (default: all); a new one starts the moment one ends.
    lockstep: the old schedule, kept for comparison (benchmarks/rollout_async.py): episodes start in batches of
      max_live, every live episode generates, then every env steps, turn after turn; analyses start when the
      whole batch has ended.
    analyzer, analysis_prompt, analysis_max_new_tokens, analysis_loop_stop: SEED's self-analysis (seed_rl.py).
      When an episode ends (without an env failure), analysis_prompt(episode) gives its prompt ids (None: no
      analysis) and the analyzer (the policy's own engine in SEED) answers greedily; the text lands in
      episode["analysis"], how it ended in episode["analysis_finish"] ('stop', 'length', 'repetition':
      analysis_loop_stop=window, see common/backends.py LoopStop).
    invalid_rule: 'public' (the env's validity rule, as the paper's public code) or 'strict' (a well-formed
      action that is not admissible is invalid too: the stricter ablation). Either way each step records whether
      its action was admissible (`admissible_action`, the env's `is_admissible`; None where that does not apply).
    on_episode(episode): called the moment an episode is complete (collect.py and evaluate.py write it then);
    progress(done, total) likewise. on_played(episodes): called once, the moment the last env step is in (every
      episode's steps are final; self-analyses may still be in flight): seed_rl.py starts its plain scoring then.
    Returns (episodes in spec order, timings): see `Clock`."""
    invalid_penalty = env.PRESET["invalid_penalty"] if invalid_penalty is None else invalid_penalty
    # Qwen3 with thinking off writes no <think> block of its own (the empty one is in the prompt): no think rule
    require_think = requires_think_tags(tokenizer)
    # chat_prompt's text and ids with the template rendered once and each prompt line tokenized once: a prompt
    # built while the engine has nothing queued leaves it idle (issue 31; benchmarks/loop_cpu.py, Clock)
    chat = ChatPrompts(tokenizer)
    n = len(specs)
    episodes = [None] * n
    todo = collections.deque(range(n))  # episodes not started yet
    free = list(range(min(n, max_live or n)))[::-1]  # env slots
    slot_of, on_env = {}, {}  # episode -> its env slot while it plays; slot -> episode with a command pending
    ready, acting, stepping = [], {}, {}  # env answered: prompt due; parsed: action due; action sent: step records
    to_analyze, requests = [], {}  # ended episodes whose analysis is due; request id -> (episode, kind)
    kinds = collections.Counter()  # requests in flight per kind, kept as they come and go (not summed per call)
    backends = [policy] + ([analyzer] if analyzer is not None and analyzer is not policy else [])
    finished, played = 0, 0
    # the policy engine's timeline (backends.py: WallMark, CudaMark): how long the loop's own work left it idle
    clock = Clock(getattr(policy, "mark", None))
    pool.clear()

    def end(i):
        """The episode's env part is over: free its slot, then analyze it or hand it over."""
        nonlocal played
        ep = episodes[i]
        free.append(slot_of.pop(i))
        for k in ("_obs", "_admissible", "done"):
            ep.pop(k, None)
        ep["return"] = round(ep["return"], 6)
        played += 1
        if played == n and on_played is not None:
            on_played(episodes)
        ids = None
        if analyzer is not None:
            ep["analysis"], ep["analysis_tokens"], ep["analysis_finish"] = None, 0, None
            ids = None if ep["env_failure"] else analysis_prompt(ep)
        if ids is not None:
            to_analyze.append((i, ids))
        else:
            complete(i)

    def complete(i):
        nonlocal finished
        finished += 1
        if on_episode is not None:
            on_episode(episodes[i])
        if progress is not None:
            progress(finished, n)

    def generating():
        return kinds["generate"]

    def load():
        clock.load(generate=generating(), analysis=len(requests) - generating(), env=len(on_env))

    while finished < n:
        # ---- start episodes on free env slots; lockstep: a new batch once the last one is over
        if todo and free and not (lockstep and (slot_of or requests or to_analyze)):
            while todo and free:
                i, s = todo.popleft(), free.pop()
                slot_of[i], on_env[s] = s, i
                pool.submit(s, "reset", specs[i])  # the worker builds the game from the task dict (env.make_game)
        load()

        # ---- env answers; wait for one only when the engines have nothing in flight
        clock.lap("parse")
        answers = pool.poll(timeout=None if on_env and not requests else 0)
        clock.lap("reset" if on_env and all(episodes[i] is None for i in on_env.values()) else "env")
        for s, st in answers:
            i = on_env.pop(s)
            if episodes[i] is None:  # its reset
                episodes[i] = new_episode(env, specs[i], st)
                (end if episodes[i]["done"] else ready.append)(i)
            elif record_step(env, episodes[i], stepping.pop(i), st, invalid_penalty, max_steps):
                end(i)
            else:
                ready.append(i)
        load()

        # ---- prompts (plain: no skill), oldest history dropped first when over the limit; lockstep: once
        #      every live episode's env has answered
        if ready and not (lockstep and (on_env or generating())):
            for i in ready:
                ep = episodes[i]
                t = len(ep["steps"])
                fit = fit_prompt(tokenizer, ep, t, history, max_prompt_tokens, chat=chat)
                if fit is None:  # cannot happen with ALFWorld at 2,048 tokens; never crash on it
                    ep.update(prompt_too_long=True, done=True)
                    end(i)
                    continue
                ep["history_truncations"] += fit[2] < min(history, t)
                ep["_prompt"] = fit
                requests[f"{i}/{t}"] = (i, "generate")
                kinds["generate"] += 1
                policy.submit(f"{i}/{t}", fit[1], max_new_tokens=max_new_tokens, temperature=temperature,
                              seed=sample_seed(ep.get("seed", 0), ep.get("uid", i), t), context=ep)
            ready = []
        # ---- self-analyses of ended episodes (same engine, greedy); lockstep: once the batch is over
        if to_analyze and not (lockstep and slot_of):
            for i, ids in to_analyze:
                requests[f"{i}/analysis"] = (i, "analysis")
                kinds["analysis"] += 1
                # no log-probs: nothing uses the analysis's, and HF `generate` would keep [B, T, V] logits
                analyzer.submit(f"{i}/analysis", ids, max_new_tokens=analysis_max_new_tokens, temperature=0.0,
                                want_logprobs=False, loop_stop=analysis_loop_stop, context=episodes[i])
            to_analyze = []
        load()

        # ---- engines: one poll each (vLLM: one engine step; HF and scripted: every request they hold)
        for backend in backends:
            if not backend.in_flight():
                continue
            clock.lap("parse")
            clock.engine_poll(backend is policy)
            outs = backend.poll()
            clock.lap("generate" if generating() else "analysis")
            clock.engine_polled(backend is policy)
            for rid, g in outs:
                i, kind = requests.pop(rid)
                kinds[kind] -= 1
                if kind == "analysis":
                    episodes[i].update(analysis=g.text, analysis_tokens=len(g.token_ids),
                                       analysis_finish=g.finish_reason)
                    complete(i)
                else:
                    acting[i] = parse_step(env, episodes[i], g, require_think, invalid_rule, invalid_fallback)
        load()

        # ---- actions to the env workers; lockstep: once every response of the turn is in
        if acting and not (lockstep and generating()):
            for i, rec in acting.items():
                stepping[i], on_env[slot_of[i]] = rec, i
                pool.submit(slot_of[i], "step", rec["executed"])
            acting = {}
        load()
    return episodes, clock.result()


def parse_step(env, ep, g, require_think, invalid_rule, invalid_fallback):
    """The step record of a response: the prompt it came from, the response, the parsed action and the
    validity rule's verdict, and what the agent saw (the env's answer is added by `record_step`)."""
    text, ids, k = ep.pop("_prompt")
    action, valid, reason = env.parse_action(g.text, ep["_admissible"], require_think=require_think)
    admissible = env.is_admissible(action, ep["_admissible"])  # None: the env has no such list
    if invalid_rule == "strict" and valid and admissible is False:
        valid, reason = False, "not_admissible"
    return dict(step=len(ep["steps"]) + 1, prompt=text, prompt_ids=list(ids), history_used=k, response=g.text,
                response_ids=list(g.token_ids), response_logprobs=g.logprobs, truncated=g.finish_reason == "length",
                action=action, executed=env.action_to_execute(g.text, action, invalid_fallback), valid=valid,
                invalid_reason=reason, admissible_action=admissible, observation=ep["_obs"],
                admissible=list(ep["_admissible"]))


def record_step(env, ep, rec, st, invalid_penalty, max_steps):
    """Add the env's answer st to the step record and the step to the episode. Returns True if it ended."""
    if "error" in st:
        ep.update(env_failure=st["error"], done=True)
        return True
    reward = env.reward(st, rec["valid"], invalid_penalty)
    rec.update(reward=reward, done=st["done"] or rec["step"] == max_steps, won=st["won"],
               score=st.get("score", float(st["won"])), feedback=st["observation"])
    ep["steps"].append(rec)
    ep["return"] += reward
    ep["truncated_responses"] += rec["truncated"]
    ep.update(length=len(ep["steps"]), success=st["won"], score=rec["score"], done=rec["done"],
              _obs=st["observation"], _admissible=st["admissible"])
    return ep["done"]


class WallMark:
    """A point in time, for engines whose work is done when `poll` returns (HF `generate`, the scripted ones):
    the engine is idle from the end of one poll to the start of the next."""
    __slots__ = ("t",)

    def __init__(self):
        self.t = time.perf_counter()

    def seconds_to(self, later):
        """How long the engine had nothing to run between this mark and a later one."""
        return later.t - self.t


class CudaMark:
    """A point in the engine's CUDA stream (the stream current on the calling thread: vLLM's, on the loop's
    thread): the GPU reaches it once it has run the work queued before it. vLLM schedules asynchronously: when
    `step` returns, the next forward is already queued behind it. So between a mark at the end of one poll and
    one at the start of the next, the GPU idles only for the part of the loop's work that outlasted that
    forward: the second mark is reached at once if it was recorded while the GPU was still busy."""
    __slots__ = ("event",)

    def __init__(self):
        import torch
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def seconds_to(self, later):
        later.event.synchronize()
        return self.event.elapsed_time(later.event) / 1e3  # ms -> s


class Clock:
    """Where a rollout's wall time went, two ways (the engine and the env workers now overlap).

    phases (seconds; they do not overlap and sum to `wall`): what the loop was waiting for
      generate   the engine, with rollout requests in flight (vLLM: engine steps; HF: its generate calls)
      analysis   the engine, with only self-analysis requests in flight
      env, reset the env workers, with nothing in flight on the engine (env: steps; reset: only resets pending)
      parse      the loop's own work: prompts, chat template, parsing, records, bookkeeping
    busy_* (seconds; they overlap): how long each had work in flight, whether or not the loop waited for it
      busy_generate, busy_analysis   rollout / analysis requests on the engine
      busy_gpu                       either (the engine's busy time; its share of `wall` is the GPU busy share)
      busy_env                       env commands (resets or steps) in the workers
    loop_idle (seconds): of `parse`, the part that left the policy engine with nothing to run: the loop's work
      on the rollout's critical path. vLLM queues its next forward before `step` returns, so the loop's work
      between two polls runs beside that forward (CudaMark); for engines that are done when `poll` returns (HF,
      scripted: WallMark) loop_idle is `parse`. Per gap between two polls of the policy engine, the marks give
      how long the engine idled at its end; of that stretch, what the loop spent on its own work counts (not
      its waits on the env workers or another engine).
    """
    PHASES = ("reset", "generate", "analysis", "env", "parse")

    def __init__(self, mark=None):
        self.t0 = self.last = time.perf_counter()
        self.phases = dict.fromkeys(self.PHASES, 0.0)
        self.busy = dict.fromkeys(("generate", "analysis", "gpu", "env"), 0.0)
        self.since, self.last_load = {}, None
        self.mark = mark or WallMark
        self.gaps = []  # closed gaps: (mark after a poll, mark before the next, that mark's time, the loop's waits)
        self.gap = (self.mark(), [])  # the open gap: the engine has had nothing to run since the rollout began

    def lap(self, phase):
        """The time since the last lap went to `phase`."""
        now = time.perf_counter()
        self.phases[phase] += now - self.last
        if phase != "parse" and self.gap is not None:
            self.gap[1].append((self.last, now))  # a wait on something else than the loop's own work
        self.last = now

    def engine_poll(self, policy=True):
        """Right before a poll of the policy engine (after its lap): the gap since its last poll ends."""
        if policy:
            (m0, waits), self.gap = self.gap, None
            self.gaps.append((m0, self.mark(), time.perf_counter(), waits))

    def engine_polled(self, policy=True):
        """Right after that poll and its lap: a new gap starts."""
        if policy:
            self.gap = (self.mark(), [])

    def loop_idle(self):
        total = 0.0
        for m0, m1, t1, waits in self.gaps:
            idle = m0.seconds_to(m1)  # the engine ran out of work `idle` seconds before the gap's end
            if idle > 0:
                start = t1 - idle
                total += max(0.0, idle - sum(max(0.0, min(e, t1) - max(s, start)) for s, e in waits))
        return total

    def load(self, generate, analysis, env):
        """How much is in flight now, per resource: rollout requests, self-analysis requests, env commands."""
        if (generate, analysis, env) == self.last_load:
            return  # nothing changed (the loop asks several times per engine step: keep that cheap)
        self.last_load = (generate, analysis, env)
        now = time.perf_counter()
        for k, c in (("generate", generate), ("analysis", analysis), ("env", env), ("gpu", generate + analysis)):
            if c and k not in self.since:
                self.since[k] = now
            elif not c and k in self.since:
                self.busy[k] += now - self.since.pop(k)

    def result(self):
        self.lap("parse")
        for k in list(self.since):
            self.busy[k] += self.last - self.since.pop(k)
        self.engine_poll()  # the last gap: from the last poll to the end
        return {**self.phases, "wall": self.last - self.t0, **{f"busy_{k}": v for k, v in self.busy.items()},
                "loop_idle": self.loop_idle()}


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


def add_play_args(group, batch_episodes, tp=False):
    """The engine and batch flags of collect.py and evaluate.py (make_policy's backend, play_into_jsonl's
    episodes in flight); --tp for evaluate.py's sharded engines."""
    group.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="generation engine")
    if tp:
        group.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size (GPUs per engine)")
    group.add_argument("--batch-episodes", type=int, default=batch_episodes, help="episodes in play at once (a new "
                       "one starts as one ends; the engine batches whatever requests are in flight)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's share of the GPU")
    add_kv_cache_arg(group)


def add_kv_cache_arg(group):
    """--kv-cache-gib: collect.py, evaluate.py and seed_rl.py."""
    group.add_argument("--kv-cache-gib", type=float, default=0.0, help="vLLM: a fixed KV cache of this many GiB "
                       "instead of sizing it by profiling the free memory (0); lets several jobs share one GPU and "
                       "start their engines side by side")


def rollout_kwargs(args):
    """play_episodes' keyword arguments from the flags of add_rollout_args."""
    return dict(max_steps=args.max_steps, history=args.history, max_prompt_tokens=args.max_prompt_tokens,
                max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                invalid_fallback=args.invalid_fallback, invalid_penalty=args.invalid_penalty,
                invalid_rule=args.invalid_rule)


def play_into_jsonl(env, todo, policy, tokenizer, args, path, done_before, planned):
    """collect.py's and evaluate.py's play phase: up to args.batch_episodes episodes of `todo` at once, each
    appended to the JSONL at `path` the moment it ends (the bar moves per episode). On Ctrl-C: one line (how many
    are saved; rerunning the same command resumes) and exit 130, no tracebacks. Returns (timings, env stats)."""
    import sys
    from tqdm import tqdm
    from envs.pool import EnvPool
    from common.records import append_jsonl, interrupted_message, open_jsonl_for_append, read_jsonl
    stats = {"steps": 0, "env_failures": 0, "workers_replaced": 0}
    if not todo:
        return {}, stats
    out = open_jsonl_for_append(path)
    bar = tqdm(total=len(todo), desc="episodes", unit="ep")

    def save(ep):
        append_jsonl(out, ep)
        bar.update(1)

    try:
        with EnvPool(f"envs.{env.NAME}:make_game", num_workers=min(args.workers, len(todo))) as pool:
            _, timings = play_episodes(env, todo, pool, policy, tokenizer, **rollout_kwargs(args),
                                       max_live=args.batch_episodes, on_episode=save)
            stats = dict(pool.stats)
    except KeyboardInterrupt:  # the env workers ignore Ctrl-C; the pool ends them
        bar.close()
        out.close()
        # the count from the file itself: a Ctrl-C can land inside `save` (during its fsync, say), after the
        # episode is written but before any counter of ours would hear of it
        on_file = len(read_jsonl(path))
        print(interrupted_message(on_file - done_before, on_file, planned, path), file=sys.stderr)
        sys.exit(130)
    bar.close()
    out.close()
    return timings, stats
