"""benchmarks/rollout.py on CPU (tiny model, HF backend): the path that times seed_rl.py's weight sync (an FSDP2
policy of one rank gathered into the engine) runs, and its JSON counts what was sent and generated."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_rollout_benchmark_times_generation_and_the_weight_sync(tmp_path):
    out = tmp_path / "rollout.json"
    r = subprocess.run([sys.executable, "benchmarks/rollout.py", "--config", "tiny", "--skip-vllm", "--prompts", "3",
                        "--prompt-len", "8", "--new-tokens", "4", "--hf-prompts", "3", "--sync-repeats", "2",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, REPO)
    from common.models import tiny_config
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_config()).parameters())
    assert res["sync"]["engine"] == "HFBackend"
    assert res["sync"]["gb"] == n_params * 4 / 1e9  # fp32 on CPU: 4 bytes a parameter, every parameter once
    assert res["sync"]["s"] > 0
    assert res["hf"]["prompts"] == 3 and res["hf"]["generated_tokens"] <= 3 * 4
    assert "sync (HFBackend)" in r.stdout and "-- all measured" in r.stdout
