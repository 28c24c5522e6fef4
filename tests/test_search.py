"""The Search env: envs/retriever.py (the BM25 server as a real subprocess on a loopback port, and the client
against faulty stdlib servers) and envs/search.py (parser, EM, prompts, loaders, games through the server).

Servers: `small_server` over a 6-passage corpus this file writes, `real_server` over ../shared/search's
4,968-passage corpus; each is started once per module with `--port 0` (the server prints its URL). Fault
servers run in a thread of this process and sleep at most 2 s, so every test ends by itself.
"""
import argparse
import hashlib
import json
import lzma
import os
import re
import select
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from conftest import REPO
from envs import search as S
from envs.pool import EnvPool
from envs.retriever import CorpusError, RetrieverError, check_retriever, read_corpus, retrieve

SMALL = [("s-0", "Zorblat", "Zorblat is a purple mineral mined on the moon of Quaxor."),
         ("s-1", "Quaxor", "Quaxor is a gas giant that orbits the star Velmira; its moon holds zorblat mines."),
         ("s-2", "Velmira", "Velmira is a red dwarf star in the constellation Lyra."),
         ("s-3", "Pemberly Hollow", "Pemberly Hollow is a village known for its cheese rolling festival."),
         ("s-4", "Cheese rolling", "Cheese rolling is a race in which a wheel of cheese is rolled down a hill."),
         ("s-5", "Lyra", "Lyra is a small constellation of the northern sky.")]
SMALL_TASK = {"task_id": "t/0", "split": "test", "category": "hotpotqa", "question": "Which star does Quaxor orbit?",
              "golden_answers": ["Velmira"], "data_source": "hotpotqa", "topk": 3, "retriever_timeout": 2.0,
              "retriever_retries": 1, "retriever_backoff": 0.05, "max_steps": 4}
SKILL = "Search for the planet first, then read which star it orbits, and answer with the star's name."
REAL_CORPUS = os.path.join(S.default_data_dir(), "corpus.jsonl.xz")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def start_server(corpus, workdir, *extra, cmd=None):
    """`python -m envs.retriever` on a free port (or cmd, a retriever command line of its own, e.g. h200.sh's
    with --port 0); returns (process, url) once it prints its URL."""
    cmd = cmd or [sys.executable, "-m", "envs.retriever", "--corpus", str(corpus), "--port", "0"]
    proc = subprocess.Popen([*cmd, "--cache-dir", str(workdir / "cache"), "--log-file", str(workdir / "server.log"),
                             *extra], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, seen = time.monotonic() + 120, ""
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            seen += line
            m = re.search(r"at (http://\S+/retrieve)", line)
            if m:
                return proc, m.group(1)
    proc.kill()
    raise AssertionError(f"retriever did not start: {seen} {proc.stderr.read()}")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    return write_jsonl(d / "corpus.jsonl", [{"id": i, "contents": f'"{t}"\n{x}'} for i, t, x in SMALL])


@pytest.fixture(scope="module")
def small_server(small_corpus, tmp_path_factory):
    proc, url = start_server(small_corpus, tmp_path_factory.mktemp("small_server"))
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    proc, url = start_server(REAL_CORPUS, tmp_path_factory.mktemp("real_server"))
    yield url
    stop(proc)


def post(url, body):
    r = requests.post(url, data=body if isinstance(body, (str, bytes)) else json.dumps(body), timeout=10)
    return r.status_code, r.json()


# ----------------------------------------------------------------------------------------------------
# The server

def test_health_and_cache(small_corpus, small_server, tmp_path):
    r = requests.get(small_server.replace("/retrieve", "/health"), timeout=5).json()
    assert r["status"] == "ok" and r["documents"] == len(SMALL)
    assert r["corpus_sha256"] == hashlib.sha256(open(small_corpus, "rb").read()).hexdigest()
    assert requests.get(small_server.replace("/retrieve", "/nope"), timeout=5).status_code == 404
    # the index is built once per corpus hash, then loaded from the cache
    for _ in range(2):
        proc, _ = start_server(small_corpus, tmp_path)
        stop(proc)
    log = (tmp_path / "server.log").read_text()
    assert log.count("built the index of 6 documents") == 1 and log.count("loaded the index of 6 documents") == 1
    assert os.listdir(tmp_path / "cache" / r["corpus_sha256"])


def test_both_request_shapes_and_topk(small_server):
    code, r = post(small_server, {"query": "Which star does Quaxor orbit?", "topk": 2, "return_scores": True})
    assert code == 200 and len(r["result"]) == 1 and len(r["result"][0]) == 2
    top = r["result"][0]
    assert top[0]["document"]["id"] == "s-1" and top[0]["document"]["contents"].startswith('"Quaxor"\n')
    assert top[0]["score"] >= top[1]["score"] > 0
    code, r = post(small_server, {"queries": ["cheese rolling race", "red dwarf star"], "topk": 1})
    assert code == 200 and [[d["id"] for d in q] for q in r["result"]] == [["s-4"], ["s-2"]]
    assert set(r["result"][0][0]) == {"id", "contents"}  # without return_scores: the documents (upstream's form)
    for k in (1, 2, 3, 100):  # never more than the passages that share a word with the query
        code, r = post(small_server, {"queries": ["star constellation Lyra sky"], "topk": k, "return_scores": True})
        assert code == 200 and len(r["result"][0]) == min(k, 3)
    code, r = post(small_server, {"query": "Quaxor moon zorblat Velmira cheese"})  # no topk: the server's 3
    assert code == 200 and len(r["result"][0]) == 3
    code, r = post(small_server, {"query": "the of and"})  # stop words only: nothing to rank
    assert code == 200 and r == {"result": [[]]}


@pytest.mark.parametrize("body, message", [
    ({}, "missing 'query'"), ({"topk": 3}, "missing 'query'"), ({"query": ""}, "empty query"),
    ({"query": "   "}, "empty query"), ({"query": None}, "'query' must be a string, got null"),
    ({"queries": []}, "non-empty list"),
    ({"queries": "Quaxor"}, "non-empty list"), ({"queries": ["Quaxor", " "]}, "query 1 is empty"),
    ({"query": "Quaxor", "topk": 0}, "'topk'"), ({"query": "Quaxor", "topk": "3"}, "'topk'"),
    ("not json", "not JSON"), ("[1, 2]", "JSON object")])
def test_bad_requests_get_400_with_a_json_error(small_server, body, message):
    code, r = post(small_server, body)
    assert code == 400 and message in r["error"]


@pytest.mark.parametrize("body, message", [
    # each names the field at fault; JSON types are not coerced (a string "false" would read as true)
    ({"query": "Quaxor", "return_scores": "false"}, "'return_scores' must be true or false, got a string"),
    ({"query": "Quaxor", "return_scores": 0}, "'return_scores' must be true or false, got a number"),
    ({"query": ["a", "b"]}, "'query' must be a string, got a list (several queries go in 'queries')"),
    ({"query": 7}, "'query' must be a string, got a number"),
    ({"queries": ["Quaxor", 3]}, "'queries'[1] must be a string, got a number"),
    ({"queries": [["Quaxor"]]}, "'queries'[0] must be a string, got a list"),
    ({"query": "Quaxor", "top_k": 2}, "unknown field(s) 'top_k'"),
    ({"query": "Quaxor", "queries": ["Quaxor"]}, "not both"),
    ({"query": "Quaxor", "topk": 2.0}, "'topk' must be a positive integer, got 2.0"),
    ({"query": "Quaxor", "topk": True}, "'topk' must be a positive integer, got True")])
def test_every_field_is_strict_and_named(small_server, body, message):
    code, r = post(small_server, body)
    assert code == 400 and message in r["error"], r


def test_null_fields_take_the_defaults(small_server):
    code, r = post(small_server, {"query": "Quaxor moon zorblat Velmira cheese", "topk": None, "return_scores": None})
    assert code == 200 and len(r["result"][0]) == 3 and "score" not in r["result"][0][0]


def raw(url, data, read=True):
    """Send raw bytes to the server of `url`; (status, headers, body) of the answer (or None without read)."""
    import socket
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        if not read:
            return None
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            head, sep, body = buf.partition(b"\r\n\r\n")
            m = re.search(rb"Content-Length: (\d+)", head)
            if sep and m and len(body) >= int(m.group(1)):
                break
    if not buf.startswith(b"HTTP/"):  # an HTTP/0.9-style answer (no version in the request line): body only
        return None, {}, buf
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("method, path, code, message", [
    ("PUT", "/retrieve", 405, "method PUT is not allowed on /retrieve; use GET, POST"),
    ("DELETE", "/retrieve", 405, "method DELETE is not allowed"), ("PATCH", "/health", 405, "method PATCH"),
    ("OPTIONS", "/retrieve", 405, "method OPTIONS"), ("GET", "/retrieve", 405, "use POST"),
    ("POST", "/health", 405, "use GET"), ("BREW", "/retrieve", 501, "method BREW is not an HTTP method"),
    ("GET", "/nope", 404, "no such path /nope"), ("POST", "/retrieve?topk=2", 400, "query-string parameters"),
    ("POST", "/retrieve/", 200, None), ("GET", "/health?probe=1", 200, None)])
def test_every_method_and_path_answers_json(small_server, method, path, code, message):
    body = json.dumps({"query": "Quaxor"}).encode()
    status, headers, data = raw(small_server, f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}"
                                              f"\r\nConnection: close\r\n\r\n".encode() + body)
    assert status == code and headers["Content-Type"].startswith("application/json")
    answer = json.loads(data)
    if message:
        assert message in answer["error"]
    if code == 405:
        assert headers["Allow"] in ("GET, POST", "POST", "GET")


def test_stdlib_errors_are_json_too(small_server):
    status, headers, data = raw(small_server, b"GARBAGE\r\n\r\n")  # no version: the stdlib answers 0.9-style
    assert "Bad request" in json.loads(data)["error"]
    many = "".join(f"X-{i}: y\r\n" for i in range(120))
    status, headers, data = raw(small_server, f"GET /health HTTP/1.1\r\n{many}\r\n".encode())
    assert status == 431 and headers["Content-Type"].startswith("application/json") and json.loads(data)["error"]
    status, _, data = raw(small_server, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 405 and data == b""  # a HEAD answer carries no body
    status, _, data = raw(small_server, b"POST /retrieve HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert status == 411 and "Content-Length" in json.loads(data)["error"]


@pytest.fixture
def timeout_server(small_corpus, tmp_path):
    """A server with a 1 s connection timeout and a backlog of 64; yields (url, process, log path)."""
    proc, url = start_server(small_corpus, tmp_path, "--timeout", "1", "--backlog", "64")
    yield url, proc, tmp_path / "server.log"
    stop(proc)


def test_silent_and_vanishing_clients_free_their_threads_without_tracebacks(timeout_server):
    import socket
    url, proc, log = timeout_server
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]  # connect, send nothing
    stalled = socket.create_connection((host, int(port)), timeout=10)  # headers, then half the body
    stalled.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{\"query\": ")
    t0 = time.monotonic()
    for s in silent + [stalled]:
        assert s.recv(100) == b""  # the server closed it: its thread is free again
        s.close()
    assert time.monotonic() - t0 < 8
    # clients that vanish before their answer (reset at once, a large answer pending): one log line each
    big = json.dumps({"queries": ["Quaxor moon star cheese"] * 50, "topk": 6}).encode()
    for _ in range(5):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        s.sendall(f"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: {len(big)}\r\n\r\n".encode() + big)
        s.close()
    deadline = time.monotonic() + 20
    while log.read_text().count("client disconnected") < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert post(url, {"query": "Quaxor"})[0] == 200  # still serving
    stop(proc)
    err = proc.stderr.read()
    assert "Traceback" not in err and "Error" not in err, err
    text = log.read_text()
    assert "Traceback" not in text
    assert text.count("Request timed out") == 5 and text.count("client disconnected") == 5, text[-2000:]


def test_backlog_flag_reaches_listen_and_64_clients_get_no_error(timeout_server):
    url, proc, _ = timeout_server
    port = re.match(r"http://[^:/]+:(\d+)", url).group(1)
    ss = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
    assert ss[2] == "64", ss  # a listening socket's Send-Q is its backlog
    from concurrent.futures import ThreadPoolExecutor
    errors = []

    def client(i):  # a fresh connection per request: the accept queue is what a burst fills
        for j in range(5):
            try:
                r = requests.post(url, json={"query": f"Quaxor star {i} {j}"}, timeout=30)
                assert r.status_code == 200
            except Exception as e:  # counted, not raised: the assertion below reports them all
                errors.append(f"{type(e).__name__}: {e}")

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(client, range(64)))
    assert errors == []


def test_real_corpus_retrieval_matches_the_data_readme(real_server):
    """README of ../shared/search: BM25 top-3 holds a gold paragraph for 472 of the 500 questions."""
    with lzma.open(os.path.join(S.default_data_dir(), "hotpotqa500.jsonl.xz"), "rt") as f:
        rows = [json.loads(line) for line in f]
    t0 = time.perf_counter()
    hits = retrieve(real_server, [r["question"] for r in rows], topk=3)  # one "queries" request
    assert time.perf_counter() - t0 < 30
    assert sum(any(d["id"] in r["metadata"]["gold_ids"] for d in h) for r, h in zip(rows, hits)) == 472
    one = retrieve(real_server, rows[0]["question"], topk=3, shape="query")[0]
    assert [d["id"] for d in one] == [d["id"] for d in hits[0]] and one[0]["score"] == pytest.approx(hits[0][0]["score"])


def test_corpus_errors_name_the_line(tmp_path):
    good = {"id": "a", "contents": '"A"\ntext'}
    cases = [([good, "", '{"id": "b", "contents": "x"', good], ":3: corpus line is not JSON"),  # line 2 blank
             ([good, {"id": "b"}], ":2: missing string field 'contents'"),
             ([good, {"id": "a", "contents": "again"}], ":2: duplicate id 'a' (first at line 1)"),
             (["[1]"], ":1: corpus line is not a JSON object"), ([], "the corpus is empty")]
    for i, (rows, message) in enumerate(cases):
        path = write_jsonl(tmp_path / f"c{i}.jsonl", rows)
        with pytest.raises(CorpusError, match=re.escape(message)):
            read_corpus(path)
    # the server command: one line on stderr, exit code 2, within seconds
    res = subprocess.run([sys.executable, "-m", "envs.retriever", "--corpus", str(tmp_path / "c0.jsonl"), "--port",
                          "0", "--cache-dir", str(tmp_path / "cache")], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "c0.jsonl:3: corpus line is not JSON" in res.stderr


# ----------------------------------------------------------------------------------------------------
# The client against faulty servers

class FaultServer:
    """A stdlib HTTP server in a thread with one behaviour: '500', 'hang' (2 s), 'badjson', 'noresult',
    'flaky' (two 500s, then answers), 'query_only' (refuses {"queries"} with 422 like a FastAPI server
    written for {"query"}; answers a bare list of title/text documents without scores)."""

    def __init__(self, mode):
        self.mode, self.requests = mode, []
        owner = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                code, out = owner.answer(body)
                data = out if isinstance(out, bytes) else json.dumps(out).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout): nothing to answer
                    pass

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, body):
        doc = {"document": {"id": "d1", "contents": '"T"\ntext'}, "score": 1.5}
        if self.mode == "500":
            return 500, {"error": "boom"}
        if self.mode == "hang":
            time.sleep(2.0)
            return 200, {"result": [[doc]]}
        if self.mode == "badjson":
            return 200, b'{"result": [[{"document"'
        if self.mode == "noresult":
            return 200, {"results": []}
        if self.mode == "flaky":
            return (500, {"error": "warming up"}) if len(self.requests) <= 2 else (200, {"result": [[doc]]})
        if self.mode == "query_only":
            if "query" not in body:
                return 422, {"detail": [{"loc": ["body", "query"], "msg": "field required"}]}
            return 200, {"result": [{"id": "d2", "title": "T2", "text": f"about {body['query']}"}]}
        raise ValueError(self.mode)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fault():
    servers = []

    def make(mode):
        servers.append(FaultServer(mode))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


def test_client_retries_5xx_with_backoff_then_raises(fault):
    s = fault("500")
    t0 = time.perf_counter()
    with pytest.raises(RetrieverError, match=r"failed after 3 attempt\(s\): HTTP 500"):
        retrieve(s.url, ["q"], retries=2, backoff=0.1)
    assert len(s.requests) == 3 and time.perf_counter() - t0 >= 0.3  # slept 0.1 + 0.2


def test_client_times_out_and_retries(fault):
    s = fault("hang")
    t0 = time.perf_counter()
    with pytest.raises(RetrieverError, match=r"no answer within 0.3 s"):
        retrieve(s.url, ["q"], timeout=0.3, retries=1, backoff=0.05)
    assert len(s.requests) == 2 and time.perf_counter() - t0 < 1.5


@pytest.mark.parametrize("mode, message", [("badjson", "the answer is not JSON"), ("noresult", "no 'result' list")])
def test_client_malformed_answer_raises_at_once(fault, mode, message):
    s = fault(mode)
    with pytest.raises(RetrieverError, match=message):
        retrieve(s.url, ["q"], retries=3, backoff=0.05)
    assert len(s.requests) == 1  # a malformed answer is not a transient fault: no retry


def test_client_recovers_from_transient_5xx(fault):
    s = fault("flaky")
    assert retrieve(s.url, ["q"], retries=3, backoff=0.01) == [[{"id": "d1", "contents": '"T"\ntext', "score": 1.5}]]
    assert len(s.requests) == 3


def test_client_falls_back_to_the_query_shape(fault):
    s = fault("query_only")
    out = retrieve(s.url, ["a b", "c"], topk=2)
    assert out == [[{"id": "d2", "contents": '"T2"\nabout a b', "score": None}],
                   [{"id": "d2", "contents": '"T2"\nabout c', "score": None}]]
    assert [list(r) for r in s.requests] == [["queries", "topk", "return_scores"]] + [["query", "topk", "return_scores"]] * 2
    retrieve(s.url, ["d"])  # learned: straight to the "query" shape
    assert "query" in s.requests[-1] and len(s.requests) == 4
    with pytest.raises(RetrieverError, match="refused the request: HTTP 422"):
        retrieve(s.url, ["d"], shape="queries")


def test_client_against_a_stopped_server(small_corpus, tmp_path):
    proc, url = start_server(small_corpus, tmp_path)
    assert retrieve(url, ["Quaxor"], topk=1)[0][0]["id"] == "s-1"
    check_retriever(url)
    stop(proc)
    t0 = time.perf_counter()
    with pytest.raises(RetrieverError, match="connection failed") as e:
        retrieve(url, ["Quaxor"], retries=2, backoff=0.05)
    with pytest.raises(RetrieverError) as e:
        check_retriever(url, timeout=2)
    msg = str(e.value)
    assert url in msg and "\n" not in msg and "python -m envs.retriever" in msg
    assert time.perf_counter() - t0 < 5
    # the env's start-up check: the same one line, before any task is built
    args = argparse.Namespace(retriever_url=url, retriever_timeout=2.0, no_retriever_check=False)
    with pytest.raises(SystemExit, match=re.escape(url)):
        S.eval_tasks("val", 0, 1, args)
    args.no_retriever_check = True
    assert len(S.eval_tasks("val", 0, 1, args)) == 1


# ----------------------------------------------------------------------------------------------------
# Parser, EM, reward

OK_SEARCH = ("search[Quaxor orbit]", True, "")
# (response, public rules: the paper's code and the default, strict rules: the three flags' other values).
# Public, hand-derived from verl-agent's search_projection: cut after the first </search> (else </answer>),
# take the first search block, else the first answer block; invalid when the whole text has both opening
# tags or two of one; the block is executed even then; an empty block is valid.
STRICT = {"invalid_step": "nothing", "empty_block": "invalid", "stray_tags": "ignore"}
TRUTH_TABLE = [
    ("<think>need the star</think>\n<search>Quaxor orbit</search>", OK_SEARCH, OK_SEARCH),
    ("<search>Quaxor orbit</search>", OK_SEARCH, OK_SEARCH),  # no <think>: still valid here
    ("<think>x</think><search>\n  Quaxor \n orbit </search>", OK_SEARCH, OK_SEARCH),  # inner whitespace folded
    ("<SEARCH>Quaxor orbit</Search>", OK_SEARCH, OK_SEARCH),  # tags in any case
    # a tag mentioned in the reasoning: public counts it (and its block swallows the mention), strict ignores it
    ("<think>I will use <search> tags</think><search>Quaxor orbit</search>",
     ("search[tags</think><search>Quaxor orbit]", False, "several_blocks"), OK_SEARCH),
    ("<think>the answer goes in <answer> tags</think><search>Quaxor orbit</search>",
     ("search[Quaxor orbit]", False, "both_kinds"), OK_SEARCH),
    ("<think>known</think><answer> Velmira </answer>", ("answer[Velmira]", True, ""), ("answer[Velmira]", True, "")),
    ("<answer>The Velmira star</answer> trailing text", ("answer[The Velmira star]", True, ""),
     ("answer[The Velmira star]", True, "")),
    ("", ("", False, "no_block"), ("", False, "no_block")),
    ("<think>only thinking</think>", ("", False, "no_block"), ("", False, "no_block")),
    ("<search>unclosed", ("", False, "no_block"), ("", False, "no_block")),
    ("search[Quaxor]", ("", False, "no_block"), ("", False, "no_block")),
    # invalid, and the public code still runs the first block (a search before an answer)
    ("<search>a</search><answer>b</answer>", ("search[a]", False, "both_kinds"), ("", False, "both_kinds")),
    ("<answer>b</answer> then <search>a</search>", ("search[a]", False, "both_kinds"), ("", False, "both_kinds")),
    ("<search>a</search><search>b</search>", ("search[a]", False, "several_blocks"), ("", False, "several_blocks")),
    ("<answer>a</answer>\n<answer>b</answer>", ("answer[a]", False, "several_blocks"),
     ("", False, "several_blocks")),
    ("<search>  </search>", ("search[]", True, ""), ("", False, "empty_block")),
    ("<answer></answer>", ("answer[]", True, ""), ("", False, "empty_block")),
    (None, ("", False, "no_block"), ("", False, "no_block")), (12, ("", False, "no_block"), ("", False, "no_block")),
]


@pytest.mark.parametrize("text, public, strict", TRUTH_TABLE)
def test_parser_truth_table(text, public, strict):
    assert S.parse_action(text, []) == public  # the module's rules: the defaults unless configure() changed them
    assert S.parse_action(text, [], rules=S.PUBLIC_RULES) == public
    assert S.parse_action(text, [], rules=STRICT) == strict
    assert {public[2], strict[2]} <= {""} | set(S.REASONS)


def test_each_protocol_flag_alone():
    both = "<search>a</search><answer>b</answer>"
    assert S.parse_action(both, [], rules={"invalid_step": "nothing"}) == ("", False, "both_kinds")
    assert S.parse_action("<answer> </answer>", [], rules={"empty_block": "invalid"}) == ("answer[]", False,
                                                                                          "empty_block")
    assert S.parse_action("<think><answer> later</think><search>q</search>", [], rules={"stray_tags": "ignore"}) \
        == ("search[q]", True, "")


def test_configure_sets_the_rules_from_flags_and_refuses_what_changes_nothing():
    p = argparse.ArgumentParser()
    S.add_args(p)
    p.add_argument("--invalid-rule", default="public")
    p.add_argument("--invalid-fallback", default=None)
    try:
        S.configure(p.parse_args(["--search-invalid-step", "nothing", "--search-stray-tags", "ignore"]))
        assert S.RULES == {"invalid_step": "nothing", "empty_block": "valid", "stray_tags": "ignore"}
        assert S.parse_action("<search>a</search><search>b</search>", []) == ("", False, "several_blocks")
        for argv, message in [(["--invalid-rule", "strict"], "--invalid-rule strict: the search env has no "
                                                             "admissible-action list"),
                              (["--invalid-fallback", "look"], "--invalid-fallback 'look': the search env runs only")]:
            with pytest.raises(SystemExit, match=message):
                S.configure(p.parse_args(argv))
        S.configure(p.parse_args(["--invalid-fallback", "answer[unknown]"]))  # one the env can run: accepted
    finally:
        S.configure(None)
    assert S.RULES == S.PUBLIC_RULES


def test_action_to_execute_and_split():
    assert S.action_to_execute("x", "search[q]") == "search[q]"
    assert S.action_to_execute("x", "") == "invalid" and S.action_to_execute("x", "", "noop") == "noop"
    assert S.split_action("search[a [b]]") == ("search", "a [b]") and S.split_action("answer[x]") == ("answer", "x")
    assert S.split_action("invalid") == (None, "") and S.split_action("search[ ]") == ("search", " ")


@pytest.mark.parametrize("pred, gold, em", [
    ("Velmira", ["velmira"], True), ("  VELMIRA. ", ["Velmira"], True), ("The Beatles", ["Beatles"], True),
    ("an apple", ["apple"], True), ("a  red   dwarf", ["red dwarf"], True), ("U.S.A.", ["USA"], True),
    ("Ovidius University", ["Ovidius University", "Ovidius"], True), ("Ovidius", ["Ovidius University"], False),
    ("theatre", ["atre"], False), ("Paris, France", ["Paris"], False), ("14 December 1972", ["December 1972"], False),
    ("yes", ["no"], False), ("", ["x"], False), ("1,000", ["1000"], True), ("Anne", ["anne"], True),
    # a gold that normalises to '' matches an answer that does too (the public em_check), nothing else
    ("", ["The"], True), ("the", ["."], True), (" A ", ["An", "x"], True), ("Velmira", ["The"], False)])
def test_exact_match_normalisation(pred, gold, em):
    assert S.exact_match(pred, gold) is em
    if not S.normalize_answer(pred) and not any(S.normalize_answer(g) for g in gold if g != "x"):
        assert S.exact_match(pred, gold, empty_gold="never") is False  # --search-empty-gold never


def test_normalize_answer_is_squad():
    assert S.normalize_answer("  The  Quick, brown FOX!  an  a the ") == "quick brown fox"
    assert S.normalize_answer("Théâtre") == "théâtre"  # non-ASCII letters stay (ASCII punctuation only)


def test_reward():
    assert S.reward({"won": True}, True, 0.01) == 1.0 and S.reward({"won": False}, True, 0.01) == 0.0
    assert S.reward({"won": False}, False, 0.01) == pytest.approx(-0.01)
    assert S.reward({"won": True}, False, 0.5) == pytest.approx(0.5)


# ----------------------------------------------------------------------------------------------------
# Prompts

HIST = [{"step": 1, "observation": "Which star does Quaxor orbit?", "action": "search[Quaxor]",
         "executed": "search[Quaxor]", "feedback": '<information>Doc 1: (Title: "Quaxor") Quaxor is a gas giant.'
                                                   '</information>'},
        {"step": 2, "observation": "...", "action": "", "executed": "invalid", "feedback": S.INVALID_FEEDBACK}]


def test_prompt_turn_1():
    p = S.build_prompt("Which star does Quaxor orbit?", "Which star does Quaxor orbit?", [], 1, [])
    assert p == (f"{S.ROLE}\nQuestion: Which star does Quaxor orbit?\n"
                 f"This is your first step: nothing has been searched yet.\nYou are now at step 1.\n\n{S.CLOSING}")
    assert all(t in S.CLOSING for t in ("<think> </think>", "<search> </search>", "<answer> </answer>", "<information>"))
    assert S.build_prompt(SMALL_TASK, "", [], 1, []) == p  # the task dict works as the task argument


def test_prompt_turn_3():
    p = S.build_prompt("Which star does Quaxor orbit?", HIST[-1]["feedback"], [], 3, HIST)
    assert p == (f"{S.ROLE}\nQuestion: Which star does Quaxor orbit?\n"
                 f"Before this step you have taken 2 step(s). Below are the most recent 2 actions and the "
                 f"information each returned:\n"
                 f"[Step 1] <search> Quaxor </search>\n{HIST[0]['feedback']}\n"
                 f"[Step 2] (an invalid response: no single search or answer block)\n{S.INVALID_FEEDBACK}\n"
                 f"You are now at step 3.\n\n{S.CLOSING}")
    p1 = S.build_prompt("Which star does Quaxor orbit?", "", [], 3, HIST[1:])  # k = 1: only the last pair
    assert "[Step 1]" not in p1 and "most recent 1 actions" in p1 and "taken 2 step(s)" in p1


@pytest.mark.parametrize("step", [1, 3])
def test_skill_block_is_exactly_the_difference(step):
    hist = HIST[:step - 1]
    plain = S.build_prompt("Which star does Quaxor orbit?", "", [], step, hist)
    teach = S.build_prompt("Which star does Quaxor orbit?", "", [], step, hist, skill=SKILL)
    block = S.skill_block(SKILL)
    at = plain.index("\n", plain.index("Question:")) + 1  # right after the question line
    assert teach == plain[:at] + block + plain[at:]
    assert S.build_prompt("Which star does Quaxor orbit?", "", [], step, hist, skill="") == plain


def test_plain_and_skill_contexts_align_token_by_token(tokenizer):
    """With the real Qwen2.5 tokenizer and chat template, the skill context is the plain context's tokens
    with the block's tokens inserted (no merge across the seams), for real questions of every source."""
    from prompts import chat_prompt
    questions = [S.split_questions("train", None)[0]["question"]] + \
                [t["question"] for t in S.eval_tasks("test", 0, 1, argparse.Namespace(no_retriever_check=True))]
    response = "<think>Quaxor orbits Velmira.</think>\n<answer>Velmira</answer>"
    resp_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    for q in questions:
        for step in (1, 3):
            text, plain = chat_prompt(tokenizer, S.build_prompt(q, "", [], step, HIST[:step - 1]))
            t_text, teach = chat_prompt(tokenizer, S.build_prompt(q, "", [], step, HIST[:step - 1], skill=SKILL))
            assert t_text.replace(S.skill_block(SKILL), "") == text
            p = next(i for i, (a, b) in enumerate(zip(plain, teach)) if a != b)
            s = len(plain) - p
            assert teach[:p] == plain[:p] and teach[len(teach) - s:] == plain[p:]
            assert tokenizer.decode(teach[p:len(teach) - s]) == S.skill_block(SKILL)
            # the same response tokens follow both contexts
            for ctx in (plain, teach):
                assert tokenizer(tokenizer.decode(ctx) + response, add_special_tokens=False)["input_ids"] == ctx + resp_ids


# ----------------------------------------------------------------------------------------------------
# Games through the real server

def play(task, respond, game=None):
    """The rollout loop's env side for one episode (parse -> execute -> game -> reward), without a model:
    respond(episode) gives each turn's response text. Returns the episode record."""
    game = game or S.make_game(task)
    st = game.reset()
    ep = dict(task, task=st["task"], steps=[], _obs=st["observation"], _admissible=st["admissible"])
    ep["return"] = 0.0
    for t in range(task["max_steps"]):
        text = respond(ep)
        action, valid, reason = S.parse_action(text, ep["_admissible"])
        executed = S.action_to_execute(text, action)
        st = game.step(executed)
        r = S.reward(st, valid, S.PRESET["invalid_penalty"])
        ep["steps"].append(dict(step=t + 1, response=text, action=action, executed=executed, valid=valid,
                                invalid_reason=reason, feedback=st["observation"], reward=r, won=st["won"],
                                done=st["done"]))
        ep["return"] += r
        ep.update(_obs=st["observation"], _admissible=st["admissible"], success=st["won"])
        if st["done"]:
            break
    return ep


@pytest.fixture(scope="module")
def val_tasks(real_server):
    args = argparse.Namespace(retriever_url=real_server, max_steps=4)
    return S.eval_tasks("val", 0, 12, args)


def test_expert_wins_through_the_real_server(val_tasks):
    assert len(val_tasks) == 12 and {t["category"] for t in val_tasks} == {"hotpotqa"}
    for task in val_tasks:
        ep = play(task, S.expert_response)
        assert ep["success"] and ep["return"] == 1.0 and len(ep["steps"]) == 2
        first, second = ep["steps"]
        assert first["executed"] == f"search[{' '.join(task['question'].split())}]"
        assert first["feedback"].startswith("<information>Doc 1: (Title: ") and "\nDoc 3: (Title: " in first["feedback"]
        assert second["executed"] == f"answer[{task['golden_answers'][0]}]" and second["done"]
        if S.normalize_answer(task["golden_answers"][0]) in S.normalize_answer(first["feedback"]):
            assert re.search(r"Doc \d mentions", second["response"])  # it says where it found the answer


def test_wrong_answer_scores_zero(val_tasks):
    ep = play(val_tasks[0], lambda ep: S.expert_response(ep) if not ep["steps"] else "<answer>Zorblat Quaxor</answer>")
    assert not ep["success"] and ep["return"] == 0.0 and len(ep["steps"]) == 2 and ep["steps"][-1]["done"]


def test_four_searches_end_with_zero(val_tasks):
    ep = play(val_tasks[1], lambda ep: f"<think>more</think><search>{ep['question']} {len(ep['steps'])}</search>")
    assert len(ep["steps"]) == 4 and ep["return"] == 0.0 and not ep["success"] and ep["steps"][-1]["done"]
    assert [s["done"] for s in ep["steps"]] == [False, False, False, True]
    assert all(s["feedback"].startswith("<information>") for s in ep["steps"][:3])
    assert ep["steps"][3]["feedback"] == S.LAST_TURN_FEEDBACK


def test_invalid_turn_is_penalised(val_tasks):
    bad = ["<think>thinking only</think>", "<search>Romanian singer</search><answer>b</answer>"]
    ep = play(val_tasks[2], lambda ep: bad[len(ep["steps"])] if len(ep["steps"]) < 2 else S.expert_response(
        dict(ep, steps=ep["steps"][2:])))
    assert [s["valid"] for s in ep["steps"]] == [False, False, True, True]
    assert [s["invalid_reason"] for s in ep["steps"]] == ["no_block", "both_kinds", "", ""]
    assert ep["steps"][0]["executed"] == "invalid" and ep["steps"][0]["feedback"] == S.INVALID_FEEDBACK
    assert ep["success"] and ep["return"] == pytest.approx(1.0 - 2 * 0.01)
    assert [s["reward"] for s in ep["steps"]] == pytest.approx([-0.01, -0.01, 0.0, 1.0])
    # the public rule: the invalid turn still ran its first block, the search, through the server
    assert ep["steps"][1]["executed"] == "search[Romanian singer]" and ep["steps"][1]["feedback"].startswith("<information>Doc 1")


def test_strict_rules_run_nothing_for_an_invalid_turn_and_empty_blocks(val_tasks):
    try:
        S.configure(argparse.Namespace(search_invalid_step="nothing", search_empty_block="invalid",
                                       search_stray_tags="ignore"))
        ep = play(val_tasks[2], lambda ep: ["<search>a</search><answer>b</answer>", "<answer> </answer>"][
            len(ep["steps"])] if len(ep["steps"]) < 2 else "<answer>x</answer>")
        assert [(s["executed"], s["feedback"]) for s in ep["steps"][:2]] == [("invalid", S.INVALID_FEEDBACK)] * 2
        assert [s["invalid_reason"] for s in ep["steps"]] == ["both_kinds", "empty_block", ""]
    finally:
        S.configure(None)


def test_empty_blocks_under_the_public_rules(val_tasks):
    # an empty search is valid, sends nothing, shows no passage; an empty answer ends the episode, scored
    ep = play(val_tasks[3], lambda ep: "<search> </search>" if not ep["steps"] else "<answer></answer>")
    assert [(s["executed"], s["valid"]) for s in ep["steps"]] == [("search[]", True), ("answer[]", True)]
    assert ep["steps"][0]["feedback"] == "<information>No passage matched the query.</information>"
    assert ep["steps"][1]["done"] and not ep["success"]
    empty_gold = dict(val_tasks[3], golden_answers=["The"])  # a gold that normalises to ''
    assert play(empty_gold, lambda ep: "<answer>the</answer>")["success"]
    assert not play(dict(empty_gold, empty_gold="never"), lambda ep: "<answer>the</answer>")["success"]


def test_episode_length_follows_the_task_max_steps(val_tasks):
    task = dict(val_tasks[3], max_steps=1)
    ep = play(task, S.expert_response)  # the expert answers at once on a one-turn budget
    assert ep["success"] and len(ep["steps"]) == 1
    game = S.make_game(task)
    game.reset()
    st = game.step("search[anything]")
    assert st["done"] and not st["won"] and st["observation"] == S.LAST_TURN_FEEDBACK
    with pytest.raises(RuntimeError):
        game.step("answer[x]")


def test_server_killed_mid_episode_is_an_env_failure(small_corpus, tmp_path):
    proc, url = start_server(small_corpus, tmp_path)
    task = dict(SMALL_TASK, retriever_url=url)
    try:
        game = S.make_game(task)  # in-process: the game raises
        game.reset()
        assert "Doc 1: (Title: \"Quaxor\")" in game.step("search[Quaxor orbit]")["observation"]
        with EnvPool("envs.search:make_game", num_workers=1) as pool:  # through the pool: an env failure
            assert pool.reset([task])[0]["task"] == task["question"]
            assert pool.step({0: "search[Quaxor orbit]"})[0]["observation"].startswith("<information>Doc 1")
            stop(proc)
            out = pool.step({0: "search[Velmira]"})[0]
            assert out["error"].startswith("RetrieverError: retriever http://127.0.0.1:") and "connection failed" in out["error"]
            assert pool.stats["env_failures"] == 1
        with pytest.raises(RetrieverError, match="failed after 2 attempt"):
            game.step("search[Velmira]")
    finally:
        stop(proc)


# ----------------------------------------------------------------------------------------------------
# Question files, splits, tasks

def test_question_file_errors(tmp_path):
    q = {"id": "1", "question": "Who?", "golden_answers": ["Me"], "data_source": "nq"}
    cases = [([q, q, {"id": "3", "golden_answers": ["x"]}], ":3: missing field 'question'"),
             ([q, {"id": "2", "question": "Why?"}], ":2: missing field 'golden_answers'"),
             ([q, "", {"id": "3", "question": "Why?", "golden_answers": []}], ":3: empty gold answer list"),
             ([{"id": "1", "question": "Why?", "golden_answers": ["", "  "]}], ":1: empty gold answer list"),
             ([q, "{oops"], ":2: not JSON"), ([], "no questions")]
    for i, (rows, message) in enumerate(cases):
        path = write_jsonl(tmp_path / f"q{i}.jsonl", rows)
        with pytest.raises(S.QuestionFileError, match=re.escape(f"q{i}.jsonl{message}" if message[0] == ":" else message)):
            S.read_questions(path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        S.read_questions(str(tmp_path / "nope.jsonl"))


def test_flashrag_rows_without_data_source_take_the_folder_name(tmp_path):
    (tmp_path / "triviaqa").mkdir()
    path = write_jsonl(tmp_path / "triviaqa" / "test.jsonl", [{"id": "test_1", "question": " Q? ", "golden_answers": "A"}])
    assert S.read_questions(path) == ({"id": "test_1", "question": "Q?", "golden_answers": ["A"], "data_source": "triviaqa"},)


def test_search_r1_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    prompt = lambda q: [{"role": "user", "content": f"Answer the given question. ... Question: {q}\n"}]
    rows = [{"data_source": "nq", "prompt": prompt("who wrote hamlet?"), "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare", "William Shakespeare"]}},
             "extra_info": {"split": "train", "index": 0}},
            {"data_source": "hotpotqa", "prompt": prompt("which is older?"), "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": ["the oak"]}},
             "extra_info": {"split": "train", "index": 1}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    qs = S.read_questions(str(tmp_path / "train.parquet"))
    assert qs[0] == {"id": "0", "question": "who wrote hamlet?", "golden_answers": ["Shakespeare", "William Shakespeare"],
                     "data_source": "nq"}
    assert qs[1]["data_source"] == "hotpotqa" and qs[1]["golden_answers"] == ["the oak"]
    # a user's parquet as --train-file: the same split rules
    args = argparse.Namespace(train_file=str(tmp_path / "train.parquet"), val_size=1, no_retriever_check=True)
    assert [t["task_id"] for t in S.stage1_tasks(0, 4, args)] and len(S.split_questions("train", args)) == 1
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": {"other": 1}}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(S.QuestionFileError, match=r"bad.parquet: row 1: missing field 'golden_answers'.*target"):
        S.read_questions(str(tmp_path / "bad.parquet"))
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": {"target": []}}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "empty.parquet")
    with pytest.raises(S.QuestionFileError, match=r"empty.parquet: row 1: empty gold answer list"):
        S.read_questions(str(tmp_path / "empty.parquet"))


def test_splits_and_task_draws():
    args = argparse.Namespace(no_retriever_check=True, retriever_url="http://127.0.0.1:9/retrieve", topk=3)
    train, val = S.split_questions("train", args), S.split_questions("val", args)
    assert len(train) == 400 and len(val) == 100 and not {q["id"] for q in train} & {q["id"] for q in val}
    s1 = S.stage1_tasks(7, 180, args)
    assert len({t["task_id"] for t in s1}) == 180 and s1 == S.stage1_tasks(7, 180, args) != S.stage1_tasks(8, 180, args)
    assert {t["split"] for t in s1} == {"train"} and json.loads(json.dumps(s1)) == s1  # JSON-able
    assert s1[0]["retriever_url"] == "http://127.0.0.1:9/retrieve" and s1[0]["max_steps"] == 4
    stream = S.rl_tasks(7, 1000, args)  # more than the 400 train questions: full passes, each reshuffled
    assert len(stream) == 1000 and len({t["task_id"] for t in stream[:400]}) == 400
    assert [t["task_id"] for t in stream[:400]] != [t["task_id"] for t in stream[400:800]]
    test = S.eval_tasks("test", 0, 3, args)
    assert [t["category"] for t in test] == [g for g in S.GROUPS for _ in range(3)]
    assert test == S.eval_tasks("test", 0, 3, args) and len(S.eval_tasks("test", 0, 200, args)) == 200 * 6 + 125
    assert S.IN_DOMAIN == {"nq", "hotpotqa"} and S.IN_DOMAIN < set(S.GROUPS)
    with pytest.raises(ValueError, match="unknown split"):
        S.eval_tasks("dev", 0, 1, args)


def test_data_manifest():
    lines, checks, manifest = S.data_manifest(0, 128, 150, 180)  # evaluate.py --data-manifest's call
    assert all(checks.values()) and len(checks) == 6, checks
    assert manifest["stage1"]["count"] == 180 and manifest["rl_stream"]["count"] == 19200
    assert manifest["rl_stream"]["task_ids"][:180] == manifest["stage1"]["task_ids"]  # the same seeded passes
    assert manifest["test"]["questions"] == 28133 and any(line.startswith("test ") for line in lines)
    # the six shipped test golds that normalise to '' (by hand: punctuation, or only articles/'a' left)
    assert manifest["empty_golds"]["test"] == [
        {"task_id": t, "gold": g} for t, g in [("nq/nq-0290", "---"), ("nq/nq-0363", ")"), ("nq/nq-1150", "A+"),
                                               ("nq/nq-2720", "*"), ("hotpotqa/hotpotqa-3667", "The The"),
                                               ("hotpotqa/hotpotqa-5470", "!!!")]]
    assert manifest["empty_golds"]["train"] == manifest["empty_golds"]["val"] == []
    assert any(line.startswith("empty golds : 6 gold answer(s)") for line in lines)


def test_preset_and_flags():
    assert S.NAME == "search" and S.PRESET["max_steps"] == 4 and S.PRESET["invalid_penalty"] == 0.01
    assert (S.PRESET["tasks_per_update"], S.PRESET["mini_batch"], S.PRESET["micro_batch"]) == (128, 512, 16)
    p = argparse.ArgumentParser()
    S.add_args(p)
    assert all(a.help for a in p._actions)
    a = p.parse_args([])
    g = argparse.ArgumentParser()
    S.add_args(g.add_argument_group("env"))  # the scripts pass their "env" group
    assert vars(g.parse_args([])) == vars(a)
    assert a.retriever_url == "http://127.0.0.1:8000/retrieve" and a.topk == 3 and a.search_data == S.default_data_dir()


# ----------------------------------------------------------------------------------------------------
# The chain with --env search against the real server (scripts as subprocesses)

def test_collect_expert_wins_end_to_end(real_server, tmp_path):
    from common.records import read_jsonl
    from conftest import run_script
    out = tmp_path / "traj.jsonl"
    res = run_script(["collect.py", "--env", "search", "--model", "expert", "--tasks", "3", "--rollouts", "2",
                      "--workers", "2", "--retriever-url", real_server, "--out", str(out)], timeout=300)
    eps = read_jsonl(out)
    assert len(eps) == 6 and all(ep["env"] == "search" and ep["category"] == "hotpotqa" for ep in eps)
    assert all(ep["success"] and ep["return"] == 1.0 and ep["length"] == 2 and not ep["env_failure"] for ep in eps)
    for ep in eps:
        search, answer = ep["steps"]
        assert search["executed"].startswith("search[") and search["feedback"].startswith("<information>Doc 1: ")
        assert answer["executed"] == f"answer[{ep['golden_answers'][0]}]" and answer["reward"] == 1.0
        assert search["prompt"].count("Question: ") == 1 and "[Step 1] <search> " in answer["prompt"]
    assert "hotpotqa" in res.stdout and "env failures 0" in res.stdout
    # --split is honoured and the manifest records the split played (it used to play train, recording val)
    val = tmp_path / "val.jsonl"
    run_script(["collect.py", "--env", "search", "--model", "expert", "--tasks", "2", "--rollouts", "1", "--split",
                "val", "--workers", "1", "--retriever-url", real_server, "--out", str(val)], timeout=300)
    val_ids = {f"{q['data_source']}/{q['id']}" for q in S.split_questions("val", None)}
    assert {ep["split"] for ep in read_jsonl(val)} == {"val"} and {ep["task_id"] for ep in read_jsonl(val)} <= val_ids
    assert json.load(open(str(val) + ".manifest.json"))["split"] == "val"
    res = run_script(["collect.py", "--env", "search", "--model", "expert", "--split", "valid_seen", "--out",
                      str(tmp_path / "x.jsonl")], check=False, timeout=120)
    assert res.returncode == 1 and res.stderr.strip() == ("--split 'valid_seen': the search env has the splits "
                                                          "train, val, test")
    res = run_script(["collect.py", "--env", "search", "--model", "expert", "--invalid-rule", "strict", "--out",
                      str(tmp_path / "x.jsonl")], check=False, timeout=120)
    assert res.returncode == 1 and res.stderr.strip().startswith("--invalid-rule strict: the search env has no")
    # an unreachable retriever: one line naming the URL, within seconds, before any episode
    dead = "http://127.0.0.1:9/retrieve"
    t0 = time.perf_counter()
    res = run_script(["collect.py", "--env", "search", "--model", "expert", "--tasks", "1", "--rollouts", "1",
                      "--retriever-url", dead, "--out", str(tmp_path / "dead.jsonl")], check=False, timeout=120)
    assert res.returncode == 1 and time.perf_counter() - t0 < 60
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: retriever {dead}: failed after 1 attempt(s)")
    assert "Traceback" not in res.stderr


def test_evaluate_expert_per_data_source(real_server, tmp_path):
    from conftest import run_script
    run_script(["evaluate.py", "--env", "search", "--model", "expert", "--limit", "2", "--workers", "2",
                "--retriever-url", real_server, "--out", str(tmp_path)], timeout=300)
    res = json.load(open(tmp_path / "results.json"))
    md = (tmp_path / "results.md").read_text()
    assert "| nq | triviaqa | popqa | hotpotqa | 2wikimultihopqa | musique | bamboogle | Avg | All |" in md
    assert "| **this run** | " + " | ".join(["100.0"] * 9) in md
    assert "| paper: Qwen2.5-3B-Instruct SEED | " in md and "45.7" in md  # the paper's average EM beside it
    assert json.dumps(res)  # written, parseable


TINY_FLAGS = ["seed_rl.py", "--env", "search", "--model", "tiny", "--tasks-per-update", "2", "--group-size", "2",
              "--max-steps", "2", "--max-new-tokens", "8", "--analyzer-model", "scripted", "--workers", "1"]


@pytest.fixture(scope="module")
def two_updates(real_server, tmp_path_factory):
    """seed_rl.py, 1 process, 2 updates. Shared: its update 1 is also the 1-process reference of the 2-process run
    below (update 1 plays the same tasks and seeds whatever --updates is; a save changes nothing in the math), so
    that test needs no 1-process run of its own (~25 s). Read only."""
    from conftest import run_script
    out = tmp_path_factory.mktemp("search_seed_rl")
    run_script([*TINY_FLAGS, "--updates", "2", "--save-every", "1", "--retriever-url", real_server,
                "--out", str(out)], timeout=600)
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_seed_rl_two_updates_tiny(two_updates):
    m = two_updates
    assert [r["update"] for r in m] == [1, 2]
    for r in m:
        assert r["rollout/episodes"] == 4 and r["opd/teacher_coverage"] == 1.0 and r["skill/parse_rate"] == 1.0
        assert r["loss/opd"] != 0.0 and r["tokens/response"] == 4 * 2 * 8  # random tokens: every step cut at 8
        assert r["rollout/invalid_rate"] == 1.0  # a random model writes no <search>/<answer> block


def test_seed_rl_two_processes_match_one_process(real_server, two_updates, tmp_path):
    """2 ranks (gloo) play 1 group each; the losses equal the 1-process run's (global token-means)."""
    from conftest import run_script
    run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *TINY_FLAGS,
                "--updates", "1", "--save-every", "100", "--retriever-url", real_server,
                "--out", str(tmp_path / "two")], timeout=600)
    one = two_updates[0]
    two = json.loads((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()[0])
    assert two["rollout/episodes"] == 4
    for k in ("loss/pg", "loss/kl", "loss/opd", "loss/total", "opd/gate_mean", "tokens/response", "grad_norm"):
        assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-7), k


def test_bc_clones_only_wins_whose_passages_held_the_gold(real_server, tmp_path):
    """sft.py --bc-data on Search expert episodes: a win is cloned only when a retrieved passage held the gold
    (otherwise the expert answered from what it was told, not from what it read); each cloned win is 2 steps."""
    from conftest import run_script
    traj = tmp_path / "expert.jsonl"
    run_script(["collect.py", "--env", "search", "--model", "expert", "--tasks", "12", "--rollouts", "1",
                "--workers", "1", "--retriever-url", real_server, "--out", str(traj)])
    eps = [json.loads(line) for line in open(traj)]
    supported = [e for e in eps if S.episode_stats(e)["gold_retrieved"] == 1.0]
    assert all(e["success"] for e in eps) and 0 < len(supported) < len(eps)  # both kinds among these 12
    res = run_script(["sft.py", "--env", "search", "--model", "tiny", "--bc-data", str(traj), "--out",
                      str(tmp_path / "sft"), "--epochs", "1", "--batch-size", "4", "--max-steps", "1"])
    assert (f"{2 * len(supported)} step examples from {len(supported)} won of 12 episodes "
            f"({12 - len(supported)} wins skipped: the gold was in no retrieved passage)") in res.stdout
