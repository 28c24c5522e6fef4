"""Prompt wording shared by every stage: the agent step prompt, skill injection, parsing, analysis."""
from prompts.agent import (build_agent_prompt, extract_task, parse_action, action_to_execute, skill_block,
                           SKILL_TITLE)
from prompts.analysis import (build_analysis_prompt, parse_analysis, target_json, serialize_steps,
                              MIN_SKILL_WORDS, ANALYSIS_MAX_CHARS)


def chat_prompt(tokenizer, user_text):
    """One user message through the model's chat template with the generation prompt (no system message:
    Qwen2.5's template adds its default one). Returns (templated text, token ids)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]
