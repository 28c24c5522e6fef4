"""Every env module has every name of the interface (the list in envs/__init__.py's docstring) and the same
PRESET keys, so a script can read any env the same way."""
import importlib
import re

import pytest

import envs

INTERFACE = re.findall(r"^  (\w+)", envs.__doc__, re.M)  # "  NAME ...", "  make_game(task) ...", ...


def test_the_interface_list_is_read():
    assert {"NAME", "PRESET", "make_game", "parse_action", "episode_stats", "data_manifest"} <= set(INTERFACE)


@pytest.mark.parametrize("name", list(envs.ENVS))
def test_every_env_has_the_whole_interface(name):
    env = importlib.import_module(envs.ENVS[name])
    missing = [n for n in INTERFACE if not hasattr(env, n)]
    assert not missing, f"{envs.ENVS[name]} lacks {missing}"
    assert env.NAME == name
    for n in INTERFACE:
        if n[0].islower():
            assert callable(getattr(env, n)), n


def test_every_env_has_the_same_preset_keys():
    keys = {name: set(importlib.import_module(mod).PRESET) for name, mod in envs.ENVS.items()}
    first = keys["alfworld"]
    assert all(k == first for k in keys.values()), {n: sorted(k ^ first) for n, k in keys.items()}


def banners(module):
    """The section titles of a module: the comment line under each `# -----` banner, in file order."""
    with open(module.__file__) as f:
        lines = f.read().splitlines()
    return [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.startswith("# -----")]


SECTIONS = ["# Data and flags", "# Tasks", "# One game (runs inside an EnvPool worker)", "# The prompt",
            "# Parsing and reward", "# The scripted expert (CPU demos and tests) and the episode stats"]


@pytest.mark.parametrize("name", list(envs.ENVS))
def test_every_env_module_reads_the_same_way(name):
    """The same sections in the same order (envs/__init__.py says which), and a docstring that opens with one
    step worked through: prompt, response, parsed action, feedback, reward."""
    env = importlib.import_module(envs.ENVS[name])
    assert banners(env) == SECTIONS
    example = re.search(r"worked through.*?\n\n((?:    .*\n)+)", env.__doc__)
    assert example, "no worked example in the docstring"
    labels = re.findall(r"^    (\w+)", example.group(1), re.M)
    assert labels == ["prompt", "response", "parsed", "feedback", "reward"], labels
