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
    num_blocks: int | None = None  # default: enough for max_num_seqs full contexts, capped by the cache budget
    # The cache budget (engine/memory.py): kv_cache_bytes when given; else kv_cache_fraction of the
    # memory left after the weights, that memory being memory_bytes - weights when memory_bytes is
    # given (an explicit device budget) or, on a GPU, what CUDA reports free after loading; else
    # (CPU) 2 GiB. The rest of free memory is for activations, CUDA graph pools and allocator slack.
    kv_cache_bytes: int | None = None
    memory_bytes: int | None = None
    kv_cache_fraction: float = 0.85
    enable_prefix_caching: bool = True
    # Replay decode steps, and steps of prompt chunks up to 512 padded tokens, as CUDA graphs where the
    # model allows (GPU only; engine/cuda_graphs.py).
    cuda_graphs: bool = True
    prefill_graphs: bool = True  # with cuda_graphs: steps of prompt chunks too (False: decode steps only)
    # With decode graphs: launch each decode step before reading the previous one's tokens (the graph
    # takes them on the device), so the host's bookkeeping between steps overlaps the GPU's work. A
    # sequence that stops on a token computes one more row, dropped.
    run_ahead: bool = True
    # Count the tokens routed to each expert of each MoE layer (exported as a metric). Decode steps then
    # run eagerly: a graph's padding rows would be counted as tokens.
    expert_stats: bool = False

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
