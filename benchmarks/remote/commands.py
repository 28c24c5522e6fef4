"""The commands that benchmarks/remote/h200.sh's job-starting parts run (part L for both envs, part Q), built here
in one place so that tests/test_h200_paths.py runs the very same commands on CPU with the tiny model: a wrong URL
or flag fails CI instead of a GPU call (issue 29; every Search job once failed with HTTP 404, the URL lacked
/retrieve). h200.sh passes only paths and its knobs' values; what a job is (its script and flags) is here.

    python benchmarks/remote/commands.py probe --model M --out /tmp/probe --print   # the command, not run
    python benchmarks/remote/commands.py probe --model M --out /tmp/probe           # run it (exec)
    python benchmarks/remote/commands.py search-eval --model tiny --out /tmp/e --backend hf -- --limit 1

Flags after `--` are appended to the built command (the script's argparse keeps the last value: the CPU tests
shrink sizes that way, without touching the flags that say what runs). Without --print the command is printed,
then this process becomes it (os.execvp: same pid, so h200.sh's `timeout`, `&` and `wait` act on the job itself).
"""
import argparse
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RETRIEVER_PORT = 8000  # h200.sh's retriever, kept between calls of a machine (its health check uses the same port)


def head(torchrun):
    """The interpreter, under torchrun with one process as on the GPU (seed_rl.py, sft.py), or plainly."""
    return [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
                               if torchrun else [])


def retriever_url(port):
    return f"http://127.0.0.1:{port}/retrieve"  # the POST endpoint (the bare host answers HTTP 404)


def kv_flag(a):
    """--kv-cache-gib where h200.sh's KV_GIB is set: the engine's fixed KV cache."""
    return ["--kv-cache-gib", str(a.kv_cache_gib)] if a.kv_cache_gib else []


def retriever(a):
    """The BM25 server over the shared corpus (Search), on loopback."""
    return [sys.executable, "-m", "envs.retriever", "--corpus", a.corpus, "--port", str(a.port),
            "--log-file", a.log_file]


def search_eval(a):
    """Part Q's EM on the 100 validation questions (all of them: no --limit), plain prompt."""
    return ([sys.executable, "evaluate.py", "--env", "search", "--splits", "val", "--backend", a.backend]
            + (["--gpu-memory-utilization", "0.5"] if a.backend == "vllm" else [])
            + ["--workers", str(a.workers), "--retriever-url", retriever_url(a.port), "--model", a.model,
               "--out", a.out])


def search_train(a):
    """Part Q's SEED updates on the train questions."""
    return head(a.torchrun) + [
        "seed_rl.py", "--env", "search", "--model", a.model, "--tasks-per-update", str(a.tasks), "--group-size", "8",
        "--updates", str(a.updates), "--lr", str(a.lr), "--workers", str(a.workers), "--save-every", "100",
        "--dump-examples", "8", "--retriever-url", retriever_url(a.port), "--out", a.out]


def probe(a):
    """Part L's plumbing check (PROBE=1): GRPO on ALFWorld rewarded for a valid, admissible first action, one step
    per episode; it shows that a reward the policy can reach moves it (README: the learning benchmark). ('look'
    was tried first: the base model never wrote it, so no group had signal.)"""
    return head(a.torchrun) + [
        "seed_rl.py", "--env", "alfworld", "--model", a.model, "--opd-coef", "0", "--probe-action", "admissible",
        "--max-steps", "1", "--updates", str(a.updates), "--tasks-per-update", "4", "--group-size", "8", "--lr", "1e-5",
        "--workers", str(a.workers), "--gpu-memory-utilization", "0.15", "--save-every", "0", "--dump-examples", "0",
        "--out", a.out] + kv_flag(a)


def bc_sft(a):
    """Part L's warm start (START=bc): one SFT of the base model on the expert's won train episodes (collect.py
    --model expert) plus the scripted analyzer's skill examples; both arms start from it."""
    return head(a.torchrun) + (
        ["sft.py", "--env", "alfworld", "--model", a.model, "--bc-data", a.bc_data]
        + (["--data", a.skills] if a.skills else [])
        + ["--out", a.out, "--epochs", str(a.epochs), "--lr", str(a.lr), "--batch-size", "32", "--micro-batch", "8",
           "--save-every", "10000", "--save-dtype", "bfloat16"])


def learning(a):
    """Part L's driver: benchmarks/remote/learning_remote.py for this call (settings left unset: learning.py's
    per-env preset); Search's env flag points both seed_rl.py and evaluate.py at the retriever."""
    seed_rl_args = " ".join(x for x in ([f"--packing {a.packing}"] if a.packing else []) + [a.seed_rl_args] if x)
    opt = [(f, v) for f, v in (("--updates", a.updates), ("--tasks-per-update", a.tasks), ("--max-steps", a.steps),
                               ("--lr", a.lr)) if v is not None]
    return ([sys.executable, "benchmarks/remote/learning_remote.py", "--model", a.model, "--env", a.env,
             "--methods", a.methods, "--seeds", a.seeds, "--lanes", str(a.lanes)]
            + [x for f, v in opt for x in (f, str(v))]
            + ["--eval-limit", str(a.eval_limit if a.eval_limit is not None else 100 if a.env == "search" else 12),
               "--deadline-s", str(a.deadline_s), "--scratch", a.scratch, "--python", sys.executable]
            + ([f"--seed-rl-args={seed_rl_args}"] if seed_rl_args else []) + kv_flag(a)
            + ([f"--env-args=--retriever-url {retriever_url(a.port)}"] if a.env == "search" else [])
            + (["--detach"] if a.detach else []))


BUILDERS = {"retriever": retriever, "search-eval": search_eval, "search-train": search_train, "probe": probe,
            "bc-sft": bc_sft, "learning": learning}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="name", required=True, metavar="NAME")

    def cmd(name, help, port=False, torchrun=False, model=True, out=True):
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("--print", action="store_true", help="print the command (shell-quoted) and exit")
        if model:
            s.add_argument("--model", required=True, help="HF folder of the policy | tiny")
        if out:
            s.add_argument("--out", required=True, help="the job's output folder")
        if port:
            s.add_argument("--port", type=int, default=RETRIEVER_PORT, help="the retriever's port on 127.0.0.1")
        if torchrun:
            s.add_argument("--no-torchrun", dest="torchrun", action="store_false",
                           help="plain python instead of torchrun with one process (CPU tests)")
        return s

    s = cmd("retriever", "the BM25 retriever server", port=True, model=False, out=False)
    s.add_argument("--corpus", required=True, help="corpus.jsonl(.xz) of passages")
    s.add_argument("--log-file", required=True, help="the server's request log")
    s = cmd("search-eval", "part Q's evaluation (EM on the val questions)", port=True)
    s.add_argument("--workers", type=int, default=16, help="env workers")
    s.add_argument("--backend", default="vllm", choices=["vllm", "hf"], help="evaluate.py's engine")
    s = cmd("search-train", "part Q's SEED updates", port=True, torchrun=True)
    s.add_argument("--tasks", type=int, default=16, help="questions per update (h200.sh: $TASKS)")
    s.add_argument("--updates", type=int, default=4, help="h200.sh: $UPDATES")
    s.add_argument("--lr", type=float, default=1e-5, help="h200.sh: $LR")
    s.add_argument("--workers", type=int, default=16, help="env workers")
    s = cmd("probe", "part L's plumbing check (PROBE=1)", torchrun=True)
    s.add_argument("--updates", type=int, default=10, help="h200.sh: $PROBE_UPDATES")
    s.add_argument("--kv-cache-gib", type=float, default=0.0, help="the engine's fixed KV cache (h200.sh: $KV_GIB)")
    s.add_argument("--workers", type=int, default=4, help="env workers")
    s = cmd("bc-sft", "part L's behaviour-cloning warm start (START=bc)", torchrun=True)
    s.add_argument("--bc-data", required=True, help="the expert's episodes (collect.py --model expert)")
    s.add_argument("--skills", default=None, help="skill examples (annotate.py --analyzer scripted), optional")
    s.add_argument("--epochs", type=int, default=2, help="h200.sh: $BC_EPOCHS")
    s.add_argument("--lr", type=float, default=1e-5, help="h200.sh: $BC_LR")
    s = cmd("learning", "part L's driver for one call", port=True, out=False)
    s.add_argument("--env", default="alfworld", choices=["alfworld", "search"], help="h200.sh: $ENV")
    s.add_argument("--methods", default="seed,grpo", help="h200.sh: $METHODS")
    s.add_argument("--seeds", default="0 1 2", help="h200.sh: $SEEDS")
    s.add_argument("--lanes", type=int, default=2, help="jobs side by side (h200.sh: $LANES)")
    s.add_argument("--updates", type=int, default=None, help="h200.sh: $UPDATES (unset: the env preset)")
    s.add_argument("--tasks", type=int, default=None, help="tasks per update (h200.sh: $TASKS)")
    s.add_argument("--steps", type=int, default=None, help="max steps (h200.sh: $STEPS)")
    s.add_argument("--lr", type=float, default=None, help="h200.sh: $LR")
    s.add_argument("--eval-limit", type=int, default=None, help="tasks per split (default: 12; Search 100, the "
                   "whole val split)")
    s.add_argument("--deadline-s", type=float, required=True, help="what this call has left for the driver")
    s.add_argument("--scratch", required=True, help="job folders (kept on the machine between calls)")
    s.add_argument("--packing", default=None, help="seed_rl.py --packing (h200.sh: $PACKING)")
    s.add_argument("--seed-rl-args", default="", help="more seed_rl.py flags, one string (h200.sh: $SEED_RL_ARGS)")
    s.add_argument("--kv-cache-gib", type=float, default=0.0, help="each engine's fixed KV cache: engine starts no "
                   "longer stop the other jobs (h200.sh: $KV_GIB)")
    s.add_argument("--detach", action="store_true", help="leave the jobs running at the deadline (h200.sh: DETACH=1)")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    cmd = BUILDERS[args.name](args) + extra
    print(("" if args.print else "== exec: ") + shlex.join(cmd), flush=True)
    if not args.print:
        os.chdir(REPO)  # the scripts' paths are relative to the checkout
        os.execvp(cmd[0], cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
