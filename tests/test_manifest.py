"""common/records.py run manifest: every field the reading guide asks for, each checked against an independent
reading (git itself, importlib.metadata, the tokenizer's files, a hub-cache snapshot folder built here); and the
one resume check of all five scripts (other settings refused by name, the flags that may change, resume entries)."""
import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
from importlib import metadata

import pytest

from conftest import REPO
from envs.alfworld import select_games
from common.models import shared_dir
from common.records import (PACKAGES, args_diff, check_resume, games_sha256, games_summary, model_info,
                          resumed_manifest, run_manifest, tokenizer_info, write_manifest)

PAPER = dict(splits="valid_seen,valid_unseen", temperature=0.4, max_steps=30, history=5, max_new_tokens=512)


def sha(data):
    return hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()


def git(*a):
    return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def test_run_manifest_fields(tokenizer, tmp_path):
    args = argparse.Namespace(**dict(PAPER, temperature=1.0, max_steps=50, model="tiny", seed=3, out="x"))
    games = select_games("valid_seen", 0, n=5)
    m = run_manifest("evaluate.py", args, paper=PAPER, model="tiny", tokenizer=tokenizer, split="valid_seen",
                     games=games, seeds={"seed": 3})
    # code: the commit and the dirty flag as git reports them
    assert m["git"]["commit"] == git("rev-parse", "HEAD")
    assert m["git"]["dirty"] == bool(git("status", "--porcelain", "--untracked-files=no"))
    if m["git"]["dirty"]:
        assert m["git"]["diff_sha256"] == sha(git("diff", "HEAD"))
    # software: Python, CUDA (None on CPU), the named packages and the full installed list
    import torch
    assert m["hardware"]["python"] == platform.python_version() and m["hardware"]["cuda"] == torch.version.cuda
    assert len(m["hardware"]["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert set(m["packages"]) == set(PACKAGES) and m["packages"]["torch"] == metadata.version("torch")
    assert m["packages"]["alfworld"] == metadata.version("alfworld")
    assert f"torch=={metadata.version('torch')}" in m["environment"]["installed"]
    with open(os.path.join(REPO, "requirements.txt"), "rb") as f:
        assert m["environment"]["requirements_sha256"]["requirements.txt"] == sha(f.read())
    # tokenizer: each file's sha256, and the chat template's sha256 equals that of the template in its files
    tok = m["tokenizer"]
    folder = tokenizer.name_or_path
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        template = json.load(f)["chat_template"]
    assert tok["chat_template_sha256"] == sha(template) == sha(tokenizer.chat_template)
    for name, digest in tok["files_sha256"].items():
        with open(os.path.join(folder, name), "rb") as f:
            assert digest == sha(f.read()), name
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= set(tok["files_sha256"])
    # data: split, the ordered game list's sha256, counts; seeds and the full arguments
    assert m["split"] == "valid_seen" and m["games"]["count"] == 5 and m["games"]["per_split"] == {"valid_seen": 5}
    assert m["games"]["sha256"] == sha("\n".join(g["task_id"] for g in games))
    assert sum(m["games"]["per_type"].values()) == 5 and m["seeds"] == {"seed": 3}
    assert m["args"] == vars(args) and m["model"]["model"] == "tiny" and m["model"]["config_sha256"]
    # the diff against the paper lists exactly the two changed flags, with both values
    assert m["diff_vs_paper"] == {"temperature": {"run": 1.0, "paper": 0.4}, "max_steps": {"run": 50, "paper": 30}}
    # written atomically and readable as JSON
    path = tmp_path / "m.json"
    write_manifest(str(path), m)
    assert json.loads(path.read_text())["git"] == m["git"] and not os.path.exists(str(path) + ".tmp")


def test_args_diff_lists_exactly_the_changed_flags():
    same = dict(PAPER, extra_flag="not a paper setting")
    assert args_diff(same, PAPER) == {}
    for flag, value in (("history", 2), ("max_new_tokens", 16), ("splits", "valid_seen")):
        assert args_diff(dict(same, **{flag: value}), PAPER) == {flag: {"run": value, "paper": PAPER[flag]}}
    assert set(args_diff(argparse.Namespace(**dict(same, history=2, temperature=0.0)), PAPER)) == {"history",
                                                                                                    "temperature"}


def test_game_list_sha256_changes_with_the_list():
    games = select_games("valid_unseen", 0, n=6)
    base = games_sha256(games)
    assert base == games_sha256([dict(g) for g in games])  # same ids, same order: same digest
    assert base != games_sha256(games[:-1])  # one game fewer
    assert base != games_sha256(games[::-1])  # the order is part of the list (it decides which update plays what)
    assert base != games_sha256(select_games("valid_unseen", 1, n=6))  # another seed
    assert base != games_sha256(select_games("valid_seen", 0, n=6))  # another split
    s = games_summary(games)
    assert s["count"] == s["unique"] == 6 and s["per_split"] == {"valid_unseen": 6}


def test_model_info_hub_snapshot_and_local_folder(tmp_path, monkeypatch):
    """A hub id resolved offline from the local HF cache: the snapshot's commit is the revision; the config
    and generation config are hashed; weight files are listed with their sizes."""
    src = os.path.join(shared_dir(), "assets", "qwen2.5-configs", "Qwen2.5-0.5B-Instruct")
    rev = "a" * 8 + "0123456789abcdef0123456789abcdef"
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / rev
    snap.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, name), snap / name)
    (snap / "model.safetensors").write_bytes(b"\0" * 1234)
    refs = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "refs"
    refs.mkdir()
    (refs / "main").write_text(rev)
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    with open(os.path.join(src, "config.json"), "rb") as f:
        config_sha = sha(f.read())
    hub = model_info("Qwen/Qwen2.5-0.5B-Instruct")
    assert hub["revision"] == rev and hub["config_sha256"] == config_sha and hub["path"] is None
    assert hub["weight_files"] == {"model.safetensors": 1234}
    with open(os.path.join(src, "generation_config.json"), "rb") as f:
        assert hub["generation_config_sha256"] == sha(f.read())
    local = model_info(str(snap))  # the same snapshot given as a path
    assert local["revision"] == rev and local["path"] == str(snap) and local["config_sha256"] == config_sha
    missing = model_info("Qwen/Qwen2.5-7B-Instruct")  # not in this cache: said so, not guessed
    assert missing["revision"] is None and "revision unknown" in missing["note"]
    plain = tmp_path / "ckpt"  # a local checkpoint folder that is no snapshot: no revision, config hashed
    plain.mkdir()
    shutil.copy(os.path.join(src, "config.json"), plain / "config.json")
    (plain / "seed_manifest.json").write_text("{}")
    info = model_info(str(plain))
    assert info["revision"] is None and info["config_sha256"] == config_sha
    assert info["produced_by"] == str(plain / "seed_manifest.json")


def test_tokenizer_info_without_template_is_explicit(tokenizer):
    info = tokenizer_info(tokenizer)
    assert info["vocab_size"] == len(tokenizer) == 151665 and info["eos_token"] == "<|im_end|>"
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        assert tokenizer_info(tokenizer)["chat_template_sha256"] is None  # no template: None, not sha256("")
    finally:
        tokenizer.chat_template = saved


# ---------------------------------------------------------------------------------------------------
# Resuming into an existing output: the one check of all five scripts (common/records.py)

def _first_run(tmp_path, script="seed_rl.py", **flags):
    args = argparse.Namespace(**dict(dict(lr=1e-6, opd_coef=0.01, updates=150, save_every=10, seed=0, out="x"),
                                     **flags))
    m = run_manifest(script, args, games=select_games("valid_seen", 0, n=4), seeds={"seed": 0})
    path = str(tmp_path / "manifest.json")
    write_manifest(path, m)
    return path, m


def test_resume_with_other_settings_is_refused_naming_each_flag(tmp_path, capsys):
    path, first = _first_run(tmp_path)
    changed = argparse.Namespace(**dict(first["args"], lr=2e-6, opd_coef=0.0))
    with pytest.raises(SystemExit) as e:
        check_resume(path, changed, script="seed_rl.py", out="runs/x")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("runs/x was written with other settings")
    assert "--lr 1e-06 then, 2e-06 now" in msg and "--opd-coef 0.01 then, 0.0 now" in msg
    assert "--seed" not in msg.split("(these may change")[0]  # only what differs is named
    assert "--updates" in msg.split("(these may change")[1]  # and what may differ is listed
    # the same flags for another script: seed_rl's may-change list does not apply to collect.py
    (tmp_path / "c").mkdir()
    path2, first2 = _first_run(tmp_path / "c", script="collect.py", updates=2)
    with pytest.raises(SystemExit, match="--updates 2 then, 3 now"):
        check_resume(path2, argparse.Namespace(**dict(first2["args"], updates=3)), script="collect.py", out="o")


def test_resume_with_flags_that_may_change_appends_a_resume_entry(tmp_path):
    path, first = _first_run(tmp_path)
    assert check_resume(str(tmp_path / "none.json"), argparse.Namespace(lr=1), script="seed_rl.py", out="o") is None
    now = argparse.Namespace(**dict(first["args"], updates=300, save_every=5, new_flag="a flag added since"))
    old = check_resume(path, now, script="seed_rl.py", out="runs/x")
    assert old["args"] == first["args"]
    second = run_manifest("seed_rl.py", now, games=select_games("valid_seen", 0, n=4))
    m = resumed_manifest(old, second, update=7)
    assert m["args"] == first["args"] and m["time"] == first["time"]  # the first run's record is kept
    (entry,) = m["resumes"]
    assert entry["changed"] == {"updates": {"then": 150, "now": 300}, "save_every": {"then": 10, "now": 5}}
    assert entry["update"] == 7 and entry["argv"] == second["argv"] and entry["git"] == second["git"]
    write_manifest(path, m)
    m2 = resumed_manifest(check_resume(path, now, script="seed_rl.py", out="o"), second, update=9)
    assert [e["update"] for e in m2["resumes"]] == [7, 9]  # one entry per resume, none overwritten
    assert resumed_manifest(None, second) is second  # a fresh output: this run's manifest


def test_resume_with_another_task_list_or_data_file_is_refused(tmp_path):
    path, first = _first_run(tmp_path)
    same = argparse.Namespace(**first["args"])
    check_resume(path, same, script="seed_rl.py", out="o", identity={"games.sha256": first["games"]["sha256"]})
    other = games_sha256(select_games("valid_seen", 1, n=4))
    with pytest.raises(SystemExit, match="games.sha256"):
        check_resume(path, same, script="seed_rl.py", out="o", identity={"games.sha256": other})


def test_git_state_keeps_the_launchers_commit_beside_gits(monkeypatch):
    from common.records import git_state
    monkeypatch.delenv("SEED_CODE_COMMIT", raising=False)
    plain = git_state()
    assert "launcher_commit" not in plain
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert plain["commit"] == (head or None)
    monkeypatch.setenv("SEED_CODE_COMMIT", "5313b2b")
    named = git_state()
    assert named["launcher_commit"] == "5313b2b" and named["commit"] == plain["commit"]  # git's view kept too
