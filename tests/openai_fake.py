"""A real HTTP server on 127.0.0.1 that speaks the OpenAI chat-completions API and misbehaves on purpose.

Tests script it per request; run as a program it is a stand-in analyzer for CPU demos of annotate.py:

    python tests/openai_fake.py --port 8000 &      # prints its pid; `kill %1` (or kill <pid>) stops it
    python annotate.py --trajectories runs/demo/expert.jsonl --out runs/demo/skills.jsonl \
        --base-url http://127.0.0.1:8000/v1 --model fake-analyzer
    kill %1

    server = FakeOpenAI(script)          # script(request) -> Reply, called once per POST
    server.url                           # "http://127.0.0.1:<port>/v1" (the --base-url to pass)
    server.requests                      # every request received, in arrival order (dicts, see below)
    server.close()

A request dict: {"n": arrival index, "time": monotonic seconds, "prompt": the user message text,
"task": the prompt's "Task: ..." line, "reminder": whether the stricter reminder is in it, "try": how many
earlier requests carried the same task (0 for the first), "auth": the Authorization header, "peer": the
client's (host, port), one per TCP connection, "body": the JSON}.
The script chooses what the server does with a Reply: an HTTP status, an answer text (wrapped in a real
chat-completion object), extra headers (Retry-After), a delay before answering (to run past a client's
timeout), or a raw body (a 200 that is not a chat completion).
"""
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    status: int = 200
    content: str = None          # the assistant message (status 200)
    headers: dict = field(default_factory=dict)
    delay: float = 0.0           # seconds to sleep before answering
    raw_body: bytes = None       # sent as is instead of a chat completion / error object


def good_answer(summary, skill):
    return json.dumps({"episode_summary": summary, "episode_skill": skill})


_TASK_RE = re.compile(r"^Task: (.*)$", re.MULTILINE)


class FakeOpenAI:
    def __init__(self, script, port=0):
        self.script = script
        self.requests = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet: pytest shows stderr of failing tests only
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                prompt = body["messages"][-1]["content"]
                m = _TASK_RE.search(prompt)
                task = m.group(1) if m else ""
                with fake.lock:
                    req = {"n": len(fake.requests), "time": time.monotonic(), "prompt": prompt, "task": task,
                           "reminder": "IMPORTANT: your previous answer could not be used" in prompt,
                           "try": sum(r["task"] == task for r in fake.requests),
                           "auth": self.headers.get("Authorization"), "peer": self.client_address, "body": body}
                    fake.requests.append(req)
                reply = fake.script(req)
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.raw_body is not None:
                    return self._send(reply.status, reply.raw_body, reply.headers)
                if reply.status != 200:
                    return self._send(reply.status, {"error": {"message": f"scripted {reply.status}"}},
                                      reply.headers)
                return self._send(200, {
                    "id": f"chatcmpl-{req['n']}", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": reply.content}}],
                    "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(reply.content or "") // 4,
                              "total_tokens": (len(prompt) + len(reply.content or "")) // 4}}, reply.headers)

            def _send(self, status, payload, headers=None):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, str(v))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout) or was killed
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self, task):
        with self.lock:
            return sum(r["task"] == task for r in self.requests)

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def demo_script(req):
    """The demo analyzer: a canned skill made from the trajectory's own actions (no model). Every fifth
    request answers HTTP 503 and a failed episode's first answer is not JSON, so the demo shows both
    kinds of retry."""
    prompt = req["prompt"]
    if req["n"] % 5 == 4:
        return Reply(status=503)
    success = "Outcome: SUCCESS" in prompt
    if not success and not req["reminder"]:
        return Reply(content="Let me look at this episode step by step first...")
    actions = re.findall(r"<action>(.*?)</action>", prompt)
    steps = len(re.findall(r"^Action valid: ", prompt, re.MULTILINE))
    invalid = len(re.findall(r"^Action valid: no", prompt, re.MULTILINE))
    if success:
        return Reply(content=good_answer(
            f"The agent completed '{req['task']}' in {steps} steps.",
            "For this kind of task, " + ", then ".join(actions[:8]) + "."))
    return Reply(content=good_answer(
        f"The agent did not complete '{req['task']}': {invalid} of {steps} steps were invalid.",
        "Never answer without <think> and <action> tags, and always choose the action from the admissible list."))


if __name__ == "__main__":
    import argparse
    import errno
    import os
    import sys
    ap = argparse.ArgumentParser(description="a fake OpenAI-compatible analyzer for CPU demos",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: any free port)")
    a = ap.parse_args()
    try:
        server = FakeOpenAI(demo_script, port=a.port)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        sys.exit(f"port {a.port} is in use: another server (a fake analyzer started earlier?) listens there. Stop "
                 f"that one (`kill <its pid>`, printed when it started; `fuser -k {a.port}/tcp` finds it), or pass "
                 f"another --port")
    print(f"fake analyzer at {server.url}, pid {os.getpid()}: stop it with Ctrl-C, or `kill {os.getpid()}`",
          flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.close()
