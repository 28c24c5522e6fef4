"""Activation checkpointing (common/training.py `shard_model`, seed_rl.py --checkpoint-policy/--checkpoint-every):
every variant gives the gradients of the run without checkpointing, and each recomputes what it says it does.
What backward recomputes is counted with a TorchDispatchMode: a recomputed layer runs its forward ops again
inside backward. Hand counts for the tiny Qwen2 (2 decoder layers, each 7 linear maps: q, k, v, o, gate, up,
down): no checkpointing runs no forward matmul in backward; full checkpointing re-runs 6 of each layer (not
down_proj: PyTorch's non-reentrant checkpoint stops recomputing once it holds every tensor backward needs, and
no backward needs down_proj's output); selective re-runs none but does re-run the SiLU; every 2nd layer re-runs
one layer's 6."""
import collections

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from common.models import load_model
from common.training import checkpoint_kwargs, shard_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def grads_and_backward_ops(group, **ckpt):
    model = shard_model(load_model("tiny", seed=0), CPU, **ckpt)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    with OpCount() as count:
        loss.backward()
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}, count.n


def test_every_checkpointing_variant_gives_the_same_gradients_and_recomputes_what_it_says(group):
    n_layers = load_model("tiny").config.num_hidden_layers
    assert n_layers == 2  # the hand counts below
    ref, none = grads_and_backward_ops(group)
    runs = {name: grads_and_backward_ops(group, activation_checkpointing=True, **kw) for name, kw in {
        "full": dict(checkpoint_policy="full"), "selective": dict(checkpoint_policy="selective"),
        "every2": dict(checkpoint_policy="full", checkpoint_every=2)}.items()}
    for name, (grads, _) in runs.items():
        for k in ref:
            torch.testing.assert_close(grads[k], ref[k], rtol=1e-5, atol=1e-7, msg=f"{name}: {k}")
    forward_mm = lambda ops: ops["mm"] + ops["addmm"] - none["mm"] - none["addmm"]  # matmuls re-run in backward
    assert runs["selective"][1]["_scaled_dot_product_flash_attention_for_cpu"] == 0  # attention kept too
    assert forward_mm(none) == 0
    assert forward_mm(runs["full"][1]) == 6 * n_layers  # q, k, v, o, gate, up of every layer
    assert forward_mm(runs["selective"][1]) == 0  # the matmul outputs were kept
    assert forward_mm(runs["every2"][1]) == 6  # the first layer only
    assert none["silu"] == 0 and runs["selective"][1]["silu"] == n_layers  # the elementwise work is re-run


def test_unknown_checkpoint_policy_is_refused():
    with pytest.raises(ValueError, match="expected full or selective"):
        checkpoint_kwargs("some")


def test_seed_rl_refuses_a_checkpoint_policy_without_checkpointing(tmp_path):
    from conftest import run_script
    res = run_script(["seed_rl.py", "--model", "tiny", "--no-activation-checkpointing", "--checkpoint-policy",
                      "selective", "--out", str(tmp_path)], check=False)
    assert res.returncode != 0 and "--no-activation-checkpointing recomputes none" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "seed_manifest.json").exists()
