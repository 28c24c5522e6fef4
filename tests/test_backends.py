"""common/backends.py: what the generation backends ask their engines for, and what they hand back.

VLLMBackend needs CUDA, so its tests use the one stand-in of the suite, a fake `vllm` module. It records what
the backend asks vLLM for (SamplingParams per request, token-id prompts, engine arguments) and answers in
vLLM's output shapes. The real engine ran on the H200 (README: "On one H200"). What is pinned here:
- per-request seeds, and vLLM's V2 model runner, which draws them in one kernel;
- explicit sampling parameters;
- sampled-token log-probs only when asked for, per backend or per call;
- the mapping of vLLM's outputs to Generation, with the text decoded here (vLLM's detokenizer is off).
HFBackend runs for real, with a tiny model: its log-probs equal a forward pass's, and a call can decline them.
"""
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from common.backends import HFBackend, LoopStop, VLLMBackend, cut_at_loop, loop_end

from common.models import load_model


class FakeEngine:
    """vLLM's synchronous `LLMEngine` as the backend drives it: `add_request` queues a request; each `step` is one
    forward, in which every running request gets one token, and returns the requests that finished in it
    (output_kind FINAL_ONLY: the whole response) and, for output_kind DELTA, every running request with its new
    token. Request k answers [100 + k, 200 + k], odd ones then stop with <|im_end|>; `answers[k]`, where set, is
    request k's answer instead (ending in <|im_end|> means it stops by itself). `abort_request` drops requests."""

    def __init__(self):
        self.added, self.running, self.steps, self.joins, self.answers, self.aborted = [], {}, 0, [], {}, []

    def add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str) and request_id not in self.running
        k = len(self.added)
        self.added.append((request_id, prompt, params))
        self.joins.append((self.steps, len(self.running)))  # (engine steps so far, requests running)
        toks = self.answers.get(k, [100 + k, 200 + k] + ([151645] if k % 2 else []))[:params.max_tokens]
        self.running[request_id] = dict(k=k, todo=toks, done=[], params=params, stop=toks[-1] == 151645)

    def abort_request(self, request_ids, internal=False):
        for rid in request_ids:
            self.aborted.append(rid)
            self.running.pop(rid)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        self.steps += 1
        out = []
        for rid, r in list(self.running.items()):
            r["done"].append(r["todo"].pop(0))
            finished, sp = not r["todo"], r["params"]
            if finished:
                del self.running[rid]
            elif sp.output_kind != 1:  # not DELTA: nothing until it finishes
                continue
            toks = r["done"] if sp.output_kind != 1 else r["done"][-1:]
            first = len(r["done"]) - len(toks)
            lps = [{t: SimpleNamespace(logprob=-0.5 * (first + j + 1) - r["k"])} for j, t in enumerate(toks)] \
                if sp.logprobs is not None else None
            out.append(SimpleNamespace(request_id=rid, finished=finished, outputs=[SimpleNamespace(
                token_ids=toks, text="" if sp.detokenize is False else f"out{r['k']}",
                finish_reason=("stop" if r["stop"] else "length") if finished else None,
                logprobs=lps)], finished_at=self.steps))
        return out


class FakeExecutor:
    """vLLM 0.24's executor around sleep (executor/abstract.py, gpu_worker.py): the worker frees the memory, then
    checks the device's free memory, and only a passing check lets the executor mark itself asleep; wake_up does
    nothing unless it is marked. `check_error` makes the worker's check fail, as another process allocating on
    the same GPU meanwhile does."""

    def __init__(self):
        self.is_sleeping, self.sleeping_tags, self.resident, self.check_error = False, set(), True, None

    def sleep(self, level):
        self.resident = False  # the worker's allocator.sleep: weights offloaded, KV cache dropped
        if self.check_error:
            raise AssertionError(self.check_error)
        self.sleeping_tags, self.is_sleeping = {"weights", "kv_cache"}, True

    def wake_up(self, tags=None):
        if not self.is_sleeping:  # vLLM: "Executor is not sleeping." and nothing happens
            return
        self.sleeping_tags -= set(tags or self.sleeping_tags)
        self.is_sleeping = bool(self.sleeping_tags)
        self.resident = not self.is_sleeping


class FakeLLM:
    def __init__(self, **kw):
        self.kw, self.llm_engine = kw, FakeEngine()
        self.llm_engine.model_executor = FakeExecutor()

    def sleep(self, level=1):
        self.llm_engine.model_executor.sleep(level)

    def wake_up(self, tags=None):
        self.llm_engine.model_executor.wake_up(tags)


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(CUMULATIVE=0, DELTA=1, FINAL_ONLY=2)
    sampling.RepetitionDetectionParams = lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")  # vLLM 0.24: an already-rendered prompt of token ids
    inputs.tokens_input = lambda prompt_token_ids: {"type": "token", "prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.setenv(var, "x")  # the backend sets these: record the original state, so teardown restores it
        monkeypatch.delenv(var)
    assert not dist.is_initialized()  # outside torchrun: the engine core must run in-process
    return vllm


def test_sampling_params_seeds_and_outputs(fake_vllm, tokenizer):
    eng = VLLMBackend("some/model", tokenizer, max_model_len=4096, seed=3)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # batched per-request seeded sampling
    assert eng.llm.kw["max_model_len"] == 4096 and eng.llm.kw["seed"] == 3 and eng.llm.kw["enable_sleep_mode"]
    assert "distributed_executor_backend" not in eng.llm.kw

    gens = eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=7, temperature=1.0, seeds=[11, 2 ** 31 + 5])
    added = eng.llm.llm_engine.added
    assert [p for _, p, _ in added] == [{"type": "token", "prompt_token_ids": [1, 2, 3]},
                                        {"type": "token", "prompt_token_ids": [4, 5]}]
    sps = [sp for _, _, sp in added]
    assert [sp.seed for sp in sps] == [11, 5]  # per request, folded into vLLM's int32 range
    for sp in sps:  # nothing left to model defaults (generation_config.json may set top_p/top_k/penalty)
        assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (1.0, 1.0, 0, 1.0, 7)
        assert sp.logprobs is None  # not asked for: they cost generation speed
        assert sp.output_kind == 2  # FINAL_ONLY: a request comes back once, finished
    assert [g.token_ids for g in gens] == [[100, 200], [101, 201, 151645]]  # the stop token kept for the trainer
    assert all(sp.detokenize is False for sp in sps)  # the backend decodes the finished responses itself
    assert [g.text for g in gens] == [tokenizer.decode([100, 200]), tokenizer.decode([101, 201])]
    assert [g.finish_reason for g in gens] == ["length", "stop"]
    assert all(g.logprobs is None for g in gens)

    eng.generate([[1]], max_new_tokens=4, temperature=0.0)  # greedy, unseeded
    assert added[-1][2].seed is None and added[-1][2].temperature == 0.0


def test_vllm_loop_stop_aborts_a_looping_answer_where_its_loop_completes(fake_vllm, tokenizer):
    """loop_stop=window in vLLM: the request streams its tokens (output_kind DELTA), the backend checks them
    itself, and on a loop aborts the request and returns the answer cut where the loop completed, finish_reason
    'repetition', log-probs cut alike. Answers without a loop come back whole; requests without loop_stop stay
    FINAL_ONLY."""
    eng = VLLMBackend("some/model", tokenizer, max_model_len=1024, want_logprobs=True)
    core = eng.llm.llm_engine
    core.answers = {0: [5, 1, 2, 1, 2, 1, 2, 9, 9],  # window 4: [1 2 1 2] completes on the 5th token
                    1: [5, 1, 2, 151645],  # no loop: stops by itself
                    2: [7, 7, 7, 7, 7]}  # no loop_stop: runs to its end
    eng.submit("loop", [1], max_new_tokens=9, temperature=0.0, loop_stop=4)
    eng.submit("stops", [2], max_new_tokens=9, temperature=0.0, loop_stop=4)
    eng.submit("plain", [3], max_new_tokens=9, temperature=0.0)
    assert [sp.output_kind for _, _, sp in core.added] == [1, 1, 2]  # DELTA, DELTA, FINAL_ONLY
    got = {}
    while eng.in_flight():
        got.update(eng.poll())
    assert core.aborted == ["loop"] and core.steps == 5  # aborted at its 5th token, not run to its 9th
    assert (got["loop"].token_ids, got["loop"].finish_reason) == ([5, 1, 2, 1, 2], "repetition")
    assert got["loop"].logprobs == [-0.5, -1.0, -1.5, -2.0, -2.5]  # each delta's log-probs, in order
    assert got["loop"].text == tokenizer.decode([5, 1, 2, 1, 2])
    assert (got["stops"].token_ids, got["stops"].finish_reason) == ([5, 1, 2, 151645], "stop")
    assert (got["plain"].token_ids, got["plain"].finish_reason) == ([7, 7, 7, 7, 7], "length")
    assert eng.growing == {}  # nothing left behind
    # a loop that completes on the cap's token: the cap comes first ('length', as vLLM and HF order them)
    core.answers[3] = [1, 2, 1, 2]
    (g,) = eng.generate([[4]], max_new_tokens=4, temperature=0.0, loop_stop=4)
    assert (g.token_ids, g.finish_reason) == ([1, 2, 1, 2], "length") and core.aborted == ["loop"]


def test_requests_come_back_as_each_finishes(fake_vllm, tokenizer):
    """The rollout loop's path: submit adds one request to the running engine; each poll is one engine step
    and returns only what finished in it; a request added while others run joins the next step (continuous
    batching); ids come back as given."""
    eng = VLLMBackend("some/model", tokenizer, max_model_len=1024)
    core = eng.llm.llm_engine
    assert eng.poll() == [] and core.steps == 0  # nothing in flight: no engine step
    eng.submit("ep0/0", [1, 2], max_new_tokens=8, temperature=1.0, seed=1)  # k=0: 2 tokens, no stop
    eng.submit("ep1/0", [3], max_new_tokens=8, temperature=1.0, seed=2)  # k=1: 3 tokens with the stop
    assert eng.poll() == [] and eng.in_flight() == 2
    eng.submit("ep0/analysis", [4], max_new_tokens=1, temperature=0.0)  # k=2, joins while the others run
    got = eng.poll()
    assert [rid for rid, _ in got] == ["ep0/0", "ep0/analysis"] and eng.in_flight() == 1
    assert got[0][1].token_ids == [100, 200] and got[1][1].token_ids == [102]
    assert got[1][1].finish_reason == "length"
    (rid, g), = eng.poll()
    assert rid == "ep1/0" and g.token_ids == [101, 201, 151645] and g.finish_reason == "stop"
    assert eng.in_flight() == 0 and eng.poll() == [] and core.steps == 3
    eng.submit("x", [1], max_new_tokens=2, temperature=1.0)
    with pytest.raises(RuntimeError, match="in flight"):  # one batch call cannot run under the loop's requests
        eng.generate([[1]], max_new_tokens=2, temperature=1.0)


def test_older_vllm_gets_a_tokens_prompt(fake_vllm, tokenizer, monkeypatch):
    inputs = types.ModuleType("vllm.inputs")  # no tokens_input: a raw prompt, which vLLM preprocesses
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    eng = VLLMBackend("some/model", tokenizer, max_model_len=1024)
    eng.generate([[7, 8]], max_new_tokens=2, temperature=1.0)
    assert eng.llm.llm_engine.added[0][1] == {"prompt_token_ids": [7, 8]}


def test_a_users_model_runner_choice_wins(fake_vllm, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    VLLMBackend("some/model", tokenizer, max_model_len=1024)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_a_fixed_kv_cache_reaches_vllm_and_skips_its_profiling(fake_vllm, tokenizer):
    """--kv-cache-gib 1.5 -> kv_cache_memory_bytes (vLLM then does not size the cache from the free memory it sees
    while profiling); 0, the default, leaves vLLM's own sizing from gpu_memory_utilization."""
    eng = VLLMBackend("some/model", tokenizer, max_model_len=1024, gpu_memory_utilization=0.1, kv_cache_gib=1.5)
    assert eng.llm.kw["kv_cache_memory_bytes"] == 1610612736 and eng.llm.kw["gpu_memory_utilization"] == 0.1
    assert "kv_cache_memory_bytes" not in VLLMBackend("some/model", tokenizer, max_model_len=1024).llm.kw
    from common.backends import make_policy  # collect.py's and evaluate.py's engine
    pol = make_policy("some/model", tokenizer, backend="vllm", max_model_len=1024, kv_cache_gib=0.25)
    assert pol.llm.kw["kv_cache_memory_bytes"] == 2 ** 28 and pol.llm.kw["enable_sleep_mode"] is False


def test_sampled_token_logprobs_when_asked(fake_vllm, tokenizer):
    eng = VLLMBackend("some/model", tokenizer, max_model_len=1024, want_logprobs=True)
    gens = eng.generate([[1, 2], [3]], max_new_tokens=3, temperature=1.0, seeds=[0, 1])
    assert all(sp.logprobs == 0 for _, _, sp in eng.llm.llm_engine.added)  # the sampled token's own log-prob only
    assert gens[0].logprobs == [-0.5, -1.0] and gens[1].logprobs == [-1.5, -2.0, -2.5]
    gens = eng.generate([[1]], max_new_tokens=2, temperature=1.0, want_logprobs=False)  # this call declines
    assert eng.llm.llm_engine.added[-1][2].logprobs is None and gens[0].logprobs is None


def test_hf_logprobs_match_a_forward_and_a_call_can_decline(tokenizer):
    model = load_model("tiny", seed=0)
    hf = HFBackend(model, tokenizer, batch_size=2, want_logprobs=True)
    prompts = [[9707, 11, 1879], [40, 1079]]  # unequal lengths: left padding
    gens = hf.generate(prompts, max_new_tokens=5, temperature=1.0, seeds=[1, 2])
    for p, g in zip(prompts, gens):
        assert len(g.logprobs) == len(g.token_ids) > 0
        with torch.no_grad():
            lp = model(torch.tensor([p + g.token_ids])).logits[0].float().log_softmax(-1)
        want = [lp[len(p) - 1 + k, t].item() for k, t in enumerate(g.token_ids)]
        assert g.logprobs == pytest.approx(want, abs=1e-4)
    again = hf.generate(prompts, max_new_tokens=5, temperature=1.0, seeds=[1, 2], want_logprobs=False)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # same seeds, same samples
    assert all(g.logprobs is None for g in again)


def test_loop_end_by_hand():
    """loop_stop=window: the response ends at its first token where its last `window` tokens are one block of at
    most window // 2 tokens written over and over."""
    assert loop_end([5, 1, 2, 1, 2, 1, 2], 4) == 5  # [1 2 1 2]
    assert loop_end([5, 1, 2, 1, 2, 1, 2], 6) == 7  # [1 2 1 2 1 2]
    assert loop_end([5, 1, 2, 1, 2, 1, 2], 7) is None  # the 5 breaks any 7-token window
    assert loop_end([1, 2, 3, 1, 2, 3, 1], 7) == 7  # period 3, the window need not hold whole blocks
    assert loop_end([1, 2, 3, 1, 2, 9], 6) is None
    assert loop_end([3, 3], 2) == 2 and loop_end([3, 4, 3], 2) is None
    assert loop_end([1, 2, 3, 4, 1, 2, 3], 7) is None  # period 4 > 7 // 2: a block written less than twice
    assert loop_end([], 4) is None
    stop = LoopStop(4)  # fed in pieces, as vLLM's deltas arrive; the end stays once found
    assert stop.push([5, 1]) is None and stop.push([2, 1]) is None and stop.push([2, 1, 2]) == 5 and stop.push([0]) == 5
    with pytest.raises(ValueError, match="at least 2"):
        LoopStop(1)
    # against the definition written another way: the shortest prefix whose last `window` tokens equal the same
    # tokens shifted by some p <= window // 2; long enough that LoopStop's buffer grows
    import random
    rng = random.Random(0)
    for _ in range(300):
        ids, window = [rng.randrange(2) for _ in range(rng.randrange(1, 90))], rng.randrange(2, 12)
        want = next((n for n in range(window, len(ids) + 1) for p in range(1, window // 2 + 1)
                     if ids[n - window + p:n] == ids[n - window:n - p]), None)
        assert loop_end(ids, window) == want, (ids, window)


def test_cut_at_loop_orders_stop_cap_loop():
    """vLLM's order on each new token: a stop token, then the cap, then the loop."""
    assert cut_at_loop(9, "length", 5, 9) == (5, "repetition")  # looped before the cap
    assert cut_at_loop(5, "stop", 5, 9) == (5, "stop")  # the stop token completed the loop: a stop
    assert cut_at_loop(9, "length", 9, 9) == (9, "length")  # the cap's token completed it: the cap
    assert cut_at_loop(5, "length", 5, 9) == (5, "repetition")  # HF: its criterion ended the row there
    assert cut_at_loop(7, "stop", None, 9) == (7, "stop")


def test_hf_loop_stop_ends_each_answer_where_it_first_loops(tokenizer):
    """HFBackend with loop_stop: each greedy answer is the unstopped answer cut where its loop completes, with
    finish_reason 'repetition'; answers without a loop within the cap are unchanged ('length')."""
    hf = HFBackend(load_model("tiny", seed=0), tokenizer, batch_size=4)
    prompts = [[9707, 11, 1879], [40, 1079], [785, 3974, 13876, 38835], [14990]]
    full = hf.generate(prompts, max_new_tokens=24, temperature=0.0)
    for window in (4, 12, 30):  # 30: no answer of 24 tokens has a 30-token window
        cut = hf.generate(prompts, max_new_tokens=24, temperature=0.0, loop_stop=window)
        for f, c in zip(full, cut):
            r = loop_end(f.token_ids, window)
            if r is not None and r < 24:
                assert (c.token_ids, c.finish_reason) == (f.token_ids[:r], "repetition")
            else:
                assert (c.token_ids, c.finish_reason) == (f.token_ids, f.finish_reason)
    # the tiny random model loops at once (one token over and over): each case above was exercised
    assert [loop_end(f.token_ids, 4) for f in full] == [4, 5, 4, 4]
    assert all(loop_end(f.token_ids, 12) is not None for f in full)


def test_the_offline_replay_cuts_the_loop_and_spares_the_list(tmp_path, tokenizer):
    """benchmarks/analysis_loops.py on two answers: a skill that lists one action five times (it ended by itself)
    and one that loops on a phrase. A window of 16 tokens cuts both (the list is lost); 64 only the loop."""
    import json
    from conftest import run_script
    listed = '{"episode_summary": "s", "episode_skill": "' + ", ".join(["then go to desk 1"] * 5) + '."}'
    loop = '{"episode_summary": "s", "episode_skill": "' + "then go to bed 1, " * 40
    f = tmp_path / "analyses.jsonl"
    f.write_text("".join(json.dumps(dict(update=1, uid=u, finish=fin, text=t)) + "\n"
                         for u, fin, t in [("a", "stop", listed), ("b", "length", loop)]))
    res = run_script(["benchmarks/analysis_loops.py", str(f), "--windows", "16", "64", "--json",
                      str(tmp_path / "cuts.json")])
    cuts = json.loads((tmp_path / "cuts.json").read_text())
    assert [c["uid"] for c in cuts["16"]] == ["a", "b"] and [c["uid"] for c in cuts["64"]] == ["b"]
    ids = tokenizer(loop, add_special_tokens=False)["input_ids"]
    assert cuts["64"][0]["cut"] == loop_end(ids, 64) < len(ids)
    assert "cuts 2 of 2 answers, 1 of them ended by themselves" in res.stdout


def test_hf_samples_do_not_depend_on_which_requests_share_a_call(tokenizer):
    """HFBackend batches whatever it holds at each poll; a seeded request samples the same tokens whether it
    shares the call with all others, in another order, alone, or beside a greedy request of another length."""
    hf = HFBackend(load_model("tiny", seed=0), tokenizer, batch_size=3)
    prompts = [[9707, 11, 1879], [40, 1079], [785, 3974, 13876, 38835], [14990]]

    def run(groups, extra=False):
        got = {}
        for grp in groups:  # one poll per group
            for k in grp:
                hf.submit(k, prompts[k], max_new_tokens=6, temperature=1.0, seed=100 + k)
            if extra:
                hf.submit("greedy", [1, 2, 3, 4, 5], max_new_tokens=9, temperature=0.0, want_logprobs=False)
            got.update(hf.poll())
            assert hf.in_flight() == 0
        return [got[k].token_ids for k in range(4)]

    together = run([[0, 1, 2, 3]])  # batch_size 3: generate runs [0, 1, 2] and [3]
    assert len({tuple(t) for t in together}) == 4
    assert run([[3, 2, 1, 0]]) == together
    assert run([[0], [1], [2], [3]]) == together
    assert run([[2, 0], [3, 1]], extra=True) == together


def test_the_rollout_loop_drives_the_engine_request_by_request(fake_vllm, tokenizer):
    """play_episodes through VLLMBackend on the stand-in engine and fake games (tests/fake_games.py): every
    step of every episode is one add_request with its own seed, submitted while other requests are running;
    each self-analysis goes to the same engine, greedy, with its own token limit and no log-probs; the
    responses recorded are the engine's."""
    import envs.alfworld as alfworld
    from envs.pool import EnvPool
    from common.rollout import play_episodes, sample_seed

    eng = VLLMBackend("some/model", tokenizer, max_model_len=4096, want_logprobs=True)
    specs = [dict(uid=f"e{i}", name=f"r{i}", seed=4, delay=0.05 * i) for i in range(3)]
    with EnvPool("tests.fake_games:make_game", num_workers=2) as pool:
        eps, tm = play_episodes(alfworld, specs, pool, eng, tokenizer, max_steps=3, max_new_tokens=8,
                                temperature=1.0, analyzer=eng, analysis_prompt=lambda ep: [7, 7, 7],
                                analysis_max_new_tokens=64)
    core = eng.llm.llm_engine
    rollout = {rid: (p, sp) for rid, p, sp in core.added if not rid.endswith("/analysis")}
    analysis = [(rid, sp) for rid, _, sp in core.added if rid.endswith("/analysis")]
    assert len(rollout) == 9 and len(analysis) == 3 and eng.in_flight() == 0
    for i, ep in enumerate(eps):
        assert ep["length"] == 3 and ep["analysis"] is not None
        for t, s in enumerate(ep["steps"]):
            prompt, sp = rollout[f"{i}/{t}"]
            assert prompt["prompt_token_ids"] == s["prompt_ids"]
            assert sp.seed == sample_seed(4, f"e{i}", t) % 2 ** 31 and sp.max_tokens == 8 and sp.logprobs == 0
            assert s["response_ids"][:1] == [100 + [rid for rid, _, _ in core.added].index(f"{i}/{t}")]
            assert len(s["response_logprobs"]) == len(s["response_ids"])
    assert all((sp.temperature, sp.max_tokens, sp.logprobs) == (0.0, 64, None) for _, sp in analysis)
    # continuous batching: requests joined while others were running
    assert any(steps > 0 and running > 0 for steps, running in core.joins)
    assert tm["busy_gpu"] > 0 and tm["generate"] > 0


def test_a_sleep_whose_memory_check_another_process_fails_still_sleeps_and_wakes(fake_vllm, tokenizer, capsys):
    eng = VLLMBackend("some/model", tokenizer, max_model_len=4096)
    ex = eng.llm.llm_engine.model_executor
    eng.sleep(), eng.wake_up()  # the plain cycle
    assert ex.resident and not eng.sleeping and eng.sleep_check_failures == 0
    ex.check_error = "Memory usage increased after sleeping."  # vLLM's message (gpu_worker.py)
    eng.sleep()
    assert eng.sleeping and ex.is_sleeping and not ex.resident and eng.sleep_check_failures == 1
    assert "sleep check failed" in capsys.readouterr().err
    eng.wake_up(tags=["weights"])  # seed_rl.py's order: weights, sync, then the KV cache
    assert eng.sleeping and not ex.resident
    eng.wake_up(tags=["kv_cache"])
    assert ex.resident and not eng.sleeping  # without the fix the executor never woke: weights stayed off the GPU
    ex.check_error = "some other invariant"
    with pytest.raises(AssertionError, match="some other invariant"):
        eng.sleep()
