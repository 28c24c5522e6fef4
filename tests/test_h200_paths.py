"""benchmarks/h200.sh's job-starting command paths, run for real on CPU (issue 29): part L with ENV=search builds
its seed_rl.py / evaluate.py commands through benchmarks/learning.py from the env flags written in h200.sh; this
test reads those flags out of h200.sh itself, points them at a live local retriever (python -m envs.retriever
over the shared corpus, a free loopback port) and runs one Search update of the tiny model, then the end
evaluation. A wrong URL or flag in h200.sh fails here instead of on a GPU (part L was only dry-run before, and
every Search job failed with HTTP 404: the URL lacked /retrieve)."""
import json
import os
import re

import pytest

from conftest import REPO, run_script
from test_search import REAL_CORPUS, start_server, stop

H200 = os.path.join(REPO, "benchmarks", "remote", "h200.sh")


def h200_search_env_args():
    """The --env-args string that part L passes for ENV=search, as written in h200.sh."""
    m = re.search(r'ENV_ARGS=\("--env-args=([^"]+)"\)', open(H200).read())
    assert m, "part L's ENV_ARGS for Search not found in benchmarks/h200.sh"
    return m.group(1)


def test_h200_search_urls_name_the_endpoint():
    text = open(H200).read()
    urls = re.findall(r"--retriever-url (http://[^\s\"')]+)", text)
    assert len(urls) >= 3 and all(u.endswith("/retrieve") for u in urls), urls  # parts L and Q


@pytest.mark.slow
def test_part_L_search_commands_run_for_real_against_a_live_retriever(tmp_path):
    proc, url = start_server(REAL_CORPUS, tmp_path)
    try:
        port = re.match(r"http://127\.0\.0\.1:(\d+)/", url).group(1)
        env_args = h200_search_env_args().replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        res = tmp_path / "results"
        run_script(["benchmarks/learning.py", "--env", "search", "--model", "tiny", "--methods", "grpo", "--seeds", "0",
                    "--updates", "1", "--tasks-per-update", "1", "--group-size", "2", "--max-new-tokens", "8",
                    "--eval-limit", "1", "--workers", "1", f"--env-args={env_args}", "--results-dir", str(res),
                    "--scratch", str(tmp_path / "scratch")], timeout=900)
        runs = [json.loads(line) for line in open(res / "runs.jsonl")]
        assert len(runs) == 1 and runs[0]["env"] == "search"
        assert f"--retriever-url {url}" in runs[0]["commands"]["train"]
        assert runs[0]["updates"][0]["env_failures"] == 0
        assert runs[0]["eval"]["end"]["all"]["episodes"] == 1
    finally:
        stop(proc)
