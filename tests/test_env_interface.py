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
