"""Models and tokenizers: loading (a local folder, a hub id, or the tiny random Qwen2 of the CPU demos and tests),
the offline shared assets, and the parameter names both the engine and the checkpoints use."""
import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUB_TOKENIZER = "Qwen/Qwen2.5-0.5B-Instruct"  # same tokenizer files as every Qwen2.5 instruct size


def shared_dir():
    """../shared (or $SHARED): the offline Qwen2.5 tokenizer/configs and the ALFWorld archive."""
    return os.environ.get("SHARED", os.path.join(os.path.dirname(REPO), "shared"))

def default_tokenizer_path():
    """$SEED_TOKENIZER, else the real Qwen2.5 tokenizer in ../shared/assets, else the hub id."""
    for path in (os.environ.get("SEED_TOKENIZER"), os.path.join(shared_dir(), "assets", "qwen2.5-tokenizer")):
        if path and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            return path
    return HUB_TOKENIZER

def load_tokenizer(model):
    """`tiny` and `expert` use the real Qwen2.5 tokenizer; a model path/hub id uses its own."""
    from transformers import AutoTokenizer
    path = default_tokenizer_path() if model in ("tiny", "expert") else model
    tok = AutoTokenizer.from_pretrained(path)
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
    (envs/training.py `packed_attention`)."""
    from transformers import AutoModelForCausalLM
    device = torch.device(device)
    if model == "tiny":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=attn or "sdpa", dtype=dtype)
        return m.to(device)
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype,
                                                attn_implementation=attn or attn_implementation(device)).to(device)


def clean_param_name(name):
    """Parameter names as the HF checkpoint has them: drop wrapper prefixes (activation checkpointing,
    torch.compile) so the same names work for vLLM's load_weights and for saving."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name

