"""Queries/s and latency of the Search env's BM25 retriever server, and how they grow with corpus size.

For each corpus size (the shipped 4,968-passage corpus, and that corpus replicated 10x and 100x with new
ids), start `python -m envs.retriever` as a subprocess on a loopback port with an empty index cache (so the
build time is measured too), then send a fixed number of requests from 1 and from 16 concurrent clients
(threads of this process calling `envs.retriever.retrieve`, the env's own client and pooled session). Each
request is what a game sends: {"queries": [one hotpotqa500 question], "topk": 3, "return_scores": true}.
Latency is measured by the client (request to parsed answer); the server's RSS is read from /proc.

    python benchmarks/retriever_bench.py --out benchmarks/retriever_results.md
    python benchmarks/retriever_bench.py --sizes 1,10 --requests 500     # quicker

Not a test (pytest does not collect it). Loopback only; the replicated corpora go to a temporary folder that
is removed at the end. Numbers depend on the machine and its load; the load average is printed with them.
"""
import argparse
import json
import lzma
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.retriever_common import (load_average, parse_args, pct, read_questions, start_server,  # noqa: E402
                                         write_results)
from envs.retriever import retrieve  # noqa: E402

_, args = parse_args(__doc__.split("\n\n")[0], argparse.ArgumentDefaultsHelpFormatter, [  # and --data, --out
    ("--sizes", str, "1,10,100", "corpus replication factors to measure"),
    ("--clients", str, "1,16", "numbers of concurrent clients"),
    ("--requests", int, 1000, "timed requests per (size, clients) cell"),
    ("--warmup", int, 20, "untimed requests before each cell"),
    ("--topk", int, 3, "passages per query (the env's default)")])

questions = read_questions(args.data)
with lzma.open(os.path.join(args.data, "corpus.jsonl.xz"), "rt") as f:
    corpus = [json.loads(line) for line in f]


def write_corpus(path, times):
    """The corpus `times` times; copy r > 0 gets ids '<id>-r<r>' (same contents, so it only adds volume)."""
    with open(path, "w") as f:
        for r in range(times):
            for d in corpus:
                f.write(json.dumps({"id": d["id"] if r == 0 else f"{d['id']}-r{r}", "contents": d["contents"]}) + "\n")


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def one(url, i):
    t0 = time.perf_counter()
    hits = retrieve(url, [questions[i % len(questions)]], topk=args.topk, timeout=60, retries=0)
    assert len(hits) == 1
    return time.perf_counter() - t0


def measure(url, clients):
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda i: one(url, i), range(args.warmup)))
        t0 = time.perf_counter()
        lat = sorted(pool.map(lambda i: one(url, i), range(args.requests)))
        wall = time.perf_counter() - t0
    return {"qps": len(lat) / wall, "p50": 1000 * pct(lat, 0.50), "p99": 1000 * pct(lat, 0.99)}


load = load_average()
print(f"machine: {os.cpu_count()} CPU cores, load average {load}; {args.requests} requests per cell", flush=True)
rows = []
tmp = tempfile.mkdtemp(prefix="retriever_bench_")
try:
    for times in [int(x) for x in args.sizes.split(",")]:
        path = os.path.join(args.data, "corpus.jsonl.xz") if times == 1 else os.path.join(tmp, f"corpus_x{times}.jsonl")
        if times != 1:
            write_corpus(path, times)
        work = tempfile.mkdtemp(dir=tmp)
        t0 = time.perf_counter()
        proc, url = start_server(path, work, wait_s=1800)  # the time to serve includes building the index
        ready_s = time.perf_counter() - t0
        try:
            for c in [int(x) for x in args.clients.split(",")]:
                r = measure(url, c)
                rows.append(dict(r, docs=len(corpus) * times, times=times, clients=c, ready_s=ready_s,
                                 rss=rss_mb(proc.pid)))
                print(f"x{times:<4} {len(corpus) * times:>8,} docs  {c:>2} clients  {r['qps']:8.1f} q/s  "
                      f"p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            shutil.rmtree(work, ignore_errors=True)
finally:
    shutil.rmtree(tmp, ignore_errors=True)

table = ["| corpus | passages | clients | queries/s | p50 ms | p99 ms | start incl. index build (s) | server RSS (MB) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
label = lambda times: "shipped" if times == 1 else f"shipped x{times} (new ids)"
table += [f"| {label(r['times'])} | {r['docs']:,} | {r['clients']} | "
          f"{r['qps']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['ready_s']:.1f} | {r['rss']:.0f} |" for r in rows]
print("\n".join(table))
if args.out:
    write_results(args.out, "Retriever server benchmark", "benchmarks/retriever_bench.py", load,
                  f"; {args.requests} timed requests per row after {args.warmup} warm-up ones, each one question "
                  f"(hotpotqa500) with topk {args.topk}, over loopback HTTP through `envs.retriever.retrieve`.", table)
