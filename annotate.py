"""Stage 1b: an analyzer writes one hindsight skill per collected trajectory; the parsed ones become SFT data.

The paper's setting (docs/paper.md, Stage 1 step 2): an external analyzer (GLM through an OpenAI-compatible
endpoint) reads each trajectory (task, outcome, `Step i / Observation / Response / Action valid`) at
temperature 0 with up to 4,096 new tokens and answers `{"episode_summary": ..., "episode_skill": ...}`;
answers that do not parse get up to 2 retries with a stricter reminder; skills under 5 words are rejected;
only parsed answers become SFT examples (10% validation).

    # the paper's setup: an external analyzer behind an OpenAI-compatible endpoint (the API key is read
    # from $OPENAI_API_KEY, or the variable --api-key-env names; it is never logged or written)
    python annotate.py --trajectories runs/stage1/traj.jsonl --out runs/stage1/skills.jsonl \\
        --analyzer openai --base-url https://open.bigmodel.cn/api/paas/v4 --model glm-5.2
    # 1 GPU: a local analyzer through the project's vLLM backend
    python annotate.py --trajectories runs/stage1/traj.jsonl --out runs/stage1/skills.jsonl \\
        --analyzer local --model Qwen/Qwen2.5-7B-Instruct --backend vllm
    # 8 GPUs: serve a large analyzer with vLLM's own OpenAI server (tensor parallel) and ask it concurrently
    vllm serve Qwen/Qwen2.5-72B-Instruct --tensor-parallel-size 8 --max-model-len 16384 &
    until curl -sf localhost:8000/v1/models > /dev/null; do sleep 10; done   # loading takes minutes
    python annotate.py --trajectories runs/stage1/traj.*.jsonl --out runs/stage1/skills.jsonl \\
        --analyzer openai --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-72B-Instruct --concurrency 64
    # CPU demo: a stand-in endpoint (canned skills, no model; it answers 503 and non-JSON now and then)
    python tests/openai_fake.py --port 8765 &
    python annotate.py --trajectories runs/demo/expert.jsonl --out runs/demo/skills.jsonl \\
        --base-url http://127.0.0.1:8765/v1 --model fake-analyzer
    kill %1   # stops the stand-in endpoint
    # CPU demo, local analyzer: a tiny random model never writes JSON, so every record ends `failed`
    python annotate.py --trajectories runs/demo/tiny.jsonl --out runs/demo/skills_tiny.jsonl \\
        --analyzer local --model tiny --max-new-tokens 16
    # follow one SFT example from the raw trajectory to its target (the summary prints ids to try; this one is
    # an example of the demo above: the ids depend only on the trajectories)
    python annotate.py --trace sft-a344ed357f1b --sft runs/demo/skills.sft.jsonl

Outputs (append-only: a killed run restarts where it stopped, keyed by trajectory uid, no duplicates; a record
that failed for transport reasons (timeouts, HTTP 5xx/429/408, connection errors, a 200 that is no chat
completion) is asked again by the next run, and its new record supersedes it; any other `failed` record
(unparsable answers, HTTP 400) is final unless a later run passes --retry-failed). An endpoint that cannot be
reached at all (nothing listening, unknown host) stops the run at once, with one line and a non-zero exit; so
does a run that ends with transport failures (rerun the same command to retry them):
  <out>                one line per trajectory: status parsed | failed | skipped, reason, skill, summary,
                       every attempt (answer or error, parse reason, HTTP status, latency), analyzer spec
  <out stem>.sft.jsonl rebuilt from the whole <out> at the end of every run: one line per parsed record,
                       {"id", "split", "prompt", "target", "annotation_id", "annotation_file",
                        "trajectory_uid", "trajectory_file", "outcome", ...}  (what sft.py reads)
  <out>.manifest.json  the run manifest (no API key: the key only ever lives in the environment)
"""
import argparse
import errno
import hashlib
import json
import os
import random
import re
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed

import requests
from requests.adapters import HTTPAdapter
from tqdm import tqdm

from envs import ENVS, HelpFormatter, load_env, refuse_unused, require_positive
from common.records import (append_jsonl, check_resume, open_jsonl_for_append, read_jsonl, resumed_manifest,
                          run_manifest, sha256_file, write_manifest)
from prompts import build_analysis_prompt, chat_prompt, parse_analysis, target_json

# The paper's settings (docs/paper.md, Stage 1 steps 2 and 3); argparse defaults equal these. The 5-word minimum
# lives in prompts.MIN_SKILL_WORDS (the parser enforces it, in every stage).
PAPER = dict(temperature=0.0, max_new_tokens=4096, parse_retries=2, val_fraction=0.1)

p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
p.add_argument("--env", default=None, choices=list(ENVS), help="default: the env each trajectory records (the "
               "analysis prompt describes that env); given, every trajectory must be of this env")
p.add_argument("--trajectories", nargs="+", help="collect.py output file(s)")
p.add_argument("--out", help="annotation JSONL (append-only)")
p.add_argument("--analyzer", default="openai", choices=["openai", "local", "scripted"], help="openai: an OpenAI-"
               "compatible endpoint (--base-url); local: a model run here through the project's backends (--backend); "
               "scripted: no model, a rule-based stand-in (common/backends.py ScriptedAnalyzer: a success -> the action "
               "order that worked, a failure -> avoidance rules from its own steps; --model names only the tokenizer, "
               "e.g. tiny), for CPU demos and the behaviour-cloning warm start's skill examples")
p.add_argument("--model", help="endpoint model name | local HF path or hub id | tiny")
p.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. http://host:8000/v1 (POST <base>/chat/completions)")
p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="name of the environment variable holding the key")
p.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="local analyzer: HF generate or vLLM")
p.add_argument("--temperature", type=float, default=PAPER["temperature"], help="analyzer sampling temperature (0: greedy)")
p.add_argument("--max-new-tokens", type=int, default=PAPER["max_new_tokens"], help="tokens of one analyzer answer")
p.add_argument("--retry-failed", action="store_true", help="re-ask every trajectory whose record is `failed`, also "
               "unparsable answers (transport failures are re-asked without it); the new record supersedes the old")
p.add_argument("--parse-retries", type=int, default=PAPER["parse_retries"], help="re-asks after an unparsable answer")
p.add_argument("--concurrency", type=int, default=8, help="endpoint requests in flight")
p.add_argument("--timeout", type=float, default=600.0, help="seconds without an answer before a request is retried")
p.add_argument("--http-retries", type=int, default=5, help="re-sends after an HTTP 5xx/429, connection error or timeout")
p.add_argument("--backoff", type=float, default=2.0, help="first backoff in seconds (doubles per retry)")
p.add_argument("--max-wait", type=float, default=60.0, help="cap on one wait (backoff or Retry-After), seconds")
p.add_argument("--batch-size", type=int, default=64, help="local analyzer: trajectories per generation round")
p.add_argument("--max-model-len", type=int, default=16384, help="local analyzer: prompt + answer token limit")
p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="local analyzer, vLLM: its share of the GPU")
p.add_argument("--val-fraction", type=float, default=PAPER["val_fraction"], help="share of SFT examples in the "
               "validation split (by a seeded hash of the id: stable when a rerun adds examples)")
p.add_argument("--seed", type=int, default=0, help="validation split (and the local model's init for `tiny`)")
p.add_argument("--sft", help="SFT dataset path (default: <out stem>.sft.jsonl)")
p.add_argument("--trace", metavar="SFT_ID", help="print the chain of one SFT example and exit")
args = p.parse_args()

sft_path = args.sft or (os.path.splitext(args.out)[0] + ".sft.jsonl" if args.out else None)


def analysis_prompt(ep, reminder=None):
    """The analysis prompt of a recorded episode, for its own env (records written before envs had names are
    ALFWorld's)."""
    return build_analysis_prompt(ep, load_env(ep.get("env", "alfworld")), reminder=reminder)


def locate(path, near):
    """A path recorded in a file, or (the files were moved together) the same name beside `near`."""
    if os.path.exists(path):
        return path
    alt = os.path.join(os.path.dirname(os.path.abspath(near)), os.path.basename(path))
    if os.path.exists(alt):
        return alt
    sys.exit(f"cannot find {path} (nor {alt})")


def find_episode(path, uid):
    """The full trajectory record with this uid (scans the file; json-decodes only the matching line)."""
    needle = json.dumps(uid, ensure_ascii=False)[1:-1]
    with open(path, encoding="utf-8") as f:
        for line in f:
            if needle in line:
                try:
                    ep = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line
                if ep.get("uid") == uid:
                    return ep
    sys.exit(f"trajectory {uid} not found in {path}")


# ---------------------------------------------------------------------------------------------------
# Trace mode: follow one SFT example back to its annotation and its raw trajectory, then exit
if args.trace:  # (issue 29: no flag silently ignored) trace mode reads only --sft / --out
    refuse_unused(p, args, [a.dest for a in p._actions if a.dest not in ("help", "trace", "sft", "out")],
                  "--trace prints one SFT example and exits")
    if not sft_path:
        p.error("--trace needs --sft (or --out, to derive the SFT path)")
    ex = next((e for e in read_jsonl(sft_path) if e["id"] == args.trace), None)
    if ex is None:
        sys.exit(f"no SFT example {args.trace!r} in {sft_path}")
    ann_file, traj_file = locate(ex["annotation_file"], sft_path), locate(ex["trajectory_file"], sft_path)
    anns = [r for r in read_jsonl(ann_file) if r["id"] == ex["annotation_id"]]
    if not anns:
        sys.exit(f"annotation {ex['annotation_id']} not found in {ann_file}")
    ann = anns[-1]  # the latest: earlier ones are failed records that a later run superseded
    ep = find_episode(traj_file, ex["trajectory_uid"])
    rule = "=" * 100
    print(f"{rule}\nSFT example {ex['id']} ({ex['split']})  <-  annotation {ann['id']} in {ann_file}\n"
          f"  <-  trajectory {ep['uid']} in {traj_file}\n{rule}")
    print(f"TRAJECTORY  task: {ep['task']!r}  type: {ep['task_type']}  outcome: "
          f"{'success' if ep['success'] else 'failure'}  return: {ep['return']}  steps: {ep['length']}")
    for s in ep["steps"]:
        print(f"--- step {s['step']}  action: {s['action']!r} (executed {s['executed']!r})  "
              f"valid: {'yes' if s['valid'] else 'no'}{'' if s['valid'] else ' (' + s['invalid_reason'] + ')'}  "
              f"reward: {s['reward']}")
        print(f"observation: {s['observation']}\nresponse: {s['response']}")
    if ep["steps"]:
        print(f"--- final feedback: {ep['steps'][-1]['feedback']}")
    spec = ", ".join(f"{k}={v}" for k, v in ann["analyzer"].items())
    print(f"{rule}\nANALYZER  ({spec})  status: {ann['status']}  attempts: {len(ann['attempts'])}"
          + (f"  (after {len(anns) - 1} failed record(s): {[r['reason'] for r in anns[:-1]]})" if len(anns) > 1 else ""))
    for a in ann["attempts"]:
        print(f"--- attempt try {a['try']} request {a['request']}  http: {a['http_status']}  "
              f"latency: {a['latency_s']}s  reminder: {a['reminder']}  parse: {a['parse_reason']}"
              + (f"  error: {a['error']} {a.get('detail', '')}" if a["error"] else "")
              + (f"  (waited {a['waited_s']}s before re-sending)" if a.get("waited_s") else ""))
        if a["raw"] is not None:
            print(a["raw"])
    same = ex["prompt"] == analysis_prompt(ep)
    print(f"{rule}\nSFT PROMPT  {len(ex['prompt'])} chars; rebuilt from the trajectory: "
          f"{'identical' if same else 'DIFFERENT (the prompt wording changed since annotation)'}")
    print(f"SFT TARGET  {ex['target']}")
    sys.exit(0)

for name in ("trajectories", "out", "model"):
    if not getattr(args, name):
        p.error(f"--{name.replace('_', '-')} is required")
if args.analyzer == "openai" and not args.base_url:
    p.error("--analyzer openai needs --base-url")
if not 0 <= args.val_fraction <= 1 or args.parse_retries < 0 or args.http_retries < 0:
    p.error("need 0 <= --val-fraction <= 1, --parse-retries >= 0, --http-retries >= 0")
require_positive(args, "concurrency", "max_new_tokens", "batch_size", "max_model_len")
if args.analyzer == "local" and args.model == "tiny" and args.backend == "vllm":
    p.error("`tiny` is built in memory; vLLM needs a model path (use --backend hf)")
# flags of another analyzer would change nothing (issue 29; tests/test_flags.py walks them all)
if args.analyzer != "openai":
    refuse_unused(p, args, ["base_url", "api_key_env", "concurrency", "timeout", "http_retries", "backoff", "max_wait"],
                  f"--analyzer {args.analyzer} sends no HTTP request")
if args.analyzer == "openai":
    refuse_unused(p, args, ["backend", "batch_size", "max_model_len", "gpu_memory_utilization"],
                  "--analyzer openai runs no local model")
if args.analyzer == "scripted":
    refuse_unused(p, args, ["backend", "gpu_memory_utilization", "temperature"],
                  "--analyzer scripted runs no model (a rule-based stand-in: the same episode, the same answer)")

# ---------------------------------------------------------------------------------------------------
# Plan: every trajectory of the input files, minus those already in --out (resume by uid)
HEAVY = ("prompt", "prompt_ids", "response_ids", "response_logprobs", "admissible")


def read_episodes(path):
    """collect.py records, streamed, without the per-step token ids and prompts (a 1,440-episode file is
    hundreds of MB; the analysis prompt needs only observations, responses and valid flags)."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                ep = json.loads(line)
            except json.JSONDecodeError:
                if not line.endswith(b"\n"):  # a torn last line: collect.py was killed mid-write
                    print(f"[annotate] {path}: ignoring a torn last line", file=sys.stderr)
                    continue
                sys.exit(f"{path}: line {n} is not JSON (and not a torn last line)")
            if "uid" not in ep or "steps" not in ep:
                sys.exit(f"{path}: line {n} is not a collect.py episode (no uid/steps)")
            ep["steps"] = [{k: v for k, v in s.items() if k not in HEAVY} for s in ep["steps"]]
            yield ep


episodes, source = [], {}
for path in args.trajectories:
    if not os.path.isfile(path):
        sys.exit(f"--trajectories {path}: no such file")
    for ep in read_episodes(path):
        if ep["uid"] in source:
            sys.exit(f"trajectory uid {ep['uid']} appears twice ({source[ep['uid']]} and {path}); "
                     f"annotate different collections into different --out files")
        source[ep["uid"]] = os.path.abspath(path)
        if args.env and ep.get("env", "alfworld") != args.env:
            sys.exit(f"{path}: trajectory {ep['uid']} is of env {ep.get('env', 'alfworld')!r}, not --env {args.env}")
        episodes.append(ep)

if not episodes:
    sys.exit(f"no trajectories in {', '.join(args.trajectories)}; nothing to annotate")
manifest_path = args.out + ".manifest.json"
old_manifest = check_resume(manifest_path, args, script="annotate.py", out=args.out)  # one analyzer per file


def transport_failure(reason):
    """A failure of the way to the analyzer, not of its answer: the next run asks again."""
    return reason in ("timeout", "connection_error", "bad_response") or bool(re.fullmatch(r"http_(408|429|5\d\d)", reason))


latest = {r["trajectory_uid"]: r for r in read_jsonl(args.out)}  # a later record supersedes an earlier failed one
again = {uid: r["reason"] for uid, r in latest.items() if r["status"] == "failed"
         and (args.retry_failed or transport_failure(r["reason"]))}
todo = [ep for ep in episodes if ep["uid"] not in latest or ep["uid"] in again]
print(f"annotate: {len(episodes)} trajectories in {len(args.trajectories)} file(s); {len(episodes) - len(todo)} "
      f"already in {args.out}, {len(todo)} to annotate")


def counts(counter):
    """'kind n, ...' by count, then name."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


if again:
    print(f"annotate: asking again {len(again)} that failed before "
          + ("(--retry-failed)" if args.retry_failed else "for transport reasons") + f": {counts(Counter(again.values()))}")

spec = {"analyzer": args.analyzer, "model": args.model, "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens}
spec.update({"base_url": args.base_url} if args.analyzer == "openai" else
            {"backend": "scripted" if args.analyzer == "scripted" else args.backend})

# ---------------------------------------------------------------------------------------------------
# One record per trajectory (shared by both analyzers)


def ann_id(ep):
    """Deterministic in the trajectory (uid and content), so a resumed run and its SFT file agree on every
    id, and two collections of the same tasks (same uids, other policies) never share an id."""
    content = json.dumps([ep["uid"], [[s["observation"], s["response"]] for s in ep["steps"]]], ensure_ascii=False)
    return "ann-" + hashlib.sha256(content.encode("utf-8")).hexdigest()[:12]


def make_record(ep, prompt, attempts, parsed, status, reason):
    answers = [a["raw"] for a in attempts if a["raw"] is not None]
    skill = parsed["episode_skill"] if parsed else None
    return {"id": ann_id(ep), "trajectory_uid": ep["uid"], "trajectory_file": source[ep["uid"]],
            "env": ep.get("env", "alfworld"), "task_id": ep.get("task_id"), "task_type": ep.get("task_type"),
            "category": ep.get("category"), "task": ep.get("task"),
            "outcome": "success" if ep.get("success") else "failure", "return": ep.get("return"),
            "length": ep.get("length"), "status": status, "reason": reason,
            "episode_summary": parsed["episode_summary"] if parsed else None, "episode_skill": skill,
            "skill_words": len(skill.split()) if skill else None,
            "raw": answers[-1] if answers else None, "tries": max([a["try"] for a in attempts], default=0),
            "attempts": attempts, "prompt": prompt, "analyzer": spec,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def skip_reason(ep):
    """Episodes that must not be annotated (never silently: they are written as `skipped`)."""
    if ep.get("env_failure"):
        return f"env_failure: {ep['env_failure']}"
    if not ep["steps"]:
        return "no_steps"
    return None


skipped = [ep for ep in todo if skip_reason(ep)]
todo = [ep for ep in todo if not skip_reason(ep)]

# ---------------------------------------------------------------------------------------------------
# Analyzer A: an OpenAI-compatible chat endpoint (one pooled requests.Session, one thread per request in flight)
api_key = os.environ.get(args.api_key_env) if args.analyzer == "openai" else None
if args.analyzer == "openai" and not api_key:
    print(f"annotate: ${args.api_key_env} is not set; sending requests without an Authorization header")


class Fatal(Exception):
    """The endpoint refuses every request (bad key, wrong URL or model name) or cannot be reached at all: stop
    the whole run."""


stop, refusals = threading.Event(), []  # set on the first refusal: the other threads send nothing more
reached = threading.Event()  # set by the first HTTP answer of this run: from then on, connection errors are outages


def scrub(text):
    """Whatever the endpoint echoes back is stored; the key must never be."""
    return text.replace(api_key, "<api key>") if api_key and isinstance(text, str) else text


def bearer(request):
    """requests' auth hook: the key goes into the Authorization header of each request and nowhere else (set as
    the session's auth, it also keeps a ~/.netrc entry for the host from replacing it)."""
    request.headers["Authorization"] = f"Bearer {api_key}"
    return request


# One session for all threads: keep-alive connections, a pool as large as --concurrency (urllib3's pool is
# thread-safe). max_retries=0: the retries are ours (ask_endpoint), because every request is an attempt in the
# record (status, error, latency, wait) and a refusal must stop the other threads; urllib3's Retry would re-send
# out of sight.
session = requests.Session()
adapter = HTTPAdapter(pool_connections=1, pool_maxsize=args.concurrency, max_retries=0)
session.mount("http://", adapter)
session.mount("https://", adapter)
if api_key:
    session.auth = bearer


def causes(e):
    """e and the exceptions it wraps, outermost first: requests' ConnectionError holds urllib3's MaxRetryError,
    whose .reason is e.g. NewConnectionError, whose __cause__ is the socket error that says why."""
    chain = []
    while isinstance(e, BaseException) and e not in chain:
        chain.append(e)
        reason = getattr(e, "reason", None)
        e = reason if isinstance(reason, BaseException) else e.__cause__ or (e.args[0] if e.args else None)
    return chain


def post_chat(prompt):
    """One HTTP request. Returns an attempt: {raw answer | error kind + detail, http status, latency}."""
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}],
            "temperature": args.temperature, "max_tokens": args.max_new_tokens}
    att = {"http_status": None, "latency_s": None, "raw": None, "error": None, "parse_reason": None}
    t0 = time.perf_counter()
    try:
        # timeout: seconds to connect, and seconds of silence while waiting for the answer (not the total)
        resp = session.post(args.base_url.rstrip("/") + "/chat/completions", json=body, timeout=args.timeout)
    except requests.RequestException as e:
        chain = causes(e)
        why = chain[-1]  # e.g. "[Errno 111] Connection refused", not the wrappers' one-paragraph repr
        att.update(error="timeout" if isinstance(e, requests.Timeout) or any(isinstance(x, TimeoutError) for x in chain)
                   else "connection_error", detail=scrub(repr(e))[:300], why=scrub(str(why))[:200],
                   # no connection at all: nothing listening, no route, or an unknown host
                   connect_failed=isinstance(why, (ConnectionRefusedError, socket.gaierror))
                   or getattr(why, "errno", None) in (errno.EHOSTUNREACH, errno.ENETUNREACH))
    else:
        att["http_status"] = resp.status_code
        if resp.status_code >= 400:  # 4xx/5xx with a body
            att.update(error=f"http_{resp.status_code}", retry_after=resp.headers.get("Retry-After"),
                       detail=scrub(resp.content[:300].decode("utf-8", "replace")))
        else:
            try:
                payload = json.loads(resp.content)
                choice = payload["choices"][0]
                att.update(raw=choice["message"].get("content") or "", finish_reason=choice.get("finish_reason"),
                           usage=payload.get("usage"))
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:  # a 200 that is no chat completion
                att.update(error="bad_response", detail=scrub(repr(e))[:300])
    att["latency_s"] = round(time.perf_counter() - t0, 3)
    att["raw"] = scrub(att["raw"])
    if att["http_status"] is not None:
        reached.set()
    return att


def retry_wait(att, i):
    """Seconds before re-sending: the server's Retry-After (seconds form) if it gave one, else exponential
    backoff with jitter (so concurrent requests that failed together do not retry together); capped."""
    try:
        wait = float(att.get("retry_after"))
    except (TypeError, ValueError):  # absent, or the HTTP-date form: fall back to backoff
        wait = args.backoff * 2 ** i * random.uniform(0.5, 1.0)
    return min(max(wait, 0.0), args.max_wait)


def ask_endpoint(prompt):
    """One answer, re-sending after 5xx/429/408, connection errors and timeouts. Returns every request's
    attempt (the last one holds the answer, or the error that exhausted the retries)."""
    tries = []
    for i in range(args.http_retries + 1):
        if stop.is_set():
            raise Fatal("another request was refused")
        att = post_chat(prompt)
        tries.append(att)
        status = att["http_status"]
        if att["error"] is None:
            break
        if att.get("connect_failed") and not reached.is_set():  # never answered: retrying for minutes helps nobody
            refusals.append(f"cannot reach {args.base_url} ({att['why']}): is the endpoint up? Start it (or fix "
                            f"--base-url) and rerun the same command")
            stop.set()
            raise Fatal(refusals[-1])
        if status in (401, 403, 404):
            refusals.append(f"the endpoint answered HTTP {status} ({att['detail'][:200]}); check --base-url, "
                            f"--model and ${args.api_key_env}")
            stop.set()
            raise Fatal(refusals[-1])
        retryable = att["error"] in ("timeout", "connection_error", "bad_response") or status in (408, 429) \
            or (status or 0) >= 500
        if not retryable or i == args.http_retries:  # e.g. 400 (prompt too long for the model): final
            break
        att["waited_s"] = round(retry_wait(att, i), 3)
        time.sleep(att["waited_s"])
    return tries


def annotate_remote(ep):
    """The analysis loop of one trajectory: ask; if the answer does not parse, ask again with the stricter
    reminder naming why (up to --parse-retries times)."""
    prompt = analysis_prompt(ep)  # exactly what sft.py trains on and seed_rl.py asks
    attempts, reason = [], None
    for t in range(1, args.parse_retries + 2):
        tries = ask_endpoint(prompt if reason is None else analysis_prompt(ep, reason))
        for k, a in enumerate(tries, start=1):
            a.update(**{"try": t, "request": k, "reminder": reason})
        attempts += tries
        last = tries[-1]
        if last["error"]:
            return make_record(ep, prompt, attempts, None, "failed", last["error"])
        parsed, reason = parse_analysis(last["raw"])
        last["parse_reason"] = reason or "ok"
        if parsed:
            return make_record(ep, prompt, attempts, parsed, "parsed", "")
    return make_record(ep, prompt, attempts, None, "failed", reason)


# ---------------------------------------------------------------------------------------------------
# Analyzer B: a local model through the project's generation backends, in rounds over a batch
def annotate_local(batch, backend, tokenizer):
    """Round t asks every trajectory of the batch that has no parsed answer yet (one batched generate
    call); the ones that fail to parse go to the next round with the stricter reminder."""
    prompts = [analysis_prompt(ep) for ep in batch]
    attempts, reasons, records = [[] for _ in batch], [None] * len(batch), [None] * len(batch)
    for t in range(1, args.parse_retries + 2):
        live = [i for i in range(len(batch)) if records[i] is None]
        if not live:
            break
        ids = {i: chat_prompt(tokenizer, prompts[i] if reasons[i] is None else
                              analysis_prompt(batch[i], reasons[i]))[1] for i in live}
        for i in [i for i in live if len(ids[i]) + args.max_new_tokens > args.max_model_len]:
            attempts[i].append({"try": t, "request": 1, "reminder": reasons[i], "http_status": None, "latency_s": 0,
                                "raw": None, "error": "prompt_too_long", "parse_reason": None,
                                "detail": f"{len(ids[i])} prompt tokens + {args.max_new_tokens} > {args.max_model_len}"})
            records[i] = make_record(batch[i], prompts[i], attempts[i], None, "failed", "prompt_too_long")
        live = [i for i in live if records[i] is None]
        t0 = time.perf_counter()
        gens = backend.generate([ids[i] for i in live], max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, contexts=[batch[i] for i in live]) if live else []
        dt = round(time.perf_counter() - t0, 3)  # one batched call: its wall time, shared by the batch
        for i, g in zip(live, gens):
            parsed, reason = parse_analysis(g.text)
            attempts[i].append({"try": t, "request": 1, "reminder": reasons[i], "http_status": None,
                                "latency_s": dt, "batch": len(live), "raw": g.text, "error": None,
                                "parse_reason": reason or "ok", "finish_reason": g.finish_reason,
                                "usage": {"prompt_tokens": len(ids[i]), "completion_tokens": len(g.token_ids)}})
            reasons[i] = reason
            if parsed:
                records[i] = make_record(batch[i], prompts[i], attempts[i], parsed, "parsed", "")
    return [r if r is not None else make_record(ep, pr, at, None, "failed", rs)
            for r, ep, pr, at, rs in zip(records, batch, prompts, attempts, reasons)]


# ---------------------------------------------------------------------------------------------------
# Run: load the local analyzer (if any), write the manifest, then skipped episodes first and the
# analyzer's answers; each record is appended as soon as it is final
tokenizer = backend = None
if args.analyzer == "scripted":
    from common.backends import ScriptedAnalyzer
    from common.models import load_tokenizer
    tokenizer = load_tokenizer(args.model)
    backend = ScriptedAnalyzer(tokenizer)
elif args.analyzer == "local":
    from common.backends import make_policy
    from common.models import load_tokenizer
    tokenizer = load_tokenizer(args.model)
    if todo:  # vLLM: before the manifest, which queries the GPUs and so initializes CUDA in this process; vLLM
        # then starts its engine with `spawn`, which re-runs this script from the top
        backend = make_policy(args.model, tokenizer, backend=args.backend, max_model_len=args.max_model_len,
                              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed)
manifest = run_manifest("annotate.py", args, paper=PAPER, model=args.model, tokenizer=tokenizer,
                        seeds={"seed": args.seed},
                        extra={"analyzer": spec, "sft": sft_path,
                               "inputs": [{"path": os.path.abspath(t), "sha256": sha256_file(t),
                                           "collect_manifest": t + ".manifest.json"
                                           if os.path.exists(t + ".manifest.json") else None}
                                          for t in args.trajectories]})
manifest = resumed_manifest(old_manifest, manifest, records_before=len(latest), inputs=manifest["inputs"])
write_manifest(manifest_path, manifest)

t_start = time.time()
out = open_jsonl_for_append(args.out)
bar = tqdm(total=len(todo) + len(skipped), desc="annotate", unit="traj")
for ep in skipped:
    append_jsonl(out, make_record(ep, None, [], None, "skipped", skip_reason(ep)))
    bar.update(1)

if args.analyzer == "openai" and todo:
    pool = ThreadPoolExecutor(max_workers=args.concurrency)
    try:
        futures = [pool.submit(annotate_remote, ep) for ep in todo]
        for fut in as_completed(futures):  # write in completion order: a kill loses only what is in flight
            append_jsonl(out, fut.result())
            bar.update(1)
    except Fatal:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        sys.exit(f"annotate: stopped: {refusals[0]}")
    except BaseException:  # Ctrl-C: do not start the queued requests; what is written stays written
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
elif args.analyzer in ("local", "scripted") and todo:
    for b in range(0, len(todo), args.batch_size):
        for rec in annotate_local(todo[b:b + args.batch_size], backend, tokenizer):
            append_jsonl(out, rec)
        bar.update(len(todo[b:b + args.batch_size]))
bar.close()
out.close()
elapsed = time.time() - t_start

# ---------------------------------------------------------------------------------------------------
# SFT dataset, rebuilt from the whole annotation file (so a resumed run gives the same file as one run)


def val_split(example_id):
    """'val' for a seeded ~val_fraction of ids: a hash, so an example keeps its split when a resumed run
    adds others (a shuffled index list would reshuffle)."""
    h = hashlib.sha256(f"{args.seed}:{example_id}".encode("utf-8")).digest()
    return "val" if int.from_bytes(h[:8], "big") / 2 ** 64 < args.val_fraction else "train"


all_records = read_jsonl(args.out)
records = list({r["trajectory_uid"]: r for r in all_records}.values())  # the latest record of each trajectory
sft = []
for r in sorted((r for r in records if r["status"] == "parsed"), key=lambda r: r["trajectory_uid"]):
    sid = "sft-" + r["id"][len("ann-"):]
    sft.append({"id": sid, "split": val_split(sid), "prompt": r["prompt"], "target": target_json(r),
                "annotation_id": r["id"], "annotation_file": os.path.abspath(args.out),
                "trajectory_uid": r["trajectory_uid"], "trajectory_file": r["trajectory_file"],
                "outcome": r["outcome"], "env": r.get("env", "alfworld"), "task_id": r["task_id"],
                "task_type": r["task_type"]})
tmp = sft_path + ".tmp"
with open(tmp, "w", encoding="utf-8") as f:  # written whole, then renamed: a reader never sees half a file
    for ex in sft:
        f.write(json.dumps(ex, ensure_ascii=False) + "\n")
os.replace(tmp, sft_path)

# ---------------------------------------------------------------------------------------------------
# Summary over the whole annotation file (this run and earlier, resumed ones)
status = Counter(r["status"] for r in records)
print(f"\n{len(records)} annotations in {args.out}: " + ", ".join(f"{k} {status[k]}" for k in ("parsed", "failed", "skipped"))
      + (f" ({len(all_records) - len(records)} earlier failed records superseded)" if len(all_records) > len(records) else ""))
for outcome in ("success", "failure"):
    asked = [r for r in records if r["outcome"] == outcome and r["status"] != "skipped"]
    ok = sum(r["status"] == "parsed" for r in asked)
    print(f"  parse rate, {outcome:<7} trajectories: {ok}/{len(asked)}" + (f" = {100 * ok / len(asked):.1f}%" if asked else ""))
reasons = Counter(r["reason"].split(":")[0] for r in records if r["status"] != "parsed")
print("  not parsed, by reason: " + (", ".join(f"{k} {v}" for k, v in reasons.most_common()) or "-"))
words = sorted(r["skill_words"] for r in records if r["status"] == "parsed")
if words:
    bins = [(5, 9), (10, 19), (20, 39), (40, 79), (80, 10 ** 9)]
    hist = ", ".join(f"{lo}-{hi if hi < 10 ** 9 else ''}: {sum(lo <= w <= hi for w in words)}" for lo, hi in bins)
    print(f"  skill length (words): min {words[0]}, median {statistics.median(words):g}, max {words[-1]}  [{hist}]")
asked = [r for r in records if r["status"] != "skipped"]
print("  analysis tries per trajectory: " + ", ".join(f"{k}: {v}" for k, v in sorted(Counter(r["tries"] for r in asked).items())))
print("  requests per trajectory:       " + ", ".join(f"{k}: {v}" for k, v in sorted(Counter(len(r["attempts"]) for r in asked).items())))
n_val = sum(ex["split"] == "val" for ex in sft)
print(f"SFT dataset {sft_path}: {len(sft)} examples ({len(sft) - n_val} train, {n_val} val)")
for outcome in ("success", "failure"):  # one example skill of each kind, for the reader
    ex = next((r for r in records if r["status"] == "parsed" and r["outcome"] == outcome), None)
    if ex:
        print(f"  e.g. {outcome}: {ex['episode_skill']!r}  (python annotate.py --trace sft-{ex['id'][4:]} --sft {sft_path})")
print(f"this run: {len(todo) + len(skipped)} trajectories in {elapsed:.1f}s "
      f"({60 * len(todo) / max(elapsed, 1e-9):.1f} trajectories/min asked)")
manifest["summary"] = {"records": len(records), "status": dict(status), "sft_examples": len(sft), "sft_val": n_val,
                       "elapsed_s": round(elapsed, 1)}
write_manifest(manifest_path, manifest)
transport = Counter(r["reason"] for r in records if r["status"] == "failed" and transport_failure(r["reason"]))
if transport:
    sys.exit(f"annotate: {sum(transport.values())} trajectories failed for transport reasons ({counts(transport)}); "
             "rerun the same command to ask them again")
