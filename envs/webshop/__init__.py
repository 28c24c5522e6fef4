"""WebShop (Yao et al. 2022, MIT): a simulated shopping site driven by text, over the official data files.

The agent reads a shopping instruction, searches a catalog of 1,000 real products, opens items, picks options
and buys; the purchase is scored in [0, 1] against the goal (scoring.py) and a score of 1.0 is a win, rewarded
10. There is no WebShop package to install: the site is rebuilt here from the original's code and templates
(princeton-nlp/WebShop, web_agent_site/), reading its files:

    $WEBSHOP_DATA/items_shuffle_1000.json   the catalog (4.4 MB; setup.sh -d small, or a Hugging Face mirror)
    $WEBSHOP_DATA/items_ins_v2_1000.json    attributes per asin, instructions for 415 products

  data.py    the files, the products as the site shows them, the synthetic goals (6,910 with the real files)
  search.py  BM25 with Lucene's parameters over the catalog, top 50, index cached on disk per catalog sha256
  scoring.py the score of a purchase: attributes, options, price, product type
  site.py    the pages, their clickables, the moves between them, the observation text

One step, worked through (the first step of a session; the prompt is `build_prompt`'s, shortened):

    prompt    ... Your task is to: i need black leather ankle boots for women, size 8, under 60 dollars ...
              Your admissible actions in the current situation are: [ 'search[<your query>]', ... ]
    response  <think>Search for the product first.</think><action>search[black leather ankle boots size 8]</action>
    parsed    ("search[black leather ankle boots size 8]", valid=True, reason="")
    feedback  the results page: [Back to Search] Page 1 (Total results: 50) [Next >] [B07...] <title> $<price> ...
    reward    0.0 (10 when a purchase scores 1.0; an invalid step: -0.1)

Goals 0-499 are the test pool, 500 and up train (verl-agent's split of the original's goal list); goal i is
the same in every worker and every run (data.py says how). Episodes: at most 15 steps; an episode cut
before buying scores 0. Step reward: 10 x (bought with score 1.0) - 0.1 x (invalid step); an invalid step is
one without <think>/<action> tags or with CJK characters. Admissibility is not validity: a well-formed action
that the page cannot do leaves the page as it is.

Summary groups: GROUPS = [] (no fixed columns: the catalog's category names cannot be checked without the
catalog). Each task's `category` is its product's catalog category (e.g. 'beauty'); the generic summary adds
a row per category as it meets them, after the (empty) fixed columns, and All.
"""
import hashlib
import json
import os
import random
import re

from common.paths import shared_dir
from common.records import sha256_file
from common.tasks import seeded_cycle
from envs.webshop.data import DataError, load_catalog
from envs.webshop.scoring import noun_tagger_name, spacy_model
from envs.webshop.search import engine_for
from envs.webshop.site import SEARCH_ACTION, Site
# The validity rule is ALFWorld's (the public code's WebShop projection): action tags, think tags, CJK
from prompts import agent
from prompts.agent import parse_action  # noqa: F401  (interface name)

NAME = "webshop"
ENV_DESCRIPTION = "an agent shopping on WebShop, a simulated e-commerce website driven by text actions"
GROUPS = []
TEST_GOALS = 500  # goals [0, 500) are the test pool, [500, ...) train
SPLITS = ("train", "test")
PRESET = {
    "max_steps": 15, "history": 2, "max_prompt_tokens": 4096, "max_new_tokens": 512, "invalid_penalty": 0.1,
    "tasks_per_update": 16, "group_size": 8, "mini_batch": 64, "micro_batch": 8, "kl_coef": 0.01, "lr": 1e-6,
    "warmup_ratio": 0.0, "updates": 150, "sft_max_length": 12288, "collect_tasks": 180, "rollouts": 8,
    "collect_split": "train", "eval_splits": ["test"], "eval_limit": 128,
    "eval_sizes": {"test": 128},  # docs/paper.md: 128 goals drawn from the 500 test goals
    # bound on the analysis prompt in characters (~4 per token): prompt + answer inside SFT's 12,288 tokens
    # (15 steps of a ~1,500-character results page and a 512-token response would be ~50k characters)
    "analysis_max_chars": 36_000,
    # GRPO's (R - mean) / std as docs/paper.md states it; the public code's WebShop runs use R - mean (--adv-norm mean)
    "adv_norm": "mean_std",
}
WIN_REWARD = 10.0


# ----------------------------------------------------------------------------------------------------
# Data and flags

def default_data_dir():
    return os.environ.get("WEBSHOP_DATA") or shared_dir("webshop")


def default_index_dir():
    return os.environ.get("WEBSHOP_INDEX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "seed",
                                                                 "webshop-index")


def add_args(parser):
    g = parser.add_argument_group("WebShop")
    g.add_argument("--webshop-data", default=default_data_dir(),
                   help="folder with items_shuffle_1000.json and items_ins_v2_1000.json "
                        "($WEBSHOP_DATA, else ../shared/webshop)")
    g.add_argument("--webshop-index-cache", default=default_index_dir(),
                   help="where the BM25 index is cached, one folder per catalog sha256 "
                        "($WEBSHOP_INDEX_CACHE, else ~/.cache/seed/webshop-index)")


def _dirs(args):
    return (os.path.abspath(getattr(args, "webshop_data", None) or default_data_dir()),
            os.path.abspath(getattr(args, "webshop_index_cache", None) or default_index_dir()))


# ----------------------------------------------------------------------------------------------------
# Tasks

def split_indices(split, n_goals):
    if split == "test":
        return list(range(min(TEST_GOALS, n_goals)))
    if split == "train":
        return list(range(TEST_GOALS, n_goals))
    raise ValueError(f"unknown WebShop split {split!r}; expected 'test' or 'train'")


def task_record(index, split, args):
    data_dir, index_cache = _dirs(args)
    goal = load_catalog(data_dir).goals[index]
    return {"task_id": f"webshop/{index}", "split": split, "category": goal["category"], "goal_index": index,
            "asin": goal["asin"], "data_dir": data_dir, "index_cache": index_cache}


def _draw(split, seed, n, args):
    """n goals of a split drawn by a seeded shuffle (cycled through fresh shuffles when n is larger)."""
    pool = split_indices(split, len(load_catalog(_dirs(args)[0]).goals))
    if not pool:
        raise DataError(f"the WebShop {split} split is empty (a catalog with {TEST_GOALS} goals or fewer)")
    return [task_record(i, split, args) for i in seeded_cycle(pool, seed, len(pool) if n is None else n)]


def stage1_tasks(seed, n, args):
    """Stage 1's collection set: n goals (the paper: 180 train goals) of the train split, or of the split
    args.split names (collect.py --split test)."""
    return _draw(getattr(args, "split", None) or "train", seed, n, args)


def rl_tasks(seed, n, args):
    """Stage 2's task stream: n train goals, a seeded shuffle; update u plays [u*T:(u+1)*T]."""
    return _draw("train", seed, n, args)


def eval_tasks(split, seed, limit, args):
    """A split's goals in index order; limit: that many drawn by the seed (the paper: 128 of the 500 test
    goals), kept in index order."""
    pool = split_indices(split, len(load_catalog(_dirs(args)[0]).goals))
    if limit is not None and limit < len(pool):
        pool = sorted(random.Random(seed).sample(pool, limit))
    return [task_record(i, split, args) for i in pool]


REAL_GOALS = 6910  # docs/paper.md: synthetic goals of the real small set


def data_manifest(seed, tasks_per_update, updates, stage1_n, args=None):
    """The preset's data (evaluate.py --data-manifest): the files and their sha256, the goals (per split the
    sha256 of the goals themselves: asin, options, price bound, text), the Stage 1 set and the RL stream,
    with checks against docs/paper.md. args: the parsed flags (--webshop-data), else $WEBSHOP_DATA.
    Returns (printable lines, checks {name: ok}, manifest dict)."""
    from common.records import games_summary
    cat = load_catalog(_dirs(args)[0])
    stage1, stream = stage1_tasks(seed, stage1_n, args), rl_tasks(seed, tasks_per_update * updates, args)
    s1, rl = games_summary(stage1), games_summary(stream)
    rollouts = PRESET["rollouts"]
    splits = {}
    for split in ("test", "train"):
        goals = [cat.goals[i] for i in split_indices(split, len(cat.goals))]
        splits[split] = {"goals": len(goals),
                         "goals_sha256": hashlib.sha256(json.dumps(goals, sort_keys=True).encode()).hexdigest()}
    overlap = len({t["task_id"] for t in stage1} & {t["task_id"] for t in stream})
    lines = [f"catalog     : {cat.catalog_path} ({len(cat.products)} products, sha256 {cat.sha256})",
             f"goals       : {len(cat.goals)} (test {splits['test']['goals']}, train {splits['train']['goals']}); "
             f"goal-list sha256 test {splits['test']['goals_sha256'][:16]}..., "
             f"train {splits['train']['goals_sha256'][:16]}...; noun tagger: {noun_tagger_name()}",
             f"stage 1 set : {s1['count']} train goals ({s1['unique']} distinct) x {rollouts} = "
             f"{s1['count'] * rollouts} trajectories, task-list sha256 {s1['sha256']}",
             f"RL stream   : {rl['count']} ({tasks_per_update} tasks x {updates} updates, {rl['unique']} distinct; "
             f"{overlap} also in the stage 1 set), task-list sha256 {rl['sha256']}"]
    checks = {
        f"goals = {REAL_GOALS} (the real small set)": len(cat.goals) == REAL_GOALS,
        f"test pool = goals 0-{TEST_GOALS - 1}": splits["test"]["goals"] == TEST_GOALS,
        f"stage 1 tasks = {stage1_n}": s1["count"] == stage1_n,
        f"stage 1 trajectories = {stage1_n * rollouts}": s1["count"] * rollouts == stage1_n * rollouts,
        f"RL task instances = {tasks_per_update * updates}": rl["count"] == tasks_per_update * updates,
        "every Stage 1 and RL goal from the train split": all(t["goal_index"] >= TEST_GOALS for t in stage1 + stream),
    }
    manifest = {"catalog": cat.catalog_path, "catalog_sha256": cat.sha256, "attributes": cat.attribute_path,
                "attributes_sha256": sha256_file(cat.attribute_path), "products": len(cat.products),
                "goals": len(cat.goals), "noun_tagger": noun_tagger_name(), **splits,
                "stage1": dict(s1, trajectories=s1["count"] * rollouts, task_ids=[t["task_id"] for t in stage1]),
                "rl_stream": dict(rl, overlap_with_stage1=overlap, task_ids=[t["task_id"] for t in stream])}
    return lines, checks, manifest


# ----------------------------------------------------------------------------------------------------
# One game (runs inside an EnvPool worker)

class WebShopGame:
    """One goal on the site. reset()/step() -> {"observation", "admissible", "done", "won", "score"}
    (+ "task" at reset). The catalog and the search index are loaded once per process."""

    def __init__(self, task):
        self.catalog = load_catalog(task["data_dir"])
        self.engine = engine_for(self.catalog, task.get("index_cache") or default_index_dir())
        spacy_model()  # the noun tagger, when installed, loads with the catalog: not in the middle of a step
        self.goal = self.catalog.goals[task["goal_index"]]
        self.site = None

    def _state(self):
        s = self.site
        return {"observation": s.observation(), "admissible": s.admissible(), "done": s.done,
                "won": s.done and s.score == 1.0, "score": float(s.score)}

    def reset(self):
        self.site = Site(self.catalog, self.engine, self.goal)
        return dict(self._state(), task=self.goal["instruction_text"])

    def step(self, action):
        self.site.step(action)
        return self._state()


def make_game(task):
    """Top-level (picklable) factory for EnvPool workers: EnvPool("envs.webshop:make_game", ...)."""
    return WebShopGame(task)


# ----------------------------------------------------------------------------------------------------
# The prompt

ROLE = "You are an expert autonomous agent operating in the WebShop e-commerce environment."
CLOSING = agent.closing_instruction("take one action for the current step", "one admissible action",
                                    weigh=" and which admissible action best advances the shopping goal")


def build_prompt(task, observation, admissible, step, history, skill=None):
    """The user message of `step` (1-based). history: the last k step records, oldest first (their
    `observation` and `executed`). skill: None (plain) or the episode skill, whose block goes right after
    the task line; plain and skill prompts differ by exactly that block."""
    block = agent.skill_block(skill) if skill else ""
    head = f"{ROLE}\nYour task is to: {task}\n{block}"
    tail = agent.admissible_actions(admissible, bracket_lines=True) + CLOSING  # '[' and ']' on lines of their own
    if step == 1 or not history:
        return f"{head}Your current observation is: {observation}\n{tail}"
    return head + agent.recent_steps([(h["observation"], h["executed"]) for h in history], step, observation) + tail


# ----------------------------------------------------------------------------------------------------
# Parsing and reward
# parse_action is prompts/agent.py's (the public code's tag rule, shared with ALFWorld).

def is_admissible(action, admissible):
    """Whether the action is one the page offers: search[...] with a query where 'search[<your query>]' is
    listed, else the exact click. For the inadmissible-rate metric only."""
    if action.startswith("search[") and action.endswith("]") and len(action) > 8:
        return SEARCH_ACTION in admissible
    return action in admissible


def action_to_execute(text, action, fallback=None):
    """The parsed action; without action tags `fallback` if set, else the last 20 characters of the
    lower-cased response (verl-agent's WebShop projection), which the site ignores unless they happen
    to be an action."""
    return agent.action_to_execute(text, action, fallback, tail_chars=20, blank=None)


def reward(state, valid, invalid_penalty=PRESET["invalid_penalty"]):
    """10 x (bought with score 1.0) - penalty x (invalid step)."""
    return WIN_REWARD * bool(state.get("won")) - invalid_penalty * (not valid)


# ----------------------------------------------------------------------------------------------------
# The scripted expert (CPU demos and tests) and the episode stats

def expert_action(episode):
    """The expert's next action: it knows the goal. Search the goal's instruction (the product's title on
    later searches), open the target product (next pages if needed), pick the goal's options, buy."""
    goal = load_catalog(episode["data_dir"]).goals[episode["goal_index"]]
    adm, obs = episode["_admissible"], episode["_obs"]
    done = [s.get("executed", "") for s in episode.get("steps", [])]
    target = f"click[{goal['asin'].lower()}]"
    if SEARCH_ACTION in adm:  # the search page
        words = goal["base_instruction"] if not any(a.startswith("search[") for a in done) else goal["name"]
        return "search[" + " ".join(re.sub(r"[\[\]]", " ", words).split()) + "]"
    if "click[buy now]" in adm:  # an item page: the target's (the last item opened), else back
        catalog = load_catalog(episode["data_dir"])
        items = [i for i, a in enumerate(done) if a.startswith("click[") and a[6:-1].upper() in catalog.by_asin]
        if not items or done[items[-1]] != target:
            return "click[< prev]"
        opened = items[-1] + 1
        for value in goal["goal_options"].values():
            if f"click[{value}]" in adm and f"click[{value}]" not in done[opened:]:
                return f"click[{value}]"
        return "click[buy now]"
    if target in adm:  # a results page that shows the target
        return target
    m = re.search(r"'Page (\d+) \(Total results: (\d+)\)'", obs)
    if "click[next >]" in adm and m and int(m.group(1)) * 10 < int(m.group(2)):
        return "click[next >]"
    if "click[next >]" not in adm:  # a sub-page
        return "click[< prev]"
    return "click[back to search]"


def expert_response(episode):
    """The expert's response text, in the agent's <think>/<action> format."""
    action = expert_action(episode)
    return (f"<think>I know the goal; the next step towards buying it is {action}.</think>\n"
            f"<action>{action}</action>")


def episode_stats(episode):
    """Searches made and clicks on the way to a purchase (an episode that never clicks 'buy now' scores 0)."""
    executed = [str(s.get("executed") or "") for s in episode.get("steps", [])]
    return {"searches": sum(a.startswith("search[") for a in executed),
            "clicks": sum(a.startswith("click[") for a in executed)}
