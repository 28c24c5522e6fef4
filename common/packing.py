"""Micro-batch layouts for the trainers (padded for SDPA, or packed padding-free: one row, a causal block per
sequence), the response positions inside them, and the attention implementation that packed rows need.

transformers is imported only where 'seed_varlen' is registered or falls back to SDPA (`register_attention`):
its modeling code is ~4 s of imports that a refused run or --help of the trainers should not wait for."""
import functools
import inspect
import types

import torch

from common.models import attn_implementation


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
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
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
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


@functools.cache
def register_attention():
    """'seed_varlen' in transformers' attention and mask registries, once per process: before a model is built
    with it (common/models.py load_model does this for attn='seed_varlen')."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
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
        from common.training import print0  # (training.py imports this module)
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
    register_attention()  # 'seed_varlen' may be the answer, and the model that runs it is built next
    if packing not in ("auto", "on"):
        return packing
    if device.type != "cuda":
        return "seed_varlen"
    if attn_implementation(device) == "flash_attention_2":
        return "flash_attention_2"
    return "seed_varlen" if _varlen_works(device) else "flex_attention"
