"""Search (Search-R1 style retrieval QA): one question per episode, answered with the help of a retriever.

Each turn the agent reasons in <think> and then EITHER searches (`<search>query</search>`, answered with the
retriever's top 3 passages inside <information>...</information>) OR answers (`<answer>text</answer>`, which
ends the episode). At most 4 turns; a search on the last turn ends the episode unanswered. Reward: exact match
(SQuAD normalisation) of the answer against any gold answer, 1 or 0, minus 0.01 for an invalid step.

One turn, worked through (question from ../shared/search/hotpotqa500; the prompt is `build_prompt`'s, shortened):

    prompt    ... Question: Party Never Ends is an album by the Romanian singer who studied at what college?
              This is your first step: nothing has been searched yet. You are now at step 1. ...
    response  <think>I need the singer of Party Never Ends.</think>
              <search>Party Never Ends Romanian singer</search>
    parsed    ("search[Party Never Ends Romanian singer]", valid=True, reason="")
    feedback  <information>Doc 1: (Title: "Party Never Ends") Party Never Ends is the third studio album ...
              Doc 2: (Title: "Caliente (Inna song)") "Caliente" is a song recorded by Romanian singer Inna ...
              Doc 3: ...</information>
    reward    0.0 (a search scores nothing; `<answer>Ovidius University</answer>` later would score 1.0)

The passage format follows Search-R1's `_passages2string` ("Doc i(Title: <first line>) <rest>"), with the
"Doc i:" label docs/paper.md names. The retriever is an HTTP service (envs/retriever.py: ours is BM25 over a
wiki-18 JSONL corpus; a user's e5 server over the full wiki-18 dump works by URL).

Data (FlashRAG JSONL rows {"id", "question", "golden_answers", "data_source"}, .jsonl or .jsonl.xz, or
Search-R1 parquet rows {"data_source", "reward_model": {"ground_truth": {"target": [...]}}, ...}; parquet
needs the optional `pyarrow`). Splits:
    train  the --train-file (default ../shared/search/hotpotqa500) minus the val questions
    val    --val-size questions of the train file held out by a fixed seed (not the run's seed)
    test   the seven --test-files (default ../shared/search/test/<source>.jsonl.xz), one GROUPS column each
"""
import argparse
import functools
import os
import random
import re
import string

from common.paths import shared_dir
from common.tasks import seeded_cycle
from envs.retriever import RetrieverError, check_retriever, json_lines, retrieve
from prompts.agent import skill_block

NAME = "search"
# docs/paper.md, Per-env settings, Search column (Search-R1's settings as the paper's code runs them).
PRESET = dict(max_steps=4, history=4, max_prompt_tokens=4096, max_new_tokens=512, invalid_penalty=0.01,
              tasks_per_update=128, group_size=8, mini_batch=512, micro_batch=16, kl_coef=0.001, lr=1e-6,
              warmup_ratio=0.1, updates=150, sft_max_length=12288, collect_tasks=180, rollouts=8,
              collect_split="train", eval_splits=["test"], eval_limit=None,
              eval_sizes={"test": 51713},  # the paper's 7 test sets; 28,133 of them are in ../shared/search
              # bound on the analysis prompt in characters (~4 per token): a 4-turn episode of 512-token responses
              # and three passages per search is ~5k tokens; 36,000 characters keep prompt + answer inside
              # SFT's 12,288 tokens
              analysis_max_chars=36_000,
              adv_norm="mean_std")  # GRPO's (R - mean) / std (docs/paper.md)
# The seven test sets in Search-R1's reporting order; each task's `category` is its data source.
GROUPS = ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"]
IN_DOMAIN = {"nq", "hotpotqa"}  # the train sources; the other five are out-of-domain
ENV_DESCRIPTION = "an agent answering questions by searching Wikipedia through a retriever (Search-R1 style QA)"

SPLIT_SEED = 20260  # fixed: the val questions never change with the run's --seed, so they never leak into train
SPLITS = ("train", "val", "test")


# ----------------------------------------------------------------------------------------------------
# Data and flags

def default_data_dir():
    """$SEARCH_DATA, else ../shared/search (common/paths.py shared_dir)."""
    return os.environ.get("SEARCH_DATA") or shared_dir("search")


def add_args(parser):
    """The Search flags, on a parser (in their own group) or on the caller's argument group (nesting
    groups is deprecated in argparse)."""
    g = parser.add_argument_group("Search env (retriever and question files)") \
        if isinstance(parser, argparse.ArgumentParser) else parser
    g.add_argument("--retriever-url", default="http://127.0.0.1:8000/retrieve",
                   help="POST endpoint of the retriever (ours: python -m envs.retriever; or Search-R1's e5 server)")
    g.add_argument("--retriever-timeout", type=float, default=10.0, help="seconds per retriever request")
    g.add_argument("--retriever-retries", type=int, default=3,
                   help="retries of a failed request (connection error, timeout, HTTP 5xx) before the "
                        "episode ends as an env failure")
    g.add_argument("--retriever-backoff", type=float, default=0.5,
                   help="seconds before the first retry, doubled for each further one")
    g.add_argument("--retriever-shape", choices=["auto", "queries", "query"], default="auto",
                   help='request body: {"queries": [q]} or {"query": q}; auto tries "queries" and falls back')
    g.add_argument("--topk", type=int, default=3, help="passages shown per search")
    g.add_argument("--search-data", default=default_data_dir(),
                   help="folder with hotpotqa500.jsonl.xz and test/<source>.jsonl.xz (env SEARCH_DATA)")
    g.add_argument("--train-file", default=None,
                   help="train questions, FlashRAG .jsonl[.xz] or Search-R1 .parquet "
                        "(default: <search-data>/hotpotqa500.jsonl.xz)")
    g.add_argument("--val-size", type=int, default=100,
                   help="questions of the train file held out as the val split (fixed seed)")
    g.add_argument("--test-files", nargs="+", default=None,
                   help="test question files (default: <search-data>/test/<source>.jsonl.xz for the 7 sources)")
    g.add_argument("--no-retriever-check", action="store_true",
                   help="do not check at start that the retriever answers (e.g. to only list tasks)")
    # The step protocol: each default is the paper's public code (verl-agent's search projection; README,
    # "Fidelity to the paper's public code"); the other value is this project's earlier, stricter reading.
    g.add_argument("--search-invalid-step", choices=["execute-first", "nothing"], default="execute-first",
                   help="what an invalid turn runs: execute-first = its first block (a search before an answer), "
                        "as the public code; nothing = no search, no answer (the turn is only counted)")
    g.add_argument("--search-empty-block", choices=["valid", "invalid"], default="valid",
                   help="<search></search> or <answer></answer>: valid as the public code (an empty search "
                        "shows no passage, an empty answer is scored), or invalid")
    g.add_argument("--search-stray-tags", choices=["count", "ignore"], default="count",
                   help="count = every opening <search>/<answer> tag counts towards 'both kinds' and 'several "
                        "blocks', a tag mentioned in the reasoning too (the public code); ignore = only "
                        "complete blocks count")
    g.add_argument("--search-empty-gold", choices=["match", "never"], default="match",
                   help="a gold answer that normalises to '' (e.g. 'The', '.'): match = an answer that also "
                        "normalises to '' scores 1, as the public code's em_check; never = such a gold matches "
                        "nothing")
    return parser


def _opt(args, name, default=None):
    """Flag value from an argparse namespace (or None: defaults), so the functions below work without one."""
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


# Question files

class QuestionFileError(ValueError):
    """A question file that cannot be used; the message names the file and the line (or parquet row)."""


def _source_from_name(path):
    """nq.jsonl.xz -> "nq"; .../nq/test.jsonl -> "nq" (FlashRAG's folder layout); else the file stem."""
    stem = os.path.basename(path).split(".")[0]
    if stem in ("train", "test", "dev", "val", "valid"):
        return os.path.basename(os.path.dirname(os.path.abspath(path))) or stem
    return stem


def _answers(value, where):
    if isinstance(value, str):  # a single answer string (some converted sets): one gold answer
        value = [value]
    if hasattr(value, "tolist"):  # a numpy array out of a parquet column
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise QuestionFileError(f"{where}: the gold answers are not a list: {str(value)[:80]!r}")
    answers = [a for a in value if isinstance(a, str) and a.strip()]
    if not answers:
        raise QuestionFileError(f"{where}: empty gold answer list")
    return answers


def _question_from_prompt(prompt):
    """Search-R1 parquet rows without a question column: the text after the prompt's last 'Question:'."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    if isinstance(prompt, str) and "Question:" in prompt:
        return prompt.rsplit("Question:", 1)[1].strip()
    return None


def _row(row, where, default_source, index):
    """One question record {"id", "question", "golden_answers", "data_source"} from a file row."""
    if not isinstance(row, dict):
        raise QuestionFileError(f"{where}: not a JSON object")
    question = row.get("question")
    if question is None:
        question = _question_from_prompt(row.get("prompt"))
    if not isinstance(question, str) or not question.strip():
        raise QuestionFileError(f"{where}: missing field 'question'")
    # (a parquet file has one schema for all rows: a field one row lacks is present there as None)
    if row.get("golden_answers") is not None:
        answers = row["golden_answers"]
    else:
        target = ((row.get("reward_model") or {}).get("ground_truth") or {})
        if not isinstance(target, dict) or target.get("target") is None:
            raise QuestionFileError(f"{where}: missing field 'golden_answers' (FlashRAG) or "
                                    f"'reward_model.ground_truth.target' (Search-R1)")
        answers = target["target"]
    source = row.get("data_source") or default_source
    qid = row.get("id")
    if qid is None:
        qid = (row.get("extra_info") or {}).get("index", index)
    return {"id": str(qid), "question": question.strip(), "golden_answers": _answers(answers, where),
            "data_source": str(source)}


@functools.lru_cache(maxsize=None)
def read_questions(path):
    """Question records of a FlashRAG JSONL (.jsonl / .jsonl.xz) or a Search-R1 parquet file, in file order.
    Raises QuestionFileError naming the line (JSONL) or row (parquet) of the first bad record."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"question file not found: {path} (set --search-data / SEARCH_DATA, or pass "
                                f"--train-file / --test-files)")
    default_source = _source_from_name(path)
    out = []
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # optional dependency: only parquet inputs need it
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow (optional): pip install pyarrow==26.0.1") from None
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            out.append(_row(row, f"{path}: row {i}", default_source, i))
    else:
        for lineno, row in json_lines(path, QuestionFileError):
            out.append(_row(row, f"{path}:{lineno}", default_source, lineno - 1))
    if not out:
        raise QuestionFileError(f"{path}: no questions")
    return tuple(out)


def train_file(args):
    return _opt(args, "train_file") or os.path.join(_opt(args, "search_data", default_data_dir()),
                                                    "hotpotqa500.jsonl.xz")


def test_files(args):
    files = _opt(args, "test_files")
    if files:
        return list(files)
    d = os.path.join(_opt(args, "search_data", default_data_dir()), "test")
    return [next((p for p in (os.path.join(d, f"{s}.jsonl.xz"), os.path.join(d, f"{s}.jsonl"))
                  if os.path.isfile(p)), os.path.join(d, f"{s}.jsonl.xz")) for s in GROUPS]


def split_questions(split, args):
    """The question records of a split (see the module docstring), in file order."""
    if split == "test":
        return [q for path in test_files(args) for q in read_questions(path)]
    if split not in ("train", "val"):
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    path, n_val = train_file(args), _opt(args, "val_size", 100)
    qs = read_questions(path)
    if n_val >= len(qs):
        raise ValueError(f"--val-size {n_val} leaves no train questions in {path} ({len(qs)} questions)")
    order = list(range(len(qs)))
    random.Random(SPLIT_SEED).shuffle(order)
    val = set(order[:n_val])
    return [q for i, q in enumerate(qs) if (i in val) == (split == "val")]


# The run's flags: the step protocol, and flags that would change nothing for this env (refused)

PUBLIC_RULES = {"invalid_step": "execute-first", "empty_block": "valid", "stray_tags": "count"}
RULES = dict(PUBLIC_RULES)  # parse_action's rules; set from the run's flags by configure()


def configure(args):
    """Check the run's flags for the search env and set the step protocol that parse_action follows.
    Called by the task functions (every script draws its tasks through them, in the process that parses
    the responses). A flag that would change nothing here is refused with one line naming the env."""
    if _opt(args, "invalid_rule", "public") == "strict":
        raise SystemExit("--invalid-rule strict: the search env has no admissible-action list, so it would change "
                         "nothing; its validity rules are --search-invalid-step, --search-empty-block and "
                         "--search-stray-tags")
    fallback = _opt(args, "invalid_fallback")
    if fallback is not None and split_action(fallback)[0] is None:
        raise SystemExit(f"--invalid-fallback {fallback!r}: the search env runs only search[query] or answer[text]; "
                         f"anything else is an invalid turn already, so it would change nothing")
    probe = _opt(args, "probe_action")  # seed_rl.py's plumbing check: the reward of a first action equal to it
    if probe is not None and split_action(probe.strip().lower())[0] is None:
        raise SystemExit(f"--probe-action {probe!r}: the search env parses only search[query] or answer[text], so no "
                         f"episode's first action can be {probe!r} and every return would be 0")
    RULES.update(invalid_step=_opt(args, "search_invalid_step", PUBLIC_RULES["invalid_step"]),
                 empty_block=_opt(args, "search_empty_block", PUBLIC_RULES["empty_block"]),
                 stray_tags=_opt(args, "search_stray_tags", PUBLIC_RULES["stray_tags"]))


# ----------------------------------------------------------------------------------------------------
# Tasks

def make_task(q, split, args):
    """The JSON-able task dict of one question: everything a worker's game needs, nothing process-bound."""
    return {"task_id": f"{q['data_source']}/{q['id']}", "split": split, "category": q["data_source"],
            "question": q["question"], "golden_answers": list(q["golden_answers"]),
            "data_source": q["data_source"],
            "retriever_url": _opt(args, "retriever_url", "http://127.0.0.1:8000/retrieve"),
            "topk": _opt(args, "topk", 3), "retriever_timeout": _opt(args, "retriever_timeout", 10.0),
            "retriever_retries": _opt(args, "retriever_retries", 3),
            "retriever_backoff": _opt(args, "retriever_backoff", 0.5),
            "retriever_shape": _opt(args, "retriever_shape", "auto"),
            "empty_gold": _opt(args, "search_empty_gold", "match"),
            "max_steps": _opt(args, "max_steps", PRESET["max_steps"])}


@functools.lru_cache(maxsize=None)
def _checked(url, timeout, shape):
    check_retriever(url, timeout=timeout, shape=shape)
    return True


def ensure_retriever(args):
    """Stop at start with one line naming the URL (SystemExit, like an unknown --env) when the retriever
    does not answer within seconds; checked once per URL and process. --no-retriever-check skips it."""
    if not _opt(args, "no_retriever_check", False):
        try:
            _checked(_opt(args, "retriever_url", "http://127.0.0.1:8000/retrieve"),
                     min(5.0, _opt(args, "retriever_timeout", 10.0)), _opt(args, "retriever_shape", "auto"))
        except RetrieverError as e:
            raise SystemExit(f"error: {e}") from None


def _train_tasks(seed, n, args, split="train"):
    return [make_task(q, split, args) for q in seeded_cycle(split_questions(split, args), seed, n)]


def stage1_tasks(seed, n, args=None):
    """Stage 1's collection set: n questions (the paper: 180 train questions), a seeded draw from the train
    split, or from the split args.split names (collect.py --split val / test)."""
    configure(args)
    ensure_retriever(args)
    return _train_tasks(seed, n, args, _opt(args, "split", "train"))


def rl_tasks(seed, n, args=None):
    """Stage 2's task stream: n train questions (the paper: 128 x 150 = 19,200), seeded shuffles; update u
    plays [u*T:(u+1)*T]. With the 400 shipped train questions every question recurs across passes."""
    configure(args)
    ensure_retriever(args)
    return _train_tasks(seed, n, args)  # the same seeded passes: Stage 1's n questions are the stream's first n


def eval_tasks(split, seed, limit=None, args=None):
    """Evaluation tasks of a split, grouped by data source (GROUPS order, then any other source). limit:
    at most that many questions per data source, a seeded sample kept in file order; None: all."""
    configure(args)
    ensure_retriever(args)
    by_source = {}
    for q in split_questions(split, args):
        by_source.setdefault(q["data_source"], []).append(q)
    rng, out = random.Random(seed), []
    for source in [s for s in GROUPS if s in by_source] + [s for s in by_source if s not in GROUPS]:
        qs = by_source[source]
        if limit is not None and limit < len(qs):
            qs = [qs[i] for i in sorted(rng.sample(range(len(qs)), limit))]
        out += [make_task(q, split, args) for q in qs]
    return out


def data_manifest(seed, tasks_per_update, updates, stage1_n, args=None):
    """The preset's data (evaluate.py --data-manifest): the Stage 1 set, the RL stream and the val/test
    questions per data source, with checks. Returns (printable lines, checks {name: ok}, manifest dict).
    Needs no retriever."""
    from common.records import games_summary
    stage1, stream = _train_tasks(seed, stage1_n, args), _train_tasks(seed, tasks_per_update * updates, args)
    train, val, test = (split_questions(s, args) for s in ("train", "val", "test"))
    s1, rl = games_summary(stage1), games_summary(stream)
    per_source = {}
    for q in test:
        per_source[q["data_source"]] = per_source.get(q["data_source"], 0) + 1
    rollouts = PRESET["rollouts"]
    lines = [f"train file  : {train_file(args)}: {len(train)} train + {len(val)} val questions (split seed {SPLIT_SEED})",
             f"stage 1 set : {s1['count']} tasks x {rollouts} = {s1['count'] * rollouts} trajectories, "
             f"{s1['unique']} distinct, sha256 {s1['sha256']}",
             f"RL stream   : {rl['count']} task instances ({tasks_per_update} x {updates}), {rl['unique']} distinct "
             f"questions, sha256 {rl['sha256']}",
             "test        : " + ", ".join(f"{s} {n}" for s, n in per_source.items())
             + f" ({len(test)} questions; in-domain: {', '.join(g for g in GROUPS if g in IN_DOMAIN)})"]
    empty = {name: empty_golds(qs) for name, qs in (("train", train), ("val", val), ("test", test))}
    lines.append(f"empty golds : {sum(map(len, empty.values()))} gold answer(s) normalise to '' (train "
                 f"{len(empty['train'])}, val {len(empty['val'])}, test {len(empty['test'])}: "
                 + ", ".join(f"{i} {g!r}" for i, g in empty["test"][:8])
                 + "); with --search-empty-gold match (the public code) an answer that normalises to '' "
                   "scores 1 on them")
    key = lambda q: normalize_answer(q["question"])
    val_ids, test_questions = {f"{q['data_source']}/{q['id']}" for q in val}, {key(q) for q in test}
    checks = {
        f"stage 1 tasks = {stage1_n}": s1["count"] == stage1_n,
        f"stage 1 trajectories = {stage1_n * rollouts}": s1["count"] * rollouts == stage1_n * rollouts,
        f"RL task instances = {tasks_per_update * updates}": rl["count"] == tasks_per_update * updates,
        "no val question in stage 1 or the RL stream": not val_ids & {t["task_id"] for t in stage1 + stream},
        "no train question in the test sets (normalised text)": not {key(q) for q in train} & test_questions,
        f"test sets present: {', '.join(GROUPS)}": all(per_source.get(g) for g in GROUPS),
    }
    manifest = {"stage1": dict(s1, trajectories=s1["count"] * rollouts, task_ids=[t["task_id"] for t in stage1]),
                "rl_stream": dict(rl, task_ids=[t["task_id"] for t in stream]),
                "val": {"questions": len(val), "task_ids": sorted(val_ids)},
                "test": {"questions": len(test), "per_source": per_source, "files": test_files(args)},
                # questions whose gold normalises to '' (exact_match says how they score), per split
                "empty_golds": {k: [{"task_id": i, "gold": g} for i, g in v] for k, v in empty.items()}}
    return lines, checks, manifest


# ----------------------------------------------------------------------------------------------------
# One game (runs inside an EnvPool worker)


# Exact match (the SQuAD answer normalisation): how the game scores an answer

PUNCTUATION = set(string.punctuation)  # ASCII only, as in the SQuAD script


def normalize_answer(s):
    """Lower case, punctuation removed, the articles a/an/the removed, whitespace squashed."""
    s = "".join(ch for ch in str(s).lower() if ch not in PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction, golden_answers, empty_gold="match"):
    """1 if the normalised prediction equals a normalised gold answer. A gold that normalises to '' (six of
    the shipped test golds, e.g. 'The', counted by the data manifest) matches an answer that normalises to ''
    too (an empty <answer>, 'the', '.'): the public code's em_check compares the normalised strings and
    nothing more (verl-agent: env_package/search/third_party/skyrl_gym/envs/search/utils.py; Search-R1:
    verl/utils/reward_score/qa_em.py). empty_gold="never": such a gold matches nothing."""
    p = normalize_answer(prediction)
    golds = [normalize_answer(g) for g in golden_answers]
    return any(p == g for g in golds if g or empty_gold == "match")


def empty_golds(questions):
    """The questions with a gold answer that normalises to '' (see exact_match): [(task id, gold), ...]."""
    return [(f"{q['data_source']}/{q['id']}", g) for q in questions for g in q["golden_answers"]
            if not normalize_answer(g)]


# The game

INVALID_FEEDBACK = ("Your previous response was invalid: it needs exactly one <search> query </search> or "
                    "one <answer> answer </answer> block.")
LAST_TURN_FEEDBACK = "No turns left: a search on the last turn ends the episode without an answer."


def format_information(docs):
    """Passages as the agent sees them: Search-R1's "Doc i(Title: <title line>) <text>", labelled "Doc i:"."""
    if not docs:
        return "<information>No passage matched the query.</information>"
    lines = []
    for i, d in enumerate(docs, 1):
        title, _, text = d["contents"].partition("\n")
        lines.append(f"Doc {i}: (Title: {title}) {text}")
    return "<information>" + "\n".join(lines) + "</information>"


class SearchGame:
    """One question. reset()/step(action) -> {"observation", "admissible" ([]: free text), "done", "won",
    "score"}; reset's state also has "task" (the question). action: "search[query]", "answer[text]", or
    anything else (an invalid step: the agent is told so). A retriever that fails after its retries raises
    RetrieverError, which the EnvPool turns into an env failure of this episode."""

    def __init__(self, task):
        self.task = task
        self.max_steps = int(task.get("max_steps") or PRESET["max_steps"])
        self.turn, self.done, self.won = 0, False, False

    def _state(self, observation):
        return {"observation": observation, "admissible": [], "done": self.done, "won": self.won,
                "score": float(self.won)}

    def reset(self):
        self.turn, self.done, self.won = 0, False, False
        return dict(self._state(self.task["question"]), task=self.task["question"])

    def step(self, action):
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.turn += 1
        last = self.turn >= self.max_steps
        kind, arg = split_action(action)
        if kind == "answer":
            self.done, self.won = True, exact_match(arg, self.task["golden_answers"],
                                                    self.task.get("empty_gold", "match"))
            return self._state(f"You answered: {arg}")
        self.done = last
        if kind != "search":
            return self._state(INVALID_FEEDBACK)
        if last:  # the reply could not be used any more: do not spend a retriever call on it
            return self._state(LAST_TURN_FEEDBACK)
        if not arg.strip():  # an empty <search></search> (valid under the public rules): no query to send
            return self._state(format_information([]))
        t = self.task
        docs = retrieve(t["retriever_url"], [arg], topk=t.get("topk", 3), timeout=t.get("retriever_timeout", 10.0),
                        retries=t.get("retriever_retries", 3), backoff=t.get("retriever_backoff", 0.5),
                        shape=t.get("retriever_shape", "auto"))[0]
        return self._state(format_information(docs))


def make_game(task):
    """Top-level (picklable) factory for EnvPool workers. Nothing to load: the retriever is a service."""
    return SearchGame(task)


# ----------------------------------------------------------------------------------------------------
# The prompt

ROLE = "You are an expert agent answering a question with the help of a search engine over Wikipedia."
CLOSING = (
    "Now it is your turn to respond. First reason step by step about what you know and what you still need; "
    "this reasoning MUST be enclosed in <think> </think> tags. Then do exactly one of the following. If some "
    "knowledge you need is missing or uncertain, search for it: give one query inside <search> </search> tags, "
    "and the top results will come back between <information> and </information>. If you can answer with "
    "confidence, give only the final answer, a few words without explanation, inside <answer> </answer> tags, "
    "for example <answer> Beijing </answer>."
)


def format_executed(executed):
    kind, arg = split_action(executed)
    return f"<{kind}> {arg} </{kind}>" if kind else "(an invalid response: no single search or answer block)"


def format_history(history):
    """history: step records, oldest first: each (action, information) pair the agent saw."""
    return "\n".join(f"[Step {h['step']}] {format_executed(h.get('executed'))}\n{h.get('feedback', '')}"
                     for h in history)


def build_prompt(task, observation, admissible, step, history, skill=None):
    """The user message for `step` (1-based). task: the question (or the task dict). history: the last k
    step records of the episode (oldest first; keys step, executed, feedback); the current observation is
    the last record's feedback, so it is shown through the history only. skill: None or '' for the plain
    prompt; a string inserts the skill block right after the question line (the only difference)."""
    question = task["question"] if isinstance(task, dict) else str(task)
    block = skill_block(skill) if skill else ""
    history = list(history or [])
    if step <= 1:
        progress = "This is your first step: nothing has been searched yet.\n"
    else:
        progress = (f"Before this step you have taken {step - 1} step(s). Below are the most recent "
                    f"{len(history)} actions and the information each returned:\n{format_history(history)}\n")
    return f"{ROLE}\nQuestion: {question}\n{block}{progress}You are now at step {step}.\n\n{CLOSING}"


# ----------------------------------------------------------------------------------------------------
# Parsing and reward
# Validity (docs/paper.md, Search): one <search>...</search> or <answer>...</answer> block; invalid: no block, both
# kinds, more than one block. A missing <think> is NOT invalid here. The details follow the paper's public
# code, verl-agent's `search_projection` (agent_system/environments/env_package/search/projection.py) and its
# env manager's step (agent_system/environments/env_manager.py, SearchEnvironmentManager.step; read in forks
# of verl-agent, e.g. GithubX-F/ProxMO-RL@7f40b65 and jinyangwu/SPARK@06114c0, as the upstream repository
# could not be fetched here):
#   - the text is cut after the first `</search>` (else the first `</answer>`), and the first search block
#     of what is left is the action, else its first answer block (stripped), else nothing;
#   - the step is invalid when there is no block, when the ORIGINAL text holds both an opening <search> and
#     an opening <answer> tag, or more than one of either (so a tag mentioned in the reasoning counts);
#   - the extracted block is executed even when the step is invalid (the env gets the projected actions;
#     the flag only adds the penalty); an empty block is valid.
# Each of these has a flag for the stricter reading this project used first (RULES, set by configure()):
# --search-invalid-step nothing, --search-empty-block invalid, --search-stray-tags ignore.

# A block's text may not contain another opening tag of its kind: a tag mentioned in the reasoning ("I will
# use <search> tags") must not swallow the real block that follows it (the "ignore" reading).
SEARCH_RE = re.compile(r"<search>((?:(?!<search>).)*?)</search>", re.DOTALL | re.IGNORECASE)
ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL | re.IGNORECASE)
PUBLIC_SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL | re.IGNORECASE)
PUBLIC_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
REASONS = ("no_block", "both_kinds", "several_blocks", "empty_block")


def _public_block(text):
    """(kind, text) of the block the public code extracts, or (None, '')."""
    for close in ("</search>", "</answer>"):  # case-sensitive, as the public code's cut
        if close in text:
            text = text.split(close, 1)[0] + close
            break
    m = PUBLIC_SEARCH_RE.search(text)
    if m:
        return "search", m.group(1)
    m = PUBLIC_ANSWER_RE.search(text)
    return ("answer", m.group(1)) if m else (None, "")


def parse_action(text, admissible=None, require_think=True, rules=None):
    """-> (action, valid, reason): action "search[query]" / "answer[text]" (inner whitespace folded), or ''
    when there is nothing to run; reason one of REASONS, '' when valid. Never raises. rules: RULES (the
    run's flags) unless given. An invalid step keeps its action under invalid_step "execute-first" (the
    public code runs it) and has '' under "nothing". A missing <think> is not invalid here (docs/paper.md, Search), so
    require_think changes nothing."""
    r = dict(RULES, **(rules or {}))
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    if r["stray_tags"] == "count":
        kind, arg = _public_block(text)
        n_search, n_answer = len(re.findall("<search>", text, re.I)), len(re.findall("<answer>", text, re.I))
    else:
        searches, answers = SEARCH_RE.findall(text), ANSWER_RE.findall(text)
        kind, arg = ("search", searches[0]) if searches else ("answer", answers[0]) if answers else (None, "")
        n_search, n_answer = len(searches), len(answers)
    arg = " ".join(arg.split())
    if kind is None:
        reason = "no_block"
    elif n_search and n_answer:
        reason = "both_kinds"
    elif n_search + n_answer > 1:
        reason = "several_blocks"
    elif not arg and r["empty_block"] == "invalid":
        reason = "empty_block"
    else:
        reason = ""
    action = f"{kind}[{arg}]" if kind else ""
    if reason and r["invalid_step"] == "nothing":
        action = ""
    return action, not reason, reason


def split_action(action):
    """("search" | "answer" | None, argument) of an executed action string (the argument may be empty:
    an empty block, valid under the public rules)."""
    m = re.fullmatch(r"(search|answer)\[(.*)\]", str(action or ""), re.DOTALL)
    return (m.group(1), m.group(2)) if m else (None, "")


def is_admissible(action, admissible):
    """Search has no admissible list (queries and answers are free text): not applicable, None."""
    return None


def action_to_execute(text, action, fallback=None):
    """The parsed action (an invalid step's too, under the public rules); without one `fallback` if given,
    else "invalid" (the game answers any non-action with INVALID_FEEDBACK and counts the turn)."""
    return action or fallback or "invalid"


def reward(state, valid, invalid_penalty=PRESET["invalid_penalty"]):
    """Exact match at the answer step (1 or 0, no x10), minus the penalty for an invalid step."""
    return float(bool(state.get("won"))) - invalid_penalty * (not valid)


# ----------------------------------------------------------------------------------------------------
# The scripted expert (CPU demos and tests) and the episode stats

def expert_response(episode):
    """First turn: search the question itself; then: answer with the first gold answer, saying which
    retrieved passage (if any) contains it. On the last allowed turn it answers at once."""
    question, gold = episode["question"], episode["golden_answers"][0]
    t = len(episode.get("steps", []))
    if t == 0 and int(episode.get("max_steps") or PRESET["max_steps"]) > 1:
        return (f"<think>I do not know this yet, so I look the question up first.</think>\n"
                f"<search>{question}</search>")
    info = episode.get("_obs", "") or ""
    docs = re.findall(r"Doc (\d+): (.*)", info)
    where = next((f"Doc {i} mentions {gold!r}" for i, d in docs if normalize_answer(gold) in normalize_answer(d)),
                 "the passages do not state it, but I know it")
    return f"<think>{where}, so the answer is {gold}.</think>\n<answer>{gold}</answer>"


def episode_stats(episode):
    """Why EM moves, or does not: searches made, whether any retrieved passage held a gold answer (the
    retriever gave the policy what it needed), whether it answered at all, and the answer's length in words.
    A policy that stops searching and answers from memory shows as searches -> 0."""
    steps = episode.get("steps", [])
    kinds = [split_action(s.get("executed")) for s in steps]
    golds = [normalize_answer(g) for g in episode.get("golden_answers", []) if normalize_answer(g)]
    infos = [normalize_answer(s.get("feedback") or "") for s, (k, _) in zip(steps, kinds) if k == "search"]
    answers = [a for k, a in kinds if k == "answer"]
    return {"searches": sum(k == "search" for k, _ in kinds),
            "gold_retrieved": float(any(f" {g} " in f" {i} " for g in golds for i in infos)),  # whole words
            "answered": float(bool(answers)),
            "answer_words": len(answers[-1].split()) if answers else None}
