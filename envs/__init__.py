"""The thin shared layer of every stage.

envs.alfworld  ALFWorld game lists, deterministic task choice, one game (TextWorld + alfworld wrappers)
envs.pool      a batched env interface over worker processes (dead/hung workers replaced)
envs.rollout   the multi-turn rollout loop and episode summaries
envs.backends  generation backends (vLLM, HF generate, scripted expert) and model/tokenizer loading
envs.records   append-only JSONL that survives kills, and the run manifest
"""
