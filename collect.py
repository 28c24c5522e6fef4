"""Stage 1a: the base policy plays the train tasks of the chosen env; every episode is recorded for the analyzer.

The paper's set (docs/paper.md, Stage 1): 180 train tasks x 8 rollouts = 1,440 trajectories, temperature 0.4, the
plain prompt (no skill), each env's steps, history and lengths (ALFWorld: 30 tasks per type x 6 types, 30 steps,
5 history entries, 2,048-token prompts; WebShop 15 steps, history 2; Search 4 turns, history 4).

    # 1 GPU (vLLM engine)
    python collect.py --env alfworld --model Qwen/Qwen2.5-3B-Instruct --backend vllm --out runs/stage1/traj.jsonl
    # 8 GPUs: collection is embarrassingly parallel; shard it and concatenate the files
    for i in 0 1 2 3 4 5 6 7; do CUDA_VISIBLE_DEVICES=$i python collect.py --env alfworld \\
        --model Qwen/Qwen2.5-3B-Instruct --backend vllm --shard $i/8 --out runs/stage1/traj.$i.jsonl & done; wait
    # CPU demo (no GPU): the scripted expert, and a tiny random model with the real Qwen2.5 tokenizer
    python collect.py --env alfworld --model expert --tasks 6 --rollouts 2 --out runs/demo/expert.jsonl
    python collect.py --env alfworld --model tiny --tasks 6 --rollouts 1 --max-steps 3 --max-new-tokens 16 \\
        --out runs/demo/tiny.jsonl

Output: one JSON line per episode, written the moment that episode ends (the record schema: common/rollout.py;
append-only; a killed or interrupted run restarts where it stopped: episodes already written are skipped by
id, a torn last line is cut; Ctrl-C says how many are saved), and `<out>.manifest.json` beside it.
"""
import os
import sys
import time


from envs import env_from_argv, env_parser, require_positive, require_split
from common.records import check_resume, read_jsonl, resumed_manifest, run_manifest, write_manifest
from common.rollout import add_play_args, add_rollout_args, format_summary, play_into_jsonl, summarize_episodes

env = env_from_argv()  # --env first: every default below is that env's paper preset
P = env.PRESET
# The paper's settings (docs/paper.md, Stage 1 and Per-env settings); the manifest diffs the run against them.
PAPER = dict(env=env.NAME, split=P["collect_split"], tasks=P["collect_tasks"], rollouts=P["rollouts"],
             max_steps=P["max_steps"], history=P["history"], temperature=0.4, max_new_tokens=P["max_new_tokens"],
             max_prompt_tokens=P["max_prompt_tokens"], invalid_penalty=P["invalid_penalty"], invalid_rule="public")

p, g = env_parser(__doc__, env)
g.add_argument("--split", default=PAPER["split"], help=f"split the tasks come from ({env.NAME}: "
               f"{', '.join(env.SPLITS)})")
g.add_argument("--tasks", type=int, default=PAPER["tasks"], help="tasks to play (ALFWorld: an equal share of "
               "each of the 6 task types)")
g.add_argument("--rollouts", type=int, default=PAPER["rollouts"], help="episodes per task")
add_rollout_args(g, PAPER)
g.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="env worker processes")
env.add_args(g)
g = p.add_argument_group("policy and generation")
g.add_argument("--model", required=True, help="HF path or hub id | tiny (random, real tokenizer) | expert (scripted)")
add_play_args(g, batch_episodes=64)
g = p.add_argument_group("run")
g.add_argument("--seed", type=int, default=0, help="task choice and sampling")
g.add_argument("--shard", default="0/1", help="i/n: play every n-th episode starting at i")
g.add_argument("--out", required=True, help="episode JSONL (append-only; rerun the same command to resume)")
args = p.parse_args()
require_positive(args, "tasks", "rollouts", "max_steps", "max_new_tokens", "workers", "batch_episodes")
require_split(env, "--split", args.split)
try:
    shard_i, shard_n = map(int, args.shard.split("/"))
    assert 0 <= shard_i < shard_n
except (ValueError, AssertionError):
    sys.exit(f"--shard {args.shard!r}: expected i/n with 0 <= i < n, e.g. 0/8")

# ---------------------------------------------------------------------------------------------------
# Plan: the deterministic list of episodes, minus those already written (resume)
games = env.stage1_tasks(args.seed, args.tasks, args)
if not games:
    sys.exit(f"{env.NAME}: split {args.split!r} has no tasks (is the env's data complete?); nothing to play")
plan = [dict(g, uid=f"{g['task_id']}#r{r}", group=gi, rollout=r, seed=args.seed)
        for gi, g in enumerate(games) for r in range(args.rollouts)][shard_i::shard_n]
if not plan:
    sys.exit(f"--shard {args.shard}: the plan has {len(games) * args.rollouts} episodes, none of them in this shard")

# torch and transformers only now (seconds of imports): --help and the refusals above answer without them
from common.backends import make_policy  # noqa: E402
from common.models import load_tokenizer  # noqa: E402

manifest_path = args.out + ".manifest.json"
tokenizer = load_tokenizer(args.model)
# the split the games actually come from (each task says), not the flag: they can only differ by a bug
played = ",".join(sorted({g["split"] for g in games}))
if played != args.split:
    sys.exit(f"{env.NAME}: --split {args.split} drew tasks of the split(s) {played}; refusing to record a mislabelled run")
manifest = run_manifest("collect.py", args, paper=PAPER, model=args.model, tokenizer=tokenizer, split=played,
                        games=games, seeds={"seed": args.seed})
old = check_resume(manifest_path, args, script="collect.py", out=args.out,  # refuse to mix two collections
                   identity={"games.sha256": manifest["games"]["sha256"]})

done_ids = {ep["uid"] for ep in read_jsonl(args.out)}
todo = [e for e in plan if e["uid"] not in done_ids]
write_manifest(manifest_path, resumed_manifest(old, manifest, episodes_done=len(plan) - len(todo)))
print(f"collect: {len(games)} tasks x {args.rollouts} rollouts = {len(plan)} episodes in this shard; "
      f"{len(plan) - len(todo)} already in {args.out}, {len(todo)} to play")

# ---------------------------------------------------------------------------------------------------
# Policy: scripted expert, HF generate, or vLLM
policy = make_policy(args.model, tokenizer, backend=args.backend, max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                     gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=args.kv_cache_gib, seed=args.seed)

# ---------------------------------------------------------------------------------------------------
# Play: up to --batch-episodes episodes at once, each at its own pace; each is appended the moment it ends
# (samples depend only on (seed, uid, step), so the order they end in changes nothing)
t_start = time.time()
timings, env_stats = play_into_jsonl(env, todo, policy, tokenizer, args, args.out, len(plan) - len(todo), len(plan))

# ---------------------------------------------------------------------------------------------------
# Summary over everything in the file (this run and earlier, resumed ones)
elapsed = time.time() - t_start
records = read_jsonl(args.out)
print(format_summary(summarize_episodes(records, env), f"success per {env.NAME} group ({len(records)} episodes in {args.out})"))
n_steps = env_stats["steps"]
print(f"this run: {len(todo)} episodes, {n_steps} steps in {elapsed:.1f}s "
      f"({60 * len(todo) / max(elapsed, 1e-9):.1f} episodes/min); time split: "
      + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items() if v)
      + f"; env failures {env_stats['env_failures']}, workers replaced {env_stats['workers_replaced']}")
