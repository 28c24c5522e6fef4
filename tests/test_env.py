"""envs/alfworld.py game lists and task choice; envs/pool.py worker pool and its recovery from dead or hung
workers. Real ALFWorld games; the hung/broken worker cases use the small fake game defined here (the pool
imports it in its workers as `tests.test_env:make_fake_game`)."""
import collections
import os
import signal
import subprocess
import sys
import time

import pytest

# Light imports only: the pool's workers import this module for `make_fake_game` (torch, via
# common.backends, would add seconds to every worker start); the rollout tests import it inside the test.
import envs.alfworld as alfworld
from envs.alfworld import (SPLITS, TASK_TYPES, list_games, rl_task_stream, select_games, task_id_of, task_type_of,
                           walkthrough)
from envs.pool import EnvPool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ../shared/alfworld/README.md (the official release): games per split, and per type (train/seen/unseen)
SPLIT_COUNTS = {"train": 3553, "valid_seen": 140, "valid_unseen": 134}
TYPE_COUNTS = {"pick_and_place_simple": (790, 35, 24), "look_at_obj_in_light": (308, 13, 18),
               "pick_clean_then_place_in_recep": (650, 27, 31), "pick_heat_then_place_in_recep": (459, 16, 23),
               "pick_cool_then_place_in_recep": (533, 25, 21), "pick_two_obj_and_place": (813, 24, 17)}


# ----------------------------------------------------------------------------------------------------
# One game: the memoized PDDL translation changes nothing a game says

def test_memoized_translation_plays_the_same_game(monkeypatch):
    """envs/alfworld.py memoize_translation: a game built with the memo (translated once for its load and reset,
    then not at all for a second copy) says exactly what a game built with the plain translation says, step by
    step along the expert's walkthrough, and is won; and two live copies of one game do not share their state."""
    import fast_downward
    plain = getattr(fast_downward.pddl2sas, "__wrapped__", fast_downward.pddl2sas)
    memo = alfworld.memoize_translation()
    memo.cache_clear()
    game = select_games("valid_seen", 0, tasks_per_type=1)[0]["game_file"]
    a = alfworld.AlfworldGame(game)
    states_a = [a.reset()]
    assert (memo.cache_info().misses, memo.cache_info().hits) == (2, 2)  # the reset reused the load's two
    b = alfworld.AlfworldGame(game)
    states_b = [b.reset()]
    assert (memo.cache_info().misses, memo.cache_info().hits) == (2, 6)  # a second copy: no translation at all
    monkeypatch.setattr(fast_downward, "pddl2sas", plain)  # a game built without the memo
    c = alfworld.AlfworldGame(game)
    states_c = [c.reset()]
    steps = walkthrough(game)
    for action in steps:
        states_a.append(a.step(action))
        states_c.append(c.step(action))
    assert states_a == states_c and states_a[-1]["won"] and states_a[-1]["done"]
    # b was reset only: a's moves did not reach it, and it plays the same game on its own
    for action in steps:
        states_b.append(b.step(action))
    assert states_b == states_c


# ----------------------------------------------------------------------------------------------------
# Game lists and deterministic task choice

@pytest.mark.parametrize("split", list(SPLITS))
def test_split_counts_match_the_release(split):
    games = list_games(split)
    assert len(games) == SPLIT_COUNTS[split]
    assert list(games) == sorted(set(games))  # sorted, no duplicates
    col = list(SPLITS).index(split)
    per_type = collections.Counter(task_type_of(g) for g in games)
    assert per_type == {t: c[col] for t, c in TYPE_COUNTS.items()}
    assert all(task_id_of(g).startswith(f"{split}/") and os.path.isfile(g) for g in games)
    # list_games walks the folders by alfworld's own rule: the same list as alfworld's AlfredTWEnv gives
    import contextlib
    import io
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv
    from envs.alfworld import alfworld_config
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its prints, tqdm
        env = AlfredTWEnv(alfworld_config(), train_eval=SPLITS[split])
    assert games == tuple(sorted(env.game_files))


def test_select_games_stratified_and_seeded():
    a = select_games("train", 3, tasks_per_type=30)
    assert len(a) == 180
    types = [g["task_type"] for g in a]
    assert types == [t for t in TASK_TYPES for _ in range(30)]  # 30 of each type, in the paper's order (docs/paper.md)
    assert len({g["task_id"] for g in a}) == 180
    assert all(g["split"] == "train" and task_id_of(g["game_file"]) == g["task_id"] for g in a)
    assert select_games("train", 3, tasks_per_type=30) == a  # same seed -> same games
    b = select_games("train", 4, tasks_per_type=30)
    assert [g["task_id"] for g in b] != [g["task_id"] for g in a]  # another seed -> another choice
    # N per type is a prefix of a larger N (the same seeded shuffle per type)
    small = select_games("train", 3, tasks_per_type=2)
    assert [g["task_id"] for g in small] == [g["task_id"] for t in range(6) for g in a[30 * t: 30 * t + 2]]
    # not the sorted order: the choice is a shuffle, not the first N files
    assert [g["game_file"] for g in a[:30]] != [g for g in list_games("train") if task_type_of(g) == a[0]["task_type"]][:30]
    # a type with fewer games than asked gives all of them
    seen = select_games("valid_seen", 0, tasks_per_type=20)
    assert collections.Counter(g["task_type"] for g in seen)["look_at_obj_in_light"] == 13
    # neither argument: every game, sorted; n: a seeded shuffle's prefix
    assert [g["game_file"] for g in select_games("valid_unseen", 0)] == list(list_games("valid_unseen"))
    assert select_games("valid_unseen", 5, n=10) == select_games("valid_unseen", 5, n=20)[:10]
    with pytest.raises(ValueError, match="unknown split"):
        select_games("test", 0)
    stream = rl_task_stream(0, 16, 150)
    assert len(stream) == 2400 and len({g["task_id"] for g in stream}) == 2400
    assert all(g["split"] == "train" for g in stream) and stream == rl_task_stream(0, 16, 150)


def test_task_choice_is_the_same_in_another_process():
    """No dependence on hash randomization, file system order or the process: a fresh interpreter with
    another PYTHONHASHSEED picks the same games."""
    code = ("from envs.alfworld import select_games\n"
            "print('\\n'.join(g['task_id'] for g in select_games('valid_seen', 11, tasks_per_type=3)))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO, PYTHONHASHSEED="12345"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [g["task_id"] for g in select_games("valid_seen", 11, tasks_per_type=3)]


# ----------------------------------------------------------------------------------------------------
# A killed worker is replaced (real ALFWorld games, mid-episode)

def _alive(pid, zombie_is_dead=False):
    """True while the process exists (a killed child stays a zombie until the pool reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    if zombie_is_dead:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    return True


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "per-episode"])
def test_killed_worker_is_replaced_mid_episode(tokenizer, lockstep):
    from common.backends import ExpertPolicy
    from common.rollout import play_episodes, summarize_episodes

    class KillerPolicy(ExpertPolicy):
        """The expert, except that before answering slot 0's second step it SIGKILLs `pid` (a pool worker)."""

        def __init__(self, pid):
            super().__init__(tokenizer)
            self.pid = pid

        def generate(self, prompts, contexts=None, **kw):
            if any(ep["uid"] == "0" and len(ep["steps"]) == 1 for ep in contexts) and _alive(self.pid):
                os.kill(self.pid, signal.SIGKILL)
                for _ in range(250):  # let it die before the pool is asked to step it
                    if not _alive(self.pid, zombie_is_dead=True):
                        break
                    time.sleep(0.02)
            return super().generate(prompts, contexts=contexts, **kw)

    # 3 slots; slot i lives in worker i % 2: worker 0 holds slots 0 and 2, worker 1 holds slot 1
    games = [dict(g, uid=str(i)) for i, g in enumerate(select_games("valid_seen", 1, tasks_per_type=1)[:3])]
    with EnvPool("envs.alfworld:make_game", num_workers=2) as pool:  # Pick, Look, Clean: 4-6 steps each
        pids = pool.worker_pids()
        assert len(set(pids)) == 2 and all(_alive(p) for p in pids)
        episodes, _ = play_episodes(alfworld, games, pool, KillerPolicy(pids[0]), tokenizer, lockstep=lockstep)
        # worker 0 died before slot 0's step 2: every game it held is lost, so exactly its episodes end with an
        # env failure (slot 0 after one recorded step; slot 2, which plays at its own pace, after at most one);
        # worker 1's episode goes on and wins
        assert [bool(ep["env_failure"]) for ep in episodes] == [True, False, True]
        for ep in episodes[0::2]:
            assert "env worker died" in ep["env_failure"] and not ep["success"]
        assert episodes[0]["length"] == 1 and (episodes[2]["length"] == 1 if lockstep else episodes[2]["length"] <= 1)
        assert episodes[1]["success"] and episodes[1]["length"] == len(walkthrough(games[1]["game_file"]))
        assert pool.stats["workers_replaced"] == 1 and pool.stats["env_failures"] == 2
        summary = summarize_episodes(episodes)  # env failures are counted apart, not as policy failures
        assert summary["env_failures"] == 2 and summary["All"]["episodes"] == 1 and summary["All"]["success"] == 1.0
        new = pool.worker_pids()
        assert new[1] == pids[1] and new[0] != pids[0] and not _alive(pids[0]) and _alive(new[0])
        # the replacement works: a new batch resets and steps on every slot
        states = pool.reset([g["game_file"] for g in games])
        assert all("error" not in s for s in states), states
        assert all("help" not in s["admissible"] and "look" in s["admissible"] for s in states)
        out = pool.step({i: walkthrough(g["game_file"])[0] for i, g in enumerate(games)})
        assert sorted(out) == [0, 1, 2] and all("error" not in s and not s["won"] for s in out.values()), out
        assert pool.stats["workers_replaced"] == 1


# ----------------------------------------------------------------------------------------------------
# Hung and broken workers (a fake game: instant resets, steps that can sleep, raise or exit)

class FakeGame:
    def __init__(self, spec):
        if spec == "exit-on-reset":
            os._exit(3)
        self.spec, self.t = spec, 0

    def reset(self):
        return {"observation": f"start {self.spec} pid {os.getpid()}", "admissible": ["look"], "won": False,
                "done": False}

    def step(self, action):
        if action.startswith("sleep"):
            time.sleep(float(action.split()[1]))
        if action == "raise":
            raise ValueError("this game is broken")
        self.t += 1
        return {"observation": f"{self.spec} step {self.t}", "admissible": ["look"], "won": False, "done": False}


def make_fake_game(spec):
    return FakeGame(spec)


def test_hung_worker_is_killed_and_replaced():
    with EnvPool("tests.test_env:make_fake_game", num_workers=2, reset_timeout=60, step_timeout=60) as pool:
        states = pool.reset(["a", "b", "c", "d"])
        assert [s["observation"].split()[1] for s in states] == ["a", "b", "c", "d"]
        pids = pool.worker_pids()
        # a short step timeout only once the workers are up: a fresh worker's first answer includes its
        # interpreter start, which on a loaded 2-core machine can take longer than 1 s
        pool.step_timeout = 1.0
        t0 = time.monotonic()
        out = pool.step({0: "look", 1: "sleep 60", 2: "look", 3: "look"})  # worker 1 holds slots 1 and 3
        took = time.monotonic() - t0
        assert took < 10, f"the pool waited {took:.1f}s on a hung worker"
        assert out[1] == {"error": "env worker timed out"} and out[3] == {"error": "env worker timed out"}
        assert out[0]["observation"] == "a step 1" and out[2]["observation"] == "c step 1"
        assert pool.stats["workers_replaced"] == 1 and pool.stats["env_failures"] == 2
        pool.step_timeout = 60
        new = pool.worker_pids()
        assert new[0] == pids[0] and new[1] != pids[1] and not _alive(pids[1])
        # the replacement has no games: stepping its old slots is a per-slot error, not a crash or a hang
        out = pool.step({0: "look", 1: "look"})
        assert out[0]["observation"] == "a step 2" and "error" in out[1]
        assert pool.stats["workers_replaced"] == 1
        states = pool.reset(["e", "f", "g", "h"])
        assert all("error" not in s for s in states)
        assert [s["observation"].split()[3] for s in states] == [str(new[i % 2]) for i in range(4)]


def test_hung_worker_is_caught_by_non_blocking_polls():
    """The rollout loop polls with timeout 0 once per engine step; the pool then checks the deadlines a few times
    a second (not on every call), so a hung worker is still replaced soon after its deadline, and the others'
    answers come back meanwhile."""
    with EnvPool("tests.test_env:make_fake_game", num_workers=2, reset_timeout=60, step_timeout=60) as pool:
        pool.reset(["a", "b"])
        pool.step_timeout = 1.0
        pool.submit(0, "step", "sleep 0.3")
        pool.submit(1, "step", "sleep 60")
        t0, got = time.monotonic(), {}
        while len(got) < 2 and time.monotonic() - t0 < 10:
            got.update(pool.poll(timeout=0))
            time.sleep(0.001)
        took = time.monotonic() - t0
        assert got[0]["observation"] == "a step 1" and got[1] == {"error": "env worker timed out"}
        assert 1.0 <= took < 5, f"the hung worker was caught after {took:.1f}s (deadline 1 s, checks every 0.2 s)"
        assert pool.stats["workers_replaced"] == 1


def test_broken_game_and_dying_reset_are_contained():
    with EnvPool("tests.test_env:make_fake_game", num_workers=2, reset_timeout=30, step_timeout=5) as pool:
        pool.reset(["a", "b"])
        out = pool.step({0: "raise", 1: "look"})  # an exception in a game: that slot only, worker kept
        assert out[0]["error"] == "ValueError: this game is broken" and "traceback" in out[0]
        assert out[1]["observation"] == "b step 1" and pool.stats["workers_replaced"] == 0
        # a worker that exits during reset: its slots fail, the other worker's slots start
        states = pool.reset(["exit-on-reset", "x", "y", "z"])
        assert states[0]["error"].startswith("env worker died") and states[2] == states[0]
        assert [s.get("observation", "").split()[:2] for s in states[1::2]] == [["start", "x"], ["start", "z"]]
        assert pool.stats["workers_replaced"] == 1 and pool.stats["resets"] == 6
        assert all("error" not in s for s in pool.reset(["p", "q", "r", "s"]))


def test_worker_dying_while_idle_is_replaced_at_the_next_poll():
    """The pool's one selector watches idle workers too: one that dies between commands is replaced as soon as the
    loop waits on the others (its games answer 'lost'), not left for a later step to trip over."""
    with EnvPool("tests.test_env:make_fake_game", num_workers=2, reset_timeout=60, step_timeout=60) as pool:
        pool.reset(["a", "b", "c", "d"])  # worker 0: slots 0, 2; worker 1: slots 1, 3
        pids = pool.worker_pids()
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        out = pool.step({0: "sleep 0.5", 2: "look"})  # only worker 0 is asked; the wait sees worker 1's socket close
        assert time.monotonic() - t0 < 10
        assert out[0]["observation"] == "a step 1" and out[2]["observation"] == "c step 1"
        assert pool.stats["workers_replaced"] == 1 and not _alive(pids[1])
        out = pool.step({1: "look", 3: "look", 0: "look"})
        assert out[1]["error"].startswith("env worker died") and out[3] == out[1]
        assert out[0]["observation"] == "a step 2" and pool.stats["workers_replaced"] == 1
        # nothing pending: a poll with a timeout waits that long and returns nothing (no spinning on a closed socket)
        t0 = time.monotonic()
        assert pool.poll(timeout=0.2) == [] and time.monotonic() - t0 < 1
        assert all("error" not in s for s in pool.reset(["p", "q", "r", "s"]))
