"""Fused kernels (common/training.py `fuse_layers`, --fused): the compile path gives the log-probs and gradients of
the unfused one (fp32 on CPU: equal up to float rounding, as Inductor reorders the same arithmetic), with and
without activation checkpointing, padded and packed, at two lengths on one graph; its checkpoint, moved inside the
compiled function, still drops what it should. liger (GPU only) is refused on CPU in one line, and --fused parses
in both trainers."""
import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import REPO, run_script
from common.models import load_model
from common.records import check_resume
from common.packing import make_batch, response_select
from common.training import check_fused, shard_model
from test_packing import group  # noqa: F401  (a process group of one)

CPU = torch.device("cpu")
CKPT = {"none": {}, "full": dict(activation_checkpointing=True),
        "selective": dict(activation_checkpointing=True, checkpoint_policy="selective"),
        "every2": dict(activation_checkpointing=True, checkpoint_every=2)}


def model(fused, packed=False, **ckpt):
    m = shard_model(load_model("tiny", seed=0, attn="seed_varlen" if packed else None), CPU, fused=fused, **ckpt)
    m.train()
    return m


def batch(n, packed):
    """Two sequences of n and n // 2 + 3 tokens; the last 5 of each are the response."""
    g = torch.Generator().manual_seed(n)
    seqs = [torch.randint(0, 1000, (k,), generator=g).tolist() for k in (n, n // 2 + 3)]
    b = make_batch(seqs, CPU, packed=packed)
    return b, response_select(b, [(len(s) - 5, 5) for s in seqs])


def logprobs_and_grads(m, n, packed=False, saved=None, score=False):
    """Token log-probs (with grad), their gradients, and (score) the log-probs again under no_grad."""
    b, sel = batch(n, packed)
    kw = dict(attention_mask=b.get("attention_mask"), position_ids=b.get("position_ids"))
    with torch.autograd.graph.saved_tensors_hooks(*saved) if saved else contextlib.nullcontext():
        lp = m.token_logprobs(b["input_ids"], b["targets"], sel, **kw)
    (lp * torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)).sum().backward()
    grads = {k: p.grad.full_tensor().clone() for k, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    if score:
        with torch.no_grad():
            grads["no_grad log-probs"] = m.token_logprobs(b["input_ids"], b["targets"], sel, **kw)
    return lp.detach(), grads


def assert_same(ref, got, what):
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5, msg=f"{what}: log-probs")
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], rtol=1e-4, atol=1e-5, msg=f"{what}: {k}")


@pytest.fixture
def aot_eager(monkeypatch):
    """torch.compile without Inductor's code generation (minutes of C++ compiles on 2 CPU cores): the same
    capture, dynamic shapes, AOT autograd and checkpoint partitioning, run by eager kernels. The Inductor
    backend itself: test_inductor below (slow)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


@pytest.mark.parametrize("ckpt", list(CKPT))
def test_compile_gives_the_unfused_logprobs_and_gradients(group, aot_eager, ckpt):
    ref, fused = model("off", **CKPT[ckpt]), model("compile", **CKPT[ckpt])
    assert all(not layer.gradient_checkpointing for layer in fused.model.layers)  # moved inside the compile
    assert_same(logprobs_and_grads(ref, 24), logprobs_and_grads(fused, 24), ckpt)


def test_compile_at_another_length_and_without_grad(group, aot_eager):
    """Every 2nd layer checkpointed: both branches of the compiled function. A second length runs on the same
    graphs (dynamic shapes), and scoring under no_grad agrees too."""
    ref, fused = model("off", **CKPT["every2"]), model("compile", **CKPT["every2"])
    assert_same(logprobs_and_grads(ref, 24, score=True), logprobs_and_grads(fused, 24, score=True), "24 tokens")
    graphs = counters["stats"]["unique_graphs"]
    assert_same(logprobs_and_grads(ref, 31, score=True), logprobs_and_grads(fused, 31, score=True), "31 tokens")
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile for the new length


def test_compile_on_packed_rows(group, aot_eager):
    """seed_varlen on CPU: SDPA per sequence, a graph break at its host-side boundaries (.tolist()). Without
    checkpointing the layer compiles around the break; inside a checkpoint a break makes the whole layer run
    eagerly (so CPU packed + checkpointing is correct but unfused; on GPU the varlen kernel has no break)."""
    ref, fused = model("off", packed=True), model("compile", packed=True)
    graphs = counters["stats"]["unique_graphs"]
    assert_same(logprobs_and_grads(ref, 24, packed=True), logprobs_and_grads(fused, 24, packed=True), "packed")
    assert counters["stats"]["unique_graphs"] > graphs  # the packed layer did compile (around the break)


def saved_bytes(m):
    """Bytes of the tensors autograd keeps for backward of one forward (parameters counted too: the same in each)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    logprobs_and_grads(m, 48, saved=(pack, lambda t: t))
    return total[0]


def test_compiled_checkpointing_still_drops_activations(group, aot_eager):
    """The checkpoint runs inside the compiled function: it must still keep less than no checkpointing, and
    selective (matmul and attention outputs kept) more than full."""
    none, sel, full = (saved_bytes(model("compile", **CKPT[c])) for c in ("none", "selective", "full"))
    assert full < sel < none, (full, sel, none)


@pytest.mark.slow
def test_inductor(group):
    """The default backend, as on GPU (there: Triton kernels; here: C++), with the trainers' default full
    checkpointing (selective is checked above with aot_eager: one Inductor compile here is ~40-80 s on 2 cores)."""
    ref, fused = model("off", **CKPT["full"]), model("compile", **CKPT["full"])
    assert_same(logprobs_and_grads(ref, 24), logprobs_and_grads(fused, 24), "inductor, full")


def test_liger_is_refused_on_cpu_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--fused liger: .*GPU only"):
        check_fused("liger", CPU)
    res = run_script(["sft.py", "--model", "tiny", "--bc-data", "x.jsonl", "--fused", "liger", "--out",
                      str(tmp_path)], check=False)
    assert res.returncode != 0 and "--fused liger: liger-kernel's kernels are Triton" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_fused_flag_in_both_trainers():
    env = dict(os.environ, PYTHONPATH=REPO, COLUMNS="200", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, s, "--help"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
             for s in ("seed_rl.py", "sft.py")]
    for proc in procs:
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0 and "--fused {off,liger,compile}" in out and "(default: off)" in out


@pytest.mark.parametrize("script", ["seed_rl.py", "sft.py"])
def test_a_resumed_run_may_change_fused(tmp_path, script):
    """--fused changes kernels, not the math: check_resume lets it change (and still refuses, e.g., --lr)."""
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"args": {"fused": "off", "lr": 1e-6}}))
    assert check_resume(str(path), argparse.Namespace(fused="compile", lr=1e-6), script=script, out="o")
    with pytest.raises(SystemExit, match="--lr"):
        check_resume(str(path), argparse.Namespace(fused="compile", lr=2e-6), script=script, out="o")
