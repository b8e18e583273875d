"""What the engine puts in device memory and how it sizes its KV cache: the one copy of this
arithmetic, used by the engine at start-up and by the capacity planner (`quantship capacity`).

    free      = memory left once the weights are in: on CUDA what the driver reports free after
                loading; with an explicit budget (EngineConfig.memory_bytes), budget - weight bytes
    kv budget = kv_cache_fraction x free                                  (default 0.85)
    blocks    = min(ceil(max_num_seqs x max_model_len / block_size),       (what the batch can use)
                    kv budget // (block_size x bytes per token) - 1)       (what fits; -1: scratch block)
    cache     = (blocks + 1) x block_size x bytes per token               (the scratch block CUDA-graph
                                                                            padding writes into)
    sequences of context L held at once = blocks // ceil(L / block_size)

The rest of free memory, (1 - fraction) x free, is the reserve for everything that is not weights or
cache: one step's activations, the CUDA graph pool, the int4 decode copies of packed Linears, and the
caching allocator's slack. The estimates of those below are models of this engine's code paths
(which tensors one step creates), not measurements; benchmarks/capacity_check.py --where gpu
measures them against a real out-of-memory point.
"""

from __future__ import annotations

import os

import torch

from quantship.models.config import ModelConfig

KV_CACHE_FRACTION = 0.85  # share of free memory the KV cache takes (vLLM's gpu_memory_utilization is 0.9 of all)
_expandable = False  # set once prefer_expandable_segments has switched the allocator
CPU_KV_CACHE_BYTES = 2 << 30  # on CPU, without an explicit budget: a fixed 2 GiB cache
INT64, BOOL, FLOAT32 = 8, 1, 4


class CacheTooSmall(ValueError):
    """The budget holds no KV block: the weights take (nearly) all the memory given."""


def out_of_memory(error: BaseException) -> bool:
    """Whether an error means the device ran out of memory: torch's own, or one that surfaces as a plain
    RuntimeError (cuBLAS failing to create a handle or its workspace near the limit; the CPU allocator)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        sign in text for sign in ("ALLOC_FAILED", "out of memory", "can't allocate memory"))  # last: the CPU's


def allocator_setting() -> str:
    """How the CUDA caching allocator is set up, for the server's start-up log."""
    chosen = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if chosen is not None:
        return f"PYTORCH_CUDA_ALLOC_CONF={chosen}"
    return "expandable segments" if _expandable else "fixed segments (this PyTorch has no runtime switch)"


def prefer_expandable_segments(device: torch.device) -> bool:
    """Let the CUDA caching allocator grow segments instead of carving fixed ones, unless the user chose
    (PYTORCH_CUDA_ALLOC_CONF set). Measured on an H200 (benchmarks/capacity_check.py, 6.7B bf16): with
    fixed segments up to 9.7 GB sat in split blocks no request could use and the engine ran out of
    memory 2-3 sequences before its prediction at 4K-16K contexts. Segments made before the switch stay
    fixed: call it before loading weights. Process-wide, like the variable; True when applied."""
    if device.type != "cuda" or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # PyTorch >= 2.9
    setter = setter or getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:  # a PyTorch without the runtime switch: fixed segments stay
        return False
    setter("expandable_segments:True")
    global _expandable
    _expandable = True
    return True


def free_after_weights(memory_bytes: int | None, weight_bytes: int, device: torch.device) -> int | None:
    """Memory left for the cache and the reserve once the weights are loaded; None on CPU without a budget."""
    free = None if memory_bytes is None else memory_bytes - weight_bytes
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what loading left reserved but unused is free memory too
        reported = torch.cuda.mem_get_info(device)[0]
        free = reported if free is None else min(free, reported)
    return free


def kv_cache_budget(free_bytes: int, fraction: float = KV_CACHE_FRACTION) -> int:
    return int(free_bytes * fraction)


def cache_blocks(budget_bytes: int, bytes_per_token: int, block_size: int, max_num_seqs: int,
                 max_model_len: int) -> int:
    """Blocks the engine allocates: enough for max_num_seqs full contexts, at most what the budget
    holds (the scratch block included). ValueError when the budget holds no block at all."""
    wanted = -(-max_num_seqs * max_model_len // block_size)
    fitting = budget_bytes // (block_size * bytes_per_token) - 1
    if fitting < 1:
        raise CacheTooSmall(f"a KV-cache budget of {max(budget_bytes, 0) / 2**20:.1f} MiB holds no block of "
                         f"{block_size} tokens ({block_size * bytes_per_token / 2**20:.2f} MiB each, plus a "
                         f"scratch block)")
    return min(wanted, fitting)


def cache_bytes(num_blocks: int, block_size: int, bytes_per_token: int) -> int:
    return (num_blocks + 1) * block_size * bytes_per_token


def sequences_held(num_blocks: int, block_size: int, context: int) -> int:
    """Sequences of `context` tokens whose whole cache fits in num_blocks at once."""
    return num_blocks // -(-context // block_size)


def decode_kernel(config: ModelConfig, cuda: bool) -> bool:
    """Whether decode attention reads the paged cache in place (kernels/paged_attention.py: MLA's latent
    kernel, or the K/V one)."""
    from quantship.kernels import paged_attention

    if not cuda:
        return False
    if config.is_mla:
        return paged_attention.mla_supports(config.kv_lora_rank, config.qk_rope_head_dim)
    return paged_attention.supports(config.llama_head_dim, config.num_attention_heads, config.num_key_value_heads)


def _mlp_numbers_per_token(config: ModelConfig) -> int:
    """Temporaries per token of the widest MLP: gate, up and their product; for routed experts, per
    chosen expert also the down projection's output before it is weighted and summed."""
    c = config
    dense = 3 * c.intermediate_size
    if not c.is_mla or not c.n_routed_experts:
        return dense
    moe = c.num_experts_per_tok * (3 * c.moe_intermediate_size + c.hidden_size) + \
        3 * c.moe_intermediate_size * c.n_shared_experts
    return max(dense, moe)


def _part_bytes(config: ModelConfig, b: int, seqs: int, queries: int, keys: int, tokens: int,
                cuda: bool) -> tuple[int, int, int]:
    """(index, shared, own) bytes of one part of a step (models/paged.py PagedBatch): its index tensors
    and mask, which live for the whole step; the attention temporaries that scale with its tokens and
    exist for every part at once (MLA's queries are projected for all tokens before the parts run); and
    those only its own attention call holds, freed before the next part runs."""
    c = config
    padded = seqs * queries
    index = seqs * keys * (INT64 + BOOL * queries) + padded * (2 * INT64 + BOOL)  # key_slots, mask, query index
    bias = padded * keys * b  # the boolean mask as the attention kernel's additive bias
    if c.is_mla:
        from quantship.models.deepseek import SCORES_BUDGET

        latent = c.kv_lora_rank + c.qk_rope_head_dim
        heads = c.num_attention_heads
        shared = tokens * heads * (c.qk_head_dim + latent) * b  # q, absorbed q
        if decode_kernel(c, cuda) and queries == 1:
            return index, shared, tokens * heads * c.kv_lora_rank * FLOAT32
        # The gathered latent, and SDPA's scores (heads chunked within SCORES_BUDGET). The math backend
        # (CPU) holds the scores and their softmax; on CUDA the H200's peaks at 4K-32K
        # (benchmarks/capacity_check.py) show one [chunk, Q, K] tensor in the compute dtype beside the mask.
        chunk = min(heads, max(1, SCORES_BUDGET // max(1, padded * keys)))
        scores = (chunk * padded * keys * b) if cuda else 2 * chunk * padded * keys * FLOAT32
        return index, shared, padded * heads * (latent + c.kv_lora_rank) * b + seqs * keys * latent * b + bias + scores
    if decode_kernel(c, cuda) and queries == 1:
        return index, tokens * c.num_attention_heads * c.llama_head_dim * b, \
            tokens * c.num_attention_heads * c.llama_head_dim * FLOAT32
    head, groups = c.llama_head_dim, c.num_attention_heads // c.num_key_value_heads
    context = seqs * keys * 2 * c.num_key_value_heads * head * b
    return index, 0, (context * (2 if groups > 1 else 1)  # gathered K/V, and its per-head copy under GQA
                      + 2 * padded * c.num_attention_heads * head * b + bias)


def step_activation_bytes(config: ModelConfig, dtype: torch.dtype, seqs: int, queries: int, keys: int,
                          tokens: int | None = None, cuda: bool = False) -> int:
    """Peak transient memory of one engine step: `seqs` sequences, each padded to `queries` new tokens
    (the longest chunk of the step), attending to `keys` keys; `tokens` real new tokens (default
    seqs x queries). A model of models/paged.py and the attention/MLP code: the step's index tensors
    and mask, the largest layer's temporaries, the hidden states, and the logits of every sequence."""
    tokens = seqs * queries if tokens is None else tokens
    return split_step_bytes(config, dtype, [(seqs, queries, keys, tokens)], cuda)


def split_step_bytes(config: ModelConfig, dtype: torch.dtype, parts: list[tuple[int, int, int, int]],
                     cuda: bool = False) -> int:
    """Peak transient memory of a step made of parts (seqs, queries, keys, tokens), each padded alone
    and attended one after the other (PagedBatch.each); the MLP, hidden states and logits cover them all."""
    c, b = config, dtype.itemsize
    sizes = [_part_bytes(c, b, *part, cuda) for part in parts]
    tokens, seqs = sum(part[3] for part in parts), sum(part[0] for part in parts)
    index = sum(i for i, _, _ in sizes)
    attention = sum(s for _, s, _ in sizes) + max(own for _, _, own in sizes)
    mlp = tokens * _mlp_numbers_per_token(c) * b
    hidden = 4 * tokens * c.hidden_size * b
    logits = seqs * c.vocab_size * (b + 2 * FLOAT32)  # lm_head output, the float32 copy and softmax of sampling
    return index + max(attention, mlp) + hidden + logits


def peak_activation_bytes(config: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int,
                          batch: int, context: int, cuda: bool) -> int:
    """The largest step the scheduler can form with `batch` running sequences of up to `context`
    tokens: a whole prefill chunk, a decode of the batch, or both in one step: the decodes of a mixed
    step run apart from its chunk (models/paged.py builds them as parts), as the H200 out-of-memory
    points of benchmarks/capacity_check.py were measured."""
    chunk = min(max_num_batched_tokens, context)
    decode = min(batch, max_num_batched_tokens)
    mixed_chunk = min(max(1, max_num_batched_tokens - (decode - 1)), context)
    mixed = [(decode - 1, 1, context, decode - 1), (1, mixed_chunk, context, mixed_chunk)]
    return max(step_activation_bytes(config, dtype, 1, chunk, context, cuda=cuda),
               step_activation_bytes(config, dtype, decode, 1, context, cuda=cuda),
               split_step_bytes(config, dtype, [part for part in mixed if part[0]], cuda))


def graph_pool_bytes(config: ModelConfig, dtype: torch.dtype, max_seqs: int, max_len: int, block_size: int) -> int:
    """CUDA graphs (engine/cuda_graphs.py), every bucket captured: each decode graph keeps its staged
    input rows [size, 2 + blocks] and its logits, each graph of chunks its staged rows, and all of them
    one logits buffer; the temporaries of the largest graph (decode or chunks: the batch it derives on
    the device and the step) are shared through the pool."""
    from quantship.engine import cuda_graphs

    seq_buckets, key_buckets = cuda_graphs.buckets(max_seqs, 1), cuda_graphs.key_buckets(max_len, block_size)
    static = sum(size * ((2 + -(-key_len // block_size)) * INT64 + config.vocab_size * dtype.itemsize)
                 for size in seq_buckets for key_len in key_buckets)
    chunks = cuda_graphs.prefill_shapes(config, dtype, max_len, block_size)
    static += sum(size * (2 + queries + -(-key_len // block_size)) * INT64 for size, queries, key_len in chunks)
    static += cuda_graphs.PREFILL_GRAPH_SEQS * config.vocab_size * dtype.itemsize
    largest = max([step_activation_bytes(config, dtype, seq_buckets[-1], 1, key_buckets[-1], cuda=True)] +
                  [step_activation_bytes(config, dtype, *shape, cuda=True) for shape in chunks])
    return static + largest


def graph_rows(config: ModelConfig, dtype: torch.dtype, max_seqs: int, max_len: int, block_size: int) -> int:
    """The most token rows one captured graph computes: a decode of max_seqs, or the largest graph of
    chunks (padding included); a packed Linear past wna16's table then holds a dense copy in the pool."""
    from quantship.engine import cuda_graphs

    chunks = cuda_graphs.prefill_shapes(config, dtype, max_len, block_size)
    return max([max_seqs] + [size * queries for size, queries, _ in chunks])


def int4_decode_copy(name: str, module: torch.nn.Module) -> int:
    """Bytes of the tinygemm copy a PackedLinear makes of its int4 weight at its first CUDA decode in
    bf16 (kernels/wna16.py): the packed bytes again plus scales and offsets as bf16 pairs. Routed
    experts run through the fused MoE kernels instead and make none."""
    from quantship.kernels.wna16 import TINYGEMM_GROUPS, TINYGEMM_MAX_M
    from quantship.models.quantized import PackedLinear

    if not (TINYGEMM_MAX_M and isinstance(module, PackedLinear) and module.bits == 4 and module.group_size in TINYGEMM_GROUPS
            and module.in_features % 128 == 0 and module.out_features % 8 == 0 and ".experts." not in f".{name}"):
        return 0
    return module.out_features * module.in_features // 2 + 2 * 2 * module.weight_scale.numel()
