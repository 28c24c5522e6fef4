"""ALFWorld (TextWorld engine, the `alfworld` package): the env module of the first benchmark.

The same names as every env module (envs/__init__.py): the paper preset, the task lists, one game played in an
env worker, the agent prompt, the action parser, the step reward, the summary columns, a scripted expert.

One step, worked through (a pick-and-place game; the prompt is `build_prompt`'s, shortened):

    prompt    ... Your task is to: put a clean apple in fridge. ... Your admissible actions in the current
              situation are: ['go to countertop 1', 'go to fridge 1', ..., 'look', 'inventory'] ...
    response  <think>The apple may be in the fridge.</think><action>go to fridge 1</action>
    parsed    ("go to fridge 1", valid=True, reason="")   (parse_action; action_to_execute runs it as is)
    feedback  You arrive at fridge 1. The fridge 1 is closed.
    reward    0.0 (+10 at the step the game is won; an invalid step: -0.1)

Game files are the ones alfworld's own `AlfredTWEnv.collect_game_files` lists (the solvable games of a split,
as its trainer sees them; `list_games` applies its rule); each game is played through TextWorld with alfworld's
wrappers, exactly as `AlfredTWEnv.init_env` builds its envs (AlfredDemangler without shuffling, AlfredInfos), one
game per episode slot of an `EnvPool` worker.
"""
import functools
import json
import os
import random
import re
import sys

from prompts.agent import action_to_execute, parse_action  # noqa: F401  (interface names)
from prompts.agent import admissible_actions, closing_instruction, recent_steps, skill_block

NAME = "alfworld"
# docs/paper.md, Per-env settings, ALFWorld column (+ Stage 1 and evaluation). Every script's defaults come from here.
PRESET = dict(max_steps=30, history=5, max_prompt_tokens=2048, max_new_tokens=512, invalid_penalty=0.1,
              tasks_per_update=16, group_size=8, mini_batch=256, micro_batch=32, kl_coef=0.01, lr=1e-6,
              warmup_ratio=0.0, updates=150, sft_max_length=8192, collect_tasks=180, rollouts=8,
              collect_split="train", eval_splits=["valid_seen", "valid_unseen"], eval_limit=None,
              eval_sizes={"valid_seen": 140, "valid_unseen": 134},
              adv_norm="mean_std",  # GRPO's (R - mean) / std (the public code's WebShop runs use R - mean)
              # bound on the analysis prompt in characters (~4 per token): keeps prompt + answer inside
              # SFT's 8,192 tokens (a 30-step episode of 512-token responses would be ~16k tokens)
              analysis_max_chars=24_000)
WIN_REWARD = 10.0
INVALID_PENALTY = PRESET["invalid_penalty"]
ENV_DESCRIPTION = "an agent acting in the ALFRED text environment"

# The paper's reporting order (docs/paper.md); keys are alfworld's task_type names, values the summary columns.
TASK_TYPES = {
    "pick_and_place_simple": "Pick",
    "look_at_obj_in_light": "Look",
    "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat",
    "pick_cool_then_place_in_recep": "Cool",
    "pick_two_obj_and_place": "Pick2",
}
TYPE_ORDER = GROUPS = list(TASK_TYPES.values())
SPLITS = {"train": "train", "valid_seen": "eval_in_distribution", "valid_unseen": "eval_out_of_distribution"}


# ----------------------------------------------------------------------------------------------------
# Data and flags

def add_args(parser):
    """ALFWorld needs no flags of its own: the games are found through $ALFWORLD_DATA (see data_dir)."""


DATA_HOME = os.path.expanduser("~/.cache/alfworld")  # where `alfworld-download` writes (alfworld's own default)


def _has_games(d):
    return os.path.isdir(os.path.join(d, "json_2.1.1"))


def data_dir():
    """The ALFWorld games: $ALFWORLD_DATA if set, else ~/.cache/alfworld, the one location the README, the tests
    and CI use. When ~/.cache/alfworld lacks them and the offline archive lies beside the checkout
    (../shared/alfworld/alfworld-data.tar.xz, or under $SHARED), it is unpacked there on first use (a few
    seconds, once); otherwise the error names the one command that gets them."""
    chosen = os.environ.get("ALFWORLD_DATA")
    # importing alfworld sets ALFWORLD_DATA to its own default, which is ours: the same as unset
    explicit = bool(chosen) and os.path.abspath(os.path.expanduser(chosen)) != DATA_HOME
    d = os.path.abspath(os.path.expanduser(chosen)) if explicit else DATA_HOME
    if _has_games(d):
        return d
    if explicit:
        sys.exit(f"ALFWorld games not found: $ALFWORLD_DATA={d} has no json_2.1.1/. Unset ALFWORLD_DATA to use "
                 f"{DATA_HOME}, or fill this folder: `alfworld-download --data-dir {d}`")
    from common.paths import shared_dir
    archive = os.path.join(shared_dir(), "alfworld", "alfworld-data.tar.xz")
    if not os.path.isfile(archive):
        sys.exit(f"ALFWorld games not found in {d}. Get them with `alfworld-download` (internet; it writes "
                 f"{d}), or put the offline archive at {archive}")
    _unpack(archive, d)
    return d


def _unpack(archive, d):
    """Unpack the archive into d, safe against processes doing the same at once (torchrun ranks, pytest
    workers): under a lock, into a temporary folder, then json_2.1.1/ moved in last (its presence is what
    marks the games complete)."""
    import fcntl
    import shutil
    import tarfile
    os.makedirs(d, exist_ok=True)
    with open(d + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _has_games(d):  # another process unpacked them while this one waited
            return
        print(f"[alfworld] unpacking {archive} into {d} (once)", file=sys.stderr, flush=True)
        tmp = f"{d}.unpacking-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(archive) as t:
            t.extractall(tmp, filter="data")
        for name in sorted(os.listdir(tmp), key=lambda n: n == "json_2.1.1"):
            shutil.rmtree(os.path.join(d, name), ignore_errors=True)
            os.rename(os.path.join(tmp, name), os.path.join(d, name))
        os.rmdir(tmp)


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


# ----------------------------------------------------------------------------------------------------
# Tasks

def task_type_of(game_file):
    folder = os.path.basename(os.path.dirname(os.path.dirname(game_file)))  # <type>-<obj>-...-<scene>
    return folder.split("-")[0]


@functools.lru_cache(maxsize=None)
def list_games(split):
    """Sorted solvable game files of a split (os.walk order is filesystem-dependent, so sort).

    alfworld's own rule (`AlfredTWEnv.collect_game_files`, with alfworld_config's settings), walked here: building
    AlfredTWEnv for it imports TextWorld and alfworld's agents (~1 s of every script's start-up, where the games
    themselves are played in env workers). A folder with traj_data.json is a game unless its path names
    'movable' or 'Sliced', its task type is not one of the six, it has no game.tw-pddl, or that file is not
    marked solvable. tests/test_env.py checks the lists equal AlfredTWEnv's for every split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    dataset = alfworld_config()["dataset"]
    root = os.path.expandvars(dataset[{"train": "data_path", "valid_seen": "eval_id_data_path",
                                       "valid_unseen": "eval_ood_data_path"}[split]])
    games = []
    for folder, _, files in os.walk(root):
        if "traj_data.json" not in files or "movable" in folder or "Sliced" in folder:
            continue
        with open(os.path.join(folder, "traj_data.json")) as f:
            if json.load(f)["task_type"] not in TASK_TYPES:
                continue
        game_file = os.path.join(folder, "game.tw-pddl")
        if not os.path.exists(game_file):
            continue
        with open(game_file) as f:
            if json.load(f).get("solvable"):
                games.append(game_file)
    return tuple(sorted(games))


def task_id_of(game_file):
    """'<split>/<task folder>/<trial>': stable across machines (relative to ALFWORLD_DATA)."""
    parts = os.path.normpath(game_file).split(os.sep)
    return "/".join(parts[-4:-1])


def game_record(game_file, split):
    """A task: what the worker needs (game_file) and what the summaries group by (category)."""
    t = task_type_of(game_file)
    return {"task_id": task_id_of(game_file), "game_file": game_file, "task_type": t, "split": split,
            "category": TASK_TYPES.get(t, t)}


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


def stage1_tasks(seed, n, args=None):
    """Stage 1's set: n tasks, n/6 of each type (the paper: 30 per type x 6 = 180), from the train split
    unless args.split names another."""
    return select_games(getattr(args, "split", None) or "train", seed, tasks_per_type=-(-n // len(TASK_TYPES)))


def rl_tasks(seed, n, args=None):
    """Stage 2's task instances: n games drawn from the train split (the paper: 16 x 150 = 2,400), a seeded
    shuffle; update u plays stream[u*tasks_per_update:(u+1)*tasks_per_update]."""
    return select_games("train", seed, n=n)


def rl_task_stream(seed, tasks_per_update, updates):
    return rl_tasks(seed, tasks_per_update * updates)


def eval_tasks(split, seed, limit=None, args=None):
    """All games of the split (sorted), or `limit` of them: seeded picks of each type taken in turn
    (Pick, Look, Clean, Heat, Cool, Pick2, Pick, ...) so a small subset still covers every type."""
    if limit is None:
        return select_games(split, seed)
    by_type = {}
    for g in select_games(split, seed, tasks_per_type=-(-limit // len(TASK_TYPES))):
        by_type.setdefault(g["task_type"], []).append(g)
    out = []
    for i in range(max(map(len, by_type.values()), default=0)):  # an empty split: no task
        out += [by_type[t][i] for t in TASK_TYPES if i < len(by_type.get(t, []))]
    return out[:limit]


def data_manifest(seed, tasks_per_update, updates, stage1_n, args=None):
    """The preset's data: the Stage 1 task set and the RL task stream, per type, with checks against the
    paper's Table 3 (docs/paper.md, Per-env settings). Returns (printable lines, checks {name: ok}, manifest dict)."""
    from common.records import games_summary
    stage1, stream = stage1_tasks(seed, stage1_n), rl_tasks(seed, tasks_per_update * updates)
    s1, rl = games_summary(stage1), games_summary(stream)
    rollouts = PRESET["rollouts"]
    per_type = stage1_n // len(TASK_TYPES)
    lines = [f"{'type':<6} {'stage1 tasks':>12} {'x' + str(rollouts) + ' trajectories':>16} {'RL stream':>10}"]
    for t, name in TASK_TYPES.items():
        lines.append(f"{name:<6} {s1['per_type'].get(t, 0):>12} {s1['per_type'].get(t, 0) * rollouts:>16} "
                     f"{rl['per_type'].get(t, 0):>10}")
    lines.append(f"{'total':<6} {s1['count']:>12} {s1['count'] * rollouts:>16} {rl['count']:>10}")
    overlap = len({g["task_id"] for g in stage1} & {g["task_id"] for g in stream})
    lines += [f"stage 1 set : splits {s1['per_split']}, {s1['unique']} distinct, game-list sha256 {s1['sha256']}",
              f"RL stream   : splits {rl['per_split']}, {rl['unique']} distinct, game-list sha256 {rl['sha256']} "
              f"({tasks_per_update} tasks x {updates} updates; {overlap} of its games are also in the stage 1 set)"]
    checks = {
        f"stage 1 tasks = {stage1_n} ({per_type} per type)":
            s1["count"] == stage1_n and all(s1["per_type"].get(t) == per_type for t in TASK_TYPES),
        f"stage 1 trajectories = {stage1_n * rollouts}": s1["count"] * rollouts == stage1_n * rollouts,
        f"RL task instances = {tasks_per_update * updates}": rl["count"] == tasks_per_update * updates,
        # the split as the game file's own folder says (task ids are '<split>/<task>/<trial>'), not a label
        "every game from the train split": {g["task_id"].split("/")[0] for g in stage1 + stream} == {"train"},
    }
    manifest = {"stage1": dict(s1, trajectories=s1["count"] * rollouts, task_ids=[g["task_id"] for g in stage1]),
                "rl_stream": dict(rl, overlap_with_stage1=overlap, task_ids=[g["task_id"] for g in stream])}
    return lines, checks, manifest


# ----------------------------------------------------------------------------------------------------
# One game (runs inside an EnvPool worker)

def memoize_translation(maxsize=8):
    """Translate each game's PDDL once per worker process. TextWorld builds a game's planning state twice (once when
    the game loads, again at reset) and each build runs fast-downward's PDDL -> SAS translation twice (plain and
    optimized): ~1 s of Python each, ~70% of a reset's ~3 s of CPU. The translation is a pure function of its text
    inputs and TextWorld only reads what it returns, so the same inputs share one result: a new game then translates
    twice instead of four times, and the same game again (a GRPO group's episodes share a worker) not at all.
    maxsize counts translations, two per game: the last 4 games, ~11 MiB each, which is all the reuse there is (a
    worker holds a few games of an update at a time). tests/test_env.py plays memoized and fresh games side by side."""
    import fast_downward
    if not hasattr(fast_downward.pddl2sas, "cache_info"):  # textworld calls it as fast_downward.pddl2sas(...)
        fast_downward.pddl2sas = functools.lru_cache(maxsize=maxsize)(fast_downward.pddl2sas)
    return fast_downward.pddl2sas


class AlfworldGame:
    """One ALFWorld game in a worker process. reset()/step() return
    {"observation", "admissible" (without 'help'), "won", "done", "score"}; reset also "task"."""

    def __init__(self, game_file):
        memoize_translation()
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        self.env = textworld.start(game_file, request_infos=infos,
                                   wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])

    @staticmethod
    def _state(gs, done):
        return {"observation": gs.feedback.strip(),
                "admissible": [a for a in gs.admissible_commands if a != "help"],
                "won": bool(gs.won), "done": bool(done or gs.won), "score": float(bool(gs.won))}

    def reset(self):
        state = self._state(self.env.reset(), False)
        state["task"] = extract_task(state["observation"])
        return state

    def step(self, action):
        gs, _, done = self.env.step(action)
        return self._state(gs, done)


def make_game(task):
    """Top-level (picklable) factory for EnvPool workers: a task dict (or a game file path)."""
    return AlfworldGame(task["game_file"] if isinstance(task, dict) else task)


# ----------------------------------------------------------------------------------------------------
# The prompt
# docs/paper.md, ALFWorld protocol. Every step of an episode is its own (prompt, response) sample. The prompt
# is one user message:
#   step 1      role, current observation, admissible actions, closing instruction
#   step t > 1  role + task line, steps taken so far, the last k (observation, action) pairs, current step
#               number and observation, admissible actions, closing instruction
# (the history, the admissible actions and the closing instruction: prompts/agent.py, shared with WebShop)
# The skill-aware "teacher" prompt of Stage 2 is the same prompt with an episode-skill block inserted right
# after the task line (at step 1 that line is inside the observation, as in the public code's
# seed/prompting.py; an observation without one gets the block before the closing instruction).
# Both prompts are built by the one function below, so they differ by exactly that block.

ROLE = "You are an expert agent operating in the ALFRED embodied environment."
CLOSING = closing_instruction("act", "exactly one admissible action for this step")
TASK_LINE_RE = re.compile(r"^.*Your task is to:.*$", re.MULTILINE)


def build_agent_prompt(observation, admissible, *, step, task=None, history=(), skill=None):
    """The user message for one step.

    step: 1-based index of the step being decided. history: the (observation, action) pairs of the most
    recent earlier steps that fit (oldest first; the caller chooses how many). skill: None for the plain
    prompt, a string for the skill-augmented teacher prompt.
    """
    actions = admissible_actions(admissible, bracket_lines=False)  # one quoted action per line, inside [...]
    block = skill_block(skill) if skill else ""
    if step == 1:  # the task line is inside the first observation: the block goes right after it, if it is there
        current = f"Your current observation is: {observation}\n"
        task_line = TASK_LINE_RE.search(current)
        if block and task_line:
            current, block = current[:task_line.end() + 1] + block + current[task_line.end() + 1:], ""
        return f"{ROLE}\n{current}{actions}{block}{CLOSING}"
    return f"{ROLE} Your task is to: {task}\n{block}{recent_steps(history, step, observation)}{actions}{CLOSING}"


def build_prompt(task, observation, admissible, step, history, skill=None):
    """The interface's prompt: history = the last k step records; an entry is (observation, executed action)."""
    return build_agent_prompt(observation, admissible, step=step, task=task,
                              history=[(s["observation"], s["executed"]) for s in history], skill=skill)


def extract_task(first_observation):
    """ALFWorld's first observation ends with 'Your task is to: <task>'; '' when absent."""
    m = re.search(r"Your task is to:\s*(.+)", first_observation)
    return m.group(1).strip().rstrip(".") + "." if m else ""


# ----------------------------------------------------------------------------------------------------
# Parsing and reward
# parse_action and action_to_execute are prompts/agent.py's (the public code's tag rule, shared with WebShop).

def is_admissible(action, admissible):
    """Whether the parsed action is one of the env's admissible commands (its own metric; not validity)."""
    return action in admissible


def reward(state, valid, invalid_penalty=INVALID_PENALTY):
    """+10 at the step the game is won; an invalid step costs the penalty (docs/paper.md)."""
    return WIN_REWARD * state["won"] - invalid_penalty * (not valid)


# ----------------------------------------------------------------------------------------------------
# The scripted expert (CPU demos and tests) and the episode stats

def walkthrough(game_file):
    """The game's stored expert walkthrough (a list of commands that wins it)."""
    with open(game_file) as f:
        return list(json.load(f).get("walkthrough", []))


@functools.lru_cache(maxsize=4096)
def _plan(game_file):
    return tuple(walkthrough(game_file))


def expert_response(episode):
    """The next command of the game's stored walkthrough, in the agent's <think>/<action> format. The thought
    names only what the agent can see (the task and the action), never the plan's length or position, so the
    episodes can be behaviour-cloned (sft.py --bc-data) without teaching the policy to cite a plan it lacks."""
    plan, t = _plan(episode["game_file"]), len(episode["steps"])
    action = plan[t] if t < len(plan) else "look"
    task = (episode.get("task") or "finish the task").rstrip(".")
    return f"<think>To {task}, my next step is: {action}.</think>\n<action>{action}</action>"


def episode_stats(episode):
    """ALFWorld's diagnostics are generic ones (success per task type, inadmissible share: seed_rl.py logs them
    for every env), so none of its own."""
    return {}
