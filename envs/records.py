"""Append-only JSONL outputs that survive a kill, and the run manifest every script writes.

JSONL: one record per line, flushed and fsynced per record. A kill can only leave a torn last line;
`open_jsonl_for_append` cuts it off (and says so) before appending, and `read_jsonl` reports it, so a
restarted run sees exactly the records that were completely written: no duplicate, none lost.

Manifest (the reading guide: "others can rebuild the same software and model versions from the
manifest"): git commit and dirty flag, Python/CUDA/GPUs, package versions, model and reference paths with
revision or config sha256, tokenizer files and chat-template sha256, split and game-list sha256, seeds, the
full arguments, and their diff against the paper's settings.
"""
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ["torch", "transformers", "vllm", "flash-attn", "accelerate", "alfworld", "textworld", "numpy"]


def read_jsonl(path):
    """Records of a JSONL file; a torn last line (a kill mid-write) is skipped with a warning."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines) - 1:  # no newline after it: the write was cut
                print(f"[records] {path}: ignoring a torn last line ({len(line)} bytes)", file=sys.stderr)
            else:
                raise ValueError(f"{path}: line {n + 1} is not JSON (not a torn tail; refusing to guess)")
    return out


def open_jsonl_for_append(path):
    """Open for appending after cutting a torn last line, so new records start on a fresh line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(path):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                cut = data.rfind(b"\n") + 1
                print(f"[records] {path}: cutting a torn last line ({len(data) - cut} bytes)", file=sys.stderr)
                f.truncate(cut)
    return open(path, "a", encoding="utf-8")


def append_jsonl(f, record):
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_text(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def git_state():
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD")
    return {"commit": commit or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def package_versions():
    from importlib import metadata
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def hardware():
    info = {"python": sys.version.split()[0], "platform": platform.platform(), "cuda": None, "gpus": []}
    try:
        import torch
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


def model_info(model):
    """Path or hub id, its revision where known, and the sha256 of its config (what shapes it)."""
    if model in (None, "tiny", "expert", "scripted"):
        if model == "tiny":
            from envs.backends import tiny_config
            return {"model": "tiny", "config_sha256": sha256_text(tiny_config().to_json_string(use_diff=False))}
        return {"model": model}
    info = {"model": model, "path": os.path.abspath(model) if os.path.exists(model) else None}
    cfg = os.path.join(model, "config.json")
    if os.path.isfile(cfg):
        info["config_sha256"] = sha256_file(cfg)
        with open(cfg) as f:
            info["revision"] = json.load(f).get("_commit_hash")
    for name in ("seed_manifest.json",):  # a checkpoint written by this project points to its parent run
        if os.path.isfile(os.path.join(model, name)):
            info["produced_by"] = os.path.join(model, name)
    return info


def tokenizer_info(tokenizer):
    if tokenizer is None:
        return None
    path = getattr(tokenizer, "name_or_path", "")
    files = {}
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            files[name] = sha256_file(p)
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"path": path, "files_sha256": files, "chat_template_sha256": sha256_text(template),
            "vocab_size": len(tokenizer)}


def games_sha256(games):
    """sha256 over the ordered task ids (relative, so the same on every machine)."""
    return sha256_text("\n".join(g["task_id"] if isinstance(g, dict) else str(g) for g in games))


def args_diff(args, paper):
    """{flag: {"run": value, "paper": value}} for every flag whose value differs from the paper's."""
    a = vars(args) if not isinstance(args, dict) else args
    return {k: {"run": a.get(k), "paper": v} for k, v in paper.items() if a.get(k) != v}


def run_manifest(script, args, *, paper=None, model=None, ref_model=None, tokenizer=None, split=None,
                 games=None, seeds=None, extra=None):
    m = {"script": script, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv,
         "git": git_state(), "hardware": hardware(), "packages": package_versions(),
         "model": model_info(model), "ref_model": model_info(ref_model) if ref_model else None,
         "tokenizer": tokenizer_info(tokenizer), "split": split,
         "games": {"count": len(games), "sha256": games_sha256(games)} if games is not None else None,
         "seeds": seeds, "args": vars(args) if not isinstance(args, dict) else args,
         "diff_vs_paper": args_diff(args, paper) if paper else None}
    if extra:
        m.update(extra)
    return m


def write_manifest(path, manifest):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2, default=str)
