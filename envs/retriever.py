"""The Search env's retriever: the project's own BM25 server, and the HTTP client every game uses.

Start the server (the index is built once per corpus and cached on disk; later starts load it in a second):

    python -m envs.retriever --corpus ../shared/search/corpus.jsonl.xz --port 8000

The HTTP contract is the one Search-R1's retrieval server speaks, so a user with the real e5 index over the
21M-passage wiki-18 dump runs that server instead and only points `--retriever-url` at it:

    POST /retrieve  {"queries": ["who sang party never ends", ...], "topk": 3, "return_scores": true}
                    or {"query": "who sang party never ends", "topk": 3, "return_scores": true}
    -> 200 {"result": [[{"document": {"id": "hp-0004", "contents": "\\"Party Never Ends\\"\\nParty Never Ends
            is the third studio album ..."}, "score": 21.37}, ...], ...]}
            one list per query (a single "query" gets a list of one list), best first; without
            "return_scores" (upstream's default is false) the items are the documents themselves
    -> 400 {"error": "..."}   body not JSON, no query, an empty query, a field of the wrong type (each
            field is strict: "return_scores": "false" is an error, not true), an unknown field, a query string
    GET /health -> 200 {"status": "ok", "documents": 4968, "corpus_sha256": "...", ...}

Every answer is JSON, errors included: 404 for another path, 405 (with an Allow header) for another standard
method (PUT, DELETE, ...), 501 for a method HTTP does not define, 413/411 for a body that is too large or not
sized. Under load: the listen backlog is --backlog (the socketserver default of 5 reset connections at 20
clients), each read of a connection waits at most --timeout seconds (a client that connects and sends nothing,
or stops mid-body, is disconnected and its thread freed; one line in the log), and a client that disconnects
before its answer is one line in the log, not a traceback on stderr.

A query with no indexed word (only stop words, or words absent from the corpus) gets an empty list: BM25
has nothing to rank, and a list of arbitrary zero-score passages would look like an answer.

The client (`retrieve`, `check_retriever`) accepts both request shapes and both answer shapes, retries
connection errors, timeouts and HTTP 5xx with exponential back-off, and then raises `RetrieverError`; inside
an EnvPool worker that exception becomes an env failure of that one episode.
"""
import argparse
import json
import logging
import lzma
import os
import shutil
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from common.records import sha256_file

# bm25s uses JAX for its top-k when JAX is installed, and JAX then takes 75% of the GPU's memory at import (seen
# on the H200: a vLLM engine on the same GPU found 34 of 140 GiB free). BM25 runs on the CPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEFAULT_CACHE = os.path.expanduser("~/.cache/seed/retriever")
MAX_BODY = 10 * 1024 * 1024  # bytes; a batch of a thousand long queries is far below this


class RetrieverError(RuntimeError):
    """The retriever could not answer (after retries) or answered something unusable. One line."""


class CorpusError(ValueError):
    """A corpus file that is not wiki-18 JSONL; the message names the file and line."""


# ----------------------------------------------------------------------------------------------------
# Corpus and index

def open_text(path):
    """A text file, plain or xz-compressed (the shared data ships as .jsonl.xz)."""
    return lzma.open(path, "rt", encoding="utf-8") if path.endswith(".xz") else open(path, encoding="utf-8")


def json_lines(path, error, what=""):
    """(line number, row) of every non-blank line of a JSONL file (plain or .xz); a line that is not JSON
    raises `error` naming it ("<path>:<line>: <what>not JSON (<why>)")."""
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno}: {what}not JSON ({e.msg})") from None
            yield lineno, row


def read_corpus(path):
    """[{"id", "contents"}] of a wiki-18 JSONL corpus, in file order. Blank lines are skipped; anything else
    that is not a JSON object with string "id" and "contents" raises CorpusError naming the line."""
    docs, seen = [], {}
    for lineno, row in json_lines(path, CorpusError, "corpus line is "):
        if not isinstance(row, dict):
            raise CorpusError(f"{path}:{lineno}: corpus line is not a JSON object")
        for key in ("id", "contents"):
            if not isinstance(row.get(key), str):
                raise CorpusError(f"{path}:{lineno}: missing string field {key!r} (wiki-18 rows are "
                                  f'{{"id", "contents"}}, contents = "Title"\\ntext)')
        if row["id"] in seen:
            raise CorpusError(f"{path}:{lineno}: duplicate id {row['id']!r} (first at line {seen[row['id']]})")
        seen[row["id"]] = lineno
        docs.append({"id": row["id"], "contents": row["contents"]})
    if not docs:
        raise CorpusError(f"{path}: the corpus is empty")
    return docs


class BM25Index:
    """bm25s over the corpus `contents` (title line included): English stop words, PyStemmer's English
    (Snowball) stemmer, Lucene's BM25 variant. Thread-safe for search (the index is read-only; each thread
    gets its own stemmer because PyStemmer objects keep internal state)."""

    def __init__(self, docs, retriever, params):
        self.docs, self.bm25, self.params = docs, retriever, params
        self._local = threading.local()

    @staticmethod
    def _stemmer():
        import Stemmer
        return Stemmer.Stemmer("english")

    def tokenize(self, texts):
        import bm25s
        if not hasattr(self._local, "stemmer"):
            self._local.stemmer = self._stemmer()
        return bm25s.tokenize(texts, stopwords="en", stemmer=self._local.stemmer, return_ids=False,
                              show_progress=False)

    @classmethod
    def build_or_load(cls, corpus_path, cache_dir, k1=1.5, b=0.75, log=None):
        """Read the corpus; load its index from `cache_dir/<sha256 of the corpus file>/<params>/` or build
        and store it there (written to a temporary folder and renamed, so a killed build leaves no half
        index behind)."""
        import bm25s
        log = log or logging.getLogger("retriever")
        docs = read_corpus(corpus_path)
        sha = sha256_file(corpus_path)
        params = {"library": f"bm25s {bm25s.__version__}", "method": "lucene", "k1": k1, "b": b,
                  "stopwords": "en", "stemmer": "english", "corpus_sha256": sha, "documents": len(docs)}
        where = os.path.join(cache_dir, sha, f"bm25s-{bm25s.__version__}-lucene-k1_{k1:g}-b_{b:g}-en")
        if os.path.isdir(where):
            t0 = time.perf_counter()
            bm = bm25s.BM25.load(where, show_progress=False)
            if bm.scores["num_docs"] == len(docs):
                log.info("loaded the index of %d documents from %s in %.2f s", len(docs), where,
                         time.perf_counter() - t0)
                return cls(docs, bm, params)
            log.warning("cached index at %s has %d documents, the corpus %d: rebuilding", where,
                        bm.scores["num_docs"], len(docs))
            shutil.rmtree(where, ignore_errors=True)
        t0 = time.perf_counter()
        index = cls(docs, None, params)
        bm = bm25s.BM25(k1=k1, b=b, method="lucene")
        bm.index(index.tokenize([d["contents"] for d in docs]), show_progress=False)
        index.bm25 = bm
        tmp = f"{where}.tmp-{os.getpid()}"
        bm.save(tmp, show_progress=False)
        try:
            os.rename(tmp, where)
        except OSError:  # another process stored the same index meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("built the index of %d documents in %.2f s, cached at %s", len(docs), time.perf_counter() - t0,
                 where)
        return index

    def search(self, queries, topk):
        """[[(doc, score), ...] per query], best first, at most topk each, zero-score passages left out."""
        out = [[] for _ in queries]
        tokens = self.tokenize(list(queries))
        todo = [i for i, t in enumerate(tokens) if any(w in self.bm25.vocab_dict for w in t)]
        if todo:
            k = min(topk, len(self.docs))
            ids, scores = self.bm25.retrieve([tokens[i] for i in todo], k=k, show_progress=False, n_threads=0)
            for row, i in enumerate(todo):  # ids/scores: [len(todo), k]
                out[i] = [(self.docs[d], float(s)) for d, s in zip(ids[row].tolist(), scores[row].tolist())
                          if s > 0]
        return out


# ----------------------------------------------------------------------------------------------------
# Server

class BadRequest(ValueError):
    pass


FIELDS = ("query", "queries", "topk", "return_scores")  # Search-R1's QueryRequest, plus the single shape


def parse_request(body, default_topk):
    """(queries, topk, return_scores, single) of a /retrieve body, or BadRequest with a one-line reason that
    names the field at fault. Types are strict (JSON's own types, no coercion): a typo or a string "false"
    must not silently become something else."""
    try:
        req = json.loads(body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(req, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(k for k in req if k not in FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; the fields are {', '.join(FIELDS)}")
    if "queries" in req and "query" in req:
        raise BadRequest("give either 'query' (one string) or 'queries' (a list of strings), not both")
    if "queries" in req:
        queries, single = req["queries"], False
        if not isinstance(queries, list) or not queries:
            raise BadRequest(f"'queries' must be a non-empty list of strings, got {_kind(queries)}")
        for i, q in enumerate(queries):
            if not isinstance(q, str):
                raise BadRequest(f"'queries'[{i}] must be a string, got {_kind(q)}")
            if not q.strip():
                raise BadRequest(f"'queries'[{i}] is empty (query {i} is empty)")
    elif "query" in req:
        q, single = req["query"], True
        if isinstance(q, list):
            raise BadRequest("'query' must be a string, got a list (several queries go in 'queries')")
        if not isinstance(q, str):
            raise BadRequest(f"'query' must be a string, got {_kind(q)}")
        if not q.strip():
            raise BadRequest("'query' is empty (empty query)")
        queries = [q]
    else:
        raise BadRequest("missing 'query' (a string) or 'queries' (a list of strings)")
    topk = req.get("topk")
    if topk is None:  # absent or null: the server's default (Search-R1: Optional[int] = None)
        topk = default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise BadRequest(f"'topk' must be a positive integer, got {topk!r}")
    scores = req.get("return_scores", False)
    if scores is None:
        scores = False
    if not isinstance(scores, bool):
        raise BadRequest(f"'return_scores' must be true or false, got {_kind(scores)} {scores!r}"[:160])
    return queries, topk, scores, single


def _kind(value):
    """A JSON value's type as JSON names it, for error messages."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


class Handler(BaseHTTPRequestHandler):
    server_version = "seed-retriever/1"
    protocol_version = "HTTP/1.1"  # keep-alive: the client's pooled session reuses connections
    # Headers and body leave in two writes; with Nagle's algorithm on, the body then waits for the client's
    # delayed ACK on a kept-alive connection: a 40 ms floor per request (measured: 44 ms p50 for a 2 ms query).
    disable_nagle_algorithm = True
    ALLOWED = "GET, POST"

    def setup(self):
        # socketserver applies `timeout` to the connection's socket: every read (the request line, headers,
        # body) waits at most this long, so a client that connects and sends nothing frees its thread
        self.timeout = self.server.conn_timeout
        self._t0 = time.perf_counter()
        super().setup()

    def _send(self, code, obj, note="", headers=()):
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers:
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":  # a HEAD answer has headers only (HTTP), else the next answer is garbled
                self.wfile.write(data)
            self.wfile.flush()
        except (ConnectionError, TimeoutError) as e:  # the client left before its answer
            self.close_connection = True
            self.server.log.info("%s %s %s client disconnected before the answer (%s)", self.client_address[0],
                                 self.command, self.path, type(e).__name__)
            return
        note = note or obj.get("error", "")
        self.server.log.info("%s %s %s %d %.1f ms %s", self.client_address[0], self.command, self.path, code,
                             1000 * (time.perf_counter() - self._t0), note)

    def send_error(self, code, message=None, explain=None):
        """The stdlib's own errors (a bad request line, headers too long, an unknown method, a read that timed
        out) as JSON like every other answer, not its HTML page."""
        self.close_connection = True
        if not hasattr(self, "command") or self.command is None:
            self.command = ""
        if code == 501 and self.command:  # a method that HTTP does not define at all
            message = f"method {self.command} is not an HTTP method this server knows; use {self.ALLOWED}"
        self._send(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def handle_one_request(self):
        self._t0 = time.perf_counter()
        try:
            super().handle_one_request()
        except TimeoutError:  # mid-body (the stdlib catches it only while reading the request line)
            self.close_connection = True
            self.server.log.info("%s connection timed out after %g s reading a request", self.client_address[0],
                                 self.server.conn_timeout)
        except ConnectionError as e:
            self.close_connection = True
            self.server.log.info("%s client disconnected (%s)", self.client_address[0], type(e).__name__)

    def _route(self):
        """(path, query string) of the request target."""
        parts = urlsplit(self.path)
        return parts.path.rstrip("/") or "/", parts.query

    def do_GET(self):
        path, _ = self._route()
        if path == "/health":  # a query string is harmless here (monitors add cache busters)
            s = self.server
            self._send(200, {"status": "ok", "documents": len(s.index.docs), "corpus": s.corpus_path,
                             "corpus_sha256": s.index.params["corpus_sha256"], "index": s.index.params,
                             "default_topk": s.default_topk})
        elif path == "/retrieve":
            self._not_allowed("POST")
        else:
            self._send(404, {"error": f"no such path {path}; use POST /retrieve or GET /health"})

    def do_POST(self):
        path, query = self._route()
        if path == "/health":
            return self._not_allowed("GET")
        if path != "/retrieve":
            return self._send(404, {"error": f"no such path {path}; use POST /retrieve or GET /health"})
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True  # the body is not read
            return self._send(411, {"error": "chunked bodies are not supported; send a Content-Length"})
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            return self._send(400, {"error": "bad Content-Length header"})
        if n > MAX_BODY:
            self.close_connection = True  # the body is not read
            return self._send(413, {"error": f"request body of {n} bytes is over {MAX_BODY}"})
        body = self.rfile.read(n)
        if len(body) < n:  # the client closed the connection mid-body
            self.close_connection = True
            self.server.log.info("%s client disconnected after %d of %d body bytes", self.client_address[0],
                                 len(body), n)
            return
        if query:
            return self._send(400, {"error": f"query-string parameters ({query[:60]}) are not read; send every "
                                             f"field in the JSON body"})
        try:
            queries, topk, scores, single = parse_request(body, self.server.default_topk)
        except BadRequest as e:
            return self._send(400, {"error": str(e)})
        try:
            hits = self.server.index.search(queries, topk)
        except Exception as e:  # a bug or a broken index: a JSON 500 (the client retries 5xx), the trace logged
            self.server.log.exception("search failed")
            return self._send(500, {"error": f"search failed: {type(e).__name__}: {str(e)[:120]}"})
        result = [[{"document": d, "score": s} if scores else d for d, s in h] for h in hits]
        self._send(200, {"result": result}, f"{len(queries)} quer{'y' if single else 'ies'}, topk {topk}")

    def _not_allowed(self, allow=None):
        allow = allow or self.ALLOWED
        self._send(405, {"error": f"method {self.command} is not allowed on {self._route()[0]}; use {allow}"},
                   headers=[("Allow", allow)])

    # the other standard methods (RFC 9110 and PATCH): 405 with the Allow header, a JSON body
    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def log_request(self, code="-", size="-"):  # _send logs each answer once, with its timing
        pass

    def log_message(self, fmt, *args):  # the stdlib's other messages (bad request lines): the log file
        self.server.log.info("%s " + fmt, self.client_address[0], *args)


class RetrieverServer(ThreadingHTTPServer):
    daemon_threads = True  # a hung client never blocks shutdown

    def __init__(self, address, index, corpus_path, default_topk, log, backlog=128, conn_timeout=30.0):
        self.index, self.corpus_path, self.default_topk, self.log = index, corpus_path, default_topk, log
        # listen()'s backlog: connections the kernel queues before accept(). socketserver's default of 5
        # reset connections under 20 concurrent clients (26 ConnectionResetError in 2,000 requests)
        self.request_queue_size = backlog
        self.conn_timeout = conn_timeout
        super().__init__(address, Handler)

    def handle_error(self, request, client_address):
        """One line in the log instead of socketserver's traceback on stderr: a client that went away is
        routine; anything else is logged with its trace (in the log file, not on the terminal)."""
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            self.log.info("%s client disconnected (%s)", client_address[0], type(e).__name__)
        else:
            self.log.exception("%s unexpected error serving a request", client_address[0])


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m envs.retriever", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="BM25 retrieval server over a wiki-18 JSONL corpus (POST /retrieve, GET /health), "
                    "compatible with Search-R1's retrieval server.")
    p.add_argument("--corpus", required=True,
                   help='corpus JSONL (.jsonl or .jsonl.xz), one {"id", "contents"} per line, '
                        'contents = "Title" + newline + text (the wiki-18 / FlashRAG format)')
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; the default serves this machine only (0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    p.add_argument("--topk", type=int, default=3, help="passages per query when a request gives no topk")
    p.add_argument("--backlog", type=int, default=128,
                   help="listen backlog: connections queued before the server accepts them (size it above the "
                        "number of concurrent clients, e.g. the env workers of every run that shares it)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a connection may wait between reads (request line, headers, body) before the "
                        "server closes it: a client that connects and sends nothing frees its thread; an idle "
                        "kept-alive connection is closed after as long (the client reconnects)")
    p.add_argument("--k1", type=float, default=1.5, help="BM25 k1 (term-frequency saturation)")
    p.add_argument("--b", type=float, default=0.75, help="BM25 b (document-length normalisation)")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE,
                   help="where indexes are cached, one folder per sha256 of the corpus file")
    p.add_argument("--log-file", default=None,
                   help="request and startup log (None: <cache-dir>/retriever-<port>.log)")
    args = p.parse_args(argv)
    for name in ("topk", "backlog"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be 1 or more, got {getattr(args, name)}")
    if not args.timeout > 0:
        p.error(f"--timeout must be more than 0 seconds, got {args.timeout}")

    os.makedirs(args.cache_dir, exist_ok=True)
    log_file = args.log_file or os.path.join(args.cache_dir, f"retriever-{args.port}.log")
    log = logging.getLogger("retriever")
    log.setLevel(logging.INFO)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    try:
        index = BM25Index.build_or_load(args.corpus, args.cache_dir, k1=args.k1, b=args.b, log=log)
        server = RetrieverServer((args.host, args.port), index, os.path.abspath(args.corpus), args.topk, log,
                                 backlog=args.backlog, conn_timeout=args.timeout)
    except (CorpusError, OSError) as e:
        log.error("%s", e)
        print(f"retriever: error: {e}", file=sys.stderr, flush=True)
        return 2
    host, port = server.server_address[:2]
    msg = (f"serving {len(index.docs)} documents at http://{host}:{port}/retrieve (log: {log_file}; backlog "
           f"{args.backlog}, connection timeout {args.timeout:g} s)")
    log.info(msg)
    print(f"retriever: {msg}", flush=True)  # tests and scripts wait for this line
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops it cleanly, like Ctrl-C
    try:
        server.serve_forever(poll_interval=0.2)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()
        log.info("stopped")
    return 0


# ----------------------------------------------------------------------------------------------------
# Client

_session = None
_shape_of = {}  # url -> "queries" | "query", learned by shape="auto"


class _Rejected(Exception):
    """HTTP 400/422: the server understood the request and refused it (e.g. the other request shape)."""


def session():
    """One pooled requests.Session per process (an EnvPool worker steps many games through it)."""
    global _session
    if _session is None:
        import requests
        from requests.adapters import HTTPAdapter
        _session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=32, max_retries=0)  # retries are ours
        _session.mount("http://", adapter)
        _session.mount("https://", adapter)
    return _session


def _short(e, n=160):
    return " ".join(str(e).split())[:n]


def _post(url, payload, timeout, retries, backoff):
    """The answer's JSON. Connection errors, timeouts and 5xx are retried (back-off, back-off x 2, ...);
    400/422 raise _Rejected; anything else unusable raises RetrieverError at once."""
    import requests
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            r = session().post(url, json=payload, timeout=timeout)
        except requests.Timeout:
            last = f"no answer within {timeout:g} s"
            continue
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            last = f"connection failed ({_short(e)})"
            continue
        if r.status_code >= 500:
            last = f"HTTP {r.status_code}: {_short(r.text)}"
            continue
        if r.status_code in (400, 422):
            raise _Rejected(f"HTTP {r.status_code}: {_short(r.text)}")
        if r.status_code != 200:
            raise RetrieverError(f"retriever {url}: HTTP {r.status_code}: {_short(r.text)}")
        try:
            return r.json()
        except ValueError:
            raise RetrieverError(f"retriever {url}: the answer is not JSON: {r.text[:80]!r}") from None
    raise RetrieverError(f"retriever {url}: failed after {retries + 1} attempt(s): {last}")


def _document(item, url):
    """{"id", "contents", "score"} of one answer item: {"document": doc, "score": s} or a bare doc; a doc
    has "contents", or "title" and "text" (then contents is rebuilt in the wiki-18 form)."""
    if not isinstance(item, dict):
        raise RetrieverError(f"retriever {url}: a result item is not an object: {str(item)[:80]!r}")
    doc, score = (item["document"], item.get("score")) if "document" in item else (item, item.get("score"))
    if not isinstance(doc, dict):
        raise RetrieverError(f"retriever {url}: a result document is not an object: {str(doc)[:80]!r}")
    if isinstance(doc.get("contents"), str):
        contents = doc["contents"]
    elif isinstance(doc.get("text"), str):
        contents = f'"{doc.get("title", "")}"\n{doc["text"]}'
    else:
        raise RetrieverError(f"retriever {url}: a result document has no 'contents': {str(doc)[:80]!r}")
    try:
        score = None if score is None else float(score)
    except (TypeError, ValueError):
        score = None
    return {"id": str(doc.get("id", "")), "contents": contents, "score": score}


def _results(answer, n, url):
    """The per-query lists of an answer to n queries. A single query's list may come unwrapped."""
    res = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(res, list):
        raise RetrieverError(f"retriever {url}: the answer has no 'result' list: {str(answer)[:80]!r}")
    if n == 1 and all(not isinstance(r, list) for r in res):  # [] or [item, ...]: one query, unwrapped
        res = [res]
    if len(res) != n or not all(isinstance(r, list) for r in res):
        raise RetrieverError(f"retriever {url}: expected {n} result list(s), got {str(res)[:80]!r}")
    return [[_document(item, url) for item in r] for r in res]


def retrieve(url, queries, topk=3, timeout=10.0, retries=3, backoff=0.5, shape="auto"):
    """[[{"id", "contents", "score"}, ...] per query], best first (score None if the server gives none).

    shape: "queries" sends {"queries": [...]} (one request), "query" sends {"query": q} per query, "auto"
    tries "queries" first and falls back to "query" for good if the server refuses it with 400/422 (a
    server written for the other shape). Raises RetrieverError after `retries` retries."""
    if isinstance(queries, str):
        queries = [queries]
    queries = list(queries)
    use = _shape_of.get(url, "queries") if shape == "auto" else shape
    if use == "queries":
        try:
            answer = _post(url, {"queries": queries, "topk": topk, "return_scores": True}, timeout, retries, backoff)
            return _results(answer, len(queries), url)
        except _Rejected as e:
            if shape != "auto":
                raise RetrieverError(f"retriever {url} refused the request: {e}") from None
            refused = e
    out = []
    for q in queries:
        try:
            answer = _post(url, {"query": q, "topk": topk, "return_scores": True}, timeout, retries, backoff)
        except _Rejected as e:  # refused in both shapes: report the first refusal (bad content, not shape)
            raise RetrieverError(f"retriever {url} refused the request: {refused if use == 'queries' else e}") \
                from None
        out += _results(answer, 1, url)
    if shape == "auto":
        _shape_of[url] = "query"  # the "query" shape worked where "queries" was refused: keep using it
    return out


def check_retriever(url, timeout=5.0, shape="auto"):
    """Raise RetrieverError (one line, naming the URL) unless `url` answers a one-word query within
    `timeout` seconds. Called once before a run's first episode."""
    try:
        retrieve(url, ["wikipedia"], topk=1, timeout=timeout, retries=0, shape=shape)
    except RetrieverError as e:
        raise RetrieverError(f"{e} (is a retriever running there? start ours with `python -m envs.retriever "
                             f"--corpus ../shared/search/corpus.jsonl.xz --port 8000`, or pass "
                             f"--retriever-url)") from None


if __name__ == "__main__":
    sys.exit(main())
