"""Stage 1b: hindsight-skill SFT. The policy learns to be its own analyzer (and, optionally, to act).

Each example is (the analysis prompt with one serialized trajectory, the analyzer's JSON answer), written by
annotate.py. The loss is the NLL of the answer tokens and the closing <|im_end|> only (the prompt is masked),
token-mean over each global batch. The result initializes Stage 2's actor, its analyzer and its KL reference.

Behaviour cloning (--bc-data, NOT in the paper: a warm start for small models that never win on their own):
every step of every won episode of a collect.py file becomes one more example, (the step's plain prompt exactly
as the rollout built it, the response that episode took). With `collect.py --model expert` those are the
game's stored walkthroughs in the agent's own <think>/<action> format. Mixed with annotate.py's examples, one
SFT gives a start that acts and analyzes; both Stage 2 arms (SEED and GRPO) then start from it.

The paper's settings (docs/paper.md, Stage 1 step 3) are the defaults: 3 epochs, lr 5e-6, max length 8,192 tokens
(prompt + answer; longer examples are counted and skipped, never truncated), global batch 8 sequences, the 10%
validation split given by each record's `split` field. Not in the paper (verl's SFT defaults): AdamW betas
(0.9, 0.95), weight decay 0.01, 10% linear warmup then cosine decay to 0, grad-norm clip 1.0.

    # 1 GPU (gradient accumulation: 8 micro-batches of 1 sequence per step)
    python sft.py --model Qwen/Qwen2.5-3B-Instruct --data runs/stage1/skills.sft.jsonl --out runs/stage1/sft
    # 8 GPUs (FSDP2, one sequence per GPU per step)
    torchrun --nproc_per_node 8 sft.py --model Qwen/Qwen2.5-3B-Instruct --data runs/stage1/skills.sft.jsonl \\
        --out runs/stage1/sft
    # CPU demo: a tiny random Qwen2 with the real tokenizer; a high lr so the loss visibly falls in 9 steps
    python sft.py --model tiny --data runs/demo/skills.sft.jsonl --out runs/demo/sft --epochs 3 --batch-size 4 \\
        --lr 3e-2 --warmup-ratio 0 --max-length 4096
    # behaviour-cloning warm start (not in the paper): the expert's won train episodes, plus the skill examples
    python collect.py --env alfworld --model expert --split train --tasks 300 --rollouts 1 --out runs/bc/expert.jsonl
    python sft.py --model Qwen/Qwen2.5-3B-Instruct --bc-data runs/bc/expert.jsonl --data runs/stage1/skills.sft.jsonl \\
        --epochs 2 --lr 1e-5 --batch-size 32 --micro-batch 8 --out runs/bc/sft
    # Search: the expert searches the question, then answers the gold; only wins whose passages held the gold count
    python collect.py --env search --model expert --split train --tasks 400 --rollouts 1 --out runs/bc/search.jsonl

Input: --data, one JSON line per example: {"id", "split": "train"|"val", "prompt": <user message>, "target":
<JSON string>, ...ids tracing it back to its annotation and trajectory}; --bc-data, collect.py's episode JSONL
(examples `bc-<episode uid>-s<step>`, split by a hash of the episode uid: an episode's steps stay together).
Output in --out: the final Hugging Face checkpoint (transformers and vLLM load the folder as is; Stage 2 takes
`--model <out>`), epoch_<k>/ after each earlier epoch, metrics.jsonl (one line per step and per validation),
seed_manifest.json, tokenized_preview.json (exactly which tokens carry loss), and trainer/ (model + optimizer
shards via torch.distributed.checkpoint, ~12 bytes per parameter: 36 GB for 3B; on several nodes --out must be
a shared filesystem). A killed run continues from its last trainer checkpoint: rerun the same command.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from envs import HelpFormatter, add_env_arg, env_from_argv, load_env, refuse_unused, require_positive
from common.models import load_model, load_tokenizer
from common.tracking import Tracker, add_log_to_arg
from common.records import (append_jsonl, args_diff, check_resume, open_jsonl_for_append, read_jsonl, resumed_manifest,
                          run_manifest, sha256_file, write_manifest)
from common.rollout import step_prompt
from common.checkpoints import latest_checkpoint, save_checkpoint_dir, save_hf_checkpoint
from common.packing import make_batch, packed_attention, response_select
from common.training import add_fused_arg, adamw_impl, check_fused, init_distributed, print0, shard_model
from prompts.chat import sft_example

def data_env(argv):
    """The env of the SFT data (annotate.py writes it into every example, collect.py into every episode): --env
    if given, else the first record's, so `sft.py --data ...` takes the right preset (max length 8,192 for
    ALFWorld, 12,288 otherwise)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env")
    pre.add_argument("--data")
    pre.add_argument("--bc-data", nargs="+")
    known, _ = pre.parse_known_args(argv)
    first_file = known.data or (known.bc_data or [None])[0]
    if not first_file or not os.path.isfile(first_file):
        return env_from_argv(argv)
    with open(first_file, encoding="utf-8") as f:
        first = f.readline()
    try:
        name = json.loads(first).get("env", "alfworld")  # examples written before envs had names: ALFWorld's
    except (json.JSONDecodeError, AttributeError):
        name = None  # a malformed file: the data check below names the bad records
    if known.env and name and known.env != name:  # the preset (max length) would be the wrong env's
        sys.exit(f"--env {known.env}: {first_file} holds {name} records; drop --env (the data's env is the default)")
    return env_from_argv(argv) if known.env else load_env(name or "alfworld")


env = data_env(sys.argv[1:])
# The paper's settings (docs/paper.md, Stage 1 step 3, and the per-env SFT max length); argparse defaults equal these.
PAPER = dict(env=env.NAME, epochs=3, lr=5e-6, max_length=env.PRESET["sft_max_length"], batch_size=8)

p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
add_env_arg(p, env)
p.add_argument("--model", required=True, help="HF path or hub id | tiny")
p.add_argument("--data", default=None, help="SFT JSONL written by annotate.py (the skill examples)")
p.add_argument("--bc-data", nargs="+", default=[], metavar="EPISODES",
               help="collect.py episode JSONL file(s): every step of every won episode becomes a behaviour-cloning "
                    "example (a warm start, not in the paper)")
p.add_argument("--val-fraction", type=float, default=0.1, help="--bc-data: share of episodes held out for the "
               "validation loss (annotate.py splits --data itself)")
p.add_argument("--out", required=True, help="output folder (checkpoints, metrics, manifest)")
p.add_argument("--epochs", type=int, default=PAPER["epochs"], help="passes over the train examples")
p.add_argument("--lr", type=float, default=PAPER["lr"], help="peak AdamW learning rate")
p.add_argument("--max-length", type=int, default=PAPER["max_length"],
               help="prompt + target tokens; longer examples are skipped")
p.add_argument("--batch-size", type=int, default=PAPER["batch_size"], help="global batch, in sequences, over all ranks")
p.add_argument("--micro-batch", type=int, default=1,
               help="sequences per forward per rank (gradient accumulation up to the global batch)")
p.add_argument("--warmup-ratio", type=float, default=0.1,
               help="linear warmup over this fraction of the steps, then cosine decay to 0")
p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
p.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip")
p.add_argument("--packing", default="auto", choices=["auto", "on", "off"],
               help="padding-free micro-batches (common/packing.py packed_attention); auto = on GPU (flash-attn, "
               "else PyTorch's varlen flash kernel, else FlexAttention), padded on CPU")
p.add_argument("--activation-checkpointing", action="store_true",
               help="recompute each decoder layer in backward (less memory)")
add_fused_arg(p)
p.add_argument("--save-every", type=int, default=50, help="trainer checkpoint every N steps (and at each epoch end)")
p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"],
               help="dtype of the HF checkpoints (float32 = the exact master weights Stage 2 continues from)")
p.add_argument("--max-steps", type=int, default=None, help="stop after this global step with a trainer checkpoint, "
               "as a preemption would (rerun without it to continue)")
p.add_argument("--resume", action="store_true", help="require a trainer checkpoint in --out (without the flag a "
               "checkpoint found there is resumed anyway)")
p.add_argument("--seed", type=int, default=0, help="data order (and the tiny model's init)")
add_log_to_arg(p)
args = p.parse_args()
require_positive(args, "epochs", "batch_size", "micro_batch", "max_length", "save_every", "max_steps")
if not args.bc_data:  # annotate.py splits --data itself (issue 29: no flag silently ignored)
    refuse_unused(p, args, ["val_fraction"], "it splits --bc-data episodes only (annotate.py split --data)")

rank, world, device = init_distributed()
check_fused(args.fused, device)  # --fused liger on CPU: one line now, not a traceback after the model loads
torch.manual_seed(args.seed)
os.makedirs(args.out, exist_ok=True)
print0(f"sft: world size {world}, device {device.type}\nconfig: {json.dumps(vars(args))}\n"
       f"diff vs paper: {json.dumps(args_diff(args, PAPER)) if args_diff(args, PAPER) else 'none'}")

# ---------------------------------------------------------------------------------------------------
# Resume: refuse other settings (common/records.py: the flags that may change), then the last complete trainer
# checkpoint in <out>/trainer (or trainer.old, if a kill hit the swap of the two)
data_files = ([args.data] if args.data else []) + args.bc_data
if not data_files:
    sys.exit("sft.py needs --data (annotate.py's skill examples), --bc-data (collect.py episodes), or both")
for path in data_files:
    if not os.path.isfile(path):
        sys.exit(f"{'--data' if path == args.data else '--bc-data'} {path}: no such file")
# one file: its sha256, as before; several: the sha256 of their sha256s in order (the resume identity)
data_sha256 = sha256_file(data_files[0]) if len(data_files) == 1 else hashlib.sha256(
    " ".join(sha256_file(f) for f in data_files).encode()).hexdigest()
manifest_path = os.path.join(args.out, "seed_manifest.json")
old_manifest = check_resume(manifest_path, args, script="sft.py", out=args.out, identity={"data.sha256": data_sha256})
tracker = Tracker(args.log_to, args.out, vars(args), rank)  # after the checks: a refused run logs nothing
CKPT = os.path.join(args.out, "trainer")
folder, resume = latest_checkpoint(CKPT, "trainer_state.json")
resume = dict(resume, path=folder) if resume else None
if args.resume and resume is None:
    sys.exit(f"--resume: no trainer checkpoint in {args.out}")
if resume is not None and resume["finished"]:
    print0(f"{args.out}: this run already finished ({resume['step']} steps); nothing to do")
    dist.destroy_process_group()
    sys.exit(0)

# ---------------------------------------------------------------------------------------------------
# Data: validate the records, tokenize exactly like the chat template, skip (and count) over-long examples
def bc_examples(path):
    """Behaviour cloning: every step of every won episode of a collect.py file -> (the step's plain prompt,
    rebuilt from the record exactly as the rollout built it, with the same history entries; the response taken).
    Episodes that lost, or whose env broke, teach nothing to copy and are skipped. So are wins that the env's
    own stats say were not supported by what the policy saw (Search: no retrieved passage held the gold answer):
    the expert knows the gold, and cloning such an episode would teach answering from memory after a useless
    search, the very habit that makes RL stop using the tool."""
    out, episodes, unsupported = [], read_jsonl(path), 0
    if episodes and not all(isinstance(e, dict) and "steps" in e and "uid" in e for e in episodes):
        sys.exit(f"--bc-data {path}: not collect.py episodes (records need 'uid' and 'steps')")
    for ep in episodes:
        if not ep.get("success") or ep.get("env_failure"):
            continue
        if env.episode_stats(ep).get("gold_retrieved") == 0.0:
            unsupported += 1
            continue
        h = hashlib.sha256(f"{args.seed}:{ep['uid']}".encode()).digest()
        split = "val" if int.from_bytes(h[:8], "big") / 2 ** 64 < args.val_fraction else "train"
        for t, st in enumerate(ep["steps"]):
            if st.get("response"):
                out.append(dict(id=f"bc-{ep['uid']}-s{t + 1}", split=split, prompt=step_prompt(ep, t, st["history_used"]),
                                target=st["response"], trajectory_uid=ep["uid"], trajectory_file=os.path.abspath(path)))
    won = sum(bool(e.get("success")) for e in episodes)
    print0(f"--bc-data {path}: {len(out)} step examples from {won - unsupported} won of {len(episodes)} episodes"
           + (f" ({unsupported} wins skipped: the gold was in no retrieved passage)" if unsupported else ""))
    return out


records = read_jsonl(args.data) if args.data else []
bad = [(n, r.get("id") if isinstance(r, dict) else None) for n, r in enumerate(records, 1)
       if not isinstance(r, dict) or r.get("split") not in ("train", "val")
       or not all(isinstance(r.get(k), str) and r.get(k) for k in ("id", "prompt", "target"))]
if bad:
    sys.exit(f"{args.data}: {len(bad)} records lack a string id/prompt/target or a split in (train, val); "
             f"first (record number, id): {bad[:5]}")
for path in args.bc_data:
    records += bc_examples(path)
if not records:
    sys.exit(f"no examples in {', '.join(data_files)}")
# Why sorted: collect.py and annotate.py append records in the order episodes finish, which varies with
# --workers and timing; the seeded shuffle below then gives the same batches for the same records in any order.
records.sort(key=lambda r: r["id"])
tokenizer = load_tokenizer(args.model)


def tokenize(rec):
    """prompt ids (the chat template, one user message, generation prompt: exactly what Stage 2 renders) + the
    target ids the loss is taken on: what the template itself renders for the assistant turn, up to and including
    <|im_end|> (prompts/chat.py `sft_example`; for Qwen2.5 that is target + <|im_end|>, for Qwen3 the same in its
    default non-thinking mode). A template whose (user, assistant) rendering does not match this layout is refused:
    training a layout the model never sees would be silent damage."""
    try:
        ex = sft_example(tokenizer, rec["prompt"], rec["target"])
    except ValueError as e:
        sys.exit(f"record {rec['id']}: {e}; refusing to train on a layout the model never sees")
    return dict(id=rec["id"], ids=ex["prompt_ids"] + ex["target_ids"], p_len=len(ex["prompt_ids"]),
                r_len=len(ex["target_ids"]))


splits = {"train": [], "val": []}
too_long = {"train": [], "val": []}
for rec in records:
    ex = tokenize(rec)
    (splits if len(ex["ids"]) <= args.max_length else too_long)[rec["split"]].append(ex)
train, val = splits["train"], splits["val"]
for s in ("train", "val"):
    if too_long[s]:
        print0(f"skipped {len(too_long[s])} {s} examples longer than --max-length {args.max_length} "
               f"(longest {max(len(e['ids']) for e in too_long[s])} tokens; "
               f"first ids: {[e['id'] for e in too_long[s][:3]]})")
if not train:
    sys.exit(f"{', '.join(data_files)}: no train example fits in --max-length {args.max_length}")
n_tgt = sum(e["r_len"] for e in train)
print0(f"data: {len(records)} records in {', '.join(data_files)}: train {len(train)}, val {len(val)} "
       f"({100 * len(val) / max(1, len(train) + len(val)):.1f}% val), over-long skipped: "
       f"train {len(too_long['train'])}, val {len(too_long['val'])}; train tokens {sum(len(e['ids']) for e in train)} "
       f"of which {n_tgt} carry loss (mean target {n_tgt / len(train):.0f} tokens)")
if not val:
    print0("no val examples: validation loss is skipped")
if args.batch_size < world:
    print0(f"warning: global batch {args.batch_size} < world size {world}: some ranks only run zero-weight dummies")

# The data order: a seeded shuffle per epoch, cut into global batches (the last one may be smaller). Every
# rank computes the same order; rank r takes examples r::world of each batch, so the global batches (and
# the loss curve) do not depend on the world size.
steps_per_epoch = math.ceil(len(train) / args.batch_size)
total_steps = args.epochs * steps_per_epoch


def epoch_batches(epoch):
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)).tolist()
    return [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]


def lr_at(step):
    """Linear warmup over the first warmup_ratio of the steps (from lr/warmup, so step 0 already learns),
    then cosine decay to 0: verl's SFT trainer defaults; the paper gives only the peak lr."""
    warmup = math.ceil(args.warmup_ratio * total_steps)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


# ---------------------------------------------------------------------------------------------------
# Model: fp32 master weights, FSDP2 per decoder layer then the root (bf16 compute on GPU), AdamW
# (distributed checkpoints and DTensor imported only here: ~2 s of imports that --help or a refused run skips)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

# padding-free micro-batches need an attention that reads the sequence boundaries (as in seed_rl.py)
packed_attn = packed_attention(device, args.packing)  # None: padded
packed = packed_attn is not None
model = load_model(args.model, dtype=torch.float32, device=device, seed=args.seed, attn=packed_attn)
attn = model.config._attn_implementation
model = shard_model(model, device, activation_checkpointing=args.activation_checkpointing, fused=args.fused)
model.train()
# betas (0.9, 0.95), weight decay 0.01 on every parameter: verl's SFT defaults (the paper states neither)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                              **adamw_impl(device))
pad_id = tokenizer.pad_token_id
print0(f"model: {args.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, attention {attn}, "
       f"{'packed' if packed else 'padded'} micro-batches of {args.micro_batch}; {steps_per_epoch} steps per epoch, "
       f"{total_steps} in all")


def save_trainer(state):
    """Model + optimizer shards (every rank writes its own) and the position in the data. A complete
    checkpoint exists at every instant (common/checkpoints.py save_checkpoint_dir: a temporary folder, completed by
    its trainer_state.json, swapped in by two renames)."""
    global saved_at
    saved_at = state["step"]
    model_sd, optim_sd = get_state_dict(model, optimizer)
    save_checkpoint_dir(CKPT, lambda tmp: dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp),
                        "trainer_state.json", dict(state, args=vars(args), data_sha256=data_sha256, world=world), rank)


step, start_epoch, start_batch, saved_at = 0, 0, 0, None
if resume is not None:
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the sharded layout to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=resume["path"])
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step, start_epoch, start_batch = resume["step"], resume["epoch"], resume["batch"]
    saved_at = step
    if start_batch and epoch_batches(start_epoch) != resume["order"]:
        sys.exit("the recomputed data order differs from the checkpoint's (different torch version?)")
    print0(f"resumed from {resume['path']}: step {step}, epoch {start_epoch + 1}, batch {start_batch} "
           f"(checkpoint written with world size {resume['world']})")

# metrics.jsonl: a resumed run drops the lines written after its checkpoint (they are recomputed)
metrics_path = os.path.join(args.out, "metrics.jsonl")
if rank == 0:
    keep = [r for r in read_jsonl(metrics_path)
            if resume is not None and r["step"] <= step and (r["kind"] == "train" or r["epoch"] <= start_epoch)]
    with open(metrics_path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(metrics_path + ".tmp", metrics_path)
    metrics = open_jsonl_for_append(metrics_path)

    def log_metrics(rec):  # metrics.jsonl, the source of truth, and the optional tracker (--log-to)
        append_jsonl(metrics, rec)
        tracker.log(rec)
    val_history = {str(r["epoch"]): r["val_loss"] for r in keep if r["kind"] == "val"}

manifest = run_manifest("sft.py", args, paper=PAPER, model=args.model, tokenizer=tokenizer, seeds={"seed": args.seed},
                        extra={"data": {"path": os.path.abspath(args.data) if args.data else None,
                                        "bc_data": [os.path.abspath(f) for f in args.bc_data], "sha256": data_sha256,
                                        "records": len(records), "train": len(train), "val": len(val),
                                        "skipped_too_long": {s: len(v) for s, v in too_long.items()},
                                        "skipped_ids": {s: [e["id"] for e in v] for s, v in too_long.items()}},
                               "world_size": world, "attn_implementation": attn, "packed": packed,
                               "optimizer": {"name": "AdamW", "betas": [0.9, 0.95], "weight_decay": args.weight_decay,
                                             "schedule": f"linear warmup {args.warmup_ratio:.0%} then cosine to 0"},
                               "steps": total_steps, "val_loss": {}})  # epoch -> val loss (0 = before training)
manifest = resumed_manifest(old_manifest, manifest, step=step if resume is not None else 0, world_size=world)
if rank == 0:
    manifest["val_loss"].update(val_history)
    write_manifest(manifest_path, manifest)

# ---------------------------------------------------------------------------------------------------
# Forward: summed NLL of the target tokens of a micro-batch


def nll_sum(examples):
    """(sum of -log p over the target tokens, number of target tokens) of a list of examples.

    An empty list still runs a forward and backward: FSDP's all-gathers and reduce-scatters are collectives
    every rank must join the same number of times, so a rank with nothing left in this global batch runs
    a 2-token dummy whose loss is multiplied by 0 (zero gradient, same communication)."""
    weight = 1.0 if examples else 0.0
    seqs = [e["ids"] for e in examples] or [[pad_id, pad_id]]
    spans = [(e["p_len"], e["r_len"]) for e in examples] or [(1, 1)]
    batch = make_batch(seqs, device, packed=packed, pad_id=pad_id)  # [B, T] padded or [1, sum T] packed
    select = response_select(batch, spans)  # [rows, T]: positions whose next token is a target token
    lp = model.token_logprobs(batch["input_ids"], batch["targets"], select, attention_mask=batch.get("attention_mask"),
                              position_ids=batch.get("position_ids"))  # [rows, T], 0 where not selected
    return -lp.sum() * weight, int(select.sum()) * int(weight)


def micro_batches(examples, n_global):
    """This rank's examples in micro-batches; every rank yields the same number (ceil(n_global / world)
    sequences at most per rank), padding with empty lists where it has fewer."""
    n_micro = math.ceil(math.ceil(n_global / world) / args.micro_batch)
    return [examples[m * args.micro_batch:(m + 1) * args.micro_batch] for m in range(n_micro)]


@torch.no_grad()
def evaluate():
    """Token-mean NLL over the whole val split (all ranks)."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [nll, target tokens]
    for mb in micro_batches(val[rank::world], len(val)):
        nll, n = nll_sum(mb)
        sums += torch.tensor([nll.item(), n], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[1]).item(), int(sums[1])


if rank == 0:  # what exactly carries loss, for a reader (and the tests): token ids and a 0/1 loss mask
    preview = []
    for ex in train[:2]:
        b = make_batch([ex["ids"]], "cpu", packed=packed, pad_id=pad_id)
        sel = response_select(b, [(ex["p_len"], ex["r_len"])])[0].tolist()
        preview.append(dict(id=ex["id"], input_ids=ex["ids"], loss_mask=[0] + [int(x) for x in sel[:-1]]))
    with open(os.path.join(args.out, "tokenized_preview.json"), "w") as f:
        json.dump(preview, f)
    ex = train[0]
    print0("example layout: ...{!r} | loss on: {!r}".format(tokenizer.decode(ex["ids"][ex["p_len"] - 12:ex["p_len"]]),
                                                            tokenizer.decode(ex["ids"][ex["p_len"]:])[:60] + " ... "
                                                            + tokenizer.decode(ex["ids"][-8:])))

# ---------------------------------------------------------------------------------------------------
# Train
if val and resume is None:
    v_loss, v_tok = evaluate()
    print0(f"val loss before training: {v_loss:.4f} ({v_tok} target tokens)")
    manifest["val_loss"]["0"] = v_loss
    if rank == 0:
        log_metrics(dict(kind="val", step=0, epoch=0, val_loss=v_loss, val_tokens=v_tok))

bar = tqdm(total=total_steps, initial=step, desc="sft", unit="step", disable=rank != 0)
t_run = time.perf_counter()
for epoch in range(start_epoch, args.epochs):
    batches = epoch_batches(epoch)
    for b in range(start_batch if epoch == start_epoch else 0, len(batches)):
        if args.max_steps is not None and step >= args.max_steps:  # a planned stop, like a preemption
            if saved_at != step:  # (the epoch end may just have saved this very position)
                save_trainer(dict(step=step, epoch=epoch, batch=b, order=batches, finished=False))
            bar.close()
            print0(f"stopped at step {step} (--max-steps); the same command without --max-steps continues")
            dist.destroy_process_group()
            sys.exit(0)
        t0 = time.perf_counter()
        idx = batches[b]
        local = [train[i] for i in idx[rank::world]]
        # Token-mean over the *global* batch: every micro-batch on every rank divides its summed NLL by the
        # same global count of target tokens, so sequences are weighted by their length, not per rank.
        counts = torch.tensor([sum(e["r_len"] for e in local), sum(len(e["ids"]) for e in local)], device=device)
        dist.all_reduce(counts)
        n_target, n_tokens = int(counts[0]), int(counts[1])
        lr = lr_at(step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for mb in micro_batches(local, len(idx)):
            nll, _ = nll_sum(mb)
            # FSDP2's reduce-scatter *averages* gradients over the ranks, but the global loss is the *sum*
            # of the ranks' shares (each already divided by the global token count): x world undoes the mean.
            (nll / n_target * world).backward()
            loss_sum += nll.detach().double()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        loss = (loss_sum / n_target).item()
        step += 1
        dt = time.perf_counter() - t0
        rec = dict(kind="train", step=step, epoch=epoch + 1, loss=loss, lr=lr, grad_norm=grad_norm.item(),
                   examples=len(idx), tokens=n_tokens, target_tokens=n_target, tokens_per_s=n_tokens / dt)
        if device.type == "cuda":
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if rank == 0:
            log_metrics(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{n_tokens / dt:.0f}")
        if step % args.save_every == 0 and b + 1 < len(batches):  # the epoch end saves anyway
            save_trainer(dict(step=step, epoch=epoch, batch=b + 1, order=batches, finished=False))

    # ----- epoch end: validation, Hugging Face checkpoint, trainer checkpoint
    if val:
        v_loss, v_tok = evaluate()
        manifest["val_loss"][str(epoch + 1)] = v_loss
        if rank == 0:
            bar.write(f"epoch {epoch + 1}: val loss {v_loss:.4f} ({v_tok} target tokens)")
            log_metrics(dict(kind="val", step=step, epoch=epoch + 1, val_loss=v_loss, val_tokens=v_tok))
    last = epoch + 1 == args.epochs
    hf_dir = args.out if last else os.path.join(args.out, f"epoch_{epoch + 1}")
    save_hf_checkpoint(model, tokenizer, hf_dir, rank, dtype=getattr(torch, args.save_dtype))
    if rank == 0:
        write_manifest(os.path.join(hf_dir, "seed_manifest.json"), dict(manifest, epochs_done=epoch + 1))
    save_trainer(dict(step=step, epoch=epoch + 1, batch=0, order=None, finished=last))
bar.close()

elapsed = time.perf_counter() - t_run
print0(f"done: {step} steps in {elapsed:.1f}s this run; final checkpoint in {args.out} "
       f"(load with --model {args.out}); metrics in {metrics_path}")
if rank == 0:
    metrics.close()
tracker.close()
dist.destroy_process_group()
