"""Which self-analysis answers would `seed_rl.py --analysis-loop-stop WINDOW` cut, and where? Replayed offline on
a run's dumped answers (analyses.jsonl, written by seed_rl.py --dump-examples), re-tokenized with the run's
tokenizer, with the rule both backends apply (common/backends.py `LoopStop`).

    python benchmarks/analysis_loops.py results/2026-12-07-seed-vs-grpo-same-episodes-30-steps/seed/analyses.jsonl \
        --windows 256 384 512

Prints, per window, every answer it would cut: uid, how the answer really ended, its length and the cut. A cut of
an answer that ended by itself ('stop') is a skill the window would have lost. Then, over the answers that ended
by themselves, the longest stretch written with a period of at most half of it: a window above it cuts none.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.backends import loop_end  # noqa: E402
from common.models import load_tokenizer  # noqa: E402
from common.records import read_jsonl  # noqa: E402


def longest_periodic(ids):
    """The longest stretch of ids with some period p <= half its length: a loop-stop window longer than this
    never cuts the answer."""
    ids, best = np.asarray(ids), 0
    for p in range(1, len(ids) // 2 + 1):
        same = np.concatenate([[False], ids[p:] == ids[:-p], [False]])  # [T - p + 2]
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))  # starts and ends of the runs of matches
        runs = edges[1::2] - edges[::2]
        if len(runs) and runs.max() >= p:
            best = max(best, int(runs.max()) + p)
    return best


p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("analyses", nargs="+", help="analyses.jsonl files of seed_rl.py runs")
p.add_argument("--windows", type=int, nargs="+", default=[256, 512], help="loop-stop windows (tokens) to replay")
p.add_argument("--tokenizer", default="tiny", help="tokenizer folder; tiny: the Qwen2.5 tokenizer under $SHARED/assets")
p.add_argument("--json", default=None, help="also write the cuts here")
args = p.parse_args()

missing = [f for f in args.analyses if not os.path.isfile(f)]
if missing:
    sys.exit(f"{', '.join(missing)}: no such file")
tok = load_tokenizer(args.tokenizer)
rows = [dict(r, file=f) for f in args.analyses for r in read_jsonl(f)]
if not rows:
    sys.exit(f"{', '.join(args.analyses)}: no answers (run seed_rl.py with --dump-examples > 0 and --opd-coef > 0)")
ids = [tok(r["text"], add_special_tokens=False)["input_ids"] for r in rows]
out = {}
for window in args.windows:
    cuts = []
    for r, t in zip(rows, ids):
        n = loop_end(t, window)
        if n is not None:
            cuts.append(dict(file=r["file"], update=r["update"], uid=r["uid"], finish=r["finish"], tokens=len(t), cut=n))
    lost = [c for c in cuts if c["finish"] == "stop"]
    print(f"--analysis-loop-stop {window}: cuts {len(cuts)} of {len(rows)} answers, "
          f"{len(lost)} of them ended by themselves")
    for c in cuts:
        print(f"  update {c['update']} {c['uid']}: {c['finish']}, {c['tokens']} tokens -> cut at {c['cut']}")
    out[str(window)] = cuts
ended = [t for r, t in zip(rows, ids) if r["finish"] == "stop"]
if ended:
    print(f"the {len(ended)} answers that ended by themselves: at most {max(map(len, ended))} tokens, their longest "
          f"periodic stretch {max(map(longest_periodic, ended))} tokens")
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
