"""Trainer-side plumbing shared by sft.py and seed_rl.py: process groups, FSDP2 sharding, the memory-lean
log-prob of given tokens, packed/padded micro-batches and the attention for packed ones, Hugging Face checkpoints
of a sharded model, and trainer checkpoint folders that a kill at any instant cannot lose.

The algorithm lives in the scripts; this file only holds what both trainers would otherwise write twice.
"""
import datetime
import functools
import inspect
import json
import os
import shutil
import signal
import socket
import types

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from envs.models import attn_implementation, clean_param_name


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

def shard_model(model, device, *, train=True, activation_checkpointing=False):
    """fully_shard every decoder layer, then the root. Parameters stay fp32 (the master weights); on GPU
    compute runs in bf16 (params all-gathered in bf16, gradients reduced in fp32). On CPU all is fp32."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
    for name, p in model.named_parameters():
        p = p.detach() if dtype is None else p.detach().to(dtype)
        yield clean_param_name(name), p.full_tensor() if isinstance(p, DTensor) else p


# ----------------------------------------------------------------------------------------------------
# Micro-batches: padded (SDPA) or packed padding-free (one row, a causal block per sequence)

def make_batch(seqs, device, packed=False, pad_id=0):
    """seqs: lists of token ids. Returns dict(input_ids, targets, attention_mask|position_ids, starts).

    padded: [B, T] right-padded, attention_mask [B, T].
    packed: [1, sum(len)] with position_ids restarting at 0 per sequence: the sequence boundaries. The model
            must run an attention that reads them (`packed_attention`): then no padding is computed at all.
    starts[i]: (row, column) of sequence i's first token. targets[b, t] = input_ids[b, t + 1] (the last
    position's target is a dummy; callers select only response positions).

        seqs [[5, 6, 7], [8, 9]]  padded: input_ids [[5, 6, 7], [8, 9, 0]]  attention_mask [[1, 1, 1], [1, 1, 0]]
                                  packed: input_ids [[5, 6, 7, 8, 9]]       position_ids [[0, 1, 2, 0, 1]]
    """
    if packed:
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None]
        pos = torch.tensor([i for s in seqs for i in range(len(s))], dtype=torch.long)[None]
        starts, off = [], 0
        for s in seqs:
            starts.append((0, off))
            off += len(s)
        batch = dict(input_ids=ids, position_ids=pos)
    else:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        starts = [(i, 0) for i in range(len(seqs))]
        # no padding at all: no mask, so SDPA can take its fused causal kernel instead of a masked one
        batch = dict(input_ids=ids) if bool(mask.all()) else dict(input_ids=ids, attention_mask=mask)
    batch["targets"] = torch.roll(batch["input_ids"], -1, dims=1)
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["starts"] = starts
    return batch


def response_select(batch, spans):
    """spans[i] = (prompt_len, response_len) of sequence i. Returns a bool [rows, T] selecting the positions
    whose *target* is a response token (position prompt_len-1+j predicts response token j)."""
    sel = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    for (row, col), (p_len, r_len) in zip(batch["starts"], spans):
        sel[row, col + p_len - 1: col + p_len - 1 + r_len] = True
    return sel


def gather_response(values, batch, spans):
    """Per-sequence response values from a [rows, T] tensor: list of 1-D tensors of length r_len."""
    return [values[row, col + p - 1: col + p - 1 + r] for (row, col), (p, r) in zip(batch["starts"], spans)]


# ----------------------------------------------------------------------------------------------------
# Attention for packed rows without the flash-attn package
#
# What transformers 5.17 does with a packed row (position_ids restarting at 0, no attention_mask, no cache):
# `masking_utils.find_packed_sequence_indices` reads the boundaries from position_ids and ANDs a
# same-sequence condition into the causal mask. `sdpa` then materializes a dense [1, 1, N, N] boolean mask:
# correct, but O(N^2) memory and compute over the whole pack (and no fused causal kernel); `flex_attention`
# builds a block-sparse BlockMask from it (a document mask), so blocks across sequences are skipped.
# Only without a KV cache: a direct model(...) call with the config's use_cache=True skips that detection
# and attends across the sequences (`_token_logprobs` passes use_cache=False).
# `flash_attention_2` reads the same boundaries as cu_seqlens (varlen kernel) but needs the flash-attn package.
# 'seed_varlen' below is the varlen path with PyTorch's own flash kernel (torch.nn.attention.varlen), and
# plain SDPA per sequence where that kernel does not run (CPU, fp32).

def packed_kwargs(position_ids):
    """Sequence boundaries of a packed row [1, N] as transformers' flash-attention keyword arguments
    (cu_seq_lens_q/k: int32 [n + 1], max_length_q/k: int), read by 'seed_varlen' and 'flash_attention_2'."""
    starts = (position_ids[0] == 0).nonzero()[:, 0]
    cu = torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int32)  # [n + 1]
    longest = int((cu[1:] - cu[:-1]).max())
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


@functools.cache
def _varlen_call():
    """torch.nn.attention.varlen.varlen_attn and the keyword arguments for causal GQA attention in this torch
    (the API changed: `is_causal` became `window_size=(-1, 0)`; `scale` and `enable_gqa` came later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    return varlen_attn, kw


def _varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                      max_length_q=None, **kwargs):
    """Attention function 'seed_varlen' (transformers' AttentionInterface). query [B, Hq, T, D], key/value
    [B, Hkv, T, D] -> ([B, T, Hq, D], None). One row without a padding mask is a packed row: causal attention
    within each sequence, boundaries from cu_seq_lens_q (given by `_token_logprobs`; else read from the
    position_ids, at one device sync per layer). Anything else (padded rows) is transformers' SDPA."""
    pos = kwargs.get("position_ids")
    if attention_mask is not None or query.shape[0] != 1 or (cu_seq_lens_q is None and pos is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if cu_seq_lens_q is None:
        bounds = packed_kwargs(pos)
        cu_seq_lens_q, max_length_q = bounds["cu_seq_lens_q"], bounds["max_length_q"]
    fn, kw = _varlen_call()
    if fn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0:
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [N, H, D]
        if "enable_gqa" not in kw and k.shape[1] != q.shape[1]:  # older torch: one KV head per query head
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        if scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-6:
            kw = dict(kw, scale=scaling)  # varlen_attn's default is 1/sqrt(D), as Qwen2's
        out = fn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, **kw)  # [N, Hq, D]
        return out[None], None
    cu = cu_seq_lens_q.tolist()
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, dropout_p=dropout,
        enable_gqa=True) for s, e in zip(cu[:-1], cu[1:])], dim=2)  # [1, Hq, N, D]
    return out.transpose(1, 2), None


def _varlen_mask(*args, attention_mask=None, **kwargs):
    """'seed_varlen''s mask: none for a packed row (its boundaries travel as cu_seq_lens), SDPA's otherwise."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register("seed_varlen", _varlen_attention)
AttentionMaskInterface.register("seed_varlen", _varlen_mask)


@functools.cache
def _varlen_works(device):
    """PyTorch's varlen flash kernel runs here and agrees with SDPA per sequence (forward and backward, bf16,
    GQA): two sequences of 5 and 3 tokens."""
    if device.type != "cuda" or _varlen_call()[0] is None:
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, h, 8, 64, device=device, generator=g, dtype=torch.bfloat16, requires_grad=True)
                   for h in (4, 2, 2))
        kw = packed_kwargs(torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=device))
        m = types.SimpleNamespace(is_causal=True)
        out = _varlen_attention(m, q, k, v, None, **kw)[0]
        out.float().square().sum().backward()
        got = [out.detach(), q.grad, k.grad]
        q.grad = k.grad = v.grad = None
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=True) for s, e in ((0, 5), (5, 8))],
            dim=2).transpose(1, 2)
        ref.float().square().sum().backward()
        return all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in zip(got, [ref, q.grad, k.grad]))
    except Exception as e:  # noqa: BLE001 - any failure means: use FlexAttention instead
        print0(f"PyTorch varlen attention unavailable here ({type(e).__name__}: {str(e)[:200]})")
        return False


def packed_attention(device, packing="auto"):
    """The attention implementation for padding-free micro-batches, or None: pad them (and keep the model's).

      auto  GPU: flash_attention_2 where flash-attn is installed, else 'seed_varlen' (PyTorch's own varlen
            flash kernel) where it works on this device, else flex_attention (transformers' document mask).
            CPU: None (padded SDPA, as before).
      on    the same on GPU; on CPU 'seed_varlen' (SDPA per sequence: correct, for tests and demos)
      off   None
      a name (seed_varlen, flex_attention, flash_attention_2, sdpa): that one (sdpa: transformers' dense
            block-diagonal mask, a reference for tests, O(N^2) in the packed length)
    """
    if packing == "off" or (packing == "auto" and device.type != "cuda"):
        return None
    if packing not in ("auto", "on"):
        return packing
    if device.type != "cuda":
        return "seed_varlen"
    if attn_implementation(device) == "flash_attention_2":
        return "flash_attention_2"
    return "seed_varlen" if _varlen_works(device) else "flex_attention"


# ----------------------------------------------------------------------------------------------------
# Hugging Face checkpoint of a sharded model

def save_hf_checkpoint(model, tokenizer, out_dir, rank, dtype=None):
    """Gather the full weights parameter by parameter (rank 0 keeps them on CPU) and write a folder that
    transformers and vLLM load as is: safetensors, config (with the real architecture name, not FSDP's
    wrapper class), generation config, tokenizer."""
    from huggingface_hub import save_torch_state_dict
    state = {}
    for name, full in full_params(model):
        if rank == 0:
            state[name] = full.to("cpu", dtype or full.dtype).contiguous()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_torch_state_dict(state, out_dir)
        cfg = model.config
        cfg.architectures = [type(model).__name__.removeprefix("FSDP")]
        cfg.use_cache = True
        if dtype is not None:
            cfg.dtype = str(dtype).removeprefix("torch.")
        cfg.save_pretrained(out_dir)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()


# ----------------------------------------------------------------------------------------------------
# Trainer checkpoints that survive a kill at any instant (seed_rl.py and sft.py)

def save_checkpoint_dir(path, write, marker, state, rank):
    """Write a trainer checkpoint so that a complete one exists at every instant: `path`, or for the moment
    between the two renames below `path.old` (`latest_checkpoint` reads either).

      1. write(path.tmp) on every rank (each writes its shards), then rank 0 writes `marker` (state, as JSON)
         last: a folder holding its marker is complete;
      2. path -> path.old, then path.tmp -> path (two renames);
      3. path.old removed, its marker first, so a half-removed folder is never taken for a checkpoint.
    kill_point names each step, for the test that kills a save at every one of them."""
    tmp, old = path + ".tmp", path + ".old"
    if rank == 0:
        _remove_checkpoint(tmp, marker)  # what a save killed before its marker left behind
    _barrier()
    write(tmp)
    if rank == 0:
        kill_point("written")
        with open(os.path.join(tmp, marker + ".tmp"), "w") as f:
            json.dump(state, f)
        os.replace(os.path.join(tmp, marker + ".tmp"), os.path.join(tmp, marker))
        kill_point("marked")
        if os.path.isdir(path):
            _remove_checkpoint(old, marker)
            os.rename(path, old)
            kill_point("retired")
        os.rename(tmp, path)
        kill_point("swapped")
        _remove_checkpoint(old, marker)
    _barrier()


def latest_checkpoint(path, marker):
    """(folder, state) of the last complete checkpoint written by save_checkpoint_dir: `path`, else `path.old`
    (a kill between the two renames), else (None, None). path.tmp is never read: its save may be cut short."""
    for folder in (path, path + ".old"):
        if os.path.isfile(os.path.join(folder, marker)):
            with open(os.path.join(folder, marker)) as f:
                return folder, json.load(f)
    return None, None


def _remove_checkpoint(folder, marker):
    if os.path.exists(os.path.join(folder, marker)):
        os.remove(os.path.join(folder, marker))
        kill_point("unmarked")
    shutil.rmtree(folder, ignore_errors=True)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


_KILL_COUNTS = {}


def kill_point(name):
    """Tests only: with $SEED_KILL_AT = "name" or "name@n", the process SIGKILLs itself the n-th time (default
    the first) it reaches this named step of a checkpoint save, so a test can check what a kill there leaves."""
    point, _, n = os.environ.get("SEED_KILL_AT", "").partition("@")
    if point == name:
        _KILL_COUNTS[name] = _KILL_COUNTS.get(name, 0) + 1
        if _KILL_COUNTS[name] == int(n or 1):
            os.kill(os.getpid(), signal.SIGKILL)
