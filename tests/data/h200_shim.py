"""A stand-in for h200.sh's $PY in tests/test_h200_paths.py: it runs nothing but records each command that
benchmarks/remote/h200.sh starts (to $H200_SHIM_LOG, one JSON line each). For the jobs that h200.sh has
benchmarks/remote/commands.py build, it records the built command too (commands.py NAME --print ...), so the test
can run exactly that on CPU; for the probe it prints the line h200.sh waits for ("init engine (")."""
import json
import os
import shlex
import subprocess
import sys

args = sys.argv[1:]
rec = {"argv": args}
if args and args[0].endswith("commands.py"):
    out = subprocess.run([sys.executable, args[0], args[1], "--print", *args[2:]], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"commands.py {args[1]} failed: {out.stderr}")
    rec["name"], rec["built"] = args[1], shlex.split(out.stdout.strip())
    if args[1] == "probe":
        print("INFO init engine (shim)", flush=True)
with open(os.environ["H200_SHIM_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\n")
