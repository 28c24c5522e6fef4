"""Load test of the Search env's retriever server: many concurrent clients, both request shapes, errors counted.

Starts `python -m envs.retriever` over the shipped corpus on 127.0.0.1 (a free port; nothing else is ever
targeted), once per --backlogs value, and sends --requests requests from --clients threads. Each client keeps
one HTTP/1.1 connection and opens a new one every --per-connection requests (so the listen queue also sees
bursts of connects, which is where a small backlog resets connections). Requests alternate between the two
shapes of the wild, {"query": q} and {"queries": [q]}, each one hotpotqa500 question with topk 3 and
return_scores true. There are no retries: any exception, non-200 answer or answer without one result list per
query is an error, and counted. Latency is the client's (request sent to answer parsed).

    OMP_NUM_THREADS=1 python benchmarks/retriever_load.py                     # 64 clients, 10,000 requests
    OMP_NUM_THREADS=1 python benchmarks/retriever_load.py --backlogs 128,5    # beside the old default of 5

Bounded: at most --requests per row, and each row stops sending after --max-seconds (the row then says so).
Exits 1 when a row had an error. Not a test (pytest does not collect it); the numbers depend on the machine and its load (printed with them).
"""
import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.retriever_common import (load_average, parse_args, pct, read_questions, start_server,  # noqa: E402
                                         write_results)

p, args = parse_args(__doc__, argparse.RawDescriptionHelpFormatter, [  # and --data, --out: retriever_common.py
    ("--clients", int, 64, "concurrent client threads"),
    ("--requests", int, 10_000, "requests per row, shared by the clients"),
    ("--per-connection", int, 20, "requests per connection before a client reconnects"),
    ("--backlogs", str, "128", "comma-separated server --backlog values, one row each"),
    ("--timeout", float, 30.0, "client socket timeout per request, seconds"),
    ("--max-seconds", float, 300.0, "a row stops sending after this many seconds")])
for name in ("clients", "requests", "per_connection"):
    if getattr(args, name) < 1:
        p.error(f"--{name.replace('_', '-')} must be 1 or more")

questions = read_questions(args.data)
CORPUS = os.path.join(args.data, "corpus.jsonl.xz")


def run_row(port):
    """Send the requests; returns (sorted latencies in ms, error counts by kind, wall seconds, requests sent)."""
    lock, latencies, errors = threading.Lock(), [], {}
    counter = iter(range(args.requests))
    deadline = time.monotonic() + args.max_seconds

    def note_error(kind):
        with lock:
            errors[kind] = errors.get(kind, 0) + 1

    def client():
        conn, used = None, 0
        while time.monotonic() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            if conn is None or used >= args.per_connection:
                if conn is not None:
                    conn.close()
                conn, used = http.client.HTTPConnection("127.0.0.1", port, timeout=args.timeout), 0
            q = questions[i % len(questions)]
            body = {"query": q} if i % 2 else {"queries": [q]}
            body.update(topk=3, return_scores=True)
            data = json.dumps(body).encode()
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/retrieve", body=data, headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                answer = r.read()
                used += 1
                if r.status != 200:
                    note_error(f"HTTP {r.status}")
                    conn.close()
                    conn = None
                    continue
                result = json.loads(answer)["result"]
                if len(result) != 1 or not isinstance(result[0], list):
                    note_error("malformed answer")
                    continue
            except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
                note_error(type(e).__name__)
                conn.close()
                conn = None
                continue
            with lock:
                latencies.append(1000 * (time.perf_counter() - t0))
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return sorted(latencies), errors, wall, len(latencies) + sum(errors.values())


load = load_average()
print(f"machine: {os.cpu_count()} CPU cores, load average {load}; {args.clients} clients, {args.requests} requests "
      f"per row, a new connection every {args.per_connection} requests per client", flush=True)
rows = []
with tempfile.TemporaryDirectory(prefix="retriever_load_") as tmp:
    for backlog in [int(x) for x in args.backlogs.split(",")]:
        work = tempfile.mkdtemp(dir=tmp)
        proc, url = start_server(CORPUS, work, "--backlog", str(backlog))
        port = urlsplit(url).port
        try:
            lat, errors, wall, sent = run_row(port)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        row = dict(backlog=backlog, sent=sent, ok=len(lat), errors=sum(errors.values()), kinds=errors,
                   qps=len(lat) / wall, p50=pct(lat, 0.50), p99=pct(lat, 0.99), max=lat[-1] if lat else float("nan"),
                   wall=wall, cut=sent < args.requests)
        rows.append(row)
        print(f"backlog {backlog:>4}: {sent} sent, {row['ok']} ok, {row['errors']} errors {errors or ''}, "
              f"{row['qps']:.0f} req/s, p50 {row['p50']:.1f} ms, p99 {row['p99']:.1f} ms, max {row['max']:.0f} ms"
              + (f" (stopped at --max-seconds {args.max_seconds:g})" if row["cut"] else ""), flush=True)

table = ["| server --backlog | clients | requests | errors | requests/s | p50 ms | p99 ms | max ms |",
         "|---:|---:|---:|---:|---:|---:|---:|---:|"]
table += [f"| {r['backlog']} | {args.clients} | {r['sent']:,}{' (cut)' if r['cut'] else ''} | {r['errors']}"
          f"{' ' + json.dumps(r['kinds']) if r['kinds'] else ''} | {r['qps']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
          f"{r['max']:.0f} |" for r in rows]
print("\n".join(table))
if args.out:
    write_results(args.out, "Retriever load test", "benchmarks/retriever_load.py", load,
                  f". {args.clients} client threads, one keep-alive connection each, renewed every "
                  f"{args.per_connection} requests; the two request shapes alternate; one hotpotqa500 question per "
                  f"request, topk 3; no retries.", table)
sys.exit(1 if any(r["errors"] for r in rows) else 0)
