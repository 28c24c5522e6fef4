"""The chat template: one user message, rendered with the model's own template."""


def chat_prompt(tokenizer, user_text):
    """One user message through the model's chat template with the generation prompt (no system message:
    Qwen2.5's template adds its default one). Returns (templated text, token ids)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]
