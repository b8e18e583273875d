"""The serving engine: continuous batching over a paged KV cache (nano-vllm's shape:
config → sequence → block_manager → scheduler → model_runner → engine, plus an asyncio front)."""
