"""WebShop's data files: the product catalog, the attribute/instruction file, and the synthetic goals.

    items_shuffle_1000.json  a JSON list, one record per product (the fields read here):
        {"asin": "B07...", "name": "...", "category": "beauty", "query": "body butter",
         "product_category": "Beauty & Personal Care › Skin Care › ...", "pricing": "$12.99" | "$7.99 - $12.99",
         "customization_options": {"Size": [{"value": "4 Ounce (Pack of 1)", "image": ...}, ...], ...},
         "small_description": [...] | "...", "full_description": "...", "images": [...], ...}
    items_ins_v2_1000.json   a JSON object keyed by asin:
        {"attributes": [...], "instruction": "Find me ...", "instruction_attributes": [...]}

Products are cleaned the way the original's `engine.load_products` does (asins that are 'nan' or over 10
characters and repeated asins dropped; prices parsed from the '$' pieces, '$100.0' when missing; option names
and values lower-cased with '/' shown as ' | '), so titles, prices and option values read the same as in the
original site, and goals are built like its `get_synthetic_goals`: for every product with an instruction, one
goal per combination of its option values (option names sorted), with a price bound U drawn from the next four
$10 steps above the product's price, then the whole list shuffled with seed 233 as the original does.

One difference, on purpose: the original draws prices (for a price range) and price bounds from Python's
global random state, never seeded at that point, so every process had other prices and bounds (and the
verl-agent workers other goals). Here they come from one fixed-seed generator, in catalog order: every worker
builds exactly the same goals. The goal ORDER needs no such fix: it depends only on the number of goals,
so goal i is the same product and options as in the original (with the real files: 6,910 goals).
"""
import itertools
import json
import os
import random
import re
from decimal import Decimal, InvalidOperation

from common.records import sha256_file

CATALOG_FILE = "items_shuffle_1000.json"
ATTRIBUTE_FILE = "items_ins_v2_1000.json"
PRICE_STEPS = [10.0 * i for i in range(1, 100)]  # the original's PRICE_RANGE: $10 ... $990
NO_PRICE_BOUND = 1000000  # a product at $980 or more gets no price clause (as the original)
GOAL_SHUFFLE_SEED = 233  # the original's random.seed(233) before shuffling the goals
PRICE_SEED = 0  # ours (see the module docstring)
HOW_TO_GET = ("get them with the WebShop setup script (github.com/princeton-nlp/WebShop: ./setup.sh -d small "
              "downloads both into data/) or from a Hugging Face mirror of the small set, then point "
              "--webshop-data or $WEBSHOP_DATA at the folder (see README: WebShop)")


class DataError(ValueError):
    """A missing or malformed data file; the message names the file, the record and the field."""


def data_files(data_dir):
    """(catalog path, attribute path); a one-line DataError naming what is missing and how to get it."""
    paths = [os.path.join(data_dir, CATALOG_FILE), os.path.join(data_dir, ATTRIBUTE_FILE)]
    missing = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataError(f"WebShop data not found: {' and '.join(missing)} missing in {data_dir}; {HOW_TO_GET}")
    return paths


# ----------------------------------------------------------------------------------------------------
# Cleaning one product record

def _need(rec, i, field, types, path):
    value = rec.get(field)
    if not isinstance(value, types):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise DataError(f"{path}: record {i}: field {field!r} must be {want}, got {type(value).__name__}")
    return value


def parse_pricing(pricing, i, path):
    """'$12.99' -> ([12.99], '$12.99'); '$7.99 - $12.99' -> ([7.99, 12.99], '$7.99 to $12.99');
    missing or empty -> ([100.0], '$100.0'). The tag prints Python floats, as the original's page does."""
    if not pricing:
        return [100.0], "$100.0"
    if not isinstance(pricing, str):
        raise DataError(f"{path}: record {i}: field 'pricing' must be a string like '$12.99', "
                        f"got {type(pricing).__name__}")
    try:
        prices = [float(Decimal(re.sub(r"[^\d.]", "", piece))) for piece in pricing.split("$")[1:]]
    except InvalidOperation:
        prices = []
    if not prices:
        raise DataError(f"{path}: record {i}: field 'pricing' is not a '$' price: {pricing[:60]!r}")
    if len(prices) == 1:
        return prices, f"${prices[0]}"
    return prices[:2], f"${prices[0]} to ${prices[1]}"


def parse_options(custom, i, path):
    """{'Color': [{'value': 'Navy/White'}, ...], 'Size': None} -> {'color': ['navy | white', ...]}."""
    if not custom:
        return {}
    if not isinstance(custom, dict):
        raise DataError(f"{path}: record {i}: field 'customization_options' must be an object, "
                        f"got {type(custom).__name__}")
    options = {}
    for name, contents in custom.items():
        if contents is None:  # the original skips an empty group
            continue
        if not isinstance(contents, list) or not all(isinstance(c, dict) and isinstance(c.get("value"), str)
                                                     for c in contents):
            raise DataError(f"{path}: record {i}: field 'customization_options' group {name!r} must be a list "
                            f"of {{'value': str, ...}}")
        options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
    return options


def clean_product(rec, i, path):
    """One catalog record -> the product dict the site and the reward read (the original's key names:
    Title, Price, BulletPoints, Description, options)."""
    if not isinstance(rec, dict):
        raise DataError(f"{path}: record {i}: must be an object, got {type(rec).__name__}")
    for field in ("asin", "name", "category", "query", "product_category"):
        _need(rec, i, field, str, path)
    bullets = rec.get("small_description")
    bullets = bullets if isinstance(bullets, list) else [] if bullets is None else [bullets]
    if not all(isinstance(b, str) for b in bullets):
        raise DataError(f"{path}: record {i}: field 'small_description' must be a string or a list of strings")
    description = rec.get("full_description") or ""
    if not isinstance(description, str):
        raise DataError(f"{path}: record {i}: field 'full_description' must be a string")
    pricing, price_tag = parse_pricing(rec.get("pricing"), i, path)
    return {
        "asin": rec["asin"], "name": rec["name"], "Title": rec["name"], "category": rec["category"],
        "query": rec["query"].lower().strip(), "product_category": rec["product_category"],
        "pricing": pricing, "Price": price_tag, "options": parse_options(rec.get("customization_options"), i, path),
        "BulletPoints": bullets, "Description": description,
    }


def attach_attributes(product, attrs, path):
    """Attributes (the reward's product side), the instruction and its attributes (the goal side)."""
    entry = attrs.get(product["asin"], {})
    if not isinstance(entry, dict):
        raise DataError(f"{path}: asin {product['asin']}: must be an object")
    for field in ("attributes", "instruction_attributes"):
        v = entry.get(field)
        if v is not None and not (isinstance(v, list) and all(isinstance(a, str) for a in v)):
            raise DataError(f"{path}: asin {product['asin']}: field {field!r} must be a list of strings")
    instruction = entry.get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise DataError(f"{path}: asin {product['asin']}: field 'instruction' must be a string")
    # 'DUMMY_ATTR' as the original: a product without attributes matches goal attributes only by its text
    product["Attributes"] = entry["attributes"] if "attributes" in entry else ["DUMMY_ATTR"]
    product["instruction_text"] = instruction
    product["instruction_attributes"] = entry.get("instruction_attributes")
    if instruction is not None and not product["instruction_attributes"]:
        raise DataError(f"{path}: asin {product['asin']}: has an instruction but no 'instruction_attributes'")


# ----------------------------------------------------------------------------------------------------
# Prices and goals

def product_prices(products, rng):
    """The price the reward compares with the bound: the single price, or a draw inside a price range."""
    return {p["asin"]: p["pricing"][0] if len(p["pricing"]) == 1 else rng.uniform(*p["pricing"][:2])
            for p in products}


def price_bound(price, rng):
    """U and the instruction's price clause: the larger of two of the next four $10 steps above the price."""
    steps = [p for p in PRICE_STEPS if p > price][:4]
    if len(steps) < 2:
        return NO_PRICE_BOUND, ""
    upper = sorted(rng.sample(steps, 2))[1]
    return upper, f", and price lower than {upper:.2f} dollars"


def synthetic_goals(products, prices, rng):
    """One goal per option combination of each product with an instruction, in catalog order, then
    shuffled with the original's seed. Goal text = instruction + ' with name: value, and ...' + price clause."""
    goals = []
    for p in products:
        if p["instruction_text"] is None:
            continue
        upper, price_text = price_bound(prices[p["asin"]], rng)
        names = sorted(p["options"])
        for combo in itertools.product(*(p["options"][n] for n in names)):
            options = dict(zip(names, combo))
            option_text = ", and ".join(f"{k}: {v}" for k, v in options.items())
            option_text = f" with {option_text}" if option_text else ""
            goals.append({
                "asin": p["asin"], "category": p["category"], "query": p["query"], "name": p["Title"],
                "product_category": p["product_category"],
                "instruction_text": f"{p['instruction_text']}{option_text}{price_text}",
                "base_instruction": p["instruction_text"], "attributes": p["instruction_attributes"],
                "price_upper": upper, "goal_options": options,
            })
    random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
    return goals


class Catalog:
    """Everything one worker needs, loaded once: products (cleaned), by_asin, prices, goals, the catalog's
    sha256 (the search index's cache key) and the files it came from."""

    def __init__(self, data_dir):
        self.data_dir = os.path.abspath(data_dir)
        self.catalog_path, self.attribute_path = data_files(self.data_dir)
        self.sha256 = sha256_file(self.catalog_path)
        records = _load_json(self.catalog_path, list)
        attrs = _load_json(self.attribute_path, dict)
        self.products, seen = [], set()
        for i, rec in enumerate(records):
            asin = rec.get("asin") if isinstance(rec, dict) else None
            if isinstance(asin, str) and (asin == "nan" or len(asin) > 10 or asin in seen):
                continue  # as the original: placeholder/overlong asins and repeats are not products
            product = clean_product(rec, i, self.catalog_path)
            seen.add(asin)
            attach_attributes(product, attrs, self.attribute_path)
            self.products.append(product)
        self.by_asin = {p["asin"]: p for p in self.products}
        rng = random.Random(PRICE_SEED)
        self.prices = product_prices(self.products, rng)
        self.goals = synthetic_goals(self.products, self.prices, rng)


def _load_json(path, kind):
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, kind):
        raise DataError(f"{path}: must hold a JSON {'list' if kind is list else 'object'}, "
                        f"got {type(data).__name__}")
    return data


_CATALOGS = {}


def load_catalog(data_dir):
    """The catalog of a data folder, parsed once per process (module-level cache; never per episode)."""
    key = os.path.abspath(data_dir)
    if key not in _CATALOGS:
        _CATALOGS[key] = Catalog(key)
    return _CATALOGS[key]
