"""annotate.py (Stage 1b) against a real HTTP server on 127.0.0.1 that misbehaves on purpose, on trajectories
that collect.py recorded from real ALFWorld games; the local analyzer path with the tiny model on CPU."""
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_script
from common.records import read_jsonl
from openai_fake import FakeOpenAI, Reply, good_answer
from envs import load_env
from prompts import build_analysis_prompt, target_json

KEY = "sk-fake-SEEDTEST-4f1c9e27b0d8"  # recognisable: must reach the server and nothing else
SKILL = "First locate the target object, pick it up, then go straight to the destination and place it."
REMINDER = "IMPORTANT: your previous answer could not be used"


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def clones(template, names):
    """Copies of one real collected episode that differ in uid and task text (the server keys on the task)."""
    out = []
    for name in names:
        ep = copy.deepcopy(template)
        ep.update(uid=f"case/{name}#r0", task=f"case {name}: {template['task']}")
        out.append(ep)
    return out


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def annotate_args(traj, out, url, *extra):
    return ["annotate.py", "--trajectories", *([traj] if isinstance(traj, (str, os.PathLike)) else traj),
            "--out", str(out), "--analyzer", "openai", "--base-url", url, "--model", "fake-glm",
            "--api-key-env", "SEED_TEST_KEY", *extra]


@pytest.fixture(scope="module")
def template(expert_trajectories):
    return load(expert_trajectories)[0]


# ---------------------------------------------------------------------------------------------------
# One run over every misbehaviour (one scripted trajectory each)
CASES = {  # name: (status, reason, requests, analysis tries)
    "good": ("parsed", "", 1, 1),
    "fenced": ("parsed", "", 1, 1),
    "nonjson_then_good": ("parsed", "", 2, 2),
    "wrong_keys": ("failed", "missing_keys", 3, 3),
    "short_skill": ("failed", "skill_too_short", 3, 3),
    "short_then_good": ("parsed", "", 2, 2),
    "http500_then_good": ("parsed", "", 2, 1),
    "http429_then_good": ("parsed", "", 2, 1),
    "http429_forever": ("failed", "http_429", 3, 1),
    "slow": ("failed", "timeout", 3, 1),
    "slow_then_good": ("parsed", "", 2, 1),
    "http400": ("failed", "http_400", 1, 1),
    "not_a_completion": ("failed", "bad_response", 3, 1),
    "env_failure": ("skipped", "env_failure", 0, 0),
}


def scripted(req):
    case, n = req["task"].split(":")[0].removeprefix("case "), req["try"]
    good = Reply(content=good_answer(f"The agent solved {case}.", SKILL))
    if case == "good":
        return good
    if case == "fenced":
        return Reply(content=f"Sure! Here is my analysis.\n```json\n{good.content}\n```\nHope this helps.")
    if case == "nonjson_then_good":
        return Reply(content="The agent did fine, it found the object quickly.") if n == 0 else good
    if case == "wrong_keys":
        return Reply(content=json.dumps({"summary": "It worked.", "skill": SKILL}))
    if case == "short_skill":
        return Reply(content=good_answer("It worked.", "Find it, place it."))
    if case == "short_then_good":
        return Reply(content=good_answer("It worked.", "Find it, place it.")) if n == 0 else good
    if case == "http500_then_good":
        return Reply(status=500) if n == 0 else good
    if case == "http429_then_good":
        return Reply(status=429, headers={"Retry-After": "1"}) if n == 0 else good
    if case == "http429_forever":
        return Reply(status=429, headers={"Retry-After": "3600"})
    if case == "slow":
        return Reply(delay=4.0, content=good.content)
    if case == "slow_then_good":
        return Reply(delay=4.0, content=good.content) if n == 0 else good
    if case == "http400":
        return Reply(status=400)
    if case == "not_a_completion":
        return Reply(raw_body=b"<html>gateway says hi</html>")
    raise AssertionError(f"unexpected request for {case!r}")


@pytest.fixture(scope="module")
def scripted_run(template, tmp_path_factory):
    d = tmp_path_factory.mktemp("scripted")
    eps = clones(template, CASES)
    eps[-1]["env_failure"] = "worker died: scripted"
    traj = write_jsonl(d / "traj.jsonl", eps)
    with FakeOpenAI(scripted) as server:
        t0 = time.monotonic()
        # timeout 1.5 s against 4 s answers (and against ms answers on a busy 2-core machine); backoff 0.05 s,
        # so only Retry-After can explain a 1 s gap; Retry-After 3600 is capped by --max-wait 1.2
        res = run_script(annotate_args(traj, d / "out" / "skills.jsonl", server.url, "--timeout", "1.5",
                                       "--http-retries", "2", "--backoff", "0.05", "--max-wait", "1.2"),
                         env={"SEED_TEST_KEY": KEY}, check=False)
        wall = time.monotonic() - t0
        recs = {r["trajectory_uid"].split("/")[1].split("#")[0]: r for r in load(d / "out" / "skills.jsonl")}
        sent = sum(len(r["attempts"]) for r in recs.values())
        deadline = time.monotonic() + 10  # a request the client gave up on may still wait for a server thread
        while len(server.requests) < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        requests = list(server.requests)
    return dict(dir=d, eps=eps, traj=traj, res=res, recs=recs, requests=requests, wall=wall)


def test_each_misbehaviour_ends_as_scripted(scripted_run):
    recs, requests = scripted_run["recs"], scripted_run["requests"]
    assert sorted(recs) == sorted(CASES), "one record per trajectory, none lost"
    for case, (status, reason, n_requests, tries) in CASES.items():
        r = recs[case]
        got = (r["status"], r["reason"].split(":")[0], len(r["attempts"]), r["tries"])
        assert got == (status, reason, n_requests, tries), case
        seen = [q for q in requests if q["task"].startswith(f"case {case}:")]
        assert len(seen) == n_requests, f"{case}: the server saw {len(seen)} requests, the record says {n_requests}"
        if status == "parsed":
            assert r["episode_skill"] == SKILL and r["skill_words"] == len(SKILL.split()) and r["raw"]
        else:
            assert r["episode_skill"] is None
    # parse retries carry the stricter reminder naming the reason; the first ask never does
    for case, why in [("nonjson_then_good", "no_json"), ("wrong_keys", "missing_keys"),
                      ("short_skill", "skill_too_short"), ("short_then_good", "skill_too_short")]:
        seen = [q for q in requests if q["task"].startswith(f"case {case}:")]
        assert not seen[0]["reminder"], case
        assert all(q["reminder"] and f"({why})" in q["prompt"] for q in seen[1:]), case
        assert recs[case]["attempts"][0]["parse_reason"] == why and recs[case]["attempts"][1]["reminder"] == why
    # HTTP retries re-send the same prompt (no reminder) and record each error
    a = recs["http500_then_good"]["attempts"]
    assert (a[0]["http_status"], a[0]["error"], a[1]["http_status"], a[1]["parse_reason"]) == (500, "http_500", 200, "ok")
    assert all(x["error"] == "timeout" and x["http_status"] is None for x in recs["slow"]["attempts"])
    assert all(x["latency_s"] >= 1.4 for x in recs["slow"]["attempts"])
    assert [x["http_status"] for x in recs["http429_forever"]["attempts"]] == [429, 429, 429]
    assert recs["not_a_completion"]["attempts"][0]["http_status"] == 200
    # Retry-After honoured (1 s, while the backoff would be 0.05 s) and capped (3600 s -> --max-wait 1.2 s)
    t = lambda case: [q["time"] for q in requests if q["task"].startswith(f"case {case}:")]
    gap = t("http429_then_good")[1] - t("http429_then_good")[0]
    assert 0.9 <= gap < 5, gap
    gaps = [b - a for a, b in zip(t("http429_forever"), t("http429_forever")[1:])]
    assert all(1.1 <= g < 5 for g in gaps), gaps
    assert scripted_run["wall"] < 60
    # the summary counts every record
    out = scripted_run["res"].stdout
    n_parsed = sum(s == "parsed" for s, *_ in CASES.values())
    n_failed = sum(s == "failed" for s, *_ in CASES.values())
    assert f"{len(CASES)} annotations" in out and f"parsed {n_parsed}, failed {n_failed}, skipped 1" in out
    assert f"parse rate, success trajectories: {n_parsed}/{n_parsed + n_failed}" in out
    # the three transport failures (HTTP 429, timeout, a 200 that is no completion) make the run fail, in one
    # line; the parse failures and the HTTP 400 are final answers, not counted there
    res = scripted_run["res"]
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == ("annotate: 3 trajectories failed for transport reasons (bad_response 1, "
                                                   "http_429 1, timeout 1); rerun the same command to ask them again")


def test_api_key_reaches_the_server_and_nothing_else(scripted_run):
    assert scripted_run["requests"] and all(q["auth"] == f"Bearer {KEY}" for q in scripted_run["requests"])
    files = [os.path.join(root, f) for root, _, fs in os.walk(scripted_run["dir"]) for f in fs]
    assert len(files) >= 4  # trajectories, annotations, SFT file, manifest
    for path in files:
        with open(path, "rb") as f:
            assert KEY.encode() not in f.read(), path
    assert KEY not in scripted_run["res"].stdout and KEY not in scripted_run["res"].stderr
    manifest = json.load(open(scripted_run["dir"] / "out" / "skills.jsonl.manifest.json"))
    assert manifest["args"]["api_key_env"] == "SEED_TEST_KEY" and manifest["analyzer"]["model"] == "fake-glm"


def test_sft_file_has_one_line_per_parsed_annotation_and_traces_back(scripted_run):
    out = scripted_run["dir"] / "out"
    sft = load(out / "skills.sft.jsonl")
    anns = {r["id"]: r for r in load(out / "skills.jsonl")}
    parsed = [r for r in anns.values() if r["status"] == "parsed"]
    assert len(sft) == len(parsed) and len({e["id"] for e in sft}) == len(sft)
    eps = {ep["uid"]: ep for ep in scripted_run["eps"]}
    for ex in sft:
        assert set(ex) >= {"id", "split", "prompt", "target", "annotation_id", "annotation_file", "trajectory_uid",
                           "trajectory_file", "outcome"}
        ann = anns[ex["annotation_id"]]
        assert ann["status"] == "parsed" and os.path.samefile(ex["annotation_file"], out / "skills.jsonl")
        assert ex["trajectory_uid"] == ann["trajectory_uid"] and os.path.samefile(ex["trajectory_file"], scripted_run["traj"])
        ep = eps[ex["trajectory_uid"]]
        # the prompt is the plain analysis prompt (no reminder, even when the answer came on a retry)
        assert ex["prompt"] == build_analysis_prompt(ep, load_env(ep.get("env", "alfworld"))) and REMINDER not in ex["prompt"]
        assert ex["target"] == target_json(ann) and json.loads(ex["target"])["episode_skill"] == SKILL
        assert ex["split"] in ("train", "val") and ex["outcome"] == "success"


# ---------------------------------------------------------------------------------------------------
def test_val_split_is_seeded_about_ten_percent_and_stable_under_resume(template, tmp_path):
    eps = clones(template, [f"n{i:03d}" for i in range(200)])
    part1, part2 = write_jsonl(tmp_path / "part1.jsonl", eps[:100]), write_jsonl(tmp_path / "part2.jsonl", eps[100:])
    out = tmp_path / "skills.jsonl"
    with FakeOpenAI(lambda req: Reply(content=good_answer("ok.", SKILL))) as server:
        run_script(annotate_args(part1, out, server.url))
        first = {e["id"]: e["split"] for e in load(tmp_path / "skills.sft.jsonl")}
        run_script(annotate_args([part1, part2], out, server.url))  # resumed with more trajectories
        second = {e["id"]: e["split"] for e in load(tmp_path / "skills.sft.jsonl")}
        assert len(server.requests) == 200, "the first 100 were not asked again"
    assert len(first) == 100 and len(second) == 200
    assert all(second[i] == s for i, s in first.items()), "a resumed run must not move examples between splits"
    n_val = sum(s == "val" for s in second.values())
    assert 8 <= n_val <= 36, n_val  # ~10% of 200


def test_transport_failures_are_asked_again_by_default_parse_failures_only_with_retry_failed(template, tmp_path):
    """An outage (HTTP 503 after the retries) fails a record for transport reasons: the run exits 1, and the
    plain rerun asks it again, saying so. An unparsable answer is final unless --retry-failed."""
    eps = clones(template, ["ok", "outage", "nonjson"])
    traj, out = write_jsonl(tmp_path / "traj.jsonl", eps), tmp_path / "skills.jsonl"
    down = {"outage": True, "nonjson": True}

    def script(req):
        if "outage" in req["task"] and down["outage"]:
            return Reply(status=503)
        if "nonjson" in req["task"] and down["nonjson"]:
            return Reply(content="I would rather not answer in JSON.")
        return Reply(content=good_answer("ok.", SKILL))
    with FakeOpenAI(script) as server:
        fast = ("--http-retries", "1", "--backoff", "0.01", "--parse-retries", "0")
        first = run_script(annotate_args(traj, out, server.url, *fast), check=False)
        assert first.returncode == 1 and "1 trajectories failed for transport reasons (http_503 1)" in first.stderr
        assert {r["trajectory_uid"]: (r["status"], r["reason"]) for r in load(out)} == {
            "case/ok#r0": ("parsed", ""), "case/outage#r0": ("failed", "http_503"), "case/nonjson#r0": ("failed", "no_json")}
        sft_bytes = (tmp_path / "skills.sft.jsonl").read_bytes()
        still_down = run_script(annotate_args(traj, out, server.url, *fast), check=False)  # the outage lasts
        assert "asking again 1 that failed before for transport reasons: http_503 1" in still_down.stdout
        assert still_down.returncode == 1 and len(load(out)) == 4 and len(server.requests) == 4 + 2
        assert (tmp_path / "skills.sft.jsonl").read_bytes() == sft_bytes, "the rebuilt SFT file is the same"
        down["outage"] = False
        res = run_script(annotate_args(traj, out, server.url, *fast))  # the endpoint is back: exit 0
        assert "asking again 1 that failed before for transport reasons: http_503 1" in res.stdout
        assert len(server.requests) == 7, "only the transport failure is asked again, not the unparsable answer"
        assert "parsed 2, failed 1" in res.stdout and "2 earlier failed records superseded" in res.stdout
        down["nonjson"] = False
        res = run_script(annotate_args(traj, out, server.url, "--retry-failed", *fast))
        assert "asking again 1 that failed before (--retry-failed): no_json 1" in res.stdout
        assert len(server.requests) == 8 and "parsed 3, failed 0" in res.stdout
        # the analyzer's settings are part of the file: another temperature is refused, by name
        other = run_script(annotate_args(traj, out, server.url, "--temperature", "0.7"), check=False)
        assert other.returncode != 0 and len(server.requests) == 8
        assert "--temperature 0.0 then, 0.7 now" in other.stderr.strip().splitlines()[-1]
    recs = load(out)
    assert recs[-1]["trajectory_uid"] == "case/nonjson#r0" and recs[-1]["status"] == "parsed"
    sft = load(tmp_path / "skills.sft.jsonl")
    assert sorted(e["trajectory_uid"] for e in sft) == ["case/nonjson#r0", "case/ok#r0", "case/outage#r0"]
    sid = next(e["id"] for e in sft if e["trajectory_uid"] == "case/outage#r0")
    trace = run_script(["annotate.py", "--trace", sid, "--sft", str(tmp_path / "skills.sft.jsonl")]).stdout
    assert "status: parsed" in trace and "after 2 failed record(s): ['http_503', 'http_503']" in trace


def test_nothing_listening_stops_at_once_in_one_line_and_the_rerun_asks_everything(template, tmp_path):
    """No server on the port: a non-zero exit within seconds, one line naming the URL, nothing written as
    failed. The same command with the fake endpoint up then annotates every trajectory."""
    eps = clones(template, [f"n{i}" for i in range(12)])
    traj, out = write_jsonl(tmp_path / "traj.jsonl", eps), tmp_path / "skills.jsonl"
    with socket.socket() as probe:  # a port nobody listens on (free now; the fake endpoint takes it below)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    t0 = time.monotonic()
    res = run_script(annotate_args(traj, out, url), check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr and time.monotonic() - t0 < 30  # was 88 s, exit 0
    assert res.stderr.strip().splitlines()[-1] == (f"annotate: stopped: cannot reach {url} ([Errno 111] Connection "
                                                   "refused): is the endpoint up? Start it (or fix --base-url) and "
                                                   "rerun the same command")
    assert load(out) == []
    with FakeOpenAI(lambda req: Reply(content=good_answer("ok.", SKILL)), port=port) as server:
        again = run_script(annotate_args(traj, out, url))
        assert len(server.requests) == 12
    assert "12 annotations" in again.stdout and "parsed 12, failed 0" in again.stdout


def test_requests_reuse_one_kept_alive_connection(template, tmp_path):
    """One pooled session: with --concurrency 1, six trajectories are six requests over one TCP connection
    (the server sees one client port), not six connections."""
    traj = write_jsonl(tmp_path / "traj.jsonl", clones(template, [f"c{i}" for i in range(6)]))
    with FakeOpenAI(lambda req: Reply(content=good_answer("ok.", SKILL))) as server:
        res = run_script(annotate_args(traj, tmp_path / "skills.jsonl", server.url, "--concurrency", "1"))
        peers = [q["peer"] for q in server.requests]
    assert "parsed 6, failed 0" in res.stdout
    assert len(peers) == 6 and len(set(peers)) == 1, peers


def test_kill_mid_run_then_resume_gives_every_trajectory_exactly_once(template, tmp_path):
    eps = clones(template, [f"k{i:02d}" for i in range(30)])
    traj, out = write_jsonl(tmp_path / "traj.jsonl", eps), tmp_path / "skills.jsonl"
    slow = {"delay": 0.25}
    with FakeOpenAI(lambda req: Reply(delay=slow["delay"], content=good_answer("ok.", SKILL))) as server:
        env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", SEED_TEST_KEY=KEY)
        proc = subprocess.Popen([sys.executable, *annotate_args(traj, out, server.url, "--concurrency", "2")],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 6:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
        before = {r["trajectory_uid"] for r in read_jsonl(out)}  # a torn last line is possible here
        asked_before = len(server.requests)
        assert 6 <= len(before) < len(eps)
        with open(out, "ab") as f:  # what a kill in the middle of a write leaves behind
            f.write(b'{"id": "ann-torn", "trajectory_uid": "case/k')
        slow["delay"] = 0.0
        res = run_script(annotate_args(traj, out, server.url), env={"SEED_TEST_KEY": KEY})
        requests = list(server.requests)
    assert "torn last line" in res.stderr
    uids = [r["trajectory_uid"] for r in load(out)]
    assert sorted(uids) == sorted(ep["uid"] for ep in eps), "every trajectory exactly once, none lost"
    for uid in before:  # finished before the kill: never asked again
        case = uid.split("/")[1].split("#")[0]
        assert sum(q["task"].startswith(f"case {case}:") for q in requests) == 1, uid
    assert len(requests) - asked_before == len(eps) - len(before)
    assert len(load(tmp_path / "skills.sft.jsonl")) == len(eps)


def test_endpoint_that_refuses_the_key_stops_the_run_clearly(template, tmp_path):
    traj = write_jsonl(tmp_path / "traj.jsonl", clones(template, [f"r{i}" for i in range(20)]))
    with FakeOpenAI(lambda req: Reply(status=401)) as server:
        res = run_script(annotate_args(traj, tmp_path / "skills.jsonl", server.url, "--concurrency", "2"),
                         env={"SEED_TEST_KEY": KEY}, check=False)
        n = len(server.requests)
    assert res.returncode != 0 and "HTTP 401" in res.stderr and "SEED_TEST_KEY" in res.stderr
    assert KEY not in res.stdout + res.stderr
    assert n <= 2, "after the first refusal only requests already in flight (--concurrency 2) were sent"
    assert load(tmp_path / "skills.jsonl") == []


# ---------------------------------------------------------------------------------------------------
def test_trace_follows_a_real_chain(expert_trajectories, tiny_trajectories, tmp_path):
    """collect.py (real ALFWorld: expert wins, tiny-model failures) -> annotate.py (fake endpoint) -> SFT
    file -> --trace prints the raw steps, every analyzer attempt and the SFT target."""
    def analyst(req):
        failure = "Outcome: FAILURE" in req["prompt"]
        if failure and not req["reminder"]:
            return Reply(content="Let me think about what went wrong here...")  # then the retry works
        return Reply(content=good_answer(f"The agent {'failed' if failure else 'did'}: {req['task']}",
                                         f"{'Never send text without action tags' if failure else 'First go to'} "
                                         f"when the task is: {req['task']}"))
    out_e, out_t = tmp_path / "expert" / "skills.jsonl", tmp_path / "tiny" / "skills.jsonl"
    with FakeOpenAI(analyst) as server:
        run_script(annotate_args(expert_trajectories, out_e, server.url))
        run_script(annotate_args(tiny_trajectories, out_t, server.url))
        mixed = run_script(annotate_args([expert_trajectories, tiny_trajectories], tmp_path / "mixed.jsonl",
                                         server.url), check=False)
    # the two collections share uids (same tasks, seed and rollout index): one --out each, said clearly
    assert mixed.returncode != 0 and "appears twice" in mixed.stderr
    sft_e, sft_t = load(tmp_path / "expert" / "skills.sft.jsonl"), load(tmp_path / "tiny" / "skills.sft.jsonl")
    assert len(sft_e) == len(load(expert_trajectories)) and len(sft_t) == len(load(tiny_trajectories))
    assert not {e["id"] for e in sft_e} & {e["id"] for e in sft_t}, "ids are unique across collections"
    for sft_file, ex, traj_file in [(tmp_path / "expert" / "skills.sft.jsonl", sft_e[0], expert_trajectories),
                                    (tmp_path / "tiny" / "skills.sft.jsonl", sft_t[-1], tiny_trajectories)]:
        res = run_script(["annotate.py", "--trace", ex["id"], "--sft", str(sft_file)])
        text = res.stdout
        ep = next(e for e in load(traj_file) if e["uid"] == ex["trajectory_uid"])
        ann = next(r for r in load(ex["annotation_file"]) if r["id"] == ex["annotation_id"])
        assert ex["id"] in text and ep["uid"] in text and ann["id"] in text
        for s in ep["steps"]:
            assert f"--- step {s['step']}  action: {s['action']!r}" in text
            assert s["observation"] in text and s["response"] in text and f"reward: {s['reward']}" in text
        assert ep["steps"][-1]["feedback"] in text
        for a in ann["attempts"]:
            assert a["raw"] in text
        assert f"attempts: {len(ann['attempts'])}" in text
        assert "rebuilt from the trajectory: identical" in text
        assert f"SFT TARGET  {ex['target']}" in text
        if ex["outcome"] == "failure":  # the tiny model's failures took a parse retry with the reminder
            assert len(ann["attempts"]) == 2 and "reminder: no_json" in text
        else:
            assert len(ann["attempts"]) == 1
    assert {ex["outcome"] for ex in sft_e} == {"success"} and {ex["outcome"] for ex in sft_t} == {"failure"}
    bad = run_script(["annotate.py", "--trace", "sft-000000000000", "--sft", str(tmp_path / "tiny" / "skills.sft.jsonl")],
                     check=False)
    assert bad.returncode != 0 and "no SFT example" in bad.stderr


def test_local_tiny_analyzer_fails_cleanly(tiny_trajectories, tmp_path):
    """A random tiny model never writes JSON: every record ends failed after 3 attempts; nothing crashes."""
    traj = write_jsonl(tmp_path / "traj.jsonl", load(tiny_trajectories)[:2])
    out = tmp_path / "skills.jsonl"
    res = run_script(["annotate.py", "--trajectories", str(traj), "--out", str(out), "--analyzer", "local",
                      "--model", "tiny", "--max-new-tokens", "16"])
    recs = load(out)
    assert len(recs) == 2
    for r in recs:
        assert r["status"] == "failed" and r["reason"] in ("empty", "no_json", "missing_keys")
        assert len(r["attempts"]) == 3 and r["tries"] == 3
        assert [a["reminder"] for a in r["attempts"]][0] is None and all(a["reminder"] for a in r["attempts"][1:])
        assert all(isinstance(a["raw"], str) and a["usage"]["completion_tokens"] <= 16 for a in r["attempts"])
        assert r["analyzer"] == {"analyzer": "local", "model": "tiny", "temperature": 0.0, "max_new_tokens": 16,
                                 "backend": "hf"}
    assert load(tmp_path / "skills.sft.jsonl") == []
    assert "failed 2" in res.stdout
    manifest = json.load(open(str(out) + ".manifest.json"))
    assert manifest["tokenizer"]["chat_template_sha256"] and manifest["diff_vs_paper"] == {
        "max_new_tokens": {"run": 16, "paper": 4096}}


def test_the_demo_endpoint_says_how_to_stop_it_and_a_port_in_use_in_one_line():
    """`python tests/openai_fake.py --port N &` (the README's demo): it prints its pid and stops on `kill`; a
    second one on the same port is one line, not an "Address already in use" traceback."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "tests/openai_fake.py", "--port", "0"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert f"pid {proc.pid}: stop it with Ctrl-C, or `kill {proc.pid}`" in first
        port = int(first.split("127.0.0.1:")[1].split("/")[0])
        second = run_script(["tests/openai_fake.py", "--port", str(port)], check=False, timeout=60)
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert second.stderr.strip().splitlines()[-1].startswith(f"port {port} is in use")
    finally:
        proc.terminate()  # what `kill <pid>` sends
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGTERM
