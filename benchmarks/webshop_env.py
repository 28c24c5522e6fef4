"""WebShop env latency and memory per env worker, on a synthetic 1,000-product catalog of the official shape
(envs/webshop/synthetic.py; the real catalog is not on the project's machines).

1. A worker's first game: a fresh interpreter imports envs.webshop, parses the catalog, builds the goals and
   the BM25 index (cold) / loads the index from the disk cache (warm), plays one reset.
2. In a worker: make_game + reset (what the pool does per episode) and step latency, p50/p99, over episodes
   that mix the scripted expert's actions with random admissible ones (every page kind, searches, purchases);
   step latency also per action kind (search, click, buy). Memory: the worker's RSS after imports, after
   loading, at the end, and its peak.
3. Through EnvPool (2 workers, 16 slots): one batched reset/step call, p50/p99.

    OMP_NUM_THREADS=1 python benchmarks/webshop_env.py                  # writes benchmarks/webshop_results.md
    OMP_NUM_THREADS=1 python benchmarks/webshop_env.py --episodes 100 --out /tmp/ws.md

Goal (issue 17): step under 20 ms and reset under 50 ms, so the env never dominates an update. Not a test.
"""
import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def rss_mb(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] * 1000 if xs else float("nan")


# ----------------------------------------------------------------------------------------------------
# The worker side (a fresh interpreter, as an EnvPool worker is)

def worker(data_dir, cache, episodes, seed, first_only):
    t0 = time.perf_counter()
    import envs.webshop as W
    mem = {"imports": rss_mb()}
    t1 = time.perf_counter()
    task = {"data_dir": data_dir, "index_cache": cache, "goal_index": 0}
    W.make_game(task).reset()
    out = {"import_s": t1 - t0, "first_game_s": time.perf_counter() - t1}
    mem["loaded"] = rss_mb()
    if first_only:
        return dict(out, mem=mem)
    rng = random.Random(seed)
    n_goals = len(W.load_catalog(data_dir).goals)
    resets, steps = [], {"search": [], "click": [], "buy": [], "other": []}
    for e in range(episodes):
        task = dict(task, goal_index=rng.randrange(n_goals))
        t = time.perf_counter()
        game = W.make_game(task)
        st = game.reset()
        resets.append(time.perf_counter() - t)
        ep = dict(task, steps=[], _obs=st["observation"], _admissible=st["admissible"])
        for _ in range(W.PRESET["max_steps"]):
            if rng.random() < 0.3 and st["admissible"]:  # a random admissible action: other pages, other items
                action = rng.choice(st["admissible"]).replace("<your query>", rng.choice(["shoes", "tea", "chair"]))
            else:
                action = W.expert_action(ep)
            kind = "buy" if action == "click[buy now]" else action.split("[")[0] if "[" in action else "other"
            t = time.perf_counter()
            st = game.step(action)
            steps[kind].append(time.perf_counter() - t)
            ep["steps"].append({"executed": action})
            ep.update(_obs=st["observation"], _admissible=st["admissible"])
            if st["done"]:
                break
    mem.update(end=rss_mb(), peak=rss_mb("VmHWM"))
    return dict(out, mem=mem, resets=resets, steps=steps)


def run_worker(*args):
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(args)], cwd=REPO, check=True,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    return json.loads(out.stdout.strip().splitlines()[-1])


def pool_latency(data_dir, cache, batches, slots=16, workers=2, seed=0):
    import envs.webshop as W
    from envs.pool import EnvPool
    rng = random.Random(seed)
    n_goals = len(W.load_catalog(data_dir).goals)
    resets, steps = [], []
    with EnvPool("envs.webshop:make_game", num_workers=workers) as pool:
        pool.reset([{"data_dir": data_dir, "index_cache": cache, "goal_index": 0}] * slots)  # workers load once
        for _ in range(batches):
            tasks = [{"data_dir": data_dir, "index_cache": cache, "goal_index": rng.randrange(n_goals)}
                     for _ in range(slots)]
            t = time.perf_counter()
            states = pool.reset(tasks)
            resets.append(time.perf_counter() - t)
            eps = [dict(tk, steps=[], _obs=s["observation"], _admissible=s["admissible"]) for tk, s in zip(tasks, states)]
            live = set(range(slots))
            for _ in range(W.PRESET["max_steps"]):
                if not live:
                    break
                actions = {i: W.expert_action(eps[i]) for i in live}
                t = time.perf_counter()
                out = pool.step(actions)
                steps.append(time.perf_counter() - t)
                for i, st in out.items():
                    eps[i]["steps"].append({"executed": actions[i]})
                    eps[i].update(_obs=st["observation"], _admissible=st["admissible"])
                    if st["done"]:
                        live.discard(i)
    return resets, steps


# ----------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--products", type=int, default=1000, help="synthetic catalog size (the real small set: 1,000)")
    ap.add_argument("--episodes", type=int, default=300, help="episodes played in the measured worker")
    ap.add_argument("--pool-batches", type=int, default=10, help="batches of 16 episodes through EnvPool")
    ap.add_argument("--description-words", type=int, default=475,
                    help="made-up words per description: 475 makes the file about the real one's 4.5 MB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "webshop_results.md"), help="markdown report")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))))
        return

    from envs.webshop.data import load_catalog
    from envs.webshop.synthetic import write_catalog
    tmp = tempfile.mkdtemp(prefix="webshop-bench-")
    data_dir = write_catalog(os.path.join(tmp, "data"), args.products, args.seed, args.description_words)
    cache = os.path.join(tmp, "index")
    size_mb = os.path.getsize(os.path.join(data_dir, "items_shuffle_1000.json")) / 1e6
    cat = load_catalog(data_dir)
    cold = run_worker(data_dir, cache, 0, args.seed, True)  # builds and saves the index
    warm = run_worker(data_dir, cache, 0, args.seed, True)  # loads it
    w = run_worker(data_dir, cache, args.episodes, args.seed, False)
    p_resets, p_steps = pool_latency(data_dir, cache, args.pool_batches, seed=args.seed)

    all_steps = [x for xs in w["steps"].values() for x in xs]
    rows = [("make_game + reset (in a worker)", w["resets"], 50), ("step, any action", all_steps, 20)]
    rows += [(f"step: {k}", v, 20) for k, v in w["steps"].items() if v]
    rows += [("EnvPool reset, 16 slots / 2 workers (one call)", p_resets, None),
             ("EnvPool step, 16 slots / 2 workers (one call)", p_steps, None)]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    lines = [
        "# WebShop env: latency and memory per worker",
        "",
        f"Synthetic catalog of {len(cat.products):,} products in the official format "
        f"(`envs/webshop/synthetic.py`, {args.description_words} made-up words per description: a "
        f"{size_mb:.1f} MB file, the real one is 4.5 MB), {len(cat.goals):,} goals; {os.cpu_count()} cores ({cpu}), shared with "
        f"other work; Python {platform.python_version()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}.",
        "",
        "    " + " ".join(["OMP_NUM_THREADS=1", "python", "benchmarks/webshop_env.py"]
                         + ([f"--products {args.products}"] if args.products != 1000 else [])
                         + ([f"--episodes {args.episodes}"] if args.episodes != 300 else [])),
        "",
        "| what | n | p50 ms | p99 ms | goal |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, xs, goal in rows:
        ok = "" if goal is None else (f"< {goal} ms: {'yes' if pct(xs, 99) < goal else 'p99 over'}")
        lines.append(f"| {name} | {len(xs)} | {pct(xs, 50):.2f} | {pct(xs, 99):.2f} | {ok} |")
    m = w["mem"]
    lines += [
        "",
        "| a worker's first game (fresh interpreter) | seconds |",
        "| --- | ---: |",
        f"| import envs.webshop | {warm['import_s']:.2f} |",
        f"| catalog + goals + BM25 index built and saved (first worker ever) + reset | {cold['first_game_s']:.2f} |",
        f"| catalog + goals + index loaded from the disk cache + reset | {warm['first_game_s']:.2f} |",
        "",
        "| worker memory (RSS) | MiB |",
        "| --- | ---: |",
        f"| after imports | {m['imports']:.0f} |",
        f"| after loading the catalog and the index | {m['loaded']:.0f} |",
        f"| after {args.episodes} episodes | {m['end']:.0f} |",
        f"| peak | {m['peak']:.0f} |",
        "",
        f"Episodes in the worker: {args.episodes}, the scripted expert's actions with 30% random admissible ones "
        f"(searches, items, options, sub-pages, pages, purchases); at most {15} steps each. The EnvPool rows are "
        f"one batched call for 16 episodes over 2 workers (IPC included), after a first batch that loaded the "
        f"workers.",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
