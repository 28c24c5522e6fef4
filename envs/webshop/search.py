"""The site's search engine: BM25 over the catalog (k1 0.9, b 0.4, English stop words, Porter stemming),
the top 50 products of a query, as the original's Lucene index (pyserini, DefaultEnglishAnalyzer) gives them.

Each product is indexed as the original's `convert_product_file_format.py` writes it: title, description,
first bullet point and the option text ('color: black, white, and size: small, large'), lower-cased.
Scoring is `bm25s` (method 'lucene': the same idf and length normalisation); a query term repeated counts
again, as Anserini's bag-of-words query weights a term by its count. Only products that share a term with the
query are results (Lucene returns no zero-score hits), best first, ties in catalog order (Lucene's doc id
order for a single-threaded index).

How results can differ from the original's Lucene index (not measured here: the catalog is not on these
machines, nor Java):
- tokens: a regex stands in for Lucene's StandardTokenizer (Unicode word breaks). It keeps 'don't' and '3.4'
  whole as UAX#29 does, but non-ASCII text, e-mail addresses and URLs may split differently;
- document length: Lucene stores each length in one byte (SmallFloat norms, exact up to 40 tokens, coarser
  above), bm25s stores it exactly, so long documents' scores differ a little and near-ties can swap;
- scores are float32 in both, summed in another order.
The index is built once per catalog and cached on disk under a folder named by the catalog's sha256; a worker
loads it once (module-level cache), never per episode.
"""
import json
import os
import re
import shutil
import tempfile

import numpy as np

# bm25s uses JAX for its top-k when JAX is installed, and JAX then takes 75% of the GPU's memory at import (seen
# on the H200: a vLLM engine on the same GPU found 34 of 140 GiB free). BM25 runs on the CPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

K1, B = 0.9, 0.4  # Lucene's BM25 parameters as pyserini sets them
TOP_N = 50  # the original's SEARCH_RETURN_N
INDEX_VERSION = 1  # bump when the tokenizer or the document text changes: a new cache folder
# Lucene's English stop words (EnglishAnalyzer.ENGLISH_STOP_WORDS_SET)
STOP_WORDS = frozenset("a an and are as at be but by for if in into is it no not of on or such that the their "
                       "then there these they this to was will with".split())
TOKEN_RE = re.compile(r"\w+(?:[.'\u2019]\w+)*")


class Tokenizer:
    """lower-case -> words -> drop a trailing possessive 's -> drop stop words -> Porter stem."""

    def __init__(self):
        import Stemmer  # PyStemmer; 'porter' is the stemmer of Lucene's PorterStemFilter
        self.stem = Stemmer.Stemmer("porter").stemWords

    def __call__(self, text):
        words = []
        for w in TOKEN_RE.findall(text.lower()):
            if w.endswith(("'s", "\u2019s")):
                w = w[:-2]
            if w and w not in STOP_WORDS:
                words.append(w)
        return self.stem(words)


def document_text(product):
    option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in product["options"].items())
    first_bullet = product["BulletPoints"][0] if product["BulletPoints"] else ""
    return " ".join([product["Title"], product["Description"], first_bullet, option_text]).lower()


class SearchEngine:
    """`search(query) -> [product index, ...]` (at most TOP_N, best first)."""

    def __init__(self, bm25, n_docs):
        self.bm25, self.n_docs, self.tokenize = bm25, n_docs, Tokenizer()

    @classmethod
    def build(cls, products):
        import bm25s
        tok = Tokenizer()
        bm25 = bm25s.BM25(k1=K1, b=B, method="lucene")
        bm25.index([tok(document_text(p)) for p in products], show_progress=False)
        return cls(bm25, len(products))

    def search(self, query, k=TOP_N):
        ids = self.bm25.get_tokens_ids(self.tokenize(query))  # unknown words drop out
        if not ids:
            return []
        scores = self.bm25.get_scores_from_ids(ids)  # [n_docs]
        order = np.argsort(-scores, kind="stable")[:k]  # stable: ties stay in catalog order
        return [int(i) for i in order if scores[i] > 0]


def index_dir(cache_root, catalog_sha256):
    return os.path.join(cache_root, f"bm25-{catalog_sha256[:16]}-v{INDEX_VERSION}")


def load_or_build(catalog, cache_root):
    """The catalog's engine from the disk cache, built and saved there first if absent. Saving goes to a
    temporary folder renamed into place, so workers that start together never read a half-written index;
    an unwritable cache only costs a rebuild per process."""
    import bm25s
    asins = [p["asin"] for p in catalog.products]
    path = index_dir(cache_root, catalog.sha256)
    try:
        with open(os.path.join(path, "asins.json")) as f:
            if json.load(f) == asins:
                return SearchEngine(bm25s.BM25.load(path, show_progress=False), len(asins))
    except (OSError, ValueError):
        pass
    engine = SearchEngine.build(catalog.products)
    try:
        os.makedirs(cache_root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_root, prefix=".tmp-")
        engine.bm25.save(tmp, show_progress=False)
        with open(os.path.join(tmp, "asins.json"), "w") as f:
            json.dump(asins, f)
        try:
            os.rename(tmp, path)
        except OSError:  # another worker saved it first, or a stale copy is in the way
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
    return engine


_ENGINES = {}


def engine_for(catalog, cache_root):
    """One engine per catalog per process (module-level cache)."""
    if catalog.sha256 not in _ENGINES:
        _ENGINES[catalog.sha256] = load_or_build(catalog, cache_root)
    return _ENGINES[catalog.sha256]
