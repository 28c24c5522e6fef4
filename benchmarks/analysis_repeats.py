"""Which self-analysis answers would `seed_rl.py --analysis-repeat-stop SPAN COUNT` cut, and where? Replayed
offline on a run's dumped answers (analyses.jsonl, written by seed_rl.py --dump-examples), re-tokenized with the
run's tokenizer, with the same rule the HF backend applies (common/backends.py `repetition_end`).

    python benchmarks/analysis_repeats.py results/2026-12-07-seed-vs-grpo-analysis-repeat-stop-bc-start-h100/seed/analyses.jsonl \
        --settings 64,4 64,16 128,16

Prints, per setting, every answer it would cut: uid, how the answer really ended, its length and the cut.
A cut of an answer that ended by itself ('stop') is a skill the setting would have lost.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.backends import repetition_end  # noqa: E402
from common.models import load_tokenizer  # noqa: E402
from common.records import read_jsonl  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("analyses", nargs="+", help="analyses.jsonl files of seed_rl.py runs")
p.add_argument("--settings", nargs="+", default=["64,16", "128,16"], help="SPAN,COUNT pairs to replay")
p.add_argument("--tokenizer", default="tiny", help="tokenizer folder; tiny: the Qwen2.5 tokenizer under $SHARED/assets")
p.add_argument("--json", default=None, help="also write the cuts here")
args = p.parse_args()

tok = load_tokenizer(args.tokenizer)
rows = [dict(r, file=f) for f in args.analyses for r in read_jsonl(f)]
if not rows:
    sys.exit(f"{', '.join(args.analyses)}: no answers (run seed_rl.py with --dump-examples > 0 and --opd-coef > 0)")
ids = [tok(r["text"], add_special_tokens=False)["input_ids"] for r in rows]
out = {}
for setting in args.settings:
    span, count = (int(x) for x in setting.split(","))
    cuts = []
    for r, t in zip(rows, ids):
        n = repetition_end(t, span, count)
        if n is not None:
            cuts.append(dict(file=r["file"], update=r["update"], uid=r["uid"], finish=r["finish"], tokens=len(t), cut=n))
    lost = [c for c in cuts if c["finish"] == "stop"]
    print(f"--analysis-repeat-stop {span} {count}: cuts {len(cuts)} of {len(rows)} answers, "
          f"{len(lost)} of them ended by themselves")
    for c in cuts:
        print(f"  update {c['update']} {c['uid']}: {c['finish']}, {c['tokens']} tokens -> cut at {c['cut']}")
    out[setting] = cuts
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
