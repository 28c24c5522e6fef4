"""Prompt pieces shared by every env and stage: the skill block, the tag parser, the chat template, analysis."""
from prompts.agent import action_to_execute, parse_action, skill_block, SKILL_TITLE
from prompts.analysis import (build_analysis_prompt, parse_analysis, target_json, serialize_steps,
                              MIN_SKILL_WORDS, ANALYSIS_MAX_CHARS)
from prompts.chat import chat_prompt
