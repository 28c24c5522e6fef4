"""Models and tokenizers: loading (a local folder, a hub id, or the tiny random Qwen2 of the CPU demos and tests;
what cannot load is one line naming it), the offline shared assets, and the parameter names both the engine and
the checkpoints use."""
import json
import os
import re
import sys

import torch

from common.paths import REPO, shared_dir  # noqa: F401 (shared_dir: re-exported for the scripts)

HUB_TOKENIZER = "Qwen/Qwen2.5-0.5B-Instruct"  # same tokenizer files as every Qwen2.5 instruct size


def default_tokenizer_path():
    """$SEED_TOKENIZER, else the real Qwen2.5 tokenizer in ../shared/assets, else the hub id."""
    for path in (os.environ.get("SEED_TOKENIZER"), os.path.join(shared_dir(), "assets", "qwen2.5-tokenizer")):
        if path and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            return path
    return HUB_TOKENIZER

BUILT_IN = ("tiny", "expert", "scripted")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name


def hub_offline():
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE",
                                                                                     "TRANSFORMERS_OFFLINE"))


def check_model(model, needs="config.json"):
    """Where to load `model` from: a local folder, or a hub id. What cannot load is one line naming it, before
    transformers gets it (a missing local folder cost 54 s of hub retries and a 78-line traceback, a malformed
    id a 20-frame one). A name that looks local (starts with . / ~, has a path separator but is no org/name
    hub id, or is org/name where org/ is a folder here) is never sent to the hub, nor anything while
    HF_HUB_OFFLINE is set. needs: the file the caller reads first (config.json, tokenizer_config.json)."""
    if model in BUILT_IN:
        return model
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, needs)):
            sys.exit(f"model {model}: the folder {os.path.abspath(path)} has no {needs} (not a Hugging Face model "
                     f"folder; a checkpoint of this project: sft.py's --out, or seed_rl.py's <out>/hf/<update>)")
        return path
    hub_like = bool(HUB_ID.match(model))
    if model.startswith((".", "/", "~")) or (os.sep in model and not hub_like) or \
            (hub_like and os.path.isdir(model.split("/")[0])):
        sys.exit(f"model {model}: no such folder ({os.path.abspath(path)})")
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(model)
    except HFValidationError:
        sys.exit(f"model {model!r}: not a folder here, and not a hub id (org/name)")
    if hub_offline() and not isinstance(try_to_load_from_cache(model, needs), str):
        sys.exit(f"model {model}: not a folder here, and not in the local hub cache (HF_HUB_OFFLINE is set, so "
                 f"nothing is downloaded)")
    return model


def from_pretrained(cls, model, **kw):
    """cls.from_pretrained, with the hub's "not found" and "cannot connect" errors as one line."""
    try:
        return cls.from_pretrained(model, **kw)
    except OSError as e:
        sys.exit(f"model {model}: {str(e).strip().splitlines()[0]}"
                 + ("" if hub_offline() else " (HF_HUB_OFFLINE=1 uses the local hub cache only)"))


def qwen2_tokenizer_folder(path):
    """Whether AutoTokenizer would load `path` as transformers' Qwen2Tokenizer and nothing else: a local folder
    whose tokenizer_config.json names that class, with no custom code (auto_map) and no config.json (a model's
    config could map its type to another class)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return (cfg.get("tokenizer_class") in ("Qwen2Tokenizer", "Qwen2TokenizerFast") and "auto_map" not in cfg
            and not os.path.exists(os.path.join(path, "config.json")))


def load_tokenizer(model):
    """`tiny` and `expert` use the real Qwen2.5 tokenizer; a model path/hub id uses its own."""
    path = default_tokenizer_path() if model in ("tiny", "expert") else check_model(model, "tokenizer_config.json")
    # after check_model: a refused name answers without transformers' imports. The Qwen2.5 folder of tiny and
    # expert: the class AutoTokenizer picks for it, imported directly, since importing AutoTokenizer imports
    # transformers' whole model stack (~1.4 s of CPU for scripts that load no model: the expert's collect and
    # evaluate). The same tokenizer: tests/test_chat.py compares the two.
    if model in ("tiny", "expert") and qwen2_tokenizer_folder(path):
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class
    tok = from_pretrained(tokenizer_class, path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok

def stop_token_ids(tokenizer):
    """Tokens that end a response: <|im_end|> (Qwen's eos) and <|endoftext|>."""
    ids = {tokenizer.eos_token_id}
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)

def tiny_config():
    """A tiny random Qwen2 with the real Qwen2.5 vocabulary (CPU demos and tests)."""
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True, rope_theta=1e6, bos_token_id=151643, eos_token_id=151645)

def attn_implementation(device):
    """flash-attention 2 when installed (GPU), else PyTorch SDPA."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"

def load_model(model, *, dtype=torch.float32, device="cpu", seed=0, attn=None):
    """`tiny` -> a random tiny Qwen2 (seeded); otherwise from_pretrained(path or hub id). attn: the attention
    implementation (default: `attn_implementation`; the tiny model: sdpa); trainers pass the packed one
    (common/packing.py `packed_attention`)."""
    from transformers import AutoModelForCausalLM
    if attn == "seed_varlen":  # the project's own attention: registered with transformers on first use
        from common.packing import register_attention
        register_attention()
    device = torch.device(device)
    if model == "tiny":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=attn or "sdpa", dtype=dtype)
        return m.to(device)
    return from_pretrained(AutoModelForCausalLM, check_model(model), dtype=dtype,
                           attn_implementation=attn or attn_implementation(device)).to(device)


def clean_param_name(name):
    """Parameter names as the HF checkpoint has them: drop wrapper prefixes (activation checkpointing,
    torch.compile) so the same names work for vLLM's load_weights and for saving."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name



def model_config(name):
    """A model's config without weights (benchmarks): `tiny`, a folder, or a name under ../shared/assets/
    qwen2.5-configs (the official Qwen2.5 configs, e.g. Qwen2.5-1.5B-Instruct)."""
    from transformers import AutoConfig
    if name == "tiny":
        return tiny_config()
    return AutoConfig.from_pretrained(name if os.path.isdir(name) else
                                      os.path.join(shared_dir(), "assets", "qwen2.5-configs", name))
