"""`--help` of the five scripts: the docstring (what the script does and its commands) exactly as written, every
flag with a help text, and the defaults shown."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPTS = ["collect.py", "annotate.py", "sft.py", "seed_rl.py", "evaluate.py"]


@pytest.fixture(scope="module")
def helps():
    """Each script's --help, the five run at once (each imports torch: seconds)."""
    env = dict(os.environ, PYTHONPATH=REPO, COLUMNS="200", OMP_NUM_THREADS="1")
    procs = {s: subprocess.Popen([sys.executable, s, "--help"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for s in SCRIPTS}
    out = {}
    for s, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, (s, stderr[-2000:])
        out[s] = stdout
    return out


def option_entries(text):
    """[(invocation, help text)] of every option in an argparse help screen: an entry starts with two spaces
    and a dash; its help follows two or more spaces later on that line, or on the deeper-indented lines below."""
    entries, current = [], None
    for line in text[text.index("\noptions:\n"):].splitlines()[1:]:
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if m:
            current = [m.group(1), m.group(2) or ""]
            entries.append(current)
        elif line.startswith("    ") and current is not None:
            current[1] += " " + line.strip()
        else:  # a group title or a blank line
            current = None
    return entries


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_has_help_and_shows_its_default(helps, script):
    entries = option_entries(helps[script])
    assert len(entries) > 8, entries
    bare = [inv for inv, text in entries if not re.sub(r"\(default: [^)]*\)", "", text).strip()]
    assert not bare, f"{script}: flags without a help text: {bare}"
    seed = [text for inv, text in entries if inv.startswith("--seed ")]
    assert seed and "(default: 0)" in seed[0], seed


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_docstring_commands_show_as_written(helps, script):
    """A backslash that ends a docstring line must be written `\\\\`: a single one joins the command to the next
    line in the string itself, and --help showed the two run together."""
    with open(os.path.join(REPO, script)) as f:
        source = f.read()
    raw = source.split('"""')[1]  # the module docstring as typed
    assert not re.search(r"(?<!\\)\\\n", raw), f"{script}: a single backslash at a line end joins two lines"
    shown = raw.replace("\\\\", "\\").strip()
    assert shown in helps[script], f"{script}: the docstring does not show as written"
    assert re.search(r"^\s+(python|torchrun|for) .*\.py", shown, re.M), "no command in the docstring"
