"""envs/backends.py: what the generation backends ask their engines for, and what they hand back.

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

from envs.backends import HFBackend, VLLMBackend

from envs.models import load_model


class FakeLLM:
    def __init__(self, **kw):
        self.kw, self.calls = kw, []

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            toks = [100 + i, 200 + i] + ([151645] if i % 2 else [])  # odd requests stop with <|im_end|>
            lps = [{t: SimpleNamespace(logprob=-0.5 * (k + 1) - i)} for k, t in enumerate(toks)] \
                if sp.logprobs is not None else None
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(
                token_ids=toks, text="" if sp.detokenize is False else f"out{i}", finish_reason="stop" if i % 2 else "length", logprobs=lps)]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
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
    prompts, sps = eng.llm.calls[-1]
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 2, 3], [4, 5]]
    assert [sp.seed for sp in sps] == [11, 5]  # per request, folded into vLLM's int32 range
    for sp in sps:  # nothing left to model defaults (generation_config.json may set top_p/top_k/penalty)
        assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (1.0, 1.0, 0, 1.0, 7)
        assert sp.logprobs is None  # not asked for: they cost generation speed
    assert [g.token_ids for g in gens] == [[100, 200], [101, 201, 151645]]  # the stop token kept for the trainer
    assert all(sp.detokenize is False for sp in sps)  # the backend decodes the finished responses itself
    assert [g.text for g in gens] == [tokenizer.decode([100, 200]), tokenizer.decode([101, 201])]
    assert [g.finish_reason for g in gens] == ["length", "stop"]
    assert all(g.logprobs is None for g in gens)

    eng.generate([[1]], max_new_tokens=4, temperature=0.0)  # greedy, unseeded
    assert eng.llm.calls[-1][1][0].seed is None and eng.llm.calls[-1][1][0].temperature == 0.0


def test_a_users_model_runner_choice_wins(fake_vllm, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    VLLMBackend("some/model", tokenizer, max_model_len=1024)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_sampled_token_logprobs_when_asked(fake_vllm, tokenizer):
    eng = VLLMBackend("some/model", tokenizer, max_model_len=1024, want_logprobs=True)
    gens = eng.generate([[1, 2], [3]], max_new_tokens=2, temperature=1.0, seeds=[0, 1])
    assert all(sp.logprobs == 0 for sp in eng.llm.calls[-1][1])  # the sampled token's own log-prob only
    assert gens[0].logprobs == [-0.5, -1.0] and gens[1].logprobs == [-1.5, -2.0, -2.5]
    gens = eng.generate([[1]], max_new_tokens=2, temperature=1.0, want_logprobs=False)  # this call declines
    assert eng.llm.calls[-1][1][0].logprobs is None and gens[0].logprobs is None


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
