"""WebShop's reward (envs/webshop/scoring.py score_purchase) against the original's scoring code
(princeton-nlp/WebShop, web_agent_site/engine/goal.py get_reward) on random goal/product pairs (issue 29).

    git clone https://github.com/princeton-nlp/WebShop /tmp/WebShop      # the original: read from there, never copied
    pip install --target /tmp/origdeps thefuzz==0.19.0                    # its matcher, as its requirements.txt pins it
    PYTHONPATH=/tmp/origdeps OMP_NUM_THREADS=1 python benchmarks/webshop_original.py --original /tmp/WebShop \\
        --seeds 0,1,2,3,4 --pairs 2000 --json /tmp/webshop_original.json

Pairs: per seed, a synthetic catalog in the official format (envs/webshop/synthetic.py, --products products, that
seed) and --pairs goals drawn at random; each is paired with its own product (half the time) or another random
product, bought with random option values of that product (for its own product, the goal's value of each option
half the time), at the catalog's price. A share --nonprintable of the pairs get one non-printable character
(U+200B, tab, newline, U+00A0, DEL, U+2028) put into one goal option value, and into the bought value of that
option where it is the same value: the case where the original's str((name, value)) and the words 'name value'
differ. Both functions get the same product, goal, options and price.

The noun tagger: the original's goal.py loads spaCy's en_core_web_sm when imported. Where that model is installed,
both sides tag with it (--tagger spacy); otherwise (--tagger fallback, the default) both use this project's
fallback tagger (scoring.py fallback_nouns), handed to the original as a stand-in `spacy` module, so the
comparison is of the scoring code, not of the tagger (the tagger moves r_type only for a product other than the
goal's; scoring.py's docstring).

Reported per seed and in all: pairs, the share with exactly the same score, the largest |difference|, and the same
for the earlier reading of goal options as 'name value' (before the str((name, value)) fix), each split into
pairs with and without a non-printable option value. Not a test: the original is not part of this project.
"""
import argparse
import json
import os
import random
import sys
import tempfile
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from envs.webshop import scoring  # noqa: E402
from envs.webshop.data import load_catalog  # noqa: E402
from envs.webshop.synthetic import write_catalog  # noqa: E402

NON_PRINTABLE = ["\u200b", "\t", "\n", "\u00a0", "\x7f", "\u2028"]


def load_original(path, tagger):
    """The original's goal module, imported from a checkout at `path` (its goal.py loads spaCy at import)."""
    if not os.path.isfile(os.path.join(path, "web_agent_site", "engine", "goal.py")):
        sys.exit(f"--original {path}: no web_agent_site/engine/goal.py (a checkout of princeton-nlp/WebShop)")
    try:
        import thefuzz  # noqa: F401
    except ImportError:
        sys.exit("the original needs thefuzz (pip install --target DIR thefuzz==0.19.0, then PYTHONPATH=DIR)")
    if tagger == "fallback":  # a stand-in spaCy whose every token is one of the fallback's nouns
        class Token:
            def __init__(self, text):
                self.text, self.pos_ = text, "NOUN"
        stub = types.ModuleType("spacy")
        stub.load = lambda name: (lambda text: [Token(w) for w in scoring.fallback_nouns(text)])
        sys.modules["spacy"] = stub
    sys.path.insert(0, os.path.abspath(path))
    from web_agent_site.engine import goal
    return goal


def name_value_text(name, value):
    """Goal options as read before the fix: a colour word when either is one, else the words 'name value'."""
    for color in scoring.COLOR_SET:
        if color in (name, value):
            return color
    return f"{name} {value}"


def make_pairs(catalog, n, rng, nonprintable):
    """n (product, options, price, goal, has_nonprintable) tuples, drawn as the module docstring says."""
    out = []
    for _ in range(n):
        goal = dict(rng.choice(catalog.goals))
        goal["goal_options"] = dict(goal["goal_options"])
        own = rng.random() < 0.5
        product = catalog.by_asin[goal["asin"]] if own else rng.choice(catalog.products)
        options = {k: (goal["goal_options"][k] if own and k in goal["goal_options"] and rng.random() < 0.5
                       else rng.choice(vs)) for k, vs in product["options"].items() if vs}
        marked = bool(goal["goal_options"]) and rng.random() < nonprintable
        if marked:
            k = rng.choice(sorted(goal["goal_options"]))
            v, c = goal["goal_options"][k], rng.choice(NON_PRINTABLE)
            i = rng.randrange(len(v) + 1)
            goal["goal_options"][k] = v[:i] + c + v[i:]
            if options.get(k) == v:
                options[k] = goal["goal_options"][k]
        out.append((product, options, catalog.prices[product["asin"]], goal, marked))
    return out


def compare(pairs, original, tagger):
    """Per pair: (ours, the earlier 'name value' reading, the original's) scores."""
    rows = []
    for product, options, price, goal, marked in pairs:
        ours = scoring.score_purchase(product, options, price, goal, tagger)[0]
        fixed, scoring.goal_option_text = scoring.goal_option_text, name_value_text
        try:
            before = scoring.score_purchase(product, options, price, goal, tagger)[0]
        finally:
            scoring.goal_option_text = fixed
        rows.append((ours, before, float(original.get_reward(product, goal, price, options)), marked))
    return rows


def summary(rows):
    def stats(col, sel):
        diffs = [abs(r[col] - r[2]) for r in rows if sel(r)]
        return {"pairs": len(diffs), "exact_pct": round(100 * sum(d < 1e-12 for d in diffs) / len(diffs), 3)
                if diffs else None, "max_abs_diff": round(max(diffs), 6) if diffs else None}
    orig = [r[2] for r in rows]  # how much of the scoring the pairs reach: the original's scores
    out = {"original_scores": {"zero": sum(x == 0 for x in orig), "between": sum(0 < x < 1 for x in orig),
                               "one": sum(x == 1 for x in orig), "distinct": len({round(x, 9) for x in orig})}}
    for name, col in (("ours", 0), ("name_value", 1)):
        out[name] = {"all": stats(col, lambda r: True), "printable": stats(col, lambda r: not r[3]),
                     "nonprintable": stats(col, lambda r: r[3])}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--original", required=True, help="a checkout of princeton-nlp/WebShop")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated catalog seeds")
    p.add_argument("--pairs", type=int, default=2000, help="goal/product pairs per seed")
    p.add_argument("--products", type=int, default=200, help="products per synthetic catalog")
    p.add_argument("--nonprintable", type=float, default=0.2, help="share of pairs with a non-printable option value")
    p.add_argument("--tagger", default="auto", choices=["auto", "spacy", "fallback"],
                   help="auto: spacy where en_core_web_sm is installed, else fallback (both sides alike)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    tagger = a.tagger if a.tagger != "auto" else ("spacy" if scoring.spacy_model() is not None else "fallback")
    original = load_original(a.original, tagger)
    result, every = {"tagger": tagger, "args": vars(a), "seeds": {}}, []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in [int(s) for s in a.seeds.split(",")]:
            catalog = load_catalog(write_catalog(os.path.join(tmp, f"c{seed}"), a.products, seed=seed))
            rows = compare(make_pairs(catalog, a.pairs, random.Random(seed), a.nonprintable), original, tagger)
            every += rows
            result["seeds"][seed] = summary(rows)
            s = result["seeds"][seed]
            print(f"seed {seed}: {len(catalog.goals)} goals; {s['ours']['all']['pairs']} pairs: "
                  f"{s['ours']['all']['exact_pct']}% identical, max |diff| {s['ours']['all']['max_abs_diff']} "
                  f"(earlier 'name value': {s['name_value']['all']['exact_pct']}%, "
                  f"{s['name_value']['all']['max_abs_diff']})", flush=True)
    result["all"] = summary(every)
    print(f"tagger {tagger}\n" + json.dumps(result["all"], indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
