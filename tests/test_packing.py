"""Packed (padding-free) micro-batches against padded ones, on CPU with the tiny model and real Qwen2.5 token
ids: the same response log-probs and parameter gradients, no attention across the sequences of a pack, and
seed_rl.py's loss the same whatever the layout or the micro-batch split (common/training.py, seed_rl.py)."""
import types

import pytest
import torch
import torch.distributed as dist

from common.models import load_model
from common.packing import gather_response, make_batch, packed_attention, response_select
from common.training import _token_logprobs

CPU = torch.device("cpu")
RTOL = 1e-5  # fp32 on CPU: the layouts differ only in summation order


@pytest.fixture(scope="module")
def samples(tokenizer):
    """(ids, prompt_len, response_len) of five sequences with real token ids, chosen for the pack boundaries:
    a long prompt with a 1-token response, a short one, a long one next to them, the shortest possible
    (1 + 1 tokens, the shape of seed_rl.py's DUMMY), and a middling one."""
    text = ("You are in the middle of a room. Looking quickly around you, you see a cabinet 4, a cabinet 3, a "
            "cabinet 2, a cabinet 1, a countertop 1, a garbagecan 1, a handtowelholder 2, a handtowelholder 1, a "
            "sinkbasin 2, a sinkbasin 1, a toilet 1, a toiletpaperhanger 1, and a towelholder 1. Your task is to: "
            "put some spraybottle on toilet. <think>The spraybottle is likely in a cabinet.</think>"
            "<action>go to cabinet 1</action>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 120
    spans = [(60, 1), (3, 5), (90, 40), (1, 1), (7, 12)]
    out, off = [], 0
    for p, r in spans:
        seq = ids[off:off + p + r] if off + p + r <= len(ids) else ids[:p + r]
        out.append((seq, p, r))
        off += 7
    return out


def tiny(attn):
    model = load_model("tiny", seed=1, attn=attn)
    model.token_logprobs = types.MethodType(_token_logprobs, model)  # as shard_model attaches it
    return model


def logprobs_and_grads(model, seqs, packed, weights):
    """Response log-probs (one 1-D tensor per sequence) and the parameter gradients of sum(w * lp)."""
    model.zero_grad(set_to_none=True)
    batch = make_batch([s for s, _, _ in seqs], CPU, packed=packed)
    spans = [(p, r) for _, p, r in seqs]
    sel = response_select(batch, spans)
    lp = model.token_logprobs(batch["input_ids"], batch["targets"], sel, attention_mask=batch.get("attention_mask"),
                              position_ids=batch.get("position_ids"))
    per_seq = gather_response(lp, batch, spans)
    sum(sum(w * x) for w, x in zip(weights, per_seq)).backward()
    return [x.detach() for x in per_seq], {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close_grads(a, b, rtol=RTOL):
    for n in a:
        scale = max(a[n].abs().max().item(), 1e-12)
        assert (a[n] - b[n]).abs().max().item() <= rtol * scale, (n, (a[n] - b[n]).abs().max().item(), scale)


# ---------------------------------------------------------------------------------------------------
# Packed == padded: log-probs and gradients, for each attention that reads a packed row on CPU

@pytest.mark.parametrize("attn", ["seed_varlen", "sdpa"])  # ours (SDPA per sequence here); transformers' dense mask
@pytest.mark.parametrize("pack", [[0, 1, 2, 3, 4], [3, 2, 0], [2], [3]],
                         ids=["all-five", "shortest-first", "one-long", "one-1+1"])
def test_packed_equals_padded_logprobs_and_gradients(samples, attn, pack):
    seqs = [samples[i] for i in pack]
    torch.manual_seed(0)
    weights = [torch.randn(r) for _, _, r in seqs]
    padded_lp, padded_g = logprobs_and_grads(tiny("sdpa"), seqs, False, weights)
    packed_lp, packed_g = logprobs_and_grads(tiny(attn), seqs, True, weights)
    for a, b, (_, _, r) in zip(padded_lp, packed_lp, seqs):
        assert a.shape == b.shape == (r,)
        torch.testing.assert_close(b, a, rtol=RTOL, atol=0)
    assert_close_grads(padded_g, packed_g)


def test_packed_attention_choice_on_cpu():
    assert packed_attention(CPU, "auto") is None  # CPU keeps padded SDPA unless asked
    assert packed_attention(CPU, "off") is None
    assert packed_attention(CPU, "on") == "seed_varlen"
    assert packed_attention(CPU, "flex_attention") == "flex_attention"


# ---------------------------------------------------------------------------------------------------
# No attention across the sequences of a pack

@pytest.mark.parametrize("attn", ["seed_varlen", "sdpa"])
def test_packed_forward_does_not_attend_across_sequences(samples, attn, tokenizer):
    model = tiny(attn)
    a, b, c = samples[2], samples[1], samples[4]
    b2 = ([(t + 1000) % len(tokenizer) for t in b[0]], b[1], b[2])  # sequence B's tokens all changed

    @torch.no_grad()
    def lps(seqs, **kw):
        batch = make_batch([s for s, _, _ in seqs], CPU, packed=True)
        spans = [(p, r) for _, p, r in seqs]
        sel = response_select(batch, spans)
        pos = kw.get("position_ids", batch["position_ids"])
        return gather_response(model.token_logprobs(batch["input_ids"], batch["targets"], sel, position_ids=pos),
                               batch, spans)

    before, after = lps([a, b, c]), lps([a, b2, c])
    assert torch.equal(before[0], after[0])  # A, before B in the pack
    assert torch.equal(before[2], after[2])  # C, after B: attends to nothing of B
    assert not torch.allclose(before[1], after[1])  # B itself did change
    # the check has teeth: one causal sequence over the whole row (positions 0..N-1) would let C see B
    n = sum(len(s) for s, _, _ in (a, b, c))
    one_row = lps([a, b, c], position_ids=torch.arange(n)[None])
    assert not torch.allclose(one_row[2], before[2])


@torch.no_grad()
def test_flex_attention_packed_forward_matches_padded(samples):
    """transformers' FlexAttention (a document mask built from position_ids: the GPU path without flash-attn
    when PyTorch's varlen kernel is missing). Forward only: FlexAttention has no backward on CPU."""
    seqs = [samples[i] for i in (0, 1, 2, 3, 4)]
    spans = [(p, r) for _, p, r in seqs]
    out = {}
    for attn, packed in (("sdpa", False), ("flex_attention", True)):
        model = tiny(attn)
        batch = make_batch([s for s, _, _ in seqs], CPU, packed=packed)
        sel = response_select(batch, spans)
        lp = model.token_logprobs(batch["input_ids"], batch["targets"], sel, attention_mask=batch.get("attention_mask"),
                                  position_ids=batch.get("position_ids"))
        out[attn] = torch.cat(gather_response(lp, batch, spans))
    torch.testing.assert_close(out["flex_attention"], out["sdpa"], rtol=RTOL, atol=0)


# ---------------------------------------------------------------------------------------------------
# seed_rl.py's code path: micro-batch plan, log-probs, dense per-token tensors, the loss

@pytest.fixture(scope="module")
def group():
    """A process group of one (in-process store: no port, no environment variables) for agreed_max."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_micro_batch_plans(group, monkeypatch):
    import seed_rl
    items, lengths = list("abcdefg"), [50, 10, 300, 20, 40, 200, 30]
    # count mode: as before, sorted by length then split into nearly equal parts
    assert seed_rl.plan_micro_batches(items, lengths, CPU, micro_batch=3) == [["b", "d", "g"], ["e", "a"], ["f", "c"]]
    # token budget, packed: longest first, each micro-batch's summed length within the budget
    plan = seed_rl.plan_micro_batches(items, lengths, CPU, micro_batch=3, max_tokens=320, packed=True)
    assert plan == [["c"], ["f", "a", "e", "g"], ["d", "b"]]
    # padded: rows x the longest row within the budget
    plan = seed_rl.plan_micro_batches(items, lengths, CPU, micro_batch=3, max_tokens=320, packed=False)
    assert plan == [["c"], ["f"], ["a", "e", "g", "d", "b"]]
    # an item over the budget goes alone; every item appears once
    plan = seed_rl.plan_micro_batches(items, lengths, CPU, micro_batch=3, max_tokens=100, packed=True)
    assert sorted(x for g in plan for x in g) == sorted(items)
    assert all(len(g) == 1 or sum(lengths[items.index(x)] for x in g) <= 100 for g in plan)
    # another rank needs more micro-batches: this one runs empty ones (dummy forwards) to match
    monkeypatch.setattr(seed_rl, "agreed_max", lambda x, device: x + 2)
    plan = seed_rl.plan_micro_batches(items, lengths, CPU, micro_batch=3, max_tokens=320, packed=True)
    assert plan[-2:] == [[], []] and len(plan) == 5


def seed_rl_loss_and_grads(model, seqs, extras, packed, **plan):
    """Step 5 of seed_rl.py's update on one mini-batch of this rank: the summed loss and the gradients."""
    import seed_rl
    model.zero_grad(set_to_none=True)
    n_tok = sum(r for _, _, r in seqs)
    n_teach = sum(r * e["tmask"] for (_, _, r), e in zip(seqs, extras))
    total = 0.0
    items = list(zip(seqs, extras))
    for micro in seed_rl.plan_micro_batches(items, [len(s) for (s, _, _), _ in items], CPU, packed=packed, **plan):
        lp, batch, sel = seed_rl.micro_batch_logprobs(model, [s for s, _ in micro] or [seed_rl.DUMMY], CPU, packed)
        mask = sel.float() if micro else torch.zeros_like(sel, dtype=torch.float32)
        per_tok = lambda key: seed_rl.dense([e[key] for _, e in micro], sel) if micro else torch.zeros_like(mask)
        full = lambda key: seed_rl.dense([torch.full((r,), e[key]) for (_, _, r), e in micro], sel) if micro else mask
        loss = seed_rl.seed_loss(lp, per_tok("old"), per_tok("ref"), per_tok("teacher"), full("adv"), mask,
                                 full("tmask"), n_tok, n_teach)["loss"]
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_seed_rl_loss_and_gradients_same_packed_padded_and_any_split(samples, group):
    import seed_rl
    torch.manual_seed(0)
    seqs = list(samples)
    extras = [dict(old=-10 - torch.rand(r), ref=-10 - torch.rand(r), teacher=-10 - torch.rand(r),
                   adv=float(torch.randn(())), tmask=float(i % 2)) for i, (_, _, r) in enumerate(seqs)]
    ref_loss, ref_g = seed_rl_loss_and_grads(tiny("sdpa"), seqs, extras, False, micro_batch=len(seqs))
    model = tiny("seed_varlen")
    for packed, plan in ((True, dict(micro_batch=len(seqs))), (True, dict(micro_batch=2)),
                         (True, dict(micro_batch=2, max_tokens=150)), (False, dict(micro_batch=2)),
                         (False, dict(micro_batch=2, max_tokens=200))):
        loss, g = seed_rl_loss_and_grads(model, seqs, extras, packed, **plan)
        assert loss == pytest.approx(ref_loss, rel=RTOL), (packed, plan)
        assert_close_grads(ref_g, g)
    # scoring (no grad): packed and padded, by count and by tokens, give the same old log-probs
    padded = seed_rl.score(tiny("sdpa"), seqs, 2, CPU, False)
    for packed, max_tokens in ((True, 0), (True, 120)):
        got = seed_rl.score(model, seqs, 2, CPU, packed, max_tokens)
        for a, b in zip(padded, got):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=0)
