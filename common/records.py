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
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_VERSION = "arXiv 2607.14777 v1"
PACKAGES = ["torch", "transformers", "vllm", "flash-attn", "accelerate", "alfworld", "textworld", "numpy"]


# seed_rl.py's flags of the self-analysis (and of the scoring beside it) and the OPD term. With --opd-coef 0 (GRPO)
# no episode is analyzed and there is no OPD term: seed_rl.py refuses them; drivers that give both arms one flag
# string drop them from GRPO's.
OPD_ONLY_FLAGS = ("analyzer_model", "analysis_max_new_tokens", "analysis_loop_stop", "analysis_max_len",
                  "min_skill_words", "opd_beta", "serial_scoring")


def drop_flags(tokens, names):
    """A command line's tokens without the flags in names ('--flag'), each with its values (--flag value,
    --flag v1 v2 for nargs flags such as evaluate.py's --report, --flag=value; a bare --flag when the next token is
    another flag or there is none). The scripts take no positional arguments, so every token up to the next
    --flag is a value."""
    out, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        i += 1
        if t.split("=")[0] in names:
            while "=" not in t and i < len(tokens) and not tokens[i].startswith("--"):
                i += 1
            continue
        out.append(t)
    return out


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


def interrupted_message(saved_now, saved_total, planned, path):
    """The one line a script prints on Ctrl-C (each episode was appended when it ended, so all are kept)."""
    return (f"interrupted: {saved_total} of {planned} episodes are saved in {path} ({saved_now} by this run); "
            "rerun the same command to resume")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_text(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def git_state():
    """Commit, dirty flag (tracked files only) and, when dirty, the sha256 of `git diff HEAD` so a run made
    from an uncommitted tree can still be matched to the exact code."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    out = {"commit": commit or None, "dirty": dirty, "diff_sha256": sha256_text(git("diff", "HEAD")) if dirty else None}
    # A copy of the tree whose .git is not the tree's own (the GPU machine here got a stale one) says the wrong
    # commit: the launcher can name the commit it sent, kept beside what git says
    if os.environ.get("SEED_CODE_COMMIT"):
        out["launcher_commit"] = os.environ["SEED_CODE_COMMIT"]
    return out


def package_versions():
    from importlib import metadata
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def environment_lock():
    """Everything installed (name==version, sorted) and the sha256 of the project's requirement files: with
    the commit, enough to rebuild the same software (the reading guide's "dependency lock")."""
    from importlib import metadata
    installed = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]},
                       key=str.lower)
    reqs = {n: sha256_file(os.path.join(REPO, n)) for n in ("requirements.txt", "requirements-gpu.txt")
            if os.path.isfile(os.path.join(REPO, n))}
    return {"installed": installed, "requirements_sha256": reqs}


def hardware():
    """Python, CUDA and GPUs. GPU names come from nvidia-smi, not torch.cuda: initializing CUDA here would make
    vLLM start its engine process with `spawn`, which re-runs a top-level script (and then fails)."""
    info = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "cuda": None, "cudnn": None, "gpus": [], "gpu_driver": None}
    try:
        import torch
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except ImportError:
        pass
    try:
        rows = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        info["gpus"] = [", ".join(r.split(", ")[:2]) for r in rows]
        info["gpu_driver"] = rows[0].split(", ")[-1] if rows else None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _hub_cached_file(repo_id, filename):
    """Path of a file of a hub model in the local HF cache (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
        p = try_to_load_from_cache(repo_id, filename)
    except Exception:  # not a valid repo id, or huggingface_hub missing: nothing to record
        return None
    return p if isinstance(p, str) and os.path.isfile(p) else None


def _snapshot_revision(path):
    """The commit of a hub snapshot folder (.../snapshots/<40 hex>/...), else None."""
    m = re.search(r"[/\\]snapshots[/\\]([0-9a-f]{40})(?:[/\\]|$)", path or "")
    return m.group(1) if m else None


def model_info(model):
    """Path or hub id, its revision where known (hub snapshot commit), the sha256 of its config (what shapes
    it) and generation config, and the weight files with their sizes (hashing GBs of weights per run is too
    slow; the revision or the producing run's manifest pins them)."""
    if model in (None, "tiny", "expert", "scripted"):
        if model == "tiny":
            from common.models import tiny_config
            return {"model": "tiny", "config_sha256": sha256_text(tiny_config().to_json_string(use_diff=False))}
        return {"model": model}
    local = os.path.isdir(model)
    info = {"model": model, "path": os.path.abspath(model) if local else None, "revision": None}
    cfg = os.path.join(model, "config.json") if local else _hub_cached_file(model, "config.json")
    if cfg and os.path.isfile(cfg):
        folder = os.path.dirname(cfg)
        info["resolved_path"] = os.path.realpath(folder)
        info["revision"] = _snapshot_revision(folder) or _snapshot_revision(info["resolved_path"])
        info["config_sha256"] = sha256_file(cfg)
        with open(cfg) as f:
            info["revision"] = info["revision"] or json.load(f).get("_commit_hash")
        gen = os.path.join(folder, "generation_config.json")
        info["generation_config_sha256"] = sha256_file(gen) if os.path.isfile(gen) else None
        index = os.path.join(folder, "model.safetensors.index.json")
        info["weights_index_sha256"] = sha256_file(index) if os.path.isfile(index) else None
        info["weight_files"] = {n: os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder))
                                if n.endswith((".safetensors", ".bin", ".pt"))}
        if os.path.isfile(os.path.join(folder, "seed_manifest.json")):  # a checkpoint of this project
            info["produced_by"] = os.path.join(folder, "seed_manifest.json")
    else:
        info["note"] = "not a local folder and not in the local hub cache: revision unknown"
    return info


TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "chat_template.json", "special_tokens_map.json", "added_tokens.json")


def tokenizer_info(tokenizer):
    """Tokenizer folder, the sha256 of each of its files, and the sha256 of the chat template actually in
    use (the string `apply_chat_template` renders), which is what decides the prompt tokens."""
    if tokenizer is None:
        return None
    path = getattr(tokenizer, "name_or_path", "")
    folder = path if os.path.isdir(path) else os.path.dirname(_hub_cached_file(path, "tokenizer_config.json") or "")
    files = {}
    for name in TOKENIZER_FILES:
        p = os.path.join(folder, name) if folder else ""
        if p and os.path.isfile(p):
            files[name] = sha256_file(p)
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"path": path, "folder": os.path.abspath(folder) if folder else None,
            "revision": _snapshot_revision(os.path.realpath(folder)) if folder else None,
            "class": type(tokenizer).__name__, "files_sha256": files,
            "chat_template_sha256": sha256_text(template) if template else None, "vocab_size": len(tokenizer),
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}


def games_sha256(games):
    """sha256 over the ordered task ids (relative, so the same on every machine)."""
    return sha256_text("\n".join(g["task_id"] if isinstance(g, dict) else str(g) for g in games))


def games_summary(games):
    """Count, sha256 of the ordered ids, count per split and per task type (alfworld names) of a game list."""
    per_split, per_type = {}, {}
    for g in games:
        if isinstance(g, dict):
            per_split[g.get("split")] = per_split.get(g.get("split"), 0) + 1
            per_type[g.get("task_type")] = per_type.get(g.get("task_type"), 0) + 1
    ids = {g["task_id"] if isinstance(g, dict) else str(g) for g in games}
    return {"count": len(games), "unique": len(ids), "sha256": games_sha256(games), "per_split": per_split,
            "per_type": per_type}


def args_diff(args, paper):
    """{flag: {"run": value, "paper": value}} for every flag whose value differs from the paper's."""
    a = vars(args) if not isinstance(args, dict) else args
    return {k: {"run": a.get(k), "paper": v} for k, v in paper.items() if a.get(k) != v}


def run_manifest(script, args, *, paper=None, model=None, ref_model=None, tokenizer=None, split=None,
                 games=None, seeds=None, extra=None):
    """The one manifest every script writes beside its outputs. paper: {flag: paper value} for the flags
    the script shares with the paper's settings (diff_vs_paper lists exactly those that differ); games: the
    ordered game records the run plays (count, sha256, per split/type); extra: script-specific fields."""
    m = {"script": script, "paper": PAPER_VERSION, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv,
         "git": git_state(), "hardware": hardware(), "packages": package_versions(),
         "environment": environment_lock(),
         "model": model_info(model), "ref_model": model_info(ref_model) if ref_model else None,
         "tokenizer": tokenizer_info(tokenizer), "split": split,
         "games": games_summary(games) if games is not None else None,
         "seeds": seeds, "args": vars(args) if not isinstance(args, dict) else args,
         "diff_vs_paper": args_diff(args, paper) if paper else None}
    if extra:
        m.update(extra)
    return m


def write_manifest(path, manifest):
    """Write via a temporary file and a rename, so a kill never leaves a half-written manifest (a resumed
    run reads the old one to refuse mixing settings)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2, default=str)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------
# Resuming into an existing output: the one check all five scripts make

# Flags that may differ when a run is resumed into the same output. They change how fast, where or how far a
# run computes, never what a record already written means. Any other flag that differs is refused, by name.
RESUME_MAY_CHANGE = {
    "all": {"out": "the output's own path (a moved output resumes)",
            "log_to": "where the metrics are mirrored (metrics.jsonl stays the record)"},
    "collect.py": {"workers": "env worker processes",
                   "batch_episodes": "episodes per generate call (samples are seeded per episode and step)",
                   "gpu_memory_utilization": "vLLM's share of the GPU", "kv_cache_gib": "vLLM's KV cache size"},
    "evaluate.py": {"workers": "env worker processes",
                    "batch_episodes": "episodes per generate call (samples are seeded per episode and step)",
                    "gpu_memory_utilization": "vLLM's share of the GPU", "kv_cache_gib": "vLLM's KV cache size",
                    "tp": "GPUs per vLLM engine",
                    "paper_backbone": "which paper rows the table shows beside the run"},
    "annotate.py": {"trajectories": "more collect.py files (each trajectory is still annotated once)",
                    "base_url": "the same analyzer served elsewhere", "api_key_env": "where the key is read",
                    "concurrency": "requests in flight", "timeout": "transport", "http_retries": "transport",
                    "backoff": "transport", "max_wait": "transport", "retry_failed": "which records are re-asked",
                    "batch_size": "local analyzer: trajectories per generate call",
                    "gpu_memory_utilization": "vLLM's share of the GPU",
                    "val_fraction": "the SFT file is rebuilt whole from the annotations at every run",
                    "sft": "the SFT file's path (rebuilt whole at every run)",
                    "env": "a check that every trajectory is of this env, not an input"},
    "sft.py": {"data": "the file's path (its contents must keep the same sha256)",
               "micro_batch": "sequences per forward (the global batches do not depend on it)",
               "packing": "padded or packed micro-batches (the same loss)",
               "activation_checkpointing": "memory, not results", "fused": "kernels, not the math",
               "save_every": "how often it checkpoints",
               "max_steps": "a planned stop", "resume": "whether a checkpoint is required"},
    "seed_rl.py": {"updates": "how far the run goes (the task stream's first updates stay the same; refused "
                              "where it would move the lr warm-up)",
                   "save_every": "how often it checkpoints", "dump_examples": "examples dumped per update",
                   "workers": "env worker processes", "gpu_memory_utilization": "vLLM's share of the GPU",
                   "kv_cache_gib": "vLLM's KV cache size",
                   "micro_batch": "forwards per mini-batch (the loss is a global token-mean: the same up to "
                                  "float rounding)",
                   "micro_tokens": "the same, by a token budget", "packing": "padded or packed micro-batches "
                                                                             "(the same loss)",
                   "activation_checkpointing": "memory, not results",
                   "checkpoint_policy": "memory, not results", "checkpoint_every": "memory, not results",
                   "fused": "kernels, not the math",
                   "lockstep": "the rollout schedule (same seeds, same episodes)",
                   "serial_scoring": "when the plain prompts are scored (the same scores)"},
}


def _json_value(v):
    """A value as the manifest stores it (tuples become lists, objects strings), so old and new compare."""
    return json.loads(json.dumps(v, default=str))


def _flag(name):
    return "--" + name.replace("_", "-")


def check_resume(manifest_path, args, *, script, out, identity=None):
    """Refuse to resume into an output written with other settings. Returns the output's manifest (None for
    a fresh output, which has none).

    Every flag the old manifest recorded must have the same value now, except RESUME_MAY_CHANGE[script]
    (flags a manifest lacks, from code older than the flag, are not compared). identity: {dotted manifest
    key: value} that must also match, e.g. {"games.sha256": ...} (the task list) or {"data.sha256": ...} (the
    input file's contents). Any difference exits with one line that names each flag with both values."""
    if not os.path.exists(manifest_path):
        return None
    with open(manifest_path) as f:
        old = json.load(f)
    may = {**RESUME_MAY_CHANGE["all"], **RESUME_MAY_CHANGE.get(script, {})}
    new, then = _json_value(vars(args)), old.get("args") or {}
    diff = [f"{_flag(k)} {then[k]!r} then, {new[k]!r} now" for k in then
            if k in new and k not in may and then[k] != new[k]]
    for key, value in (identity or {}).items():
        was = old
        for part in key.split("."):
            was = was.get(part) if isinstance(was, dict) else None
        if was is not None and was != value:
            diff.append(f"{key} {str(was)[:12]} then, {str(value)[:12]} now (other data)")
    if diff:
        sys.exit(f"{out} was written with other settings: {'; '.join(diff)}. Rerun with the same flags "
                 f"(these may change: {', '.join(_flag(k) for k in may if k in new) or 'none'}), "
                 f"or use another --out")
    return old


def resumed_manifest(old, new, **fields):
    """The manifest to write: `new` for a fresh output; for a resumed one, the old manifest (the run's first
    settings stay on record) with one more `resumes` entry: when, the command, the code and machine of this
    run, the flags that changed, and `fields` (where it resumed)."""
    if old is None:
        return new
    then, now = old.get("args") or {}, _json_value(new["args"])
    entry = {"time": new["time"], "argv": new["argv"], "git": new["git"], "hardware": new["hardware"],
             "packages": new["packages"],
             "changed": {k: {"then": then.get(k), "now": v} for k, v in now.items() if k in then and then[k] != v},
             **fields}
    return dict(old, resumes=old.get("resumes", []) + [entry])
