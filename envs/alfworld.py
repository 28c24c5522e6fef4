"""ALFWorld (TextWorld engine, the `alfworld` package): game lists, deterministic task choice, one game.

Game files come from alfworld's own `AlfredTWEnv.collect_game_files` (the solvable games of a split, as
its trainer sees them); each game is played through TextWorld with alfworld's wrappers, exactly as
`AlfredTWEnv.init_env` builds its envs (AlfredDemangler without shuffling, AlfredInfos), one game per
episode slot of an `EnvPool` worker.
"""
import functools
import json
import os
import random
import sys

# SPEC.md's reporting order; keys are alfworld's task_type names.
TASK_TYPES = {
    "pick_and_place_simple": "Pick",
    "look_at_obj_in_light": "Look",
    "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat",
    "pick_cool_then_place_in_recep": "Cool",
    "pick_two_obj_and_place": "Pick2",
}
TYPE_ORDER = list(TASK_TYPES.values())
SPLITS = {"train": "train", "valid_seen": "eval_in_distribution", "valid_unseen": "eval_out_of_distribution"}
INVALID_PENALTY = 0.1
WIN_REWARD = 10.0


def data_dir():
    d = os.path.abspath(os.environ.get("ALFWORLD_DATA", os.path.expanduser("~/.cache/alfworld")))
    if not os.path.isdir(os.path.join(d, "json_2.1.1")):
        raise FileNotFoundError(
            f"ALFWorld games not found under {d}/json_2.1.1. Run `alfworld-download` (internet) or unpack "
            f"../shared/alfworld/alfworld-data.tar.xz and set ALFWORLD_DATA (see README).")
    return d


def alfworld_config():
    """The part of alfworld's base_config.yaml that AlfredTWEnv reads, built here because
    alfworld.agents.modules.generic.load_config imports torch and parses argv."""
    d = data_dir()
    return {
        "dataset": {"data_path": f"{d}/json_2.1.1/train", "eval_id_data_path": f"{d}/json_2.1.1/valid_seen",
                    "eval_ood_data_path": f"{d}/json_2.1.1/valid_unseen", "num_train_games": -1,
                    "num_eval_games": -1},
        "logic": {"domain": f"{d}/logic/alfred.pddl", "grammar": f"{d}/logic/alfred.twl2"},
        "env": {"type": "AlfredTWEnv", "goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6],
                "domain_randomization": False, "expert_type": "handcoded"},
        "general": {"training_method": "dagger"},
    }


def task_type_of(game_file):
    folder = os.path.basename(os.path.dirname(os.path.dirname(game_file)))  # <type>-<obj>-...-<scene>
    return folder.split("-")[0]


@functools.lru_cache(maxsize=None)
def list_games(split):
    """Sorted solvable game files of a split (os.walk order is filesystem-dependent, so sort)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # AlfredTWEnv prints and draws a tqdm bar
    stderr, sys.stderr = sys.stderr, sys.stdout
    try:
        env = AlfredTWEnv(alfworld_config(), train_eval=SPLITS[split])
    finally:
        sys.stdout.close()
        sys.stdout, sys.stderr = stdout, stderr
    return tuple(sorted(env.game_files))


def task_id_of(game_file):
    """'<split>/<task folder>/<trial>': stable across machines (relative to ALFWORLD_DATA)."""
    parts = os.path.normpath(game_file).split(os.sep)
    return "/".join(parts[-4:-1])


def game_record(game_file, split):
    return {"task_id": task_id_of(game_file), "game_file": game_file, "task_type": task_type_of(game_file),
            "split": split}


def select_games(split, seed, *, tasks_per_type=None, n=None):
    """Deterministic task choice. tasks_per_type: N games of each of the 6 types (Stage 1: 30), in type
    order; n: the first n games of a seeded shuffle (n=None: all, shuffled); neither: all, sorted."""
    games = list(list_games(split))
    rng = random.Random(seed)
    if tasks_per_type is not None:
        out = []
        for t in TASK_TYPES:
            of_type = [g for g in games if task_type_of(g) == t]
            rng.shuffle(of_type)
            out += of_type[:tasks_per_type]
        return [game_record(g, split) for g in out]
    if n is not None:
        rng.shuffle(games)
        games = games[:n]
    return [game_record(g, split) for g in games]


def rl_task_stream(seed, tasks_per_update, updates):
    """Stage 2's task instances: tasks_per_update x updates games drawn from the train split (the paper:
    16 x 150 = 2,400), a seeded shuffle; update u plays stream[u*tasks_per_update:(u+1)*tasks_per_update]."""
    return select_games("train", seed, n=tasks_per_update * updates)


def walkthrough(game_file):
    """The game's stored expert walkthrough (a list of commands that wins it)."""
    with open(game_file) as f:
        return list(json.load(f).get("walkthrough", []))


class AlfworldGame:
    """One ALFWorld game in a worker process. reset()/step() return
    {"observation", "admissible" (without 'help'), "won", "done"}."""

    def __init__(self, game_file):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        self.env = textworld.start(game_file, request_infos=infos,
                                   wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])

    @staticmethod
    def _state(gs, done):
        return {"observation": gs.feedback.strip(),
                "admissible": [a for a in gs.admissible_commands if a != "help"],
                "won": bool(gs.won), "done": bool(done or gs.won)}

    def reset(self):
        return self._state(self.env.reset(), False)

    def step(self, action):
        gs, _, done = self.env.step(action)
        return self._state(gs, done)


def make_alfworld_game(game_file):
    """Top-level (picklable) factory for EnvPool workers."""
    return AlfworldGame(game_file)
