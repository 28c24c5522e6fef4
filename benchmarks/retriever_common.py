"""What the two benchmarks of the Search env's retriever server share (retriever_bench.py: speed by corpus size;
retriever_load.py: many clients, errors counted): their command line, the questions they send, the server they
start, the percentiles they report and the markdown file they write. Not a benchmark itself."""
import argparse
import json
import lzma
import os
import re
import select
import subprocess
import sys
import time

from envs.search import default_data_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(description, formatter_class, flags):
    """The command line of a benchmark: --data, then its own `flags`, a list of (flag, type, default, help), then
    --out. Returns (parser, args)."""
    p = argparse.ArgumentParser(description=description, formatter_class=formatter_class)
    p.add_argument("--data", default=default_data_dir(), help="folder with corpus.jsonl.xz and hotpotqa500.jsonl.xz")
    for flag, type_, default, text in flags:
        p.add_argument(flag, type=type_, default=default, help=text)
    p.add_argument("--out", default=None, help="also write the table and the command to this markdown file")
    return p, p.parse_args()


def read_questions(data):
    """The hotpotqa500 questions of the env's data folder (one per request, in turn)."""
    with lzma.open(os.path.join(data, "hotpotqa500.jsonl.xz"), "rt") as f:
        return [json.loads(line)["question"] for line in f]


def start_server(corpus, workdir, *flags, wait_s=300):
    """`python -m envs.retriever` over `corpus` on a free port of 127.0.0.1 (nothing else is ever targeted), its
    index cache and log under `workdir`, with extra server `flags`; returns (process, url) as soon as it prints
    where it serves (the index is built first: a large corpus needs a larger `wait_s`)."""
    proc = subprocess.Popen([sys.executable, "-m", "envs.retriever", "--corpus", corpus, "--host", "127.0.0.1",
                             "--port", "0", *flags, "--cache-dir", os.path.join(workdir, "cache"),
                             "--log-file", os.path.join(workdir, "server.log")],
                            cwd=REPO, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < wait_s:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            m = re.search(r"at (http://\S+/retrieve)", proc.stdout.readline())
            if m:
                return proc, m.group(1)
    proc.kill()
    raise SystemExit(f"the retriever over {corpus} did not start")


def pct(lat, q):
    """The q-quantile of sorted latencies (nan when there are none)."""
    return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")


def load_average():
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def write_results(path, title, script, load, setup, table):
    """The markdown file of a run: the command as run from the repository root, the machine and its load at the
    start, `setup` (what each row sends; it starts with its own separator), then the table's lines."""
    with open(path, "w") as f:
        f.write(f"# {title}\n\nCommand (from the repository root):\n\n"
                f"    OMP_NUM_THREADS=1 python {script} {' '.join(sys.argv[1:])}\n\n"
                f"Machine: {os.cpu_count()} CPU cores (shared), load average at start {load}{setup}\n\n"
                + "\n".join(table) + "\n")
