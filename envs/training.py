"""Trainer-side plumbing shared by sft.py and seed_rl.py: process groups, FSDP2 sharding, the memory-lean
log-prob of given tokens, packed/padded micro-batches, Hugging Face checkpoints of a sharded model, and trainer
checkpoint folders that a kill at any instant cannot lose.

The algorithm lives in the scripts; this file only holds what both trainers would otherwise write twice.
"""
import datetime
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

from envs.models import clean_param_name


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
    """
    # use_cache=False explicitly: save_hf_checkpoint sets config.use_cache=True (for inference), which would
    # otherwise make every later training forward build a KV cache
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False).last_hidden_state  # [B, T, H]
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
# Micro-batches: padded (SDPA) or packed padding-free (flash-attention 2)

def make_batch(seqs, device, packed=False, pad_id=0):
    """seqs: lists of token ids. Returns dict(input_ids, targets, attention_mask|position_ids, starts).

    padded: [B, T] right-padded, attention_mask [B, T].
    packed: [1, sum(len)] with position_ids restarting at 0 per sequence; flash-attention 2 (transformers)
            reads the sequence boundaries from position_ids, so no padding is computed at all.
    starts[i]: (row, column) of sequence i's first token. targets[b, t] = input_ids[b, t + 1] (the last
    position's target is a dummy; callers select only response positions).
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
