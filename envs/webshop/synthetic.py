"""A synthetic catalog in the official file formats, for tests, CPU demos and the benchmark (the real catalog
cannot be brought onto the project's machines). Deterministic for a given size and seed.

    python -m envs.webshop.synthetic OUT_DIR [--products 40] [--seed 0]

writes OUT_DIR/items_shuffle_1000.json (product records with the fields the env reads: asin, name, category,
query, product_category, pricing, customization_options, small_description, full_description, images) and
OUT_DIR/items_ins_v2_1000.json (attributes per asin; most products also get an instruction in the real file's
style, 'Find me <attributes> <product type> with <attributes>'). Product names, prices and option groups vary
the way the real ones do: single prices and '$a - $b' ranges, a missing price, one to three option groups or
none, values with '/' and capitals that the site lower-cases.
"""
import argparse
import json
import os
import random

# (category, query, type words for names, product_category, attributes, option groups {name: values})
KINDS = [
    ("beauty", "shampoo", "Shampoo", "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
     ["sulfate free", "paraben free", "natural ingredients", "tea tree", "dry hair", "hair growth"],
     {"Size": ["8 Fl Oz (Pack of 1)", "12 Fl Oz (Pack of 1)", "16 Fl Oz (Pack of 2)"],
      "Scent": ["Lavender", "Tea Tree/Mint", "Unscented"]}),
    ("beauty", "body butter", "Body Butter", "Beauty & Personal Care › Skin Care › Body › Moisturizers",
     ["dry skin", "cruelty free", "long lasting", "shea butter", "sensitive skin"],
     {"Size": ["4 Ounce", "8 Ounce", "16 Ounce"]}),
    ("fashion", "running shoes", "Running Shoes", "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
     ["rubber sole", "arch support", "non slip", "lace up", "memory foam"],
     {"Color": ["Black/White", "Navy Blue", "Grey", "Red"], "Size": ["7", "8", "9", "10", "11", "12"]}),
    ("fashion", "t-shirt", "T-Shirt", "Clothing, Shoes & Jewelry › Women › Clothing › Tops, Tees & Blouses",
     ["machine wash", "short sleeve", "cotton spandex", "relaxed fit", "everyday wear"],
     {"Color": ["Black", "White", "Heather Grey", "Pink"], "Size": ["Small", "Medium", "Large", "X-Large", "XX-Large"]}),
    ("food", "green tea", "Green Tea Bags", "Grocery & Gourmet Food › Beverages › Tea › Green",
     ["gluten free", "non gmo", "caffeine free", "usda organic", "low calorie"],
     {"Flavor Name": ["Jasmine", "Mint", "Lemon Ginger"], "Size": ["20 Count (Pack of 1)", "20 Count (Pack of 6)"]}),
    ("food", "protein bars", "Protein Bars", "Grocery & Gourmet Food › Snacks › Bars › Protein",
     ["high protein", "gluten free", "low sugar", "keto friendly"],
     {"Flavor Name": ["Chocolate Chip", "Peanut Butter", "Vanilla Almond"], "Size": ["12 Count", "24 Count"]}),
    ("electronics", "wireless earbuds", "Wireless Earbuds", "Electronics › Headphones, Earbuds & Accessories › Earbuds",
     ["noise cancelling", "fast charging", "water resistant", "long battery life", "hands free"],
     {"Color": ["Black", "White", "Midnight Blue"]}),
    ("electronics", "usb cable", "USB C Cable", "Electronics › Computers & Accessories › Cables › USB Cables",
     ["fast charging", "high speed", "braided nylon", "easy use"],
     {"Color": ["Black", "Silver"], "Size": ["3 ft", "6 ft", "10 ft"], "Style": ["1 Pack", "2 Pack"]}),
    ("furniture", "office chair", "Office Chair", "Home & Kitchen › Furniture › Home Office Furniture › Chairs",
     ["lumbar support", "height adjustable", "easy assemble", "high back", "pu leather"],
     {"Color": ["Black", "Grey", "White"]}),
    ("furniture", "coffee table", "Coffee Table", "Home & Kitchen › Furniture › Living Room Furniture › Tables",
     ["solid wood", "easy assemble", "storage space", "mid century"], {}),
]
BRANDS = ["Lumina", "Oakridge", "Nordic", "Verde", "Auric", "Bramble", "Kestrel", "Solace", "Tidewater", "Quill",
          "Marlow", "Cedar & Co", "Pioneer", "Halcyon", "Ember"]
EXTRAS = ["for Everyday Use", "Premium Edition", "Value Pack", "2024 Model", "Classic", "by Home Essentials"]


SYLLABLES = ["ka", "lo", "mi", "ten", "ra", "vo", "sel", "din", "po", "ver", "tu", "ben", "sa", "ri", "mon", "el"]


def filler_words(rng, n_vocab=5000):
    """Made-up words: a description's bulk (real descriptions are ~4 KB) without a dictionary."""
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(n_vocab)]


def make_catalog(n_products, seed=0, instructed=0.8, description_words=0):
    """(catalog records, attribute file dict) of n_products products; about `instructed` of them carry an
    instruction (so goals exist), the rest only attributes. description_words: made-up words added to each
    description (the benchmark uses ~600, the size of the real file's)."""
    rng = random.Random(seed)
    filler = filler_words(random.Random(seed + 1)) if description_words else []
    records, attrs = [], {}
    for i in range(n_products):
        category, query, noun, path, pool, groups = KINDS[i % len(KINDS)]
        asin = f"B0SYN{i:05d}"
        brand = rng.choice(BRANDS)
        chosen = rng.sample(pool, 3)
        name = f"{brand} {chosen[0].title()} {noun} {rng.choice(EXTRAS)}"
        lo = round(rng.uniform(5, 150), 2)
        r = rng.random()
        pricing = "" if r < 0.05 else f"${lo:.2f} - ${lo * 1.5:.2f}" if r < 0.3 else f"${lo:.2f}"
        if i % 97 == 96:  # now and then a product over $970: its goals get no price clause
            pricing = f"${rng.uniform(975, 2000):,.2f}"
        options = {g: [{"value": v, "image": None} for v in vals] for g, vals in groups.items()}
        records.append({
            "asin": asin, "name": name, "category": category, "query": query, "product_category": path,
            "pricing": pricing, "customization_options": options or None,
            "small_description": [f"{chosen[1].capitalize()} {noun.lower()} made by {brand}.",
                                  f"Designed with {chosen[2]} in mind."],
            "full_description": f"The {brand} {noun.lower()} is {chosen[0]} and {chosen[1]}. "
                                f"A dependable choice for anyone who needs a {query}."
                                + "".join(" " + w for w in rng.choices(filler, k=description_words)),
            "images": [f"https://example.invalid/{asin}.jpg"], "average_rating": round(rng.uniform(3, 5), 1),
        })
        entry = {"attributes": chosen}
        if rng.random() < instructed:
            inst = rng.sample(chosen, 2)
            entry.update(instruction=f"Find me {inst[0]} {query} with {inst[1]}", instruction_attributes=inst)
        attrs[asin] = entry
    return records, attrs


def write_catalog(out_dir, n_products, seed=0, description_words=0):
    """Write both files into out_dir; returns out_dir."""
    records, attrs = make_catalog(n_products, seed, description_words=description_words)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "items_shuffle_1000.json"), "w") as f:
        json.dump(records, f)
    with open(os.path.join(out_dir, "items_ins_v2_1000.json"), "w") as f:
        json.dump(attrs, f)
    return out_dir


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", help="folder to write the two files into")
    ap.add_argument("--products", type=int, default=40, help="number of products")
    ap.add_argument("--seed", type=int, default=0, help="generator seed")
    ap.add_argument("--description-words", type=int, default=0, help="made-up words added to each description")
    a = ap.parse_args()
    print(write_catalog(a.out_dir, a.products, a.seed, a.description_words))
