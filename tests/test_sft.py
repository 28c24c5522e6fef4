"""sft.py (Stage 1b) on CPU: the tiny random Qwen2 with the real Qwen2.5 tokenizer and chat template, trained
on a small real SFT file (analysis prompts of real ALFWorld expert episodes, JSON targets), 1 process and
real torchrun with 2 processes (gloo)."""
import json
import math
import os
import shutil
import signal

import pytest
import torch

from conftest import run_script, side_by_side
from common.records import read_jsonl
from envs import load_env
from prompts import build_analysis_prompt, chat_prompt, target_json

# 9 train examples (+1 over-long one), 3 val; global batch 4 -> 3 steps per epoch (4, 4, 1 examples: with
# 2 ranks the last batch leaves rank 1 with nothing, which exercises the zero-weight dummy micro-batch).
# A high lr so the tiny model visibly overfits in 9 steps.
ARGS = ["--model", "tiny", "--epochs", "3", "--batch-size", "4", "--lr", "3e-2", "--warmup-ratio", "0",
        "--max-length", "2048"]


def make_sft_records(episodes):
    """annotate.py's SFT format; the target is a rule-based analyzer answer (the workflow that worked)."""
    recs = []
    for i, ep in enumerate(episodes):
        acts = [s["action"] for s in ep["steps"]]  # short targets: the 152k-vocab LM head is the CPU cost
        answer = {"episode_summary": f"Done in {ep['length']} steps.",
                  "episode_skill": f"First {acts[0]}, then {acts[1]}."}
        recs.append(dict(id=f"sft-{i}", split="val" if i % 4 == 3 else "train", prompt=build_analysis_prompt(ep, load_env(ep.get("env", "alfworld"))),
                         target=target_json(answer), annotation_id=f"ann-{i}", annotation_file="skills.jsonl",
                         trajectory_uid=ep["uid"], trajectory_file="traj.jsonl",
                         outcome="success" if ep["success"] else "failure"))
    # one example over --max-length 2048 (the real prompts are 660-1,100 tokens): it must be skipped, not cut
    recs.append(dict(recs[0], id="sft-too-long", prompt="\n\n".join([recs[0]["prompt"]] * 4)))
    return recs


@pytest.fixture(scope="module")
def sft_file(expert_trajectories, tmp_path_factory):
    episodes = read_jsonl(expert_trajectories)
    assert len(episodes) == 12
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    with open(path, "w") as f:
        for r in make_sft_records(episodes):
            f.write(json.dumps(r) + "\n")
    return path


def metrics_of(out):
    return read_jsonl(os.path.join(out, "metrics.jsonl"))


def curve(metrics):
    """[(kind, step, loss)] in file order."""
    return [(r["kind"], r["step"], r["loss"] if r["kind"] == "train" else r["val_loss"]) for r in metrics]


@pytest.fixture(scope="module")
def runs(sft_file, tmp_path_factory):
    """The reference (1 process, padded micro-batches of 4 sequences) and torchrun with 2 gloo processes (packed
    micro-batches of 2) on the same data, side by side: neither reads the other (~1.5x faster than one after the
    other on 2 cores). Returns (reference, 2-process run); read only."""
    out1, out2 = tmp_path_factory.mktemp("sft_ref") / "run", tmp_path_factory.mktemp("sft_two") / "run2"
    res1, res2 = side_by_side(
        (run_script, ["sft.py", *ARGS, "--micro-batch", "4", "--data", str(sft_file), "--out", str(out1)]),
        (run_script, ["-m", "torch.distributed.run", "--nproc_per_node", "2", "sft.py", *ARGS, "--micro-batch", "2",
                      "--packing", "on", "--data", str(sft_file), "--out", str(out2)]))
    return [dict(out=str(out), stdout=res.stdout + res.stderr, metrics=metrics_of(out))
            for out, res in ((out1, res1), (out2, res2))]


@pytest.fixture(scope="module")
def ref_run(runs):
    return runs[0]


def test_prompt_tokens_carry_no_loss_and_layout_is_the_chat_template(ref_run, sft_file, tokenizer):
    """The tokens the trainer sees are exactly the template's rendering of the (user, assistant)
    conversation (up to its trailing newline), and the loss covers exactly the target + <|im_end|>."""
    recs = {r["id"]: r for r in read_jsonl(sft_file)}
    with open(os.path.join(ref_run["out"], "tokenized_preview.json")) as f:
        preview = json.load(f)
    assert len(preview) == 2
    for ex in preview:
        rec = recs[ex["id"]]
        ids, mask = ex["input_ids"], ex["loss_mask"]
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": rec["prompt"]},
                                                  {"role": "assistant", "content": rec["target"]}], tokenize=False)
        assert rendered.endswith("<|im_end|>\n")
        assert ids == tokenizer(rendered[:-1], add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) + "\n" == rendered
        # the loss mask: 0 over the whole prompt (system + user turn + "<|im_start|>assistant\n"), 1 after
        _, prompt_ids = chat_prompt(tokenizer, rec["prompt"])
        assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
        assert ids[:len(prompt_ids)] == prompt_ids
        assert tokenizer.decode(ids[len(prompt_ids):]) == rec["target"] + "<|im_end|>"
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_overlong_example_is_counted_and_skipped(ref_run):
    assert "skipped 1 train examples longer than --max-length 2048" in ref_run["stdout"]
    with open(os.path.join(ref_run["out"], "seed_manifest.json")) as f:
        data = json.load(f)["data"]
    assert data["skipped_too_long"] == {"train": 1, "val": 0}
    assert data["skipped_ids"]["train"] == ["sft-too-long"]
    assert (data["train"], data["val"]) == (9, 3)
    # every epoch trains on the 9 examples that fit, none twice and the long one never
    train = [r for r in ref_run["metrics"] if r["kind"] == "train"]
    assert [sum(r["examples"] for r in train if r["epoch"] == e) for e in (1, 2, 3)] == [9, 9, 9]
    assert max(r["tokens"] for r in train) <= 4 * 2048


def test_loss_falls_and_checkpoint_reloads_with_identical_logits(ref_run, sft_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m = ref_run["metrics"]
    train = [r for r in m if r["kind"] == "train"]
    val = {r["epoch"]: r["val_loss"] for r in m if r["kind"] == "val"}
    assert [r["step"] for r in train] == list(range(1, 10))
    assert train[-1]["loss"] <= train[0]["loss"] / 2, [r["loss"] for r in train]
    assert val[3] < val[0] - 3, val
    for r in train:  # no warmup, cosine decay over the 9 steps
        assert r["lr"] == pytest.approx(3e-2 * 0.5 * (1 + math.cos(math.pi * (r["step"] - 1) / 9)))
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and 0 < r["target_tokens"] < r["tokens"]

    # Every saved Hugging Face checkpoint (epoch_1, epoch_2, the final one in --out) loads with plain
    # transformers and reproduces, token for token, the val loss the trainer measured with those weights.
    recs = [r for r in read_jsonl(sft_file) if r["split"] == "val"]
    for epoch, folder in ((1, "epoch_1"), (2, "epoch_2"), (3, "")):
        path = os.path.join(ref_run["out"], folder)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tok = AutoTokenizer.from_pretrained(path)
        nll, n = 0.0, 0
        for r in recs:
            _, p = chat_prompt(tok, r["prompt"])
            t = tok(r["target"], add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
            with torch.no_grad():  # logits of the positions that predict t only: [len(t), V]
                logits = model(torch.tensor([p + t]), logits_to_keep=len(t) + 1).logits[0, :-1].float()
            nll -= logits.log_softmax(-1).gather(-1, torch.tensor(t)[:, None]).sum().item()
            n += len(t)
        assert nll / n == pytest.approx(val[epoch], rel=1e-5, abs=1e-5), (epoch, nll / n, val)
    assert os.path.isfile(os.path.join(ref_run["out"], "seed_manifest.json"))


def test_two_processes_give_the_same_loss_curve(runs):
    """torchrun with 2 gloo processes, packed micro-batches of 2, against 1 process with padded micro-batches
    of 4: the same global batches, so the same loss curve within float tolerance."""
    ref_run, run2 = runs
    assert "world size 2" in run2["stdout"] and "packed micro-batches of 2" in run2["stdout"]
    two, one = run2["metrics"], ref_run["metrics"]
    assert [c[:2] for c in curve(two)] == [c[:2] for c in curve(one)]
    for (kind, step, a), (_, _, b) in zip(curve(two), curve(one)):
        assert a == pytest.approx(b, abs=1e-4), (kind, step, a, b)
    for a, b in zip([r for r in two if r["kind"] == "train"], [r for r in one if r["kind"] == "train"]):
        assert (a["tokens"], a["target_tokens"], a["examples"]) == (b["tokens"], b["target_tokens"], b["examples"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


@pytest.mark.slow  # ~48 s on 2 cores: a killed run, its resume and a rerun of the finished one
def test_killed_run_resumes_to_the_same_result(ref_run, sft_file, tmp_path):
    """SIGKILL inside the third trainer save (step 4; checkpoints every 2 steps and at epoch ends), at the step
    that used to leave no checkpoint: the old one renamed away, the new one not yet in place ($SEED_KILL_AT,
    common/checkpoints.py kill_point). The same command continues from `trainer.old` (step 3) and ends with the
    reference's loss curve and weights."""
    from safetensors.torch import load_file
    out = tmp_path / "run"
    cmd = ["sft.py", *ARGS, "--micro-batch", "4", "--save-every", "2", "--data", str(sft_file), "--out", str(out)]
    killed = run_script(cmd, check=False, env={"SEED_KILL_AT": "retired@2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("trainer")) == ["trainer.old", "trainer.tmp"]
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) == 4

    res = run_script(cmd)
    assert f"resumed from {out / 'trainer.old'}: step 3," in res.stdout
    got, want = curve(metrics_of(out)), curve(ref_run["metrics"])
    assert [c[:2] for c in got] == [c[:2] for c in want]  # no step lost, none twice
    for a, b in zip(got, want):
        assert a[2] == pytest.approx(b[2], abs=1e-6), (a, b)
    w_ref = load_file(os.path.join(ref_run["out"], "model.safetensors"))
    w = load_file(os.path.join(out, "model.safetensors"))
    assert w.keys() == w_ref.keys()
    assert max((w[k] - w_ref[k]).abs().max().item() for k in w) <= 1e-6
    manifest = json.loads((out / "seed_manifest.json").read_text())
    assert [e["step"] for e in manifest["resumes"]] == [3]

    again = run_script(cmd)  # a finished run is not trained again
    assert "already finished" in again.stdout


def test_bad_records_get_a_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = dict(id="a", split="train", prompt="p", target='{"episode_summary": "s", "episode_skill": "k"}')
    with open(path, "w") as f:
        for r in (good, dict(good, id="b", split="test"), {k: v for k, v in good.items() if k != "target"}):
            f.write(json.dumps(r) + "\n")
    res = run_script(["sft.py", "--model", "tiny", "--data", str(path), "--out", str(tmp_path / "o")], check=False)
    assert res.returncode != 0
    assert "2 records lack a string id/prompt/target or a split in (train, val)" in res.stderr
    assert "(2, 'b')" in res.stderr and "(3, 'a')" in res.stderr


def test_resume_with_other_settings_is_refused(ref_run, sft_file, tmp_path):
    """Another --lr (a flag that changes what is trained) into a run's folder: one line naming it; a changed
    --micro-batch alone (listed in common/records.py as free to change) would pass the same check."""
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(os.path.join(ref_run["out"], "seed_manifest.json"), out / "seed_manifest.json")
    res = run_script(["sft.py", *[a if a != "3e-2" else "1e-2" for a in ARGS], "--micro-batch", "2",
                      "--data", str(sft_file), "--out", str(out)], check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "--lr 0.03 then, 0.01 now" in line and "--micro-batch" not in line.split("these may change")[0]
    assert sorted(os.listdir(out)) == ["seed_manifest.json"]
