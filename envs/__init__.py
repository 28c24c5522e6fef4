"""The env interface: one module per benchmark, and the few helpers that pick one from --env.

envs.alfworld  ALFWorld (TextWorld): game lists, deterministic task choice, one game, its prompt and parser
envs.webshop   WebShop (a product catalog with BM25 search): instructions, one shopping session, its reward
envs.search    Search (Search-R1 style retrieval QA): question files, splits, one question, its prompt and parser
envs.retriever the Search env's BM25 retriever server (python -m envs.retriever) and its HTTP client
envs.pool      a batched env interface over worker processes (dead/hung workers replaced)
The run plumbing every stage shares (rollout loop, backends, records, trainer) is the package common/.

One module per benchmark, each exposing the same few names (no base class, no registry: the dict below).
A reader compares two envs side by side: each module's docstring opens with one step worked through (prompt,
response, parsed action, feedback, reward), and its sections come in one order, under the same banners: data
and flags, tasks, one game, the prompt, parsing and reward, the scripted expert and the episode stats. A new env
is one more module with these names:

  NAME                 "alfworld" | ...
  PRESET               the paper's settings for this env (docs/paper.md, Per-env settings); every script's defaults
  GROUPS               the summary columns, in report order; each task's `category` is one of them
  SPLITS               the split names (collect.py --split, evaluate.py --splits)
  ENV_DESCRIPTION      how the analysis prompt names the env
  add_args(parser)     the env's own flags (data paths, service URLs); may add none
  stage1_tasks(seed, n, args)            Stage 1's collection set (n train tasks, or of args.split)
  rl_tasks(seed, n, args)                Stage 2's task stream (n train tasks, seeded shuffle)
  eval_tasks(split, seed, limit, args)   evaluation tasks of a split (limit: as the env defines it)
  make_game(task)      in an env worker process: an object with reset() -> state and step(action) -> state,
                       state = {observation, admissible, done, won, score}; reset's state also has `task`
  build_prompt(task, observation, admissible, step, history, skill=None)   the agent's user message
  parse_action(text, admissible, require_think=True)   -> (action, valid, reason)
  is_admissible(action, admissible)      whether the action is one the env offers (a metric; None: n/a)
  action_to_execute(text, action, fallback=None)  what the env runs for a step
  reward(state, valid, invalid_penalty)  the step reward
  expert_response(episode)               a scripted expert's next response (CPU demos and tests)
  episode_stats(episode)                 the env's own diagnostics of a played episode ({name: number};
                                         seed_rl.py logs their means as env/<name>); may be {}
  data_manifest(args)                     the preset's data: counts and sha256 of the task lists
"""
import argparse
import importlib
import sys

ENVS = {"alfworld": "envs.alfworld", "webshop": "envs.webshop", "search": "envs.search"}


def load_env(name):
    """The env module for a name; an unknown name is a one-line error listing the known ones."""
    if name not in ENVS:
        sys.exit(f"unknown env {name!r}; known envs: {', '.join(ENVS)}")
    return importlib.import_module(ENVS[name])


def env_from_argv(argv=None, default="alfworld"):
    """Pre-parse --env, so that a script can build its parser with that env's preset as the defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=default)
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    return load_env(known.env)


def add_env_arg(parser, env):
    """The --env flag itself (already pre-parsed: this only documents it in --help)."""
    parser.add_argument("--env", default=env.NAME, choices=list(ENVS),
                        help="benchmark; every default below is this env's paper preset")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the docstring's commands as written and every flag's default."""


def env_parser(description, env, group="env"):
    """A script's parser (HelpFormatter) and its first argument group, which holds --env: collect.py's,
    evaluate.py's and seed_rl.py's flags start the same way."""
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    g = parser.add_argument_group(group)
    add_env_arg(g, env)
    return parser, g


def require_split(env, flag, split):
    """A split the env does not have is refused in one line naming the env and its splits (each env module
    lists them in SPLITS), before any data is read."""
    if split not in env.SPLITS:
        sys.exit(f"{flag} {split!r}: the {env.NAME} env has the splits {', '.join(env.SPLITS)}")


def require_positive(args, *names):
    """Counts of 0 or less make a run that plays or trains nothing: refuse them, in one line naming each."""
    bad = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names
           if getattr(args, n) is not None and getattr(args, n) < 1]
    if bad:
        sys.exit(f"{', '.join(bad)}: must be 1 or more (with 0 nothing is played or trained)")


def refuse_unused(parser, args, names, why):
    """Flags set (to other than their default) where they would change nothing are refused in one line naming
    each and the setting that makes them moot (issue 29: no flag silently ignored), before any model loads."""
    bad = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) != parser.get_default(n)]
    if bad:
        sys.exit(f"{', '.join(bad)}: {why}, so {'it' if len(bad) == 1 else 'they'} would change nothing")
