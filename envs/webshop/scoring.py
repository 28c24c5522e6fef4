"""The score of a purchase, in [0, 1], as the original's `engine/goal.py:get_reward` computes it:

    score = r_type * (matched goal attributes + matched goal options + [price <= U])
                   / (goal attributes + goal options + 1)

- an attribute matches when its fuzzy token-set ratio with one of the product's attributes is > 85, or it is
  a substring of the product's title, bullet points or description (lower-cased);
- an option matches when the fuzzy token-set ratio of a bought option value and the goal option is > 85,
  after colour normalisation (a value that contains a colour word becomes that colour word);
- r_type: 1.0 for the right kind of product, 0.5 / 0.1 / 0.0 as the noun overlap of the product's and the
  goal's names falls (below).

Two details of the original are kept because the paper's numbers were measured with them:
- the goal's options reach the option matcher as (name, value) pairs, so the goal side is compared as the
  words of str((name, value)) (e.g. "('size', 'x-large')", read as 'size x-large'; a non-printable
  character in a value stays as its escape's letters, goal_option_text), and a colour goal is normalised only when the value IS a colour
  word. Token-set ratio is 100 whenever every word of one side is among the other's, so a bought 'large'
  matches the goal 'size: x-large' and a bought 'dark grey' (normalised to 'dark') the goal 'color: dark
  blue'. Exact here; lenient by design of the original.
- the fuzzy ratio is thefuzz's: text cut to ASCII (characters 128-255 dropped), non-word characters to spaces,
  lower-cased, and the 0-100 ratio rounded to an integer before the > 85 test (85.4 fails, 85.6 passes).
  rapidfuzz computes the ratio from the longest common subsequence, as thefuzz does with python-Levenshtein;
  the original pinned thefuzz 0.19 without it, whose difflib matcher can find fewer matching characters on
  some longer strings, so a few pairs near 85 may fall on the other side.

The noun tagger: the original uses spaCy's en_core_web_sm (tokens tagged NOUN or PROPN). Here spaCy is used
when it and that model are importable; otherwise a fallback tags as nouns the words that are not stop words,
numbers, units, colours, sizes or common product adjectives (listed below), nor '-ful/-less/-ous' adjectives
or '-ed' participles. The choice only moves r_type for a product OTHER than the goal's: the goal's
own product always gets r_type 1 (its nouns are the goal's nouns; a name without nouns gives title score 0.2
and the query matches).
"""
import functools
import re

from rapidfuzz import fuzz

FUZZY_THRESHOLD = 85
# normalize.py's COLOR_SET, in its order (the first colour found in a value wins)
COLOR_SET = [
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah",
    "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream", "crystal",
    "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape", "graphite",
    "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender", "lemon",
    "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "midnight", "mint", "mocha",
    "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive", "orange", "peach", "pewter", "pink",
    "plum", "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver",
    "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal", "tiger", "turquoise",
    "violet", "walnut", "wheat", "white", "wine", "yellow",
]
_NON_ASCII_LATIN1 = {i: None for i in range(128, 256)}
_NON_WORD = re.compile(r"(?ui)\W")


# ----------------------------------------------------------------------------------------------------
# Fuzzy matching and colours

def fuzz_process(text):
    """thefuzz's full_process with force_ascii: drop characters 128-255, non-word -> space, lower, strip."""
    return _NON_WORD.sub(" ", str(text).translate(_NON_ASCII_LATIN1)).lower().strip()


def token_set_ratio(a, b):
    """thefuzz.fuzz.token_set_ratio (an integer 0-100) through rapidfuzz."""
    pa, pb = fuzz_process(a), fuzz_process(b)
    if not pa or not pb:
        return 0
    return int(round(fuzz.token_set_ratio(pa, pb, processor=None)))


def fuzzy_match(a, b):
    return token_set_ratio(a, b) > FUZZY_THRESHOLD


def normalize_color(value):
    """The first colour word contained in a bought option value, else the value."""
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def goal_option_text(name, value):
    """A goal option as the original's matcher sees the (name, value) pair (web_agent_site/engine/goal.py,
    get_reward passes goal_options.items() to get_option_reward): a colour word when either IS one (tuple
    membership in normalize_color), else the pair itself, which thefuzz's full_process turns into its
    str(): "('size', 'x-large')". For printable values that reads as the words 'size x-large'; a value with a
    non-printable character differs: str() writes it as an escape ('\\u200b', '\\n'), whose letters
    become words of their own ('u200b', 'n'), where 'name value' would have dropped it."""
    for color in COLOR_SET:
        if color in (name, value):
            return color
    return str((name, value))


# ----------------------------------------------------------------------------------------------------
# Nouns

STOP = frozenset("""a an the and or but nor of for in on at to from by with without into onto over under up down
out off as per via vs than then so too very not no only just also all any both each every few more most other
some such own same this that these those it its it's i me my we our you your he him his she her they them their
what which who whom whose when where why how is are was were be been being am do does did has have had will would
shall should can could may might must x""".split())
UNITS = frozenset("""oz ounce ounces fl lb lbs pound pounds g gram grams kg mg ml l liter liters litre inch inches in
ft feet foot yard yards cm mm m meter meters pack packs pcs pc piece pieces count ct set sets pair pairs qty
gallon gallons quart pint w watt watts v volt volts mah gb tb mb hz""".split())
SIZES = frozenset("""small medium large xl xxl xs x-large xx-large x-small size plus petite tall regular wide narrow
king queen twin full mini big little long short extra""".split())
ADJECTIVES = frozenset("""new natural organic premium professional portable adjustable comfortable soft hard heavy
light lightweight durable waterproof wireless electric automatic digital smart high low best great good fresh
pure original classic modern vintage cute sexy casual formal womens mens women's men's kids baby unisex
non slim thin thick warm cool hot cold dry wet clean easy quick fast slow super ultra compact stainless solid
clear multi double single dual anti free strong gentle safe healthy sweet spicy sugar-free gluten-free vegan
vegetarian handmade outdoor indoor daily travel washable breathable rechargeable reusable foldable stackable
disposable compatible flexible""".split())
ADJ_SUFFIXES = ("ful", "less", "ous")  # not '-able' (table, cable) nor '-ly' (jelly, family)
# plain colour words only: many of COLOR_SET's are also things (coffee, chocolate, wine, lemon, rose)
COLORS = frozenset("""black white red blue green gray grey pink purple yellow brown beige navy teal maroon khaki
ivory turquoise violet magenta fuchsia burgundy multicolor""".split())
WORD_RE = re.compile(r"[a-z][a-z'\-]*")


def fallback_nouns(text):
    """Lower-cased words of a product name that a tagger would likely call nouns (see the module docstring).
    A stand-in for spaCy, not a tagger: 'Pink Shampoo for Dry Hair, 12 Fl Oz' -> ['shampoo', 'hair']."""
    out = []
    for w in WORD_RE.findall(text.lower()):
        w = w.strip("'-")
        if (len(w) < 2 or w in STOP or w in UNITS or w in SIZES or w in ADJECTIVES or w in COLORS
                or (len(w) > 5 and w.endswith(ADJ_SUFFIXES))
                or (len(w) > 4 and w.endswith("ed") and not w.endswith("eed"))):  # scented, not speed
            continue
        out.append(w)
    return out


@functools.lru_cache(maxsize=1)
def spacy_model():
    """spaCy's small English model, or None when spaCy or the model is not installed. Looked for before
    spaCy is imported: importing spaCy alone costs seconds and ~280 MB per worker."""
    import importlib.util
    if importlib.util.find_spec("spacy") is None or importlib.util.find_spec("en_core_web_sm") is None:
        return None
    try:
        import spacy
        return spacy.load("en_core_web_sm")
    except Exception:  # a broken install: the fallback
        return None


@functools.lru_cache(maxsize=65536)
def nouns(text, tagger="auto"):
    """The nouns of a product name: spaCy (NOUN/PROPN) when tagger is 'spacy', or 'auto' and it is
    installed; the fallback otherwise."""
    nlp = spacy_model() if tagger in ("auto", "spacy") else None
    if tagger == "spacy" and nlp is None:
        raise RuntimeError("spaCy with en_core_web_sm is not installed")
    if nlp is None:
        return tuple(fallback_nouns(text))
    return tuple(t.text.lower() for t in nlp(text) if t.pos_ in ("NOUN", "PROPN"))


def noun_tagger_name():
    return "spacy" if spacy_model() is not None else "fallback"


# ----------------------------------------------------------------------------------------------------
# The score

def type_reward(product, goal, tagger="auto"):
    """r_type and what it was computed from."""
    query_match = product["query"] == goal["query"]
    cats_p = {c.strip() for c in product["product_category"].split("›")}
    cats_g = {c.strip() for c in goal["product_category"].split("›")}
    category_match = len(cats_p & cats_g) >= 2
    bought, wanted = nouns(product["name"], tagger), nouns(goal["name"], tagger)
    # the denominator counts repeated nouns, as the original's list does
    title_score = len(set(bought) & set(wanted)) / len(wanted) if wanted else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match,
            "title_score": title_score}


def attribute_matches(product, goal):
    text = (product["Title"].lower(), " ".join(product["BulletPoints"]).lower(), product["Description"].lower())
    n = 0
    for g in goal["attributes"]:
        if any(fuzzy_match(p, g) for p in product["Attributes"]) or any(g in t for t in text):
            n += 1
    return n


def option_matches(bought_values, goal_options):
    bought = [normalize_color(v) for v in bought_values]
    return sum(any(fuzzy_match(b, goal_option_text(k, v)) for b in bought) for k, v in goal_options.items())


def score_purchase(product, options, price, goal, tagger="auto"):
    """(score, details) for buying `product` with the chosen `options` ({name: value}) at `price`."""
    t = type_reward(product, goal, tagger)
    n_attr = attribute_matches(product, goal)
    n_opt = option_matches(list(options.values()), goal["goal_options"])
    price_ok = price <= goal["price_upper"]
    total = len(goal["attributes"]) + len(goal["goal_options"]) + 1
    score = (n_attr + n_opt + price_ok) / total * t["r_type"]  # the original's order of operations
    return score, dict(t, attributes=n_attr, options=n_opt, price_ok=price_ok, total=total)
