"""Checkpoints of the trainers (sft.py, seed_rl.py): the Hugging Face folder of a sharded model, and trainer
checkpoint folders that a kill at any instant cannot lose."""
import json
import os
import shutil
import signal

import torch.distributed as dist

from common.training import full_params


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
