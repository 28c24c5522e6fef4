"""The chat template, for every stage: one user message -> (templated text, token ids), and the SFT answer side.

Qwen2.5-Instruct (3B, 7B): no thinking mode; the template adds its default system turn. `chat_prompt` renders
exactly what `prompts.chat_prompt` always rendered (tests/test_chat.py pins it).

Qwen3 (the paper's third backbone, Qwen3-1.7B): the template has a switch, `enable_thinking`, and no default
system turn. We detect the switch in the template text (a model without it is not asked to think or not think).
    thinking on   the generation prompt ends "<|im_start|>assistant\\n"; the model opens its own
                  "<think>...</think>" block and then answers.
    thinking off  the generation prompt ends "<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n": an empty,
                  already closed think block is part of the PROMPT.
The project's default is OFF, as in the paper's public code: every Qwen3 launcher there passes
`+data.apply_chat_template_kwargs.enable_thinking=False` (examples/gigpo_trainer/run_{alfworld,webshop,search}_qwen3.sh,
examples/grpo_trainer/run_webshop_qwen3.sh at 8efe6a77; these are its GRPO/GiGPO baselines, the snapshot has no
SEED launcher for Qwen3), and the same kwargs reach every templated prompt there
(rollout, the self-analysis prompt, the teacher prompt: agent_system/multi_turn_rollout/rollout_loop.py, and the
SFT data: verl/utils/dataset/sft_dataset.py). `thinking=True` turns native thinking on.

What it does to the agent's <think> rule (see `requires_think_tags`): with thinking off the model's response
usually carries no think tags (the empty block sits in the prompt), so a "think tags missing -> invalid" rule would
mark nearly every step invalid. The public code drops the rule exactly then
(agent_system/environments/env_manager.py: `_projection_requires_think`: a Qwen3 model with
enable_thinking=False -> require_think=False; every other case keeps it). With thinking on, the model's own
block satisfies the rule. (Qwen3's <think> and </think> are added tokens that are not "special", so decoding
with skip_special_tokens=True keeps them in the response text the parser reads.)

What it does to scoring: a response is scored as the token ids that were generated, after the prompt ids that
were generated from (old, reference and teacher log-probs alike). With thinking off the empty think block is
prompt, so it is never scored and never trained; the teacher prompt must be templated with the SAME mode, or the
same response tokens would be scored after a different prefix. With thinking on, the think tokens are response
tokens: they get the advantage, the KL and the OPD terms, and they count against the 512-token response budget.
Never re-tokenize a response's text to score it: text that starts with whitespace can merge with the prompt's
trailing "\\n\\n" (tests/test_chat.py shows one case); only generated ids are safe.

The SFT side (`sft_example`): the target is what the template itself renders for the assistant turn after the
generation prompt, up to and including <|im_end|>. For Qwen2.5, and for Qwen3 with thinking off, that is
exactly answer + <|im_end|> (the layout sft.py builds today). For Qwen3 with thinking on, Qwen3's template
renders a non-reasoning answer with an empty think block, so the target is "<think>\\n\\n</think>\\n\\n" + answer +
<|im_end|>; `layout="verl"` gives instead what the public code's SFT dataset builds (prompt + answer + eos, no
think block) for that one case. Either way the loss mask is: every target token, no prompt token.
"""

import json
import re

THINKING_DEFAULT = False  # the public code's Qwen3 runs: enable_thinking=False
END_OF_TURN = "<|im_end|>"  # closes every assistant turn in the Qwen templates


def _template_text(tokenizer):
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # named templates: the default one is what apply_chat_template uses
        t = t.get("default") or "".join(v for v in t.values() if isinstance(v, str))
    return t or ""


def supports_thinking(tokenizer):
    """True when the chat template reads `enable_thinking` (Qwen3 style)."""
    return "enable_thinking" in _template_text(tokenizer)


def resolve_thinking(tokenizer, thinking=None):
    """The thinking mode a prompt is rendered with: None for a template without the switch (Qwen2.5), else a bool.

    thinking: None = the project default (THINKING_DEFAULT, off); True/False = on/off; also accepts the flag
    strings "auto", "on", "off". Asking a template without the switch to think is an error (it cannot)."""
    if isinstance(thinking, str):
        thinking = {"auto": None, "on": True, "off": False}[thinking.lower()]
    if not supports_thinking(tokenizer):
        if thinking:
            raise ValueError("thinking=True, but this tokenizer's chat template has no enable_thinking switch")
        return None
    return THINKING_DEFAULT if thinking is None else bool(thinking)


def template_kwargs(tokenizer, thinking=None):
    """Extra apply_chat_template arguments: {} for Qwen2.5, {"enable_thinking": bool} for Qwen3."""
    mode = resolve_thinking(tokenizer, thinking)
    return {} if mode is None else {"enable_thinking": mode}


def requires_think_tags(tokenizer, thinking=None):
    """Whether the agent's "<think> tags missing -> invalid" rule applies: always, except for a thinking-capable
    template rendered with thinking off (the public code's `_projection_requires_think`)."""
    return resolve_thinking(tokenizer, thinking) is not False


def chat_prompt(tokenizer, user_text, *, thinking=None):
    """One user message through the model's chat template with the generation prompt (no system message:
    Qwen2.5's template adds its default one). Returns (templated text, token ids)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True, **template_kwargs(tokenizer, thinking))
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def sft_example(tokenizer, user_text, answer, *, thinking=None, layout="template"):
    """One SFT example: the prompt exactly as Stage 2 renders it, and the target the loss is taken on.

    Returns dict(prompt_text, prompt_ids, target_text, target_ids): train on prompt_ids + target_ids with loss
    on the target_ids only. layout "template": the target is the chat template's own rendering of the
    assistant turn after the generation prompt, up to and including <|im_end|> (its trailing newline is not a
    target); prompt + target is checked, token for token, against the template's rendering of the
    (user, assistant) conversation. layout "verl": answer + eos token, as the public code's SFT dataset builds it
    (the two differ only for Qwen3 with thinking on). Raises ValueError if the layout cannot be reproduced.
    """
    prompt_text, prompt_ids = chat_prompt(tokenizer, user_text, thinking=thinking)
    if layout == "verl":
        target_text = answer + tokenizer.eos_token
    elif layout == "template":
        full = tokenizer.apply_chat_template([{"role": "user", "content": user_text},
                                              {"role": "assistant", "content": answer}], tokenize=False,
                                             **template_kwargs(tokenizer, thinking))
        if not full.startswith(prompt_text):
            raise ValueError("the template's (user, assistant) rendering does not start with its generation prompt")
        target_text = full[len(prompt_text):].removesuffix("\n")
        if not target_text.endswith(END_OF_TURN):
            raise ValueError(f"the rendered assistant turn does not end with {END_OF_TURN}: {target_text[-40:]!r}")
    else:
        raise ValueError(f"unknown layout {layout!r}; expected 'template' or 'verl'")
    target_ids = tokenizer(target_text, add_special_tokens=False)["input_ids"]
    # tokenized apart = tokenized together, or the model would be trained on a token sequence it never sees
    if tokenizer(prompt_text + target_text, add_special_tokens=False)["input_ids"] != prompt_ids + target_ids:
        raise ValueError("prompt and target tokenize differently apart than together")
    return dict(prompt_text=prompt_text, prompt_ids=prompt_ids, target_text=target_text, target_ids=target_ids)


# ----------------------------------------------------------------------------------------------------
# The rollout loop's prompts, fast (issue 31): the loop builds one templated prompt per step while the engine
# waits for it, and tokenizing a 600-2,000-token prompt is most of that work (benchmarks/loop_cpu.py).

# Qwen2 / Qwen2.5 / Qwen3's pre-tokenizer split (their tokenizer.json). No piece it cuts runs across a newline
# into a non-whitespace character, nor into one space and then a non-whitespace character: every alternative
# that can hold a newline holds only whitespace after it, and `\s*[\r\n]+` (the first of them to match a
# whitespace run with a newline in it) ends at the run's last newline.
QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# after a newline, before a printable ASCII non-space character or one space and one (ALFWorld's admissible
# actions are one per line, each after a space)
LINE_START = re.compile(r"(?<=\n)(?= ?[!-~])")


def lines_tokenize_apart(tokenizer):
    """Whether this tokenizer's ids of a text are the concatenation of its ids of the text cut at LINE_START:
    true for a fast tokenizer with no normalizer or NFC (a newline composes with nothing), Qwen's pre-tokenizer
    split then byte-level, a BPE model (each pre-token on its own), and added tokens that neither hold a
    newline nor strip whitespace around them (so none spans a cut). (Truncation and padding: ChatPrompts.encode
    checks them per call.)"""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return False
    norm = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
    steps = pre.get("pretokenizers") or []
    added = backend.get_added_tokens_decoder().values()
    return (norm in (None, {"type": "NFC"}) and pre.get("type") == "Sequence" and len(steps) == 2
            and steps[0] == {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False}
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex")
            and not steps[1].get("add_prefix_space")
            and not any("\n" in a.content or a.lstrip or a.rstrip or a.single_word for a in added))


class ChatPrompts:
    """`chat_prompt` for one tokenizer and thinking mode, as the rollout loop calls it once per step: the same
    text and the same token ids (tests/test_rollout.py compares them over real ALFWorld, WebShop and Search
    prompts), for a fraction of the CPU.

    text: the template is rendered once around a placeholder user message into (prefix, suffix); a user message
      goes in between as the template puts it (verbatim). Checked with two placeholders; a template that does
      anything else with the message is rendered per call.
    ids: the prompt is cut at line starts (LINE_START) and each piece is tokenized once and kept: step after step
      the fixed lines (system turn, role, closing instruction) and the history lines (each shown in up to k
      prompts) come back, so only the new lines are tokenized. Exact only for the tokenizers of
      `lines_tokenize_apart` (Qwen's); any other is tokenized whole per call. At most `max_pieces` pieces are
      kept (then the memo starts over)."""

    def __init__(self, tokenizer, thinking=None, max_pieces=200_000):
        self.tok, self.thinking, self.max_pieces = tokenizer, thinking, max_pieces
        self.kwargs = template_kwargs(tokenizer, thinking)
        self.around = self._around()
        self.piecewise = lines_tokenize_apart(tokenizer)
        self.pieces = {}

    def render(self, user_text):
        return self.tok.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                            add_generation_prompt=True, **self.kwargs)

    def _around(self):
        """(prefix, suffix) of the rendered template around the user message, or None if two placeholders
        do not give the same ones (the template reads or changes the message)."""
        found = set()
        for mark in ("\x00user-message\x00", "<think>\n ünïcode  \n\n</tool_response>"):
            parts = self.render(mark).split(mark)
            if len(parts) != 2:
                return None
            found.add(tuple(parts))
        return found.pop() if len(found) == 1 else None

    def __call__(self, user_text):
        """(templated text, token ids), as chat_prompt(tokenizer, user_text, thinking=...)."""
        text = self.around[0] + user_text + self.around[1] if self.around else self.render(user_text)
        return text, self.encode(text)

    def encode(self, text):
        backend = getattr(self.tok, "_tokenizer", None)
        if not self.piecewise or backend.truncation or backend.padding:  # padding would pad the pieces
            return self.tok(text, add_special_tokens=False)["input_ids"]
        pieces = LINE_START.split(text)
        new = [p for p in dict.fromkeys(pieces) if p not in self.pieces]
        if len(self.pieces) + len(new) > self.max_pieces:
            self.pieces.clear()
            new = list(dict.fromkeys(pieces))
        if new:  # one batch call; without offsets (encode_batch_fast, tokenizers >= 0.21) it is faster
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            self.pieces.update(zip(new, (e.ids for e in encode(new, add_special_tokens=False))))
        ids = []
        for p in pieces:
            ids += self.pieces[p]
        return ids
