"""The run plumbing every stage shares, apart from the envs (envs/: the env interface and the env modules).

common.rollout      the multi-turn rollout loop and episode summaries (env-agnostic: it calls only the interface)
common.backends     generation backends (vLLM, HF generate, scripted expert/analyzer) and the policy factory
common.models       model/tokenizer loading (one line naming what cannot load)
common.paths        the checkout and the data folder ($SHARED, else ../shared): one helper for every env
common.records      append-only JSONL that survives kills, the run manifest, and the episode record schema
common.report       the training report of seed_rl.py runs (evaluate.py --report)
common.stats        mean, Student-t interval (scipy.stats) and percentile bootstrap, shared by the reports
common.training     process groups, FSDP2, chunked token log-probs
common.packing      padded/packed micro-batches and the attention for packed rows
common.checkpoints  Hugging Face folders of a sharded model, trainer checkpoints that survive a kill
common.tracking     optional experiment tracking (--log-to wandb|tensorboard) beside metrics.jsonl
"""
