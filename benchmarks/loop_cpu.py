"""The rollout loop's own CPU work (issue 31, item 4), apart from the GPU: `play_episodes` on real ALFWorld games
with the real Qwen2.5 tokenizer and a zero-latency stand-in engine, so what the loop costs per step shows
without an engine to hide it (on one H200, 9.1 s of a 68.9 s rollout: 16 x 8 episodes, 30 steps, Qwen2.5-0.5B).
On a GPU much of it runs beside the engine: vLLM queues its next forward before a step returns, and the loop
works while that forward runs. The part that leaves the engine idle is seed_rl.py's `rollout/loop_idle_share`
(common/rollout.py Clock; benchmarks/loop_idle.py checks that measure on a real engine).

    # 2 CPU cores, ~3 minutes: 16 episodes, 30 steps, 2 env workers
    python benchmarks/loop_cpu.py --episodes 16 --json /tmp/loop_cpu.json

Four parts, the first three on the same episodes (the stand-in's actions depend only on each request's seed, so
every run plays the same steps):
  play     one timed run: the Clock's phases (parse = the loop's own work: prompts, chat template,
           tokenization, parsing, records), steps, and the main thread's CPU time (time.thread_time: what the
           loop itself burned, not counting the time it waited or was preempted by the env workers)
  profile  the same run under cProfile timed by the main thread's CPU clock (the env workers are other
           processes, and waiting for them costs no CPU): the top functions by cumulative CPU time
           (profiling slows the loop down: compare items, not totals)
  prompts  every step's prompt rebuilt from the recorded episodes by `fit_prompt`, with no env and no engine
           running: the prompt work alone, free of the noise of env workers sharing the cores; once with
           chat_prompt (the plain path) and once with the loop's ChatPrompts (prompts/chat.py), each checked
           against the ids the loop recorded
  poll     EnvPool.poll(timeout=0), the loop's env check once per engine step, alone: CPU per call while all
           --workers workers are busy (a stand-in env that sleeps), for ~1 s
The stand-in engine (`RandomAdmissible`) answers each request at once with a well-formed response: a short
think block and an admissible action drawn with the request's seed (a random walk: episodes mostly run all
--max-steps turns with a full history, like an untrained policy's). --policy expert uses the scripted expert
instead (short winning episodes). Its own work (tokenizing a 20-token response) is the `generate` phase, not
`parse`. Not a test: timings are reported, never asserted.
"""
import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common.backends import BatchBackend, ExpertPolicy, Generation  # noqa: E402


class RandomAdmissible(BatchBackend):
    """A zero-latency engine: each response is a think block and one of the episode's admissible actions, chosen
    by the request's seed (so the episodes are the same in every run). polls: a request is answered at its
    polls-th poll (a vLLM engine answers after one step per response token: the loop goes round once per step)."""

    def __init__(self, tokenizer, polls=1):
        self.tok, self.eos, self.polls, self.age = tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"), polls, {}
        self.ids = functools.lru_cache(maxsize=None)(lambda text: self.tok(text, add_special_tokens=False)["input_ids"])

    def poll(self):
        held = getattr(self, "_held", [])
        for r in held:
            self.age[r[0]] = self.age.get(r[0], 0) + 1
        self._held = [r for r in held if self.age[r[0]] >= self.polls]  # BatchBackend.poll answers these
        wait = [r for r in held if self.age[r[0]] < self.polls]
        out = super().poll()
        self._held = wait
        return out

    def generate(self, prompts, *, contexts, seeds=None, **sampling):
        out = []
        for k, ep in enumerate(contexts):
            rng = random.Random(seeds[k] if seeds is not None else len(ep["steps"]))
            action = rng.choice(ep["_admissible"] or ["look"])
            text = f"<think>I should try something new here.</think>\n<action>{action}</action>"
            out.append(Generation(self.ids(text) + [self.eos], text, "stop"))
        return out


class Sleeper:
    """The poll part's env: a step sleeps `action` seconds, so its worker stays busy (envs/pool.py factory)."""

    def __init__(self, spec):
        pass

    def reset(self):
        return {}

    def step(self, action):
        time.sleep(float(action))
        return {}


def poll_cost(workers, seconds=1.0):
    """CPU microseconds per EnvPool.poll(timeout=0) while every worker has a step pending, and the calls made."""
    from envs.pool import EnvPool
    with EnvPool("benchmarks.loop_cpu:Sleeper", num_workers=workers) as pool:
        pool.reset([None] * workers)
        for s in range(workers):
            pool.submit(s, "step", seconds + 1.0)
        calls, cpu, end = 0, time.thread_time(), time.monotonic() + seconds
        while time.monotonic() < end:
            assert pool.poll(timeout=0) == [], "a worker answered early: the figure would not be for busy workers"
            calls += 1
        cpu = time.thread_time() - cpu
        while pool.pending():
            pool.poll(timeout=None)
    return 1e6 * cpu / calls, calls


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=16, help="episodes (ALFWorld games of --split, a seeded pick)")
    p.add_argument("--split", default="train", help="ALFWorld split the games come from")
    p.add_argument("--max-steps", type=int, default=30, help="turns per episode")
    p.add_argument("--history", type=int, default=5, help="history entries in the prompt (ALFWorld's preset)")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="prompt limit (ALFWorld's preset)")
    p.add_argument("--workers", type=int, default=2, help="env worker processes")
    p.add_argument("--policy", default="random", choices=["random", "expert"],
                   help="the stand-in engine: random admissible actions (long episodes) or the scripted expert")
    p.add_argument("--polls", type=int, default=1, help="the stand-in answers a request at its polls-th poll "
                   "(1: at once; N: the loop goes round N times per response, as with an engine step per token)")
    p.add_argument("--top", type=int, default=25, help="profile: functions listed (0: no profile run)")
    p.add_argument("--seed", type=int, default=0, help="game pick and sampling seeds")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def play(args, games, tokenizer, profile=False):
    """One play_episodes run; returns (episodes, timings, main-thread CPU seconds, profiler or None)."""
    import envs.alfworld as alfworld
    from common.rollout import play_episodes
    from envs.pool import EnvPool
    policy = RandomAdmissible(tokenizer, args.polls) if args.policy == "random" else ExpertPolicy(tokenizer)
    with EnvPool("envs.alfworld:make_game", num_workers=args.workers) as pool:
        prof = cProfile.Profile(time.thread_time) if profile else None  # CPU: waits cost nothing
        cpu = time.thread_time()
        if prof:
            prof.enable()
        episodes, timings = play_episodes(alfworld, games, pool, policy, tokenizer, max_steps=args.max_steps,
                                          history=args.history, max_prompt_tokens=args.max_prompt_tokens)
        if prof:
            prof.disable()
        cpu = time.thread_time() - cpu
    return episodes, timings, cpu, prof


def rebuild_prompts(args, episodes, tokenizer, chat=None):
    """Every recorded step's prompt again through fit_prompt (what the loop did per step), in the loop's order
    (steps of all episodes interleaved), with chat_prompt (chat=None) or a ChatPrompts. Returns (seconds,
    steps, prompt tokens, mismatches with the recorded ids)."""
    from common.rollout import fit_prompt
    steps = tokens = bad = 0
    order = sorted((t, e) for e, ep in enumerate(episodes) for t in range(len(ep["steps"])))
    t0 = time.perf_counter()
    for t, e in order:
        text, ids, k = fit_prompt(tokenizer, episodes[e], t, args.history, args.max_prompt_tokens, chat=chat)
        steps, tokens, bad = steps + 1, tokens + len(ids), bad + (ids != episodes[e]["steps"][t]["prompt_ids"])
    return time.perf_counter() - t0, steps, tokens, bad


def top_list(prof, n):
    """(cumulative s, own s, calls, function) of the n functions with the most cumulative time."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
        where = os.path.relpath(file, REPO) if file.startswith(REPO) else os.path.basename(file)
        rows.append((cum, own, calls, f"{where}:{line}({name})" if line else name))
    return sorted(rows, reverse=True)[:n]


def main(argv=None):
    args = parse_args(argv)
    from common.models import load_tokenizer
    from envs.alfworld import select_games
    tokenizer = load_tokenizer("tiny")  # the real Qwen2.5 tokenizer (tiny and expert use it)
    games = [dict(g, uid=f"g{i}", seed=args.seed) for i, g in enumerate(select_games(args.split, args.seed,
                                                                                   n=args.episodes))]
    episodes, timings, cpu, _ = play(args, games, tokenizer)
    steps = sum(len(ep["steps"]) for ep in episodes)
    prompt_tokens = sum(len(s["prompt_ids"]) for ep in episodes for s in ep["steps"])
    res = {"args": vars(args), "episodes": len(episodes), "steps": steps, "prompt_tokens": prompt_tokens,
           "env_failures": sum(bool(ep["env_failure"]) for ep in episodes),
           "wins": sum(ep["success"] for ep in episodes), "timings": timings, "main_thread_cpu_s": cpu,
           "parse_ms_per_step": 1e3 * timings["parse"] / max(steps, 1),
           "main_cpu_ms_per_step": 1e3 * cpu / max(steps, 1),
           "env_ms_per_step": 1e3 * (timings["env"] + timings["reset"]) / max(steps, 1)}
    from prompts.chat import ChatPrompts
    res["prompts"] = {}
    for name, chat in (("chat_prompt", None), ("ChatPrompts", ChatPrompts(tokenizer))):
        sec, n, tokens, bad = rebuild_prompts(args, episodes, tokenizer, chat)
        res["prompts"][name] = {"steps": n, "tokens": tokens, "seconds": sec, "ms_per_step": 1e3 * sec / max(n, 1),
                                "mismatches": bad}
    us, calls = poll_cost(args.workers)
    res["env_poll"] = {"workers": args.workers, "calls": calls, "cpu_us_per_call": us}
    if args.top:
        p_episodes, _, _, prof = play(args, games, tokenizer, profile=True)
        res["same_episodes_under_profile"] = [[s["prompt_ids"] for s in ep["steps"]] for ep in p_episodes] == \
            [[s["prompt_ids"] for s in ep["steps"]] for ep in episodes]
        res["profile_top"] = [dict(cumulative_s=c, own_s=o, calls=k, function=f) for c, o, k, f in
                              top_list(prof, args.top)]

    print(f"{res['episodes']} episodes ({res['wins']} won, {res['env_failures']} env failures), {steps} steps, "
          f"{prompt_tokens / max(steps, 1):.0f} prompt tokens per step")
    print(f"{'phase':<10} {'seconds':>8} {'ms/step':>8} {'share':>6}")
    for k in ("reset", "env", "generate", "parse"):
        print(f"{k:<10} {timings[k]:>8.2f} {1e3 * timings[k] / max(steps, 1):>8.2f} "
              f"{100 * timings[k] / timings['wall']:>5.1f}%")
    print(f"{'wall':<10} {timings['wall']:>8.2f}")
    print(f"main thread CPU: {cpu:.2f} s ({res['main_cpu_ms_per_step']:.2f} ms/step)")
    for name, r in res["prompts"].items():
        print(f"prompts alone, fit_prompt with {name}: {r['ms_per_step']:.2f} ms/step ({r['seconds']:.2f} s, "
              f"{r['mismatches']} mismatches with the recorded ids)")
    print(f"EnvPool.poll(timeout=0) with {args.workers} busy workers: {us:.1f} us CPU per call ({calls} calls)")
    if args.top:
        print(f"\nprofile, main thread CPU, top {args.top} by cumulative time (same episodes: "
              f"{res['same_episodes_under_profile']})")
        print(f"{'cum s':>7} {'own s':>7} {'calls':>8}  function")
        for r in res["profile_top"]:
            print(f"{r['cumulative_s']:>7.2f} {r['own_s']:>7.2f} {r['calls']:>8}  {r['function']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
