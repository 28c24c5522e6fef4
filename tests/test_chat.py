"""prompts/chat.py: Qwen2.5 prompts unchanged; Qwen3's thinking switch; prompt/response and SFT token alignment.

CPU only, no model. The Qwen3 tokenizer is the real Qwen2.5 tokenizer folder with its chat template replaced by
a Qwen3-style one written here (the behaviour that matters: no default system turn; `enable_thinking=False`
closes an empty think block in the generation prompt; an assistant turn after the last user turn is rendered
with a think block, empty when the answer has no reasoning). The Qwen2.5 vocabulary is enough: nothing here
depends on <think> being one token.
"""
import json
import os
import random
import shutil

import pytest

import prompts
from common.models import default_tokenizer_path
from prompts.chat import (THINKING_DEFAULT, ChatPrompts, chat_prompt, lines_tokenize_apart, requires_think_tags,
                          resolve_thinking, sft_example, supports_thinking, template_kwargs)

QWEN25_DIR = default_tokenizer_path()  # the real Qwen2.5 tokenizer folder (../shared/assets/qwen2.5-tokenizer)

QWEN3_STYLE_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

QWEN25_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
USER_TEXTS = ["You are an expert agent operating in the ALFRED embodied environment.\nYour task is to: put a mug "
              "in the sink.\nYour admissible actions in the current situation are: ['look', 'go to sink 1'].",
              "Review this episode and answer with JSON.\n\n  trailing spaces  \n", "中文 and émigré — ünïcode"]
RESPONSES = ["<think>The mug is on the counter.</think>\n<action>go to countertop 1</action>",
             "<action>look</action>", "I will look around first. <action>look</action>",
             "<think>\nnative thinking opens with a newline\n</think>\n\n<action>look</action>"]
ANSWER = json.dumps({"episode_summary": "The agent found the mug and cleaned it.",
                     "episode_skill": "First locate the object, then go to the sink before placing it."})


@pytest.fixture(scope="module")
def qwen25():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(QWEN25_DIR)


def qwen3_style_tokenizer(folder):
    """The real Qwen2.5 tokenizer files, copied into `folder`, with a Qwen3-style chat template in
    tokenizer_config.json (also tests/test_rollout.py's)."""
    from transformers import AutoTokenizer
    for name in os.listdir(QWEN25_DIR):
        shutil.copy(os.path.join(QWEN25_DIR, name), folder / name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_STYLE_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_style_tokenizer(tmp_path_factory.mktemp("qwen3-style-tokenizer"))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("model", ["tiny", "expert"])
def test_load_tokenizer_is_the_tokenizer_autotokenizer_loads(qwen25, model):
    """common/models.py load_tokenizer imports the Qwen2.5 folder's class directly (AutoTokenizer's import costs
    ~1.4 s): the same class, vocabulary, special tokens, chat template and ids as AutoTokenizer's tokenizer."""
    from common.models import load_tokenizer
    tok = load_tokenizer(model)
    assert type(tok) is type(qwen25) and tok.chat_template == qwen25.chat_template
    assert tok.get_vocab() == qwen25.get_vocab() and str(tok.added_tokens_decoder) == str(qwen25.added_tokens_decoder)
    assert tok.special_tokens_map == qwen25.special_tokens_map and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == qwen25.eos_token_id and tok.model_max_length == qwen25.model_max_length
    assert tok.init_kwargs == qwen25.init_kwargs
    for text in USER_TEXTS + RESPONSES + [ANSWER]:
        assert ids(tok, text) == ids(qwen25, text) and chat_prompt(tok, text) == chat_prompt(qwen25, text)
        assert tok(text)["input_ids"] == qwen25(text)["input_ids"]
        assert tok.decode(ids(tok, text)) == qwen25.decode(ids(qwen25, text)) == text


# ----------------------------------------------------------------------------------------------------
# Qwen2.5: byte-identical to what the project always rendered (the template with no extra arguments)

@pytest.mark.parametrize("user", USER_TEXTS)
def test_qwen25_prompt_unchanged(qwen25, user):
    text, tok_ids = chat_prompt(qwen25, user)
    before = qwen25.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    assert (text, tok_ids) == (before, ids(qwen25, before)) and prompts.chat_prompt is chat_prompt
    assert text == f"{QWEN25_SYSTEM}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    assert tok_ids == ids(qwen25, text)
    # no switch in the template: off is the same prompt, on is refused, and the <think> rule applies
    assert not supports_thinking(qwen25) and resolve_thinking(qwen25) is None and template_kwargs(qwen25) == {}
    assert chat_prompt(qwen25, user, thinking=False) == (text, tok_ids)
    assert chat_prompt(qwen25, user, thinking="auto") == (text, tok_ids)
    with pytest.raises(ValueError):
        chat_prompt(qwen25, user, thinking=True)
    assert requires_think_tags(qwen25) and requires_think_tags(qwen25, False)


# ----------------------------------------------------------------------------------------------------
# Qwen3: thinking off (the default) and on

@pytest.mark.parametrize("user", USER_TEXTS)
def test_qwen3_thinking_off_is_the_default(qwen3, user):
    assert supports_thinking(qwen3) and THINKING_DEFAULT is False
    text, tok_ids = chat_prompt(qwen3, user)
    # no default system turn; the generation prompt closes an empty think block
    assert text == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{EMPTY_THINK}"
    assert (text, tok_ids) == chat_prompt(qwen3, user, thinking=False) == chat_prompt(qwen3, user, thinking="off")
    assert tok_ids == ids(qwen3, text)
    # the response follows a closed think block: the <think> rule is off (the public code's rule)
    assert not requires_think_tags(qwen3) and not requires_think_tags(qwen3, "off")


@pytest.mark.parametrize("user", USER_TEXTS)
def test_qwen3_thinking_on(qwen3, user):
    text, tok_ids = chat_prompt(qwen3, user, thinking=True)
    assert text == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt(qwen3, user, thinking="on") == (text, tok_ids)
    # the model opens its own block, which satisfies the <think> rule
    assert requires_think_tags(qwen3, True)
    # the two modes differ by exactly the empty think block at the end of the prompt
    assert chat_prompt(qwen3, user)[0] == text + EMPTY_THINK


# ----------------------------------------------------------------------------------------------------
# Prompt + response: response tokens are the same after the prompt as alone

@pytest.mark.parametrize("mode", [None, True])
@pytest.mark.parametrize("response", RESPONSES)
def test_prompt_response_tokens_align(qwen3, qwen25, mode, response):
    for tok, thinking in ((qwen3, mode), (qwen25, None)):
        text, p_ids = chat_prompt(tok, USER_TEXTS[0], thinking=thinking)
        assert ids(tok, text + response) == p_ids + ids(tok, response)


def test_response_text_with_leading_newline_does_not_align(qwen3):
    """Why responses are scored as their generated ids, never re-tokenized from text: a response that starts
    with a newline merges with the prompt's trailing newline(s) (here after the empty think block)."""
    text, p_ids = chat_prompt(qwen3, USER_TEXTS[0])
    assert ids(qwen3, text + "\n<action>look</action>") != p_ids + ids(qwen3, "\n<action>look</action>")


# ----------------------------------------------------------------------------------------------------
# SFT: prompt as Stage 2 renders it, target as the template renders the assistant turn

def test_sft_example_qwen25_is_answer_plus_im_end(qwen25):
    ex = sft_example(qwen25, USER_TEXTS[1], ANSWER)
    assert ex["prompt_text"] == chat_prompt(qwen25, USER_TEXTS[1])[0]
    assert ex["target_text"] == ANSWER + "<|im_end|>"
    # sft.py's layout today: prompt ids + answer ids + <|im_end|>
    assert ex["target_ids"] == ids(qwen25, ANSWER) + [qwen25.convert_tokens_to_ids("<|im_end|>")]
    assert sft_example(qwen25, USER_TEXTS[1], ANSWER, layout="verl") == ex


@pytest.mark.parametrize("thinking, target_prefix", [(None, ""), (False, ""), (True, EMPTY_THINK)])
def test_sft_example_qwen3(qwen3, thinking, target_prefix):
    ex = sft_example(qwen3, USER_TEXTS[1], ANSWER, thinking=thinking)
    assert ex["prompt_text"] == chat_prompt(qwen3, USER_TEXTS[1], thinking=thinking)[0]
    # thinking off: the empty block is prompt (no loss); on: the template renders it inside the assistant turn
    assert ex["target_text"] == target_prefix + ANSWER + "<|im_end|>"
    full = qwen3.apply_chat_template([{"role": "user", "content": USER_TEXTS[1]},
                                      {"role": "assistant", "content": ANSWER}], tokenize=False)
    assert ex["prompt_ids"] + ex["target_ids"] == ids(qwen3, full.removesuffix("\n"))
    # the loss mask: 0 on every prompt token, 1 on every target token, the closing <|im_end|> included
    mask = [0] * len(ex["prompt_ids"]) + [1] * len(ex["target_ids"])
    kept = [t for t, m in zip(ex["prompt_ids"] + ex["target_ids"], mask) if m]
    assert qwen3.decode(kept) == target_prefix + ANSWER + "<|im_end|>"
    # the public code's SFT layout (prompt + answer + eos) agrees except for thinking on
    verl = sft_example(qwen3, USER_TEXTS[1], ANSWER, thinking=thinking, layout="verl")
    assert verl["target_text"] == ANSWER + "<|im_end|>"
    assert (verl == ex) == (target_prefix == "")


def test_sft_example_rejects_unknown_layout(qwen25):
    with pytest.raises(ValueError):
        sft_example(qwen25, "x", ANSWER, layout="other")


# ----------------------------------------------------------------------------------------------------
# ChatPrompts (the rollout loop's fast chat_prompt): the same text and ids on adversarial strings (real env
# prompts: tests/test_rollout.py), and the plain path for a tokenizer it cannot cut

PIECES = ["\n", "\n\n", "\r\n", " ", "  ", "\t", "a", "Go", "'s", "'S", "'", "[", "].", "1", "23", "中文", "é", "e\u0301",
          "\u0301", "<|im_end|>", "<|im_start|>", "<think>", "</tool_response>", "🙂", "'go to desk 1'", "\n ", "\n  ",
          " \n", "\n\t", "\u00a0", "\u2028", "-", "Your task is to: ", ">"]


@pytest.mark.parametrize("mode", ["qwen2.5", "qwen3-off", "qwen3-on"])
def test_chat_prompts_fuzz(qwen25, qwen3, mode):
    tok, thinking = {"qwen2.5": (qwen25, None), "qwen3-off": (qwen3, False), "qwen3-on": (qwen3, True)}[mode]
    fast = ChatPrompts(tok, thinking=thinking)
    assert fast.piecewise and fast.around
    rng = random.Random(0)
    texts = USER_TEXTS + ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 60))) for _ in range(1500)]
    for text in texts + texts[::-1]:  # the second pass is served from the memo
        assert fast(text) == chat_prompt(tok, text, thinking=thinking), repr(text)


def test_chat_prompts_memo_starts_over_when_full(qwen25):
    fast = ChatPrompts(qwen25, max_pieces=5)
    lines = [f"line {i}\nYour task is to: {i}\n 'look'\n" * 3 for i in range(20)]
    for text in lines + lines:
        assert fast(text) == chat_prompt(qwen25, text)
        assert len(fast.pieces) <= 5 + text.count("\n") + 3


def test_chat_prompts_plain_path_for_other_tokenizers(qwen25):
    """A normalizer other than NFC (here: lower-casing), or truncation set on the backend: the text is tokenized
    whole, as chat_prompt does (transformers' call lifts the truncation)."""
    import copy
    from tokenizers import normalizers
    tok = copy.deepcopy(qwen25)
    tok._tokenizer.normalizer = normalizers.Lowercase()
    assert not lines_tokenize_apart(tok) and not ChatPrompts(tok).piecewise
    tok = copy.deepcopy(qwen25)
    fast = ChatPrompts(tok)
    tok._tokenizer.enable_truncation(8)  # set after construction (the pieces would be cut): checked per call
    assert fast(USER_TEXTS[0]) == chat_prompt(qwen25, USER_TEXTS[0])
