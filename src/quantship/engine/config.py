"""Engine settings: plain data, with defaults that suit one CPU or one GPU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV block: prefix caching shares whole blocks
    max_num_seqs: int = 64  # sequences in the running batch
    max_num_batched_tokens: int = 512  # token budget of one step; long prompts are prefilled in chunks of it
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting: int = 256  # bounded queue: beyond it, requests are refused (HTTP 429)
    num_blocks: int | None = None  # default: enough for max_num_seqs full contexts, capped by kv_cache_bytes
    # Default: 2 GiB on CPU; on a GPU, 85% of the memory free after loading the weights (the rest is
    # for activations and CUDA graph pools), as vLLM's gpu_memory_utilization does.
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs where the model allows (GPU only)
    # Count the tokens routed to each expert of each MoE layer (exported as a metric). Decode steps then
    # run eagerly: a graph's padding rows would be counted as tokens.
    expert_stats: bool = False

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
