#!/usr/bin/env bash
# The GPU runs behind the README's "Performance" and "The chain on a real model" sections, on one H200 with
# the device bundles installed (vLLM 0.24.0, alfworld 0.4.2, Qwen2.5-Coder-0.5B-Instruct, the assets).
# benchmarks/remote/README.md says why the runs are split into such calls; your own GPU box needs none of it.
# Parts, each under 10 minutes, run back to back (B and C read S1's checkpoint from $RUN):
#
#   bash benchmarks/remote/h200.sh A    # trainer-step benchmark (Qwen2.5-1.5B shape, random weights, ablations),
#                                # then R
#   bash benchmarks/remote/h200.sh R    # rollout benchmark (vLLM direct vs the project's backend), with vLLM's V2
#                                # model runner (the project's choice) and with V1; HF generate in the first;
#                                # then both runners at seed_rl.py's batch per engine (16 x 512 new tokens)
#   bash benchmarks/remote/h200.sh W    # issue 31 item 5: weight sync and generation at the 1.5B and 3B shapes
#                                # (random weights, model runner V2): 128 x (1,200 + 256) and seed_rl.py's batch
#                                # per engine (16 x 512; B16=0 skips it, B128=0 the first); SHAPES="1.5B 3B" picks
#   bash benchmarks/remote/h200.sh I    # issue 31 item 4: does the rollout's loop_idle measure the engine's idle
#                                # time? benchmarks/loop_idle.py: a known sleep between polls of a real engine
#   bash benchmarks/remote/h200.sh S1   # Stage 1 on the real 0.5B model: collect -> annotate (the model analyzes its
#                                # own episodes) -> short SFT; then engine-vs-trainer log-prob agreement
#   SFT_DATA=results/2026-12-03-stage1-chain-0.5b/stage1/skills.sft.jsonl bash benchmarks/remote/h200.sh SFT
#                                # only S1's SFT, from an earlier run's annotated data (kept in the repo)
#   bash benchmarks/remote/h200.sh P    # trainer step on step-sample lengths (issue 20): plain HF padded vs the
#                                # project's step padded and packed; the lengths B recorded ($RUN/seed/
#                                # lengths.jsonl, or $LENGTHS) if present, else the 480 real step samples of
#                                # results/2026-12-03-search-trainer-lengths-0.5b/alfworld-seed/lengths.jsonl;
#                                # PROFILE=1 adds kernel tables (one more pass per path); PATHS=a,b picks
#                                # trainer_lengths.py --paths; LIMIT=seconds (default 290)
#   bash benchmarks/remote/h200.sh B    # seed_rl.py, SEED (the paper's per-GPU share of an update)
#   bash benchmarks/remote/h200.sh C    # seed_rl.py --opd-coef 0, GRPO (same episodes at update 1); B and C:
#                                # UPDATES (default 3), SEED_RL_ARGS="--fused liger --max-steps 15": more flags
#   bash benchmarks/remote/h200.sh AS   # issue 19: the rollout in lockstep vs per episode (2 x 8 and 16 x 8 episodes,
#                                # 30 steps), then seed_rl.py's update with the self-analysis overlapped (SEED,
#                                # GRPO, SEED --lockstep; 2 updates each) within BUDGET s (default 480);
#                                # $OUT/rollout_async.json (benchmarks/rollout_async.py); PARTS=a,update picks
#                                # its --parts (default a,update,update_lockstep,b)
#   bash benchmarks/remote/h200.sh Q    # Search (issue 16): the project's BM25 retriever over the shared corpus
#                                # ($SEARCH_DATA), the 0.5B model's EM on the 100 validation questions before
#                                # and after a few SEED updates on the train questions; retriever share of time
#   bash benchmarks/remote/h200.sh L    # the learning benchmark (issue 21, learning_remote.py): SEED and GRPO
#                                # from the same start, matched seeds, 10 updates of 2 x 8 episodes, 15 steps,
#                                # lr 1e-5, each end policy evaluated on held-out games (plain prompt); one
#                                # record per finished run in results/learning/, copied to $OUT/learning/
#
# Part L, its knobs (environment variables) and what fits (one call ~8.5 minutes: BUDGET=480 s for the driver,
# then up to ~60 s to end; the driver returns at its deadline):
#   SEEDS="0 1 2" METHODS=seed,grpo   the queue (seed-major: SEED and GRPO of a seed together); finished
#                                     runs (on file in results/learning/ or done in $RUN/learning) are skipped
#   LANES=2         jobs at a time on the GPU (two seed_rl.py side by side, vLLM at 0.2 of the GPU each,
#                   engine starts kept apart by the gate in learning_remote.py); LANES=1: one at a time (vLLM 0.4)
#   DETACH=1        (default) at the deadline the jobs keep running (own process sessions) and the next call
#                   of L collects them: call L back to back (the machine keeps /tmp ~30 s after a call).
#                   DETACH=0: only jobs that the estimates say end before the deadline are started, and what
#                   has not ended by then is killed (no record; attempts.jsonl says so)
#   START=sft       start from $RUN/sft (made here first from $SFT_DATA if missing, ~80 s) instead of the base
#   START=bc        start from $RUN/bc, made here first if missing: sft.py --bc-data $BC_DATA --data $BC_SKILLS
#                   (the behaviour-cloning warm start shared by both arms; .xz files are unpacked); PROBE=1
#                   runs the plumbing check (seed_rl.py --probe-action admissible, base model) beside that SFT
#   UPDATES TASKS STEPS LR: unset, learning.py's preset for the env (ALFWorld: 10 updates of 2 x 8, 15 steps,
#                   lr 1e-5; Search: 10 of 8 x 8, 4 turns); EVAL_LIMIT (12 games per split; Search: 100, the whole val
#                   split); PACKING=off|auto|... (seed_rl.py --packing); SEED_RL_ARGS="--mini-batch 32 ...": more
#                   seed_rl.py flags (learning.py --seed-rl-args); KV_GIB=4: each engine's fixed KV cache (GiB),
#                   so an engine start stops no other job (learning_remote.py's gate); LEARN_ARGS: more
#                   learning_remote.py flags (e.g. --dry-run; --eval-in-run: each seed_rl.py run evaluates its
#                   own start and end, no evaluate.py jobs, no separate start evaluation, one engine start per run)
#   two LRs side by side: call L twice in one call, e.g. `LR=3e-6 BUDGET=190 ... L; LR=1e-6 BUDGET=... ... L`
#                   (same $RUN: the two drivers share the start and its evaluation; the first returns at its deadline)
#   QWEN_CODER_DIR=$QWEN_CODER_15B_DIR   the 1.5B model (its device bundle exports that path) instead of the 0.5B
#   ENV=search      Search on the hotpot questions ($SEARCH_DATA): the retriever starts in its own process
#                   session on 127.0.0.1:8000 (kept for the next call), the held-out questions are the val split
# Sizing, measured in the fifth to seventh sessions (results/2026-12-03-rollout-async-trainer-profile,
# results/2026-12-03-learning-alfworld-base-partial, results/2026-12-04-learning-alfworld-base):
# alone, at 15 steps of 2 x 8 episodes, SEED 18-22 s and GRPO 15-17.5 s per update, start-up ~100 s (vLLM
# compiles on a fresh machine), end evaluation ~95 s. Side by side, per update: LANES=3 SEED 35-40 s, GRPO
# 24-32 s; LANES=2 (two SEED runs) SEED 42-44 s; a SEED run's training 607-609 s at LANES=2, device peak 82 GiB
# (LANES=3: 123.0 of 140 GiB). End evaluations 94-147 s each. So a SEED run is ~14 minutes side by side: a wave
# of runs spans two calls, and the last call must leave ~4 minutes after training for the end evaluations. The
# queue runs in the order of SEEDS, then METHODS: put the runs you need most first. Five runs at LANES=3 took
# three calls (seventh session: 428 + 531 + 367 s of the driver). If the machine goes away first,
# `python benchmarks/remote/learning_remote.py --salvage <files_at>/L.tar.gz` records what came back (a run
# whose training finished, without its end evaluation). Put SEED_CODE_COMMIT=<the commit you send> in the
# command: the device copy's .git can be stale, and the records keep what you name beside what git says.
# From the warm start (2026-12-05, results/2026-12-05-plumbing-check-bc-start-alfworld-0.5b): the device install
# took most of 2 minutes; START=bc's SFT 139 s with its load (1 epoch, 83 steps), the probe beside it; then
# KV_GIB=3 LANES=5 (the start's 274-game evaluation + 4 runs): one SEED update 32.8 s, device 41-51 GiB in use,
# the start evaluation ~1 episode/s while four runs started; engine starts one at a time took 40-50 s each
# (since then only the first of each kind goes alone). All 274 games per evaluation is the costly part: budget
# ~5 minutes for each, side by side. On one H100 80GB (2026-12-05 evening) LANES=5 with TASKS=4 had no job past
# update 1 after 225 s of driver time. Next: LANES=2-3 and LEARN_ARGS=--eval-in-run (each run evaluates its own
# start and end with its own engine: no evaluate.py engine starts, no end weights written).
# 2026-12-06 on one H100 (results/2026-12-06-learning-alfworld-bc-start-0.5b): START=bc LANES=3 SEEDS=0
# METHODS=grpo,seed UPDATES=8 TASKS=3 without --eval-in-run (one start evaluation for both runs) fit two calls:
# GRPO 27.8 s and SEED 37.4 s per update, the start's 274 games 261 s, each end evaluation ~230 s, peak 49.5 GiB.
# At LR=1e-5 both arms collapsed from the peaked BC start within two updates: use the paper's 1e-6 (or 3e-6).
# The same at LR=3e-6 (results/2026-12-06-learning-alfworld-bc-start-lr3e-6-steps-0.5b) took three calls: the
# first (install, SFT 105 s, 335 s of driver) left GRPO at update 5 and SEED at update 2; the second (530 s) ended
# GRPO with its end evaluation; the third only collected SEED's record (it ended between the calls). Peak 44.5 GiB.
#
# Each step logs to $RUN/logs and goes on after a failure (its exit code is logged); results are copied
# to $OUT (the device tool brings that folder back) as one tarball per part. Parts L and Q have their jobs'
# commands built by benchmarks/remote/commands.py, which tests/test_h200_paths.py runs on CPU (tiny model).
set -u
RUN=${RUN:-/tmp/seed-run}
OUT=${OUT:-$RUN/out}
M=${QWEN_CODER_DIR:-/tmp/models/qwen2.5-coder-0.5b-instruct}
mkdir -p "$RUN/logs" "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY=${PY:-python3}
TORCHRUN="$PY -m torch.distributed.run --standalone --nproc_per_node 1"
CMDS=benchmarks/remote/commands.py  # parts L and Q build their jobs' commands there (tests/test_h200_paths.py runs them)

step() {  # step NAME TIMEOUT_S CMD...: run, log, time, never abort the part
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$RUN/logs/steps.txt"
  timeout "$limit" "$@" > "$RUN/logs/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$RUN/logs/steps.txt"
  tail -n 25 "$RUN/logs/$name.log"
}

sft() {  # sft TIMEOUT_S DATA: the short SFT of the 0.5B model (S1, SFT); its metrics copied to stage1/
  step sft "$1" $TORCHRUN sft.py --model "$M" --data "$2" --out "$RUN/sft" --epochs 2 --save-dtype bfloat16
  mkdir -p "$RUN/stage1" && cp "$RUN/sft/metrics.jsonl" "$RUN/stage1/sft_metrics.jsonl" 2>/dev/null
}

retriever() {  # retriever [setsid]: the BM25 server on 127.0.0.1:8000 over $SEARCH_DATA unless one answers
  RETR=""       # its pid when started here; setsid: in its own session, so it outlives this call
  curl -sf http://127.0.0.1:8000/health > /dev/null && return
  ${1:-} $PY $CMDS retriever --corpus "${SEARCH_DATA:-${SHARED:-../shared}/search}/corpus.jsonl.xz" --port 8000 \
      --log-file "$RUN/logs/retriever.log" > "$RUN/logs/retriever.out" 2>&1 < /dev/null &
  RETR=$!
  for i in $(seq 90); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RUN/logs/gpu.txt"
$PY -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)" | tee -a "$RUN/logs/gpu.txt"

case "${1:-}" in
A|R)  # performance: trainer step (A only), rollout with each vLLM model runner
  mkdir -p "$RUN/perf"
  [ "$1" = A ] && step trainer_step 300 $PY benchmarks/trainer_step.py --ablate --profile "$RUN/perf/profile" \
      --json "$RUN/perf/trainer_step.json"
  step rollout 240 env VLLM_USE_V2_MODEL_RUNNER=1 $PY benchmarks/rollout.py --json "$RUN/perf/rollout.json"
  step rollout_v1 180 env VLLM_USE_V2_MODEL_RUNNER=0 $PY benchmarks/rollout.py --skip-hf \
      --json "$RUN/perf/rollout_v1.json"
  for v in 2 1; do  # model runner V2, then V1, at seed_rl.py's batch per engine: 16 episodes, 512 new tokens
    step rollout_b16_v$v 120 env VLLM_USE_V2_MODEL_RUNNER=$((v - 1)) $PY benchmarks/rollout.py --skip-hf \
        --prompts 16 --new-tokens 512 --repeats 3 --json "$RUN/perf/rollout_b16_v$v.json"
  done
  tar -czf "$OUT/$1.tar.gz" -C "$RUN" perf logs
  ;;
P)  # trainer step on real (or synthetic) step-sample lengths, padded vs packed vs plain HF
  mkdir -p "$RUN/perf"
  L=${LENGTHS:-$RUN/seed/lengths.jsonl}
  [ -f "$L" ] || L=results/2026-12-03-search-trainer-lengths-0.5b/alfworld-seed/lengths.jsonl  # 480 real ones on file
  step trainer_lengths ${LIMIT:-290} $PY benchmarks/trainer_lengths.py $([ -f "$L" ] && echo --lengths "$L") ${PATHS:+--paths "$PATHS"} \
      ${PROFILE:+--profile "$RUN/perf/profile_lengths"} --json "$RUN/perf/trainer_lengths.json"
  tar -czf "$OUT/P.tar.gz" -C "$RUN" perf logs $([ -f "$RUN/seed/lengths.jsonl" ] && echo seed/lengths.jsonl)
  ;;
W)  # weight sync + generation beside a standalone engine, per model shape (rollout.py: the sync is gather + load)
  mkdir -p "$RUN/perf"
  MEM=0.5  # the engine's share: the fp32 policy (4 bytes a parameter: 12 GB at 3B) sits beside it, on 80 GB too
  for shape in ${SHAPES:-1.5B 3B}; do
    [ "${B128:-1}" = 1 ] && step rollout_$shape 240 $PY benchmarks/rollout.py --config Qwen2.5-$shape-Instruct --skip-hf \
        --gpu-memory-utilization $MEM --json "$RUN/perf/rollout_$shape.json"
    [ "${B16:-1}" = 1 ] && step rollout_${shape}_b16 150 $PY benchmarks/rollout.py --config Qwen2.5-$shape-Instruct --skip-hf \
        --gpu-memory-utilization $MEM --prompts 16 --new-tokens 512 --repeats 3 --sync-repeats 0 \
        --json "$RUN/perf/rollout_${shape}_b16.json"
  done
  tar -czf "$OUT/W.tar.gz" -C "$RUN" perf logs
  ;;
I)  # the loop_idle check: sleeps of known length between polls of the 0.5B engine
  mkdir -p "$RUN/perf"
  step loop_idle 240 $PY benchmarks/loop_idle.py --model "$M" --json "$RUN/perf/loop_idle.json"
  tar -czf "$OUT/I.tar.gz" -C "$RUN" perf/loop_idle.json logs
  ;;
SFT)  # S1's SFT alone, from $SFT_DATA
  sft 150 "${SFT_DATA:-$RUN/stage1/skills.sft.jsonl}"
  tar -czf "$OUT/SFT.tar.gz" -C "$RUN" stage1 logs
  ;;
S1)  # Stage 1 on the real 0.5B model, then log-prob agreement on its prompts
  mkdir -p "$RUN/stage1" "$RUN/perf"
  step collect 150 $PY collect.py --model "$M" --backend vllm --split train --tasks 6 --rollouts 2 \
      --workers 12 --gpu-memory-utilization 0.6 --out "$RUN/stage1/traj.jsonl"
  step annotate 150 $PY annotate.py --trajectories "$RUN/stage1/traj.jsonl" --out "$RUN/stage1/skills.jsonl" \
      --analyzer local --model "$M" --backend vllm --gpu-memory-utilization 0.6
  sft 120 "$RUN/stage1/skills.sft.jsonl"
  INIT=$RUN/sft; [ -f "$INIT/config.json" ] || INIT=$M
  step agreement 100 $TORCHRUN benchmarks/logprob_agreement.py --model "$INIT" --trajectories "$RUN/stage1/traj.jsonl" \
      --json "$RUN/perf/logprob_agreement.json"
  tar -czf "$OUT/S1.tar.gz" -C "$RUN" stage1 perf logs
  ;;
B|C)  # Stage 2 from the Stage 1 checkpoint: B = SEED, C = the same with --opd-coef 0 (GRPO)
  INIT=$RUN/sft; [ -f "$INIT/config.json" ] || INIT=$M  # without a Stage 1 checkpoint: the base model
  # the paper's ALFWorld update on one of 8 GPUs: 16 tasks x 8 rollouts / 8 ranks = 2 groups of 8 here.
  # ~70 s start-up + ~60 s per update + the final checkpoint (fp32 weights + AdamW state, ~20 s)
  COMMON="--env alfworld --model $INIT --tasks-per-update 2 --group-size 8 --workers 16 --save-every 100 --dump-examples 8"
  if [ "$1" = B ]; then NAME=seed; EXTRA=""; else NAME=grpo; EXTRA="--opd-coef 0"; fi
  step $NAME 420 $TORCHRUN seed_rl.py $COMMON --updates ${UPDATES:-3} $EXTRA ${SEED_RL_ARGS:-} --out "$RUN/$NAME"
  tar -czf "$OUT/$1.tar.gz" -C "$RUN" $NAME/metrics.jsonl $NAME/seed_manifest.json logs \
      $(cd "$RUN" && ls $NAME/examples.jsonl $NAME/lengths.jsonl $NAME/analyses.jsonl 2>/dev/null)
  ;;
AS)  # lockstep vs per-episode rollout, and the update with the analysis overlapped (from $INIT if S1 ran)
  INIT=$RUN/sft; [ -f "$INIT/config.json" ] || INIT=$M
  mkdir -p "$RUN/async"
  step rollout_async $(( ${BUDGET:-480} + 60 )) $PY benchmarks/rollout_async.py --model "$INIT" --work "$RUN/async" \
      --budget "${BUDGET:-480}" ${PARTS:+--parts "$PARTS"} --json "$RUN/async/rollout_async.json"
  cp "$RUN/async/rollout_async.json" "$OUT/" 2>/dev/null
  tar -czf "$OUT/AS.tar.gz" -C "$RUN" logs $(cd "$RUN" && ls -d async/*.log async/*.json async/*/metrics.jsonl 2>/dev/null)
  ;;
Q)  # Search: retriever server, EM before, SEED updates, EM after (validation questions, plain prompt)
  mkdir -p "$RUN/search"
  retriever
  step search_eval0 150 $PY $CMDS search-eval --model "$M" --out "$RUN/search/eval0"
  step search_seed 330 $PY $CMDS search-train --model "$M" --tasks ${TASKS:-16} --updates ${UPDATES:-4} \
      --lr ${LR:-1e-5} --out "$RUN/search/seed"
  F=$RUN/search/seed/hf/final; [ -f "$F/config.json" ] || F=$M
  step search_eval1 150 $PY $CMDS search-eval --model "$F" --out "$RUN/search/eval1"
  [ -n "$RETR" ] && kill $RETR 2>/dev/null
  for d in eval0 eval1; do rm -f "$RUN/search/$d/trajectories.jsonl.gz"; gzip -f "$RUN/search/$d/trajectories.jsonl" 2>/dev/null; done
  tar -czf "$OUT/Q.tar.gz" -C "$RUN" search/eval0 search/eval1 search/seed/metrics.jsonl search/seed/examples.jsonl \
      search/seed/seed_manifest.json search/seed/lengths.jsonl logs
  ;;
L)  # the learning benchmark: see the header for the knobs and the sizing
  START_MODEL=$M
  if [ "${START:-base}" = sft ]; then
    [ -f "$RUN/sft/config.json" ] || sft 150 "${SFT_DATA:-results/2026-12-03-stage1-chain-0.5b/stage1/skills.sft.jsonl}"
    START_MODEL=$RUN/sft
  fi
  if [ "${START:-base}" = bc ] && [ ! -f "$RUN/bc/config.json" ]; then
    # the shared warm start (not in the paper): behaviour cloning on the expert's won train episodes
    # ($BC_DATA, collect.py --model expert) + the scripted analyzer's skill examples ($BC_SKILLS), one SFT
    # from the base model; meanwhile the plumbing check (PROBE=1) trains the base model on --probe-action
    for f in ${BC_DATA:-} ${BC_SKILLS:-}; do case $f in *.xz) xz -dkf "$f" ;; esac; done
    if [ "${PROBE:-0}" = 1 ]; then
      mkdir -p "$RUN/probe"
      $PY $CMDS probe --model "$M" --updates ${PROBE_UPDATES:-10} ${KV_GIB:+--kv-cache-gib "$KV_GIB"} \
          --out "$RUN/probe" > "$RUN/logs/probe.log" 2>&1 &
      PROBE_PID=$!
      # vLLM sizes its KV cache from the free memory it sees while it profiles, and fails if another process
      # allocates meanwhile (learning_remote.py's gate): the SFT starts once the probe's engine is up, unless
      # the engine's KV cache is fixed (KV_GIB: no profiling)
      [ -z "${KV_GIB:-}" ] && for i in $(seq 150); do
        grep -q "init engine (" "$RUN/logs/probe.log" 2>/dev/null && break; sleep 1; done
    fi
    step bc_sft 420 $PY $CMDS bc-sft --model "$M" --bc-data "${BC_DATA%.xz}" ${BC_SKILLS:+--skills "${BC_SKILLS%.xz}"} \
        --out "$RUN/bc" --epochs ${BC_EPOCHS:-2} --lr ${BC_LR:-1e-5}
    [ -n "${PROBE_PID:-}" ] && wait "$PROBE_PID"
    # one tarball (the device returns at most 8 files): the SFT's and the probe's metrics, manifests, logs
    (cd "$RUN" && tar -czf "$OUT/BC.tar.gz" $(ls bc/metrics.jsonl bc/seed_manifest.json probe/metrics.jsonl \
        probe/seed_manifest.json logs/probe.log logs/bc_sft.log 2>/dev/null))
  fi
  [ "${START:-base}" = bc ] && START_MODEL=$RUN/bc
  # the retriever outlives this call: the detached jobs need it next call
  [ "${ENV:-alfworld}" = search ] && retriever setsid
  LEFT=$(( ${BUDGET:-480} - SECONDS ))  # what this call has left for the driver
  # settings left unset come from learning.py's per-env preset (ALFWorld: 10 updates of 2 x 8, 15 steps, lr 1e-5)
  step learning $((LEFT + 60)) $PY $CMDS learning --model "$START_MODEL" --env "${ENV:-alfworld}" \
      --methods "${METHODS:-seed,grpo}" --seeds "${SEEDS:-0 1 2}" --lanes "${LANES:-2}" ${UPDATES:+--updates "$UPDATES"} \
      ${TASKS:+--tasks "$TASKS"} ${STEPS:+--steps "$STEPS"} ${LR:+--lr "$LR"} ${EVAL_LIMIT:+--eval-limit "$EVAL_LIMIT"} \
      --deadline-s "$LEFT" --scratch "$RUN/learning" ${PACKING:+--packing "$PACKING"} ${KV_GIB:+--kv-cache-gib "$KV_GIB"} \
      ${SEED_RL_ARGS:+--seed-rl-args "$SEED_RL_ARGS"} \
      $([ "${DETACH:-1}" = 1 ] && echo --detach) -- ${LEARN_ARGS:-}
  mkdir -p "$OUT/learning" && cp results/learning/*.jsonl "$OUT/learning/"
  # logs, status and metrics of every job, each evaluation's actions (no weights, no full trajectories)
  (cd "$RUN" && find learning -maxdepth 3 -not -path 'learning/start-*' \( -name '*.log' -o -name '*.json' \
      -o -name metrics.jsonl -o -name examples.jsonl -o -name results.md -o -name actions.jsonl \) -print \
      | tar -czf "$OUT/L.tar.gz" -T - logs)
  ;;
*) echo "usage: $0 A|R|P|S1|SFT|B|C|Q|L|AS"; exit 2 ;;
esac
