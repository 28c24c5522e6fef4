"""seed_rl.py's algorithm: GRPO advantages and the loss terms, against hand-computed values and gradients;
the dual-context token alignment with the real tokenizer; a direction test of OPD on a tiny model."""
import math

import pytest
import torch

from seed_rl import grpo_advantages, seed_loss

SIG5 = 1 / (1 + math.exp(-5))  # sigmoid(beta * gap) for beta = 5, gap = 1


# ---------------------------------------------------------------------------------------------------
# GRPO advantages

def test_advantages_episode_mode_hand_computed():
    # group 0: returns 10, 0, 0, 10 -> mean 5, unbiased std sqrt(4 * 25 / 3) = 5.7735
    # group 1: 9.7, 9.9, 10.0 -> mean 9.8667, std sqrt((0.02778 + 0.00111 + 0.01778) / 2) = 0.15275
    adv = grpo_advantages([10, 0, 0, 10, 9.7, 9.9, 10.0], [0, 0, 0, 0, 1, 1, 1])
    s0 = math.sqrt(100 / 3)
    assert adv[:4] == pytest.approx([5 / s0, -5 / s0, -5 / s0, 5 / s0], rel=1e-6)
    m1 = (9.7 + 9.9 + 10.0) / 3
    s1 = math.sqrt(((9.7 - m1) ** 2 + (9.9 - m1) ** 2 + (10.0 - m1) ** 2) / 2)
    assert adv[4:] == pytest.approx([(9.7 - m1) / (s1 + 1e-6), (9.9 - m1) / (s1 + 1e-6), (10 - m1) / (s1 + 1e-6)], rel=1e-6)
    assert adv[4] == pytest.approx(-1.0911, abs=1e-4)


def test_advantages_mean_only_normalisation():
    # the public code's WebShop runs (SEED_MODE=mean_norm): A = R - mean, no std; group 0: R = 10, 0, 0, 2 (mean 3)
    adv = grpo_advantages([10.0, 0.0, 0.0, 2.0, 5.0], [0, 0, 0, 0, 1], std_norm=False)
    assert adv == pytest.approx([7.0, -3.0, -3.0, -1.0, 0.0])


def test_advantages_all_equal_and_singleton_groups_are_zero():
    # all equal (e.g. every rollout failed with the same penalty): exactly 0, not (R - mean) / 1e-6 noise
    adv = grpo_advantages([-0.3, -0.3, -0.3, 7.2, 10.0, 0.0], [0, 0, 0, 1, 2, 2])
    assert adv[:3] == [0.0, 0.0, 0.0]
    assert adv[3] == 0.0  # a group of one (its siblings were env failures) has no baseline
    assert adv[4] == pytest.approx(1 / math.sqrt(2) / (1 + 1e-7), rel=1e-6)  # std of (10, 0) = 7.0711
    assert adv[5] == pytest.approx(-adv[4])


def test_advantages_steps_mode_weights_by_length():
    # returns 10 (2 steps) and 0 (3 steps): flattened population 10, 10, 0, 0, 0 -> mean 4, std sqrt(30)
    adv = grpo_advantages([10, 0], [0, 0], lengths=[2, 3])
    assert adv == pytest.approx([6 / math.sqrt(30), -4 / math.sqrt(30)], rel=1e-6)
    # one episode with 5 steps is still a group of one: 0
    assert grpo_advantages([3.0], [0], lengths=[5]) == [0.0]


# ---------------------------------------------------------------------------------------------------
# The loss, term by term

def _loss(lp, old, ref, teacher, adv, mask=None, tmask=None, **kw):
    t = lambda x: torch.tensor(x, dtype=torch.float64)
    lp = t(lp).requires_grad_()
    mask = t(mask if mask is not None else [1.0] * len(lp))
    tmask = t(tmask if tmask is not None else [1.0] * len(lp))
    n, nt = float(mask.sum()), float((mask * tmask).sum())
    sums = seed_loss(lp, t(old), t(ref), t(teacher), t(adv), mask, tmask, n, nt, **kw)
    loss = sums.pop("loss")
    loss.backward()
    return loss.item(), lp.grad.tolist(), {k: float(v) for k, v in sums.items()}


def test_ppo_clip_both_sides():
    # ratios 1.5, 0.5, 1.5, 0.5 with A = +1, +1, -1, -1 (KL and OPD off)
    lr15, lr05 = math.log(1.5), math.log(0.5)
    loss, grad, sums = _loss([lr15, lr05, lr15, lr05], [0.0] * 4, [0.0] * 4, [0.0] * 4, [1, 1, -1, -1],
                             tmask=[0] * 4, kl_coef=0.0, opd_coef=0.0)
    # -min(r A, clip(r) A): A>0, r=1.5 -> -1.2 (clipped, no grad); A>0, r=0.5 -> -0.5 (grad -r A = -0.5)
    #                       A<0, r=1.5 -> 1.5 (grad -r A = 1.5);     A<0, r=0.5 -> 0.8 (clipped, no grad)
    assert loss == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert grad == pytest.approx([0.0, -0.5 / 4, 1.5 / 4, 0.0])
    assert sums["clipped"] == 4 and sums["pg"] == pytest.approx(-1.2 - 0.5 + 1.5 + 0.8)


def test_dual_clip_caps_negative_advantage_tokens():
    # verl's dual clip (c = 3; the public code's runs): for A < 0 the loss is min(PPO loss, -c A)
    # ratios 5, 5, 2, 0.5 with A = -1, +1, -1, -1
    lrs = [math.log(5.0), math.log(5.0), math.log(2.0), math.log(0.5)]
    loss, grad, _ = _loss(lrs, [0.0] * 4, [0.0] * 4, [0.0] * 4, [-1, 1, -1, -1], tmask=[0] * 4, kl_coef=0.0,
                          opd_coef=0.0, dual_clip=3.0)
    # A<0, r=5: PPO 5.0 -> capped at 3.0, no grad; A>0, r=5: -1.2 (clipped, no grad, untouched by the dual clip);
    # A<0, r=2: 2.0 < 3 (grad -r A = 2); A<0, r=0.5: 0.8 (clipped, no grad)
    assert loss == pytest.approx((3.0 - 1.2 + 2.0 + 0.8) / 4)
    assert grad == pytest.approx([0.0, 0.0, 2.0 / 4, 0.0])
    # without it (docs/paper.md's loss) the first token costs 5.0 and pushes its ratio down with gradient 5
    loss, grad, _ = _loss(lrs, [0.0] * 4, [0.0] * 4, [0.0] * 4, [-1, 1, -1, -1], tmask=[0] * 4, kl_coef=0.0,
                          opd_coef=0.0)
    assert loss == pytest.approx((5.0 - 1.2 + 2.0 + 0.8) / 4) and grad[0] == pytest.approx(5.0 / 4)


def test_k3_kl_value_gradient_and_clamps():
    # d = ref - lp: 0.5 -> e^0.5 - 1.5 = 0.148721; -0.5 -> e^-0.5 - 0.5 = 0.106531; 30 -> clamp(20) then
    # clamp(e^20 - 21, max 10) = 10 (no gradient through either clamp)
    lp, ref = [-1.0, -1.0, -31.0], [-0.5, -1.5, -1.0]
    loss, grad, sums = _loss(lp, lp, ref, lp, [0.0] * 3, tmask=[0] * 3, kl_coef=1.0, opd_coef=0.0)
    kl = [math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5, 10.0]
    assert loss == pytest.approx(sum(kl) / 3)
    # d kl / d lp = -(e^d - 1)
    assert grad == pytest.approx([-(math.exp(0.5) - 1) / 3, -(math.exp(-0.5) - 1) / 3, 0.0])
    assert sums["kl"] == pytest.approx(sum(kl))
    # the coefficient scales it
    loss01, _, _ = _loss(lp, lp, ref, lp, [0.0] * 3, tmask=[0] * 3, kl_coef=0.01, opd_coef=0.0)
    assert loss01 == pytest.approx(0.01 * sum(kl) / 3)


def test_gated_opd_value_gate_stats_and_gradient():
    # gaps teacher - lp: +1 (endorsed), -1 (rejected), +3 (no skill for that episode: teacher mask 0)
    lp, teacher = [-2.0, -2.0, -2.0], [-1.0, -3.0, 1.0]
    coef = 0.01
    loss, grad, sums = _loss(lp, lp, lp, teacher, [0.0] * 3, tmask=[1, 1, 0], kl_coef=0.0, opd_coef=coef)
    g1, g2 = SIG5, 1 - SIG5
    assert loss == pytest.approx(coef * (g1 * 1 + g2 * -1) / 2)  # token-mean over the 2 teacher tokens
    # the gradient on each token is -coef * gate * d lp / d lp / n_teacher_tokens: never of the other sign
    assert grad == pytest.approx([-coef * g1 / 2, -coef * g2 / 2, 0.0])
    assert sums["gate"] == pytest.approx(g1 + g2) and sums["gate_active"] == 1 and sums["gap"] == pytest.approx(0.0)
    assert sums["opd"] == pytest.approx(g1 - g2)


def test_masking_pad_and_prompt_tokens_carry_nothing():
    # positions 1 and 3 are prompt/pad: whatever values they hold changes neither loss nor gradient
    base = dict(old=[-1.0, 0.0, -1.2, 0.0], ref=[-0.8, 0.0, -1.0, 0.0], teacher=[-0.5, 0.0, -2.0, 0.0],
                adv=[0.7, 0.0, -0.4, 0.0])
    junk = dict(old=[-1.0, -9.0, -1.2, 5.0], ref=[-0.8, 4.0, -1.0, -7.0], teacher=[-0.5, 3.0, -2.0, -6.0],
                adv=[0.7, 100.0, -0.4, -50.0])
    a = _loss([-1.1, 0.0, -1.3, 0.0], **base, mask=[1, 0, 1, 0])
    b = _loss([-1.1, 2.5, -1.3, -4.0], **junk, mask=[1, 0, 1, 0])
    assert a[0] == pytest.approx(b[0]) and a[1] == pytest.approx(b[1])
    assert b[1][1] == 0.0 and b[1][3] == 0.0
    # and the token-mean divides by the response tokens only (2 here): same as the two tokens alone
    c = _loss([-1.1, -1.3], [-1.0, -1.2], [-0.8, -1.0], [-0.5, -2.0], [0.7, -0.4])
    assert a[0] == pytest.approx(c[0]) and [a[1][0], a[1][2]] == pytest.approx(c[1])


def test_total_loss_combines_terms_with_their_coefficients():
    args = ([-1.1, -0.9, -2.0], [-1.0, -1.0, -1.9], [-1.2, -0.8, -2.2], [-0.7, -1.5, -1.0], [0.5, 0.5, -1.0])
    tot = _loss(*args, tmask=[1, 0, 1])[0]
    pg = _loss(*args, tmask=[1, 0, 1], kl_coef=0.0, opd_coef=0.0)[0]
    kl = _loss(*args, tmask=[1, 0, 1], kl_coef=1.0, opd_coef=0.0)[0] - pg
    opd = _loss(*args, tmask=[1, 0, 1], kl_coef=0.0, opd_coef=1.0)[0] - pg
    assert tot == pytest.approx(pg + 0.01 * kl + 0.01 * opd)


def test_gradcheck_full_loss():
    torch.manual_seed(0)
    n = 7
    lp0 = -torch.rand(n, dtype=torch.float64) * 3
    old = lp0 + 0.05 * torch.randn(n, dtype=torch.float64)  # ratios near 1: away from the clip kinks
    ref, teacher = -torch.rand(n, dtype=torch.float64) * 3, -torch.rand(n, dtype=torch.float64) * 3
    adv, mask = torch.randn(n, dtype=torch.float64), torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.float64)
    tmask = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.float64)
    # PPO + KL: the analytic gradient equals the numerical one
    f = lambda x: seed_loss(x, old, ref, teacher, adv, mask, tmask, 5.0, 3.0, kl_coef=0.3, opd_coef=0.0)["loss"]
    assert torch.autograd.gradcheck(f, (lp0.clone().requires_grad_(),))
    # + OPD: the gate is a stop-gradient weight, so the gradient is that of the surrogate in which the
    # gate is frozen at the current log-probs: sum(g0 * (teacher - lp) * mt) / n_teacher
    g0 = torch.sigmoid(5.0 * (teacher - lp0))
    frozen = lambda x: f(x) + 0.5 * (g0 * (teacher - x) * mask * tmask).sum() / 3.0
    lp = lp0.clone().requires_grad_()
    seed_loss(lp, old, ref, teacher, adv, mask, tmask, 5.0, 3.0, kl_coef=0.3, opd_coef=0.5)["loss"].backward()
    x = lp0.clone().requires_grad_()
    frozen(x).backward()
    assert torch.allclose(lp.grad, x.grad, atol=1e-12)
    assert torch.autograd.gradcheck(frozen, (lp0.clone().requires_grad_(),))
    # and the value at lp0 is the same
    assert seed_loss(lp0, old, ref, teacher, adv, mask, tmask, 5.0, 3.0, kl_coef=0.3, opd_coef=0.5)["loss"].item() == \
        pytest.approx(frozen(lp0).item())


# ---------------------------------------------------------------------------------------------------
# Dual-context scoring: the same response tokens in both contexts, with the real tokenizer

def test_plain_and_skill_contexts_score_the_same_tokens(tokenizer, expert_trajectories):
    from common.records import read_jsonl
    from common.rollout import step_prompt
    from common.packing import make_batch, response_select
    from prompts import SKILL_TITLE, chat_prompt
    ep = read_jsonl(expert_trajectories)[0]
    skill = "First find the object, then take it to the target receptacle and put it there."
    seqs, spans = [], []
    for t in (0, 2):
        st = ep["steps"][t]
        text, plain_ids = chat_prompt(tokenizer, step_prompt(ep, t, st["history_used"]))
        assert plain_ids == st["prompt_ids"]  # the recorded prompt is rebuilt exactly
        t_text, teacher_ids = chat_prompt(tokenizer, step_prompt(ep, t, st["history_used"], skill))
        block = f"{SKILL_TITLE}\n{skill}\n"
        assert t_text.replace(block, "") == text  # the contexts differ by exactly the skill block
        if t > 0:  # right after the task line
            assert f"Your task is to: {ep['task']}\n{block}" in t_text
        resp = st["response_ids"]
        for ids in (plain_ids, teacher_ids):
            seqs.append(ids + resp)
            spans.append((len(ids), len(resp)))
    for packed in (False, True):
        b = make_batch(seqs, torch.device("cpu"), packed=packed)
        sel = response_select(b, spans)
        rows = sel.sum(-1) if not packed else None
        chosen = b["targets"][sel].tolist()  # the tokens each selected position predicts
        want = [tok for seq, (p, r) in zip(seqs, spans) for tok in seq[p:p + r]]
        assert chosen == want
        if rows is not None:
            assert rows.tolist() == [r for _, r in spans]
    # and the decoded response is the recorded text, in both contexts
    assert tokenizer.decode(seqs[1][spans[1][0]:], skip_special_tokens=True) == ep["steps"][0]["response"]


# ---------------------------------------------------------------------------------------------------
# Direction: GRPO off, a teacher context that favours a known action -> OPD raises that action's
# log-prob under the plain prompt and shrinks the gap.

def test_opd_moves_plain_policy_toward_skill_context(tokenizer):
    from common.models import load_model
    from prompts import chat_prompt, skill_block
    torch.manual_seed(0)
    model = load_model("tiny", seed=3)
    # short prompts (a 2-layer random model learns a context dependence quickly on them); the skill
    # prompt is the plain one with the real skill block inserted after the task line
    task = "Your task is to: put a pen on the shelf.\n"
    plain = chat_prompt(tokenizer, task + "Choose one action.")[1]
    skill = chat_prompt(tokenizer, task + skill_block("Go to the shelf first.") + "Choose one action.")[1]
    a = tokenizer("<action>go to shelf 1</action>", add_special_tokens=False)["input_ids"]
    b = tokenizer("<action>go to desk 1</action>", add_special_tokens=False)["input_ids"]

    def lp(prompt, resp):  # per-token log-probs of resp after prompt, [R]
        ids = torch.tensor([prompt + resp])
        # the LM head on the positions that predict resp only (logits_to_keep: the same rows, not [len, 152k] of them)
        logits = model(ids, logits_to_keep=len(resp) + 1).logits[0, :-1].float().log_softmax(-1)
        return logits.gather(-1, torch.tensor(resp)[:, None])[:, 0]

    # a controlled teacher context: the skill context is taught action A, the plain context action B
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        loss = -(lp(skill, a).mean() + lp(plain, b).mean())
        opt.zero_grad(), loss.backward(), opt.step()
    with torch.no_grad():
        plain0, gap0 = lp(plain, a).sum().item(), (lp(skill, a) - lp(plain, a)).sum().item()
    assert gap0 > 2.0, gap0  # the teacher context prefers A by a wide margin

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ones = torch.ones(len(a))
    for _ in range(15):  # each "update" scores teacher and old log-probs with the pre-update weights
        with torch.no_grad():
            teacher, old = lp(skill, a), lp(plain, a)
        cur = lp(plain, a)
        loss = seed_loss(cur, old, old, teacher, 0 * ones, ones, ones, len(a), len(a),
                         kl_coef=0.0, opd_coef=1.0)["loss"]  # GRPO off: advantages 0; no KL
        opt.zero_grad(), loss.backward(), opt.step()
    with torch.no_grad():
        plain1, gap1 = lp(plain, a).sum().item(), (lp(skill, a) - lp(plain, a)).sum().item()
    assert plain1 > plain0 + 1.0, (plain0, plain1)  # A became more likely under the plain prompt
    assert gap1 < gap0 - 1.0, (gap0, gap1)  # and the plain policy moved toward the skill-aware one


# ---------------------------------------------------------------------------------------------------
# Log-probs of given tokens through the chunked LM head (common/training.py): same values and gradients as
# the full-logits computation, without a [tokens, vocab] block

def test_chunked_token_logprob_gradcheck():
    from common.training import _TokenLogprob
    torch.manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    tgt = torch.tensor([0, 3, 10, 3, 5, 1, 7])
    lp = _TokenLogprob.apply(h, w, tgt, 3)  # chunks of 3, 3, 1 rows
    want = (h @ w.t()).log_softmax(-1).gather(-1, tgt[:, None])[:, 0]
    assert torch.allclose(lp, want, atol=1e-12)
    assert torch.autograd.gradcheck(lambda h, w: _TokenLogprob.apply(h, w, tgt, 3), (h, w))


def test_chunked_token_logprob_bf16_gradients_of_confident_tokens():
    """In bf16 (the GPU compute dtype) the gradients stay within bf16 rounding of the exact ones for the same
    bf16 logits, also for the rows of tokens the model is sure of (0.99 < p < 0.9999, where p rounds to 1.0
    in bf16: 1 - p must come from the fp32 log-prob, or those rows' gradients are wrong by over 100%)."""
    from common.training import _TokenLogprob
    torch.manual_seed(0)
    n, d, v = 64, 16, 64
    w = torch.randn(v, d).bfloat16()
    tgt = torch.randint(0, v, (n,))
    h = (torch.randn(n, d) + 1.5 * w[tgt].float()).bfloat16()  # logit of the target ~ 1.5 |w|^2: p ~ 0.99+
    g = torch.randn(n)
    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp = _TokenLogprob.apply(hb, wb, tgt, 24)  # chunks of 24, 24, 16 rows
    (lp * g).sum().backward()
    # exact gradient (fp64) of the bf16 logits the kernel computes: G = g (onehot - softmax), then G @ W, G^T @ h
    logits = (h @ w.t()).double()
    lp64 = logits.log_softmax(-1).gather(-1, tgt[:, None])[:, 0]
    G = g.double()[:, None] * (torch.nn.functional.one_hot(tgt, v).double() - logits.softmax(-1))
    grad_h, grad_w = G @ w.double(), G.t() @ h.double()
    assert (lp.double() - lp64).abs().max() < 1e-5
    confident = (lp64.exp() > 0.99) & (lp64.exp() < 0.9999)
    assert confident.sum() >= 8, lp64.exp()  # the case this test is about
    row_err = (hb.grad.double() - grad_h).norm(dim=-1) / grad_h.norm(dim=-1)
    assert row_err[confident].max() < 0.02, row_err[confident]  # 0.005 here; 1.4 if 1 - p came from bf16
    for got, want in ((hb.grad, grad_h), (wb.grad, grad_w)):
        assert (got.double() - want).norm() / want.norm() < 0.01


def test_token_logprobs_match_full_logits_values_and_parameter_grads():
    from common.models import load_model
    from common.packing import make_batch, response_select
    from common.training import _token_logprobs
    model = load_model("tiny", seed=1)
    seqs = [[5, 17, 99, 3, 42, 8, 8, 1000], [7, 7, 300, 12, 4]]
    spans = [(3, 4), (2, 2)]
    batch = make_batch(seqs, torch.device("cpu"))
    sel = response_select(batch, spans)
    weights = torch.randn(sel.shape)  # an arbitrary loss over the selected log-probs

    lp = _token_logprobs(model, batch["input_ids"], batch["targets"], sel, attention_mask=batch["attention_mask"],
                         chunk_size=2)  # 6 selected tokens -> 3 chunks
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    full = logits.log_softmax(-1).gather(-1, batch["targets"][..., None])[..., 0] * sel
    (full * weights).sum().backward()
    assert torch.allclose(lp, full, atol=1e-5) and bool((lp[~sel] == 0).all())
    for n, p in model.named_parameters():
        assert (grads[n] - p.grad).abs().max() <= 1e-4 * p.grad.abs().max(), n  # fp32 summation-order noise
