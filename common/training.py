"""Trainer-side plumbing shared by sft.py and seed_rl.py: process groups, FSDP2 sharding, and the memory-lean
log-prob of given tokens. Micro-batch layouts and the attention for packed rows: common/packing.py; checkpoints:
common/checkpoints.py.

The algorithm lives in the scripts; this file only holds what both trainers would otherwise write twice.
"""
import datetime
import functools
import os
import socket
import types

import torch
import torch.distributed as dist

from common.models import clean_param_name
from common.packing import packed_kwargs


# ----------------------------------------------------------------------------------------------------
# Process group

def init_distributed():
    """torchrun or plain python (world size 1). NCCL on GPU, gloo on CPU. Returns (rank, world, device)."""
    if "RANK" not in os.environ:  # plain `python script.py`: a process group of one, so FSDP code is the same
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local)  # one GPU per local rank; on 2 nodes local != global rank
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=60))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=60))
    return rank, world, device


def print0(*a, **k):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, **k, flush=True)


# ----------------------------------------------------------------------------------------------------
# FSDP2

# The ops whose outputs selective checkpointing keeps: the matmuls and the attention kernels, i.e. the FLOPs.
# Everything else in a decoder layer (RMSNorm, rotary, SiLU * up, residual adds, casts) is recomputed in backward:
# cheap elementwise work that on an H200 costs a fraction of the layer's time but most of its saved tensors.
_SAVED_OPS = {getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward") if hasattr(torch.ops.aten, name)}


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(policy):
    """torch.utils.checkpoint's arguments for a decoder layer. "full": keep only the layer's input, recompute the
    whole layer in backward (~1/3 more compute). "selective": also keep the matmul and attention outputs
    (torch's selective activation checkpointing), recompute only the elementwise ops between them."""
    if policy == "full":
        return {"use_reentrant": False}
    if policy == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        return {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                                        _keep_matmuls)}
    raise ValueError(f"checkpoint policy {policy!r}: expected full or selective")


def shard_model(model, device, *, train=True, activation_checkpointing=False, checkpoint_policy="full",
                checkpoint_every=1, fused="off"):
    """fully_shard every decoder layer, then the root. Parameters stay fp32 (the master weights); on GPU
    compute runs in bf16 (params all-gathered in bf16, gradients reduced in fp32). On CPU all is fp32.
    activation_checkpointing: recompute decoder layers in backward, by `checkpoint_policy` (checkpoint_kwargs),
    every `checkpoint_every`-th layer only (2 = half of them: memory the step does not need buys back speed).
    fused: the decoder layers' kernels (`fuse_layers`): off, liger or compile."""
    # imported here, not at the top: FSDP2 and DTensor are ~1 s of imports that a refused run does not need
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    check_fused(fused, device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(checkpoint_policy),
                                            every_n_layers=checkpoint_every)
    fuse_layers(model, fused)  # after the checkpointing (compile moves it inside), before fully_shard
    model.config.use_cache = False
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # A second forward entry point that FSDP hooks like `forward`: it returns log-probs of given tokens
    # without ever building the full [tokens, vocab] logits (see `_token_logprobs`).
    model.token_logprobs = types.MethodType(_token_logprobs, model)
    register_fsdp_forward_method(model, "token_logprobs")
    if not train:
        model.requires_grad_(False)
    return model


# ----------------------------------------------------------------------------------------------------
# Fused kernels (--fused): a GPU profile of the step spent 34% of its kernel time in unfused elementwise and
# norm kernels (RMSNorm, rotary, SiLU * up, residual adds, casts). Both modes change kernels, not the math.

FUSED = ("off", "liger", "compile")


def add_fused_arg(parser):
    """--fused: seed_rl.py and sft.py."""
    parser.add_argument("--fused", default="off", choices=list(FUSED),
                        help="fused kernels in the decoder layers (common/training.py fuse_layers): off; liger = "
                             "liger-kernel's Triton RMSNorm, SwiGLU and rotary (GPU, requirements-gpu.txt); compile = "
                             "torch.compile of each layer. Kernels, not the math: a resumed run may change it")


def check_fused(mode, device):
    """Refuse, in one line and before any model loads, a --fused mode that cannot run here."""
    if mode not in FUSED:
        raise ValueError(f"fused {mode!r}: expected one of {', '.join(FUSED)}")
    if mode != "liger":
        return
    if device.type != "cuda":
        raise SystemExit("--fused liger: liger-kernel's kernels are Triton kernels, GPU only; here use --fused off "
                         "or --fused compile")
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--fused liger needs liger-kernel (pip install -r requirements-gpu.txt): {e}") from None


def fuse_layers(model, mode):
    """Fused kernels for the decoder layers of a Qwen2 model, before fully_shard. "off": none (runs everywhere).

    "liger": liger-kernel's Triton RMSNorm, SwiGLU and rotary for this model instance. Not its fused linear
    cross-entropy: the trainer needs the log-prob of given tokens (`_TokenLogprob`), not a loss. Its rotary is
    process-wide (it replaces the function in transformers' modeling_qwen2): every Qwen2 built later runs it too.
    "compile": torch.compile of each decoder layer's forward (`_compile_layer`): Inductor fuses the elementwise
    ops between the matmuls. The module's __call__, and with it FSDP2's all-gather hooks, stays outside the
    compiled region."""
    if mode == "liger":
        if model.config.model_type != "qwen2":
            raise SystemExit(f"--fused liger: wired for Qwen2 models only, not {model.config.model_type!r}")
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2
        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=model)
    elif mode == "compile":
        for layer in model.model.layers:
            _compile_layer(layer)
    return model


def _compile_layer(layer):
    """layer.forward := torch.compile of it, with the layer's activation checkpoint (if any) moved inside.

    HF checkpoints a layer around its __call__. Around a compiled forward that failed here (torch 2.13, CPU):
    once a layer without checkpointing had compiled (--checkpoint-every 2), backward's recompute of a
    checkpointed one saved other tensors than its forward had (CheckpointError; pytorch#166926). Inside the
    compiled function, torch.utils.checkpoint (selective policy included) is traced and partitioned by the
    compiler itself (torchtitan's order: checkpoint, then compile, then shard). So the layer's HF flag goes off
    and the same checkpoint function runs inside; call gradient_checkpointing_enable before this, not after.
    dynamic=True: every micro-batch has another length (a packed row another total and max_length_q), so the
    shapes are symbolic from the first compile, rather than a graph for the first length and a recompile at
    the second; all layers share one graph (same code, parameters are inputs)."""
    forward = layer.forward
    ckpt = layer._gradient_checkpointing_func if getattr(layer, "gradient_checkpointing", False) else None
    layer.gradient_checkpointing = False

    def run(*args, **kwargs):
        if ckpt is not None and layer.training:  # as HF: checkpoint in training mode only
            return ckpt(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    layer.forward = torch.compile(run, dynamic=True)


def adamw_impl(device):
    """AdamW's implementation: on GPU the fused kernel (one launch for all parameters; DTensor supports it),
    which saves the per-step dispatch of the foreach path over FSDP2's DTensors. On CPU, PyTorch's default."""
    return {"fused": True} if device.type == "cuda" else {}


class _TokenLogprob(torch.autograd.Function):
    """lp[i] = log_softmax(h[i] @ W^T)[tgt[i]] for N rows, one chunk of rows at a time.

    No [N, V] block ever exists, and none of [chunk, V] is kept for backward: forward saves only h, W, tgt
    and lp; backward recomputes one chunk's logits at a time and applies the closed-form gradient
        d lp_i / d logits_i = g_i * (onehot(tgt_i) - softmax(logits_i))  =: G_i    [C, V]
        grad_h[chunk] = G @ W        grad_W += G^T @ h[chunk]   (accumulated in place, no per-chunk copies)
    Logits are in the compute dtype (bf16 on GPU, like vLLM's); the log-softmax of the forward in fp32 (or
    fp64 when h is fp64, for gradcheck). G is built in the compute dtype (see backward).
    """

    @staticmethod
    def forward(ctx, h, w, tgt, chunk):
        acc = torch.promote_types(h.dtype, torch.float32)
        lp = torch.empty(h.shape[0], dtype=acc, device=h.device)  # [N]
        for s in range(0, h.shape[0], chunk):
            logits = h[s:s + chunk] @ w.t()  # [C, V]
            lp[s:s + chunk] = torch.log_softmax(logits, -1, dtype=acc).gather(-1, tgt[s:s + chunk, None])[:, 0]
        ctx.save_for_backward(h, w, tgt, lp)
        ctx.chunk = chunk
        return lp

    @staticmethod
    def backward(ctx, g):  # g: [N], the loss's gradient w.r.t. each log-prob
        h, w, tgt, lp = ctx.saved_tensors
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        for s in range(0, h.shape[0], ctx.chunk):
            hc, gc, tc = h[s:s + ctx.chunk], g[s:s + ctx.chunk], tgt[s:s + ctx.chunk]
            # G in the compute dtype, as the matmuls below read it: bf16 on GPU, where an fp32 [C, V] block
            # would double the bytes of the softmax and the scaling, and need a cast for the matmuls. The
            # softmax kernel accumulates in fp32 and the scaling runs in fp32; each rounds once to bf16.
            G = torch.softmax(hc @ w.t(), -1)  # [C, V]
            G.mul_(-gc[:, None])  # -g_i p_ij
            # the target column from the forward's fp32 log-prob: g_i (1 - p_i,tgt). Not p rounded to bf16 and
            # subtracted from 1, which loses the gradient of confident tokens (p = 0.999 is 1.0 in bf16)
            G[torch.arange(len(hc), device=h.device), tc] = (gc * -torch.expm1(lp[s:s + ctx.chunk])).to(G.dtype)
            if grad_h is not None:
                torch.mm(G, w, out=grad_h[s:s + ctx.chunk])  # [C, H]
            if grad_w is not None:
                grad_w.addmm_(G.t(), hc)  # [V, H]
        return grad_h, grad_w, None, None


def _token_logprobs(self, input_ids, targets, select, attention_mask=None, position_ids=None, chunk_size=1024):
    """log p(targets[b, t] | input_ids[b, :t+1]) at the positions where `select` is True, 0 elsewhere.

    input_ids, targets, select: [B, T] (targets = input_ids shifted left by one). Only selected positions
    go through the LM head, in chunks of `chunk_size` tokens (`_TokenLogprob`), so at most one
    [chunk, vocab] fp32 block is alive at a time instead of [B*T, vocab] (8 x 1,536 tokens x 151,936 x
    4 bytes = 7.5 GB), in forward and in backward.
    A packed row (position_ids restarting at 0 per sequence, see `make_batch`): its sequence boundaries are
    computed here once per forward, not once per layer by the attention (`packed_kwargs`).
    """
    # use_cache=False explicitly: save_hf_checkpoint sets config.use_cache=True (for inference), which would
    # otherwise make every later training forward build a KV cache
    kw = packed_kwargs(position_ids) if position_ids is not None and attention_mask is None else {}
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False, **kw).last_hidden_state  # [B, T, H]
    idx = select.reshape(-1).nonzero()[:, 0]  # [N] selected flat positions
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)  # [N, H]
    tgt = targets.reshape(-1).index_select(0, idx)  # [N]
    lp = _TokenLogprob.apply(h, self.lm_head.weight, tgt, chunk_size)  # [N] fp32
    # out-of-place scatter back to [B, T] (an FSDP output must not be a view: see FSDP2's pre-backward hook)
    return torch.zeros(input_ids.shape, dtype=torch.float32, device=lp.device).masked_scatter(select, lp)


def full_params(model, dtype=None):
    """Yield (HF name, full tensor) per parameter, in the same order on every rank (each is an all-gather
    collective). Never holds more than one full parameter at a time. dtype: cast the shard before the
    gather (bf16 halves the traffic of a weight sync)."""
    from torch.distributed.tensor import DTensor
    for name, p in model.named_parameters():
        p = p.detach() if dtype is None else p.detach().to(dtype)
        yield clean_param_name(name), p.full_tensor() if isinstance(p, DTensor) else p
