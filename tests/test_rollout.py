"""common/rollout.py: the multi-turn loop (prompt -> generate -> parse -> env -> records) on real ALFWorld games
with the real Qwen2.5 tokenizer and chat template, and the loop's own schedule (each episode at its own pace)
on deterministic fake games (tests/fake_games.py) with the tiny random model.

One 2-worker EnvPool is shared by the module; the expert's 12-game run is played once and read by several
tests. Scripted policies (below) answer with chosen texts to pin the reward rules and the end conditions.
"""
import json
import re
import time

import pytest

import envs.alfworld as alfworld
from envs.alfworld import INVALID_PENALTY, WIN_REWARD, select_games, walkthrough
from common.backends import BatchBackend, ExpertPolicy, Generation, HFBackend, ScriptedAnalyzer
from common.models import load_model, stop_token_ids
from envs.pool import EnvPool
from common.records import read_jsonl
from common.rollout import Clock, format_summary, play_episodes, step_prompt, summarize_episodes
from envs.alfworld import CLOSING, ROLE, build_agent_prompt
from prompts import chat_prompt, skill_block

SEED = 2026
HISTORY = 5
SKILL = "First go to where such objects usually are, take it, then put it in or on the target."


@pytest.fixture(scope="module")
def pool():
    with EnvPool("envs.alfworld:make_game", num_workers=2) as p:
        yield p


@pytest.fixture(scope="module")
def games():
    return select_games("valid_seen", SEED, tasks_per_type=2)  # 12 games, 2 per type


@pytest.fixture(scope="module")
def expert_run(pool, games, tokenizer):
    """The full loop with the scripted expert: paper settings (30 steps, 5 history entries, 2,048 tokens)."""
    episodes, timings = play_episodes(alfworld, games, pool, ExpertPolicy(tokenizer), tokenizer, max_steps=30,
                                      history=HISTORY, max_prompt_tokens=2048)
    return episodes, timings


class ScriptedPolicy(BatchBackend):
    """Answers episode `uid` at step t with scripts[uid][t] (the last entry repeats)."""

    def __init__(self, tokenizer, scripts):
        self.tok, self.scripts = tokenizer, scripts
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, *, contexts, **sampling):
        out = []
        for ep in contexts:
            script = self.scripts[ep["uid"]] if isinstance(self.scripts, dict) else self.scripts
            text = script[min(len(ep["steps"]), len(script) - 1)]
            out.append(Generation(self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos], text, "stop"))
        return out


def _prompt_len(tokenizer, ep, t, k):
    """Token count of step t's (0-based) templated prompt with its last k history entries, rebuilt here from
    the recorded steps (independently of common.rollout.step_prompt)."""
    s = ep["steps"]
    hist = [(s[j]["observation"], s[j]["executed"]) for j in range(t - k, t)]
    user = build_agent_prompt(s[t]["observation"], s[t]["admissible"], step=t + 1, task=ep["task"], history=hist)
    return len(chat_prompt(tokenizer, user)[1])


# ----------------------------------------------------------------------------------------------------
# The expert through the full loop

def test_expert_wins_through_the_full_loop(expert_run, games):
    episodes, timings = expert_run
    assert [ep["task_id"] for ep in episodes] == [g["task_id"] for g in games]
    assert all(ep["env_failure"] is None and not ep["prompt_too_long"] for ep in episodes)
    wins = sum(ep["success"] for ep in episodes)
    assert wins >= 0.95 * len(episodes), [(ep["task_id"], ep["length"]) for ep in episodes if not ep["success"]]
    summary = summarize_episodes(episodes)
    assert summary["All"]["episodes"] == 12 and summary["env_failures"] == 0 and summary["prompt_too_long"] == 0
    assert all(summary[t]["episodes"] == 2 for t in ("Pick", "Look", "Clean", "Heat", "Cool", "Pick2"))
    assert summary["All"]["invalid_rate"] == 0.0
    assert "All" in format_summary(summary)
    # the phases split the wall time; the env workers were busy most of it (the expert answers at once)
    assert set(timings) == set(Clock.PHASES) | {"wall", "busy_generate", "busy_analysis", "busy_gpu", "busy_env",
                                                "loop_idle"}
    assert sum(timings[k] for k in Clock.PHASES) == pytest.approx(timings["wall"], rel=1e-6)
    assert timings["analysis"] == timings["busy_analysis"] == 0.0 and timings["busy_env"] > 0.5 * timings["wall"]
    # the expert's work is done when its poll returns (WallMark): every bit of the loop's work idled the engine
    assert timings["loop_idle"] == pytest.approx(timings["parse"], rel=1e-3, abs=1e-3)


def test_clock_busy_times_by_hand(monkeypatch):
    """Clock.load's busy_* integrate 'something in flight' over time; a repeated load changes nothing."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = Clock()

    def at(t, *load):
        now[0] = 100.0 + t
        clock.load(*load)

    at(0, 2, 0, 0)    # two rollout requests on the engine
    at(1, 2, 0, 0)    # the loop asks again: no change
    at(3, 0, 0, 2)    # their actions go to the env workers
    at(4, 1, 1, 1)    # one episode generates, one ended and is analyzed, one env step pending
    at(6, 0, 1, 0)    # only the analysis left
    at(7, 0, 0, 0)
    now[0] = 110.0
    t = clock.result()
    assert t["wall"] == 10.0 and t["parse"] == 10.0  # no lap: all of it counts as the loop's own work
    assert (t["busy_generate"], t["busy_analysis"], t["busy_gpu"], t["busy_env"]) == (5.0, 3.0, 6.0, 3.0)


def test_loop_idle_by_hand(monkeypatch):
    """Clock's loop_idle: of the loop's own work, the part during which the policy engine had nothing to run. The
    fake marks work like CudaMark: a mark taken while `queued` seconds of work wait on the engine is reached when
    that work is done; a later mark no earlier than when it is taken."""
    now, queued = [0.0], [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    class QueueMark:
        def __init__(self):
            self.reached = now[0] + queued[0]

        def seconds_to(self, later):
            return max(later.reached, self.reached) - self.reached

    def poll(start, end, ahead, kind="generate"):  # the loop polls the policy engine from `start` to `end`
        now[0] = start
        clock.lap("parse")
        clock.engine_poll()
        now[0] = end
        clock.lap(kind)
        queued[0] = ahead  # the forward vLLM queued before its step returned
        clock.engine_polled()
        queued[0] = 0.0

    clock = Clock(QueueMark)        # t=0, nothing queued
    poll(1.0, 3.0, ahead=0.5)       # [0, 1]: 1 s of prompts, the engine idle all along          -> 1.0
    poll(3.2, 4.0, ahead=0.5)       # [3, 3.2]: 0.2 s of parsing beside the queued 0.5 s forward -> 0
    now[0] = 4.2                    # [4, 5]: 0.2 s of work (hidden: the forward runs until 4.5),
    clock.lap("parse")
    now[0] = 4.7                    #   a wait on the env workers until 4.7 (the engine idle from 4.5: not the loop's),
    clock.lap("env")
    poll(5.0, 6.0, ahead=0.0, kind="analysis")  # then 0.3 s of prompts, the engine idle         -> 0.3
    now[0] = 6.4                    # [6, 6.4]: the last gap, nothing queued                      -> 0.4
    t = clock.result()
    assert t["parse"] == pytest.approx(1.0 + 0.2 + 0.2 + 0.3 + 0.4)  # the loop's CPU time, 2.1 s
    assert t["loop_idle"] == pytest.approx(1.0 + 0.0 + 0.3 + 0.4)    # of which 1.7 s held the engine up
    # the same loop with an engine that is done when its poll returns (the default WallMark: HF, the expert)
    now[0] = 0.0
    clock = Clock()
    poll(1.0, 3.0, ahead=0.5)
    poll(3.2, 4.0, ahead=0.5)
    now[0] = 4.6
    clock.lap("env")
    now[0] = 5.0
    t = clock.result()
    assert t["loop_idle"] == pytest.approx(t["parse"]) and t["parse"] == pytest.approx(1.0 + 0.2 + 0.4)


def test_expert_records_and_rewards(expert_run, tokenizer):
    episodes, _ = expert_run
    for ep in episodes:
        plan = walkthrough(ep["game_file"])
        assert ep["task"] and ep["task"][:-1] in ep["steps"][0]["observation"]
        if not ep["success"]:
            continue
        # the game ends at the winning step: exactly the walkthrough, every step valid
        assert [s["action"] for s in ep["steps"]] == plan and ep["length"] == len(plan)
        assert [s["reward"] for s in ep["steps"]] == [0.0] * (len(plan) - 1) + [WIN_REWARD]
        assert ep["return"] == WIN_REWARD
        assert [s["done"] for s in ep["steps"]] == [False] * (len(plan) - 1) + [True]
        assert [s["won"] for s in ep["steps"]] == [False] * (len(plan) - 1) + [True]
        for t, s in enumerate(ep["steps"]):
            assert s["step"] == t + 1 and s["valid"] and s["invalid_reason"] == "" and s["executed"] == s["action"]
            assert s["action"] in s["admissible"] and "help" not in s["admissible"] and "'help'" not in s["prompt"]
            assert s["history_used"] == min(HISTORY, t)
            # each step's observation is the previous step's feedback
            if t:
                assert s["observation"] == ep["steps"][t - 1]["feedback"]
            # the record rebuilds its own prompt exactly (what Stage 2 does to insert a skill)
            text, ids = chat_prompt(tokenizer, step_prompt(ep, t, s["history_used"]))
            assert text == s["prompt"] and ids == s["prompt_ids"]
            # ... and its skill-augmented twin differs by exactly the block, after the task line (step 1: the
            # first observation's own "Your task is to: ..." line, as the public code inserts it)
            plain, teach = step_prompt(ep, t, s["history_used"]), step_prompt(ep, t, s["history_used"], SKILL)
            task_line = f"Your task is to: {ep['task'][:-1]}"
            at = plain.index("\n", plain.index(task_line)) + 1 if t == 0 else plain.index("\n") + 1
            assert teach == plain[:at] + skill_block(SKILL) + plain[at:]
            assert t == 0 or plain[:at] == f"{ROLE} Your task is to: {ep['task']}\n"
            assert tokenizer.decode(s["response_ids"], skip_special_tokens=True) == s["response"]
            assert s["response_ids"][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    json.dumps(episodes)  # records are plain JSON


# ----------------------------------------------------------------------------------------------------
# Reward, return, success, end conditions (scripted answers on real games)

def test_rewards_returns_and_max_steps(pool, games, tokenizer):
    win_game, idle_game = games[0], games[2]  # one reset per worker
    plan = walkthrough(win_game["game_file"])
    max_steps = len(plan) + 4
    act = lambda a, think=True: (f"<think>next: {a}</think>" if think else "") + f"<action>{a}</action>"
    scripts = {
        # two invalid steps that change nothing, the plan, and the winning action without think tags
        "win": [act("fly to the moon"), "I would rather wait here.", *[act(a) for a in plan[:-1]],
                act(plan[-1], think=False)],
        # valid and invalid steps in turn, never winning: ends at max_steps
        "idle": [act("look"), act("jump")] * max_steps,
    }
    specs = [dict(win_game, uid="win"), dict(idle_game, uid="idle")]
    (win, idle), _ = play_episodes(alfworld, specs, pool, ScriptedPolicy(tokenizer, scripts), tokenizer, max_steps=max_steps)

    # The public code's rule: a well-formed inadmissible action is VALID (it only wastes the step, and is recorded
    # as not admissible); no action tags or no think tags are invalid. Invalid steps cost 0.1 at that step; a win
    # gives 10 at that step (also when that step is invalid)
    assert [s["invalid_reason"] for s in win["steps"]] == \
        ["", "no_action_tags"] + [""] * (len(plan) - 1) + ["no_think_tags"]
    assert [s["admissible_action"] for s in win["steps"][:2]] == [False, False]
    assert all(s["admissible_action"] for s in win["steps"][2:])
    # without tags the env runs the last 30 characters of the lower-cased response
    assert [s["executed"] for s in win["steps"][:2]] == ["fly to the moon", "i would rather wait here."]
    assert [s["feedback"] for s in win["steps"][:2]] == ["Nothing happens.", "Nothing happens."]
    expected = [0.0, -INVALID_PENALTY] + [0.0] * (len(plan) - 1) + [WIN_REWARD - INVALID_PENALTY]
    assert [s["reward"] for s in win["steps"]] == pytest.approx(expected)
    assert win["return"] == pytest.approx(sum(expected)) == pytest.approx(10 - 2 * 0.1)
    assert win["success"] and win["length"] == len(plan) + 2 < max_steps and win["steps"][-1]["done"]

    # max steps ends the episode: exactly max_steps steps, the last one done, no win; return = sum. "jump" is
    # not admissible: valid under the public rule, so nothing is penalised; half the steps are inadmissible
    assert idle["length"] == len(idle["steps"]) == max_steps and not idle["success"] and idle["env_failure"] is None
    assert [s["done"] for s in idle["steps"]] == [False] * (max_steps - 1) + [True]
    assert not any(s["won"] for s in idle["steps"])
    assert all(s["valid"] for s in idle["steps"]) and idle["return"] == 0.0
    assert [s["admissible_action"] for s in idle["steps"]] == [t % 2 == 0 for t in range(max_steps)]
    assert all(s["feedback"] == "Nothing happens." for s in idle["steps"][1::2])
    summary = summarize_episodes([win, idle])
    assert summary["All"]["success"] == 0.5
    assert summary["All"]["invalid_rate"] == pytest.approx(2 / (win["length"] + max_steps))
    assert summary["All"]["inadmissible_rate"] == pytest.approx((2 + max_steps // 2) / (win["length"] + max_steps))

    # --invalid-rule strict (the ablation): an inadmissible action is invalid too and costs the penalty
    (win, idle), _ = play_episodes(alfworld, specs, pool, ScriptedPolicy(tokenizer, scripts), tokenizer,
                                   max_steps=max_steps, invalid_rule="strict")
    assert [s["invalid_reason"] for s in win["steps"]] == \
        ["not_admissible", "no_action_tags"] + [""] * (len(plan) - 1) + ["no_think_tags"]
    assert win["return"] == pytest.approx(10 - 3 * 0.1)
    assert [s["valid"] for s in idle["steps"]] == [t % 2 == 0 for t in range(max_steps)]
    assert [s["reward"] for s in idle["steps"]] == pytest.approx([0.0 if t % 2 == 0 else -INVALID_PENALTY
                                                                  for t in range(max_steps)])
    assert idle["return"] == pytest.approx(-INVALID_PENALTY * (max_steps // 2))


# ----------------------------------------------------------------------------------------------------
# History truncation under a small prompt limit

def test_history_truncation_keeps_prompts_under_the_limit(pool, expert_run, tokenizer):
    episodes, _ = expert_run
    ref = max((ep for ep in episodes if ep["success"]), key=lambda ep: ep["length"])  # the longest win
    T = ref["length"]
    lens = [[_prompt_len(tokenizer, ref, t, k) for k in range(min(HISTORY, t) + 1)] for t in range(T)]
    limit = max(row[0] for row in lens)  # the smallest limit at which every step fits without history
    want_k = [max(k for k, n in enumerate(row) if n <= limit) for row in lens]
    assert any(k < min(HISTORY, t) for t, k in enumerate(want_k)), "test setup: the limit forces no truncation"

    [ep], _ = play_episodes(alfworld, [ref], pool, ExpertPolicy(tokenizer), tokenizer, history=HISTORY,
                            max_prompt_tokens=limit)
    assert ep["success"] and ep["length"] == T and not ep["prompt_too_long"]
    assert [s["action"] for s in ep["steps"]] == [s["action"] for s in ref["steps"]]
    assert all(len(s["prompt_ids"]) <= limit for s in ep["steps"])
    got_k = [s["history_used"] for s in ep["steps"]]
    assert got_k == want_k  # as much history as fits, no less
    assert ep["history_truncations"] == sum(k < min(HISTORY, t) for t, k in enumerate(got_k))
    for t, (s, k) in enumerate(zip(ep["steps"], got_k)):
        if k == min(HISTORY, t):
            continue
        # the oldest entries are the ones dropped: the prompt shows exactly steps t-k+1..t (1-based) ...
        shown = re.findall(r"\[Observation (\d+): '(.*?)', Action (\d+): '(.*?)'\]", s["prompt"], re.DOTALL)
        assert [int(n) for n, _, _, _ in shown] == list(range(t - k + 1, t + 1))
        assert [(o, a) for _, o, _, a in shown] == [(r["observation"], r["executed"]) for r in ref["steps"][t - k:t]]
        assert f"[Observation {t - k}: " not in s["prompt"]
        assert f"most recent {k} observations" in s["prompt"] and f"already taken {t} step(s)" in s["prompt"]
        # ... and one more entry would not have fitted
        assert _prompt_len(tokenizer, ref, t, k + 1) > limit


def test_limit_below_the_bare_prompt_ends_the_episode(pool, games, tokenizer):
    [ep], _ = play_episodes(alfworld, [games[1]], pool, ExpertPolicy(tokenizer), tokenizer, max_prompt_tokens=40)
    assert ep["prompt_too_long"] and ep["steps"] == [] and ep["length"] == 0
    assert not ep["success"] and ep["return"] == 0.0 and ep["env_failure"] is None
    summary = summarize_episodes([ep])
    assert summary["prompt_too_long"] == 1 and summary["All"]["episodes"] == 1 and summary["All"]["success"] == 0.0
    assert "prompt over the limit" in format_summary(summary)


# ----------------------------------------------------------------------------------------------------
# The loop's fast prompts (prompts/chat.py ChatPrompts): chat_prompt's text and ids, on real prompts of every env

def webshop_prompts(folder, goals=6):
    """User messages of the WebShop expert's episodes on the synthetic catalog (envs/webshop/synthetic.py),
    played in this process: every step, history k = 0..5, plain and with a skill."""
    import envs.webshop as W
    from envs.webshop.synthetic import write_catalog
    data = write_catalog(str(folder / "catalog"), 80, seed=0)
    out = []
    for g in range(goals):
        task = {"data_dir": data, "index_cache": str(folder / "index"), "goal_index": g}
        game = W.make_game(task)
        st = game.reset()
        ep = dict(task, task=st["task"], steps=[], _obs=st["observation"], _admissible=st["admissible"])
        while not st["done"] and len(ep["steps"]) < 8:
            t = len(ep["steps"])
            out += [W.build_prompt(ep["task"], ep["_obs"], ep["_admissible"], t + 1, ep["steps"][max(0, t - k):t],
                                   skill) for k in range(6) for skill in (None, SKILL)]
            action = W.expert_action(ep)
            ep["steps"].append({"observation": ep["_obs"], "executed": action})
            st = game.step(action)
            ep.update(_obs=st["observation"], _admissible=st["admissible"])
    return out


def search_prompts(questions=20):
    """User messages of Search steps built from the real HotpotQA questions and their real corpus passages
    (../shared/search): first step, then 1-3 searches of history, plain and with a skill."""
    import json
    import lzma
    from envs import search as S
    d = S.default_data_dir()
    with lzma.open(f"{d}/corpus.jsonl.xz", "rt") as f:
        docs = {r["id"]: r for r in map(json.loads, f)}
    with lzma.open(f"{d}/hotpotqa500.jsonl.xz", "rt") as f:
        qs = [json.loads(line) for _, line in zip(range(questions), f)]
    out = []
    for q in qs:
        ctx = [docs[i] for i in q["metadata"]["context_ids"] if i in docs]
        hist = [{"step": j + 1, "executed": f"search[{q['question'][:40 + 10 * j]}]",
                 "feedback": S.format_information(ctx[3 * j:3 * j + 3])} for j in range(3)]
        out += [S.build_prompt(q["question"], "", [], t + 1, hist[:t], skill) for t in range(4) for skill in (None, SKILL)]
    return out


@pytest.fixture(scope="module")
def real_prompts(expert_run, tmp_path_factory):
    """{env: user messages}: ALFWorld's from the expert's 12 real games (every step, k = 0..5, plain and with a
    skill), WebShop's and Search's as above."""
    episodes, _ = expert_run
    alf = [step_prompt(ep, t, k, skill) for ep in episodes for t in range(len(ep["steps"])) for k in range(6)
           for skill in (None, SKILL)]
    return {"alfworld": alf, "webshop": webshop_prompts(tmp_path_factory.mktemp("webshop")),
            "search": search_prompts()}


@pytest.mark.parametrize("template, thinking", [("qwen2.5", None), ("qwen3", None), ("qwen3", True),
                                                ("qwen3", False)])
def test_fast_chat_prompts_are_chat_prompt(real_prompts, tokenizer, tmp_path_factory, template, thinking):
    """Byte for byte and id for id, over every prompt twice (first tokenized piece by piece, then from the
    memo), in the order the loop builds them and shuffled."""
    import random
    from prompts.chat import ChatPrompts, chat_prompt, lines_tokenize_apart
    from test_chat import qwen3_style_tokenizer
    tok = tokenizer if template == "qwen2.5" else qwen3_style_tokenizer(tmp_path_factory.mktemp("qwen3"))
    fast = ChatPrompts(tok, thinking=thinking)
    assert lines_tokenize_apart(tok) and fast.piecewise and fast.around  # the fast path is what is tested
    for env_name, users in real_prompts.items():
        assert len(users) > 100, env_name
        want = [chat_prompt(tok, u, thinking=thinking) for u in users]
        shuffled = random.Random(0).sample(range(len(users)), len(users))
        for order in (range(len(users)), shuffled):
            for i in order:
                assert fast(users[i]) == want[i], (env_name, users[i][:200])
    assert len(fast.pieces) > 100


def test_the_loop_records_chat_prompt_ids(expert_run, tokenizer):
    """What the loop recorded (its fast path) is what chat_prompt gives for the same user message."""
    episodes, _ = expert_run
    for ep in episodes:
        for t, s in enumerate(ep["steps"]):
            assert chat_prompt(tokenizer, step_prompt(ep, t, s["history_used"])) == (s["prompt"], s["prompt_ids"])


# ----------------------------------------------------------------------------------------------------
# The chat template and the recorded token ids (collect.py's tiny random model, real Qwen2.5 tokenizer)

def test_recorded_prompt_and_response_ids_round_trip(tiny_trajectories, tokenizer):
    records = read_jsonl(tiny_trajectories)
    assert len(records) == 6 and all(ep["steps"] for ep in records)
    stops = set(stop_token_ids(tokenizer))
    user_re = re.compile(r"<\|im_start\|>user\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n\Z", re.DOTALL)
    n_steps = 0
    for ep in records:
        for t, s in enumerate(ep["steps"]):
            n_steps += 1
            # the templated prompt: Qwen's default system turn, one user turn, the generation prompt
            assert s["prompt"].startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
            assert s["prompt"].count("<|im_start|>") == 3
            user = user_re.search(s["prompt"]).group(1)
            assert user == step_prompt(ep, t, s["history_used"])
            # ids <-> text both ways, and the same ids as the template's own tokenization
            assert tokenizer.decode(s["prompt_ids"]) == s["prompt"]
            assert tokenizer(s["prompt"], add_special_tokens=False)["input_ids"] == s["prompt_ids"]
            templ = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                                  add_generation_prompt=True)
            assert list(templ["input_ids"]) == s["prompt_ids"]
            # the response: its ids decode to its text; a stop token only at the end; <= 16 new tokens
            ids = s["response_ids"]
            assert 0 < len(ids) <= 16
            assert tokenizer.decode(ids, skip_special_tokens=True) == s["response"]
            assert not stops & set(ids[:-1])
            assert s["truncated"] == (ids[-1] not in stops) and s["truncated"] == (len(ids) == 16 and ids[-1] not in stops)
    assert n_steps >= 6


# ----------------------------------------------------------------------------------------------------
# The schedule: each episode at its own pace (deterministic fake games, tests/fake_games.py)

ACT = "<think>try the door</think><action>go north</action>"


def fake_specs(n, **per_uid):
    """n episodes of the fake game; per_uid: {uid: extra spec fields} (win_at, delay, hang_at, raise_at)."""
    return [dict(uid=f"e{i}", name=f"r{i}", seed=11, group=i // 2, rollout=i % 2, **per_uid.get(f"e{i}", {}))
            for i in range(n)]


def trace(episodes):
    """{uid: what an episode is}: the sampled tokens, actions, rewards, end; log-probs kept apart (floats)."""
    return {ep["uid"]: dict(ids=[s["response_ids"] for s in ep["steps"]], executed=[s["executed"] for s in ep["steps"]],
                            reward=[s["reward"] for s in ep["steps"]], prompts=[s["prompt_ids"] for s in ep["steps"]],
                            ret=ep["return"], failure=ep["env_failure"]) for ep in episodes}


def test_same_episodes_whatever_the_order_batching_and_schedule(tokenizer):
    """The tiny random model samples the same episodes whether they play in lockstep, each at its own pace with
    answers arriving out of order (steps of 0-0.3 s), two at a time in reverse order, or one at a time: every
    sample depends only on its own seed, not on which requests share a `generate` call."""
    hf = HFBackend(load_model("tiny", seed=0), tokenizer, want_logprobs=True)
    specs = fake_specs(5, **{f"e{i}": dict(delay=0.1 * ((3 * i) % 4)) for i in range(5)})
    kw = dict(max_steps=3, max_new_tokens=8, temperature=1.0)
    calls = []
    generate = hf.generate
    hf.generate = lambda prompts, **k: (calls.append(len(prompts)), generate(prompts, **k))[1]  # batch sizes
    with EnvPool("tests.fake_games:make_game", num_workers=2) as pool:
        runs = {"lockstep": play_episodes(alfworld, specs, pool, hf, tokenizer, lockstep=True, **kw)[0]}
        lockstep_calls, calls[:] = list(calls), []
        runs["per-episode"] = play_episodes(alfworld, specs, pool, hf, tokenizer, **kw)[0]
        per_episode_calls = list(calls)
        slots, submit = set(), pool.submit
        pool.submit = lambda slot, cmd, arg=None: (cmd == "reset" and slots.add(slot), submit(slot, cmd, arg))[1]
        runs["two at a time, reversed"] = play_episodes(alfworld, specs[::-1], pool, hf, tokenizer, max_live=2,
                                                        **kw)[0][::-1]
        runs["one at a time"] = play_episodes(alfworld, specs, pool, hf, tokenizer, max_live=1, **kw)[0]
    assert lockstep_calls == [5, 5, 5]  # one call per turn over every live episode
    assert sum(per_episode_calls) == 15 and len(per_episode_calls) > 3  # requests batched as they came
    assert slots == {0, 1}  # never more than max_live episodes in play
    ref = runs["lockstep"]
    assert [ep["uid"] for ep in ref] == [s["uid"] for s in specs] and all(len(ep["steps"]) == 3 for ep in ref)
    assert len({tuple(map(tuple, t["ids"])) for t in trace(ref).values()}) == 5  # the samples do differ
    for name, eps in runs.items():
        assert [ep["uid"] for ep in eps] == [s["uid"] for s in specs], name  # returned in spec order
        assert trace(eps) == trace(ref), name
        for a, b in zip(eps, ref):
            for sa, sb in zip(a["steps"], b["steps"]):
                assert sa["response_logprobs"] == pytest.approx(sb["response_logprobs"], abs=1e-4), name


class Answer(BatchBackend):
    """Every request answered with one fixed text; each `generate` call is logged as (tag, uids)."""

    def __init__(self, tokenizer, text, log, tag):
        self.ids, self.text, self.log, self.tag = tokenizer(text)["input_ids"], text, log, tag

    def generate(self, prompts, *, contexts, **kw):
        self.log.append((self.tag, sorted(ep["uid"] for ep in contexts)))
        return [Generation(self.ids, self.text, "stop") for _ in prompts]


class LoggedAnalyzer(ScriptedAnalyzer):
    def __init__(self, tokenizer, log):
        super().__init__(tokenizer)
        self.log = log

    def generate(self, prompts, *, contexts, **kw):
        self.log.append(("analysis", sorted(ep["uid"] for ep in contexts)))
        return super().generate(prompts, contexts=contexts, **kw)


@pytest.mark.parametrize("lockstep", [False, True], ids=["per-episode", "lockstep"])
def test_self_analysis_starts_as_each_episode_ends(tokenizer, lockstep):
    """e0 wins at step 1, e1 at step 2, e2 plays all 4 slow steps, e3's game breaks: per episode, e0's analysis
    is written while e2 still plays; in lockstep, after the last episode. Either way the same answers, none for
    the env failure or where the analysis prompt is None (too long), and each episode is handed over once,
    complete. on_played fires once, after the last env step and before the last analysis, with every episode's
    steps final (seed_rl.py starts its plain scoring then)."""
    log, done = [], []
    specs = fake_specs(4, e0=dict(win_at=1), e1=dict(win_at=2), e2=dict(delay=0.3), e3=dict(raise_at=1))
    with EnvPool("tests.fake_games:make_game", num_workers=2) as pool:
        eps, tm = play_episodes(alfworld, specs, pool, Answer(tokenizer, ACT, log, "generate"), tokenizer,
                                max_steps=4, lockstep=lockstep, analyzer=LoggedAnalyzer(tokenizer, log),
                                analysis_prompt=lambda ep: None if ep["uid"] == "e1" else [1, 2, 3],
                                on_episode=lambda ep: done.append(dict(ep)),
                                on_played=lambda eps: log.append(("played", [len(ep["steps"]) for ep in eps])),
                                progress=lambda k, n: log.append(("progress", k, n)))
    assert [(ep["success"], ep["length"], bool(ep["env_failure"])) for ep in eps] == \
        [(True, 1, False), (True, 2, False), (False, 4, False), (False, 0, True)]
    played = [k for k, (tag, *_) in enumerate(log) if tag == "played"]
    assert len(played) == 1 and log[played[0]][1] == [len(ep["steps"]) for ep in eps] == [1, 2, 4, 0]
    e2_analysis = [k for k, (tag, *rest) in enumerate(log) if tag == "analysis" and "e2" in rest[0]]
    assert max(k for k, (tag, *_) in enumerate(log) if tag == "generate") < played[0] < e2_analysis[0]
    assert "this game is broken" in eps[3]["env_failure"]
    assert [ep["analysis"] is not None for ep in eps] == [True, False, True, False]
    assert json.loads(eps[0]["analysis"])["episode_skill"].startswith("Follow this order")
    analyzed = [u for tag, *rest in log if tag == "analysis" for u in rest[0]]
    assert sorted(analyzed) == ["e0", "e2"]
    last_generate = max(k for k, (tag, *_) in enumerate(log) if tag == "generate")
    first_analysis = min(k for k, (tag, *_) in enumerate(log) if tag == "analysis")
    if lockstep:  # the old schedule: every analysis after every episode's last step
        assert first_analysis > last_generate
    else:  # e0's analysis while e2 is still generating
        assert first_analysis < last_generate and "e0" in log[first_analysis][1]
    # handed over once each, complete (its analysis in), with the bar moving one episode at a time
    assert sorted(ep["uid"] for ep in done) == ["e0", "e1", "e2", "e3"]
    assert all(ep == eps[int(ep["uid"][1])] for ep in done)
    assert [x[1:] for x in log if x[0] == "progress"] == [(k, 4) for k in range(1, 5)]


def test_failures_and_a_hung_worker_do_not_stop_the_others(tokenizer):
    """Worker 1 (slots 1 and 3) hangs in e1's step 2: it is killed after the step timeout and both its games are
    lost (env failures), e2's game raises at step 1 (its own failure only), e0 plays to the end. Nothing waits
    for the hung step longer than the timeout."""
    specs = fake_specs(4, e1=dict(hang_at=2), e2=dict(raise_at=1))
    with EnvPool("tests.fake_games:make_game", num_workers=2, step_timeout=3.0) as pool:
        t0 = time.monotonic()
        eps, _ = play_episodes(alfworld, specs, pool, ScriptedPolicy(tokenizer, [ACT]), tokenizer, max_steps=5)
        took = time.monotonic() - t0
        assert pool.stats["workers_replaced"] == 1
    assert took < 30, f"the loop waited {took:.0f}s on a hung worker"
    assert eps[0]["env_failure"] is None and eps[0]["length"] == 5
    assert eps[1]["env_failure"] == "env worker timed out" and eps[1]["length"] == 1
    assert eps[3]["env_failure"] == "env worker timed out" and eps[3]["length"] <= 2
    assert "this game is broken" in eps[2]["env_failure"] and eps[2]["length"] == 0
    assert summarize_episodes(eps)["env_failures"] == 3
