"""`quantship capacity`: how many sequences of which length one GPU holds, before deploying.

For each context length L it gives two numbers, both from the engine's own formulas (engine/memory.py):
- engine: the sequences of L tokens the engine's KV cache holds at once (its own sizing: a fraction of
  the memory free after the weights). Beyond them requests wait or are preempted, never out of memory.
- out of memory: the sequences whose cache would fit if the cache took everything but the estimated
  overheads (one step's activations at that batch, CUDA graphs, int4 decode copies, the largest
  quantized Linear dequantized, allocator slack): the point past which a larger cache fraction runs
  out of memory.
and the throughput-optimal batch of a roofline model: a decode step reads the weights it uses (routed
experts only as far as the batch touches them) and every sequence's cache, at the GPU's bandwidth, or
computes 2 x active parameters per token at its BF16 peak, whichever takes longer; the optimal batch is
the smallest that reaches 95% of the best tokens/s the cache allows. It is a model, not a measurement.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quantship.deploy.gpus import Gpu, cuda_overhead, find_gpu, gpu_of_memory
from quantship.deploy.weights import LISTED, UNQUANTIZED, WeightMemory, active_parameters, weight_memory
from quantship.engine import memory
from quantship.errors import QuantshipError
from quantship.kernels import fused_moe, wna16
from quantship.models.config import ModelConfig
from quantship.models.paged import cache_width, full_kv_width, kv_bytes_per_token

DEFAULT_CONTEXTS = (4096, 8192, 32768)
BATCH_CAP = 256  # the largest batch planned, as vLLM's default max_num_seqs
ALLOCATOR_SLACK = 0.01  # share of device memory the caching allocator may hold unused (fragmentation)
OPTIMAL_SHARE = 0.95  # the optimal batch reaches this share of the best roofline throughput
OVERHEAD_SAFETY = 2.0  # a recommended fraction leaves this many times the estimated overheads free


@dataclass
class Request:
    model: str | Path = "tiny"
    scheme: str | None = None  # None: as stored
    gpu: str | None = None
    gpu_memory_gb: float | None = None
    device: str = "cuda"  # "cpu": the engine's CPU path (float32, no CUDA), with memory as its budget
    contexts: tuple[int, ...] | None = None  # None: those of DEFAULT_CONTEXTS the model takes, else its own
    batch_cap: int = BATCH_CAP
    block_size: int = 16
    max_num_batched_tokens: int = 512
    kv_cache_fraction: float | None = None  # None: recommend one
    gpus: int = 1  # tensor-parallel ranks (vLLM); the native engine runs on one
    compare_schemes: bool = True  # also list the weight memory of every scheme (deploy needs only the served one)


@dataclass
class Row:
    context: int
    kv_bytes_per_sequence: int
    seqs_engine: int
    seqs_oom: int | None
    overhead_bytes: int  # estimated overheads at batch min(seqs_engine, batch_cap) and this context
    overheads: dict = field(default_factory=dict)  # the same, by part
    optimal_batch: int | None = None
    optimal_tokens_per_s: float | None = None
    best_tokens_per_s: float | None = None
    bound: str | None = None


@dataclass
class Plan:
    model: str
    architecture: str
    device: str
    gpu: str
    gpus: int
    dtype: str
    weights: list[WeightMemory]
    served: WeightMemory
    kv: dict
    memory: dict
    rows: list[Row]
    roofline: dict | None
    recommended: dict = field(default_factory=dict)  # kv_cache_fraction, max_num_seqs, at context
    warnings: list[str] = field(default_factory=list)

    def row(self, context: int) -> Row:
        return next(r for r in self.rows if r.context == context)

    def to_dict(self) -> dict:
        return asdict(self)


def _check(req: Request, config: ModelConfig) -> list[int]:
    if req.device not in ("cuda", "cpu"):
        raise QuantshipError(f"device must be cuda or cpu, got {req.device!r}")
    if req.gpu and req.gpu_memory_gb is not None:
        raise QuantshipError("give --gpu NAME or --gpu-memory GB, not both")
    if req.gpu_memory_gb is not None and not 0 < req.gpu_memory_gb < 1e6:
        raise QuantshipError(f"--gpu-memory must be a positive number of GB, got {req.gpu_memory_gb}")
    if req.kv_cache_fraction is not None and not 0 < req.kv_cache_fraction <= 1:
        raise QuantshipError(f"--kv-cache-fraction must be in (0, 1], got {req.kv_cache_fraction}")
    for name in ("batch_cap", "block_size", "max_num_batched_tokens", "gpus"):
        if getattr(req, name) < 1:
            raise QuantshipError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(req, name)}")
    limit = config.max_position_embeddings
    if req.contexts is None:
        return [c for c in DEFAULT_CONTEXTS if c <= limit] or [limit]
    if not req.contexts or any(c < 1 for c in req.contexts):
        raise QuantshipError(f"--context wants positive token counts, got {','.join(map(str, req.contexts))}")
    too_long = [c for c in req.contexts if c > limit]
    if too_long:
        raise QuantshipError(f"--context {too_long[0]} exceeds the model's context of {limit} tokens "
                             "(max_position_embeddings in config.json)")
    return sorted(set(req.contexts))


def _kv_per_token_per_gpu(config: ModelConfig, dtype: torch.dtype, gpus: int) -> int:
    """MLA keeps the whole latent on every tensor-parallel rank; K/V heads are split across ranks."""
    whole = kv_bytes_per_token(config, dtype)
    if config.is_mla or gpus == 1:
        return whole
    heads = config.num_key_value_heads
    return whole * math.ceil(heads / gpus) // heads


def plan(req: Request) -> Plan:
    from quantship.models.bundled import resolve_model
    from quantship.models.config import load_config

    path = resolve_model(req.model)
    config = load_config(path)
    contexts = _check(req, config)
    cuda = req.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # what load_engine serves in
    gpu = _gpu(req)
    stamp = (path / "config.json").stat().st_mtime_ns  # a rewritten config.json is measured again
    weights = [_weights(path, stamp, s, dtype) for s in _schemes(config)] if req.compare_schemes else []
    served = _weights(path, stamp, req.scheme, dtype)
    per_token = _kv_per_token_per_gpu(config, dtype, req.gpus)
    # On CUDA the engine also holds each MoE router's weight in float32 (the logits' dtype) once it fuses the experts.
    per_gpu_weights = math.ceil((served.weight_bytes + (served.router_float32_bytes if cuda else 0)) / req.gpus)
    mem = _memory(req, gpu, per_gpu_weights, cuda)
    plan_ = Plan(model=str(req.model), architecture=config.architecture, device=req.device, gpu=gpu.name,
                 gpus=req.gpus, dtype=str(dtype).replace("torch.", ""), weights=weights, served=served,
                 kv=_kv(config, dtype, per_token), memory=mem, rows=[], roofline=None)
    if mem["usable_bytes"] is not None and mem["usable_bytes"] <= 0:
        raise QuantshipError(f"{gpu.name} is all taken by the driver's reservation and the CUDA context "
                             f"({(mem['driver_reserved_bytes'] + mem['context_bytes']) / 1e9:.2f} GB)")
    if mem["free_bytes"] is not None and mem["free_bytes"] <= 0:
        share = f" ({_gb(served.weight_bytes)} over {req.gpus} GPUs)" if req.gpus > 1 else ""
        raise QuantshipError(f"{_gb(per_gpu_weights)} of weights{share}, {served.description}, do not fit in the "
                             f"{_gb(mem['usable_bytes'])} a process gets of {gpu.name}"
                             + ("; quantize the model or add GPUs" if cuda else ""))
    overheads = _Overheads(config, dtype, req, served.decode_copy_bytes if cuda else 0, gpu, cuda,
                           served.dequantize_bytes, served.expert_dequantize_bytes if cuda else 0)
    fraction = req.kv_cache_fraction or _recommend_fraction(mem["free_bytes"], overheads, contexts, req, per_token)
    budget = memory.kv_cache_budget(mem["free_bytes"], fraction) if mem["free_bytes"] is not None \
        else memory.CPU_KV_CACHE_BYTES
    blocks = memory.cache_blocks(budget, per_token, req.block_size, 2**40, 1)  # memory-limited only
    mem.update(kv_cache_fraction=fraction, kv_budget_bytes=budget, num_blocks=blocks, block_size=req.block_size,
               cache_bytes=memory.cache_bytes(blocks, req.block_size, per_token))
    roof = _Roofline(config, served, per_token, gpu, req.gpus) if cuda and gpu.bandwidth else None
    for context in contexts:
        seqs = memory.sequences_held(blocks, req.block_size, context)
        parts = overheads.parts(min(max(seqs, 1), req.batch_cap), context)
        row = Row(context, -(-context // req.block_size) * req.block_size * per_token, seqs,
                  _oom_point(mem, overheads, per_token, context, req) if cuda else None, sum(parts.values()), parts)
        if seqs < 1:
            plan_.warnings.append(f"not one sequence of {context} tokens fits in the cache")
        elif mem["free_bytes"] is not None and cuda and row.overhead_bytes > mem["free_bytes"] - budget:
            plan_.warnings.append(
                f"at {context} tokens and batch {min(seqs, req.batch_cap)} the estimated overheads "
                f"({row.overhead_bytes / 2**30:.1f} GiB) exceed the reserve the cache leaves "
                f"({(mem['free_bytes'] - budget) / 2**30:.1f} GiB): lower the KV-cache fraction")
        if roof is not None and seqs >= 1:
            roof.fill(row, min(seqs, req.batch_cap))
        plan_.rows.append(row)
    if roof is not None:
        plan_.roofline = roof.describe()
    first = plan_.rows[0]
    batch = first.optimal_batch or (min(first.seqs_engine, req.batch_cap) if first.seqs_engine else None)
    plan_.recommended = {"kv_cache_fraction": fraction, "max_num_seqs": batch, "context": first.context,
                         "batch_from": "roofline optimum" if first.optimal_batch else "what the cache holds"}
    return plan_


@functools.lru_cache(maxsize=32)
def _weights(path: Path, stamp: int, scheme: str | None, dtype: torch.dtype) -> WeightMemory:
    from quantship.models.config import load_config

    return weight_memory(load_config(path), scheme, dtype, path)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.0f} GB" if n >= 100e9 else f"{n / 1e9:.3g} GB"


def _schemes(config: ModelConfig) -> list[str | None]:
    stored = config.raw.get("quantization_config")
    return ([None] if stored else []) + list(LISTED)


def _gpu(req: Request) -> Gpu:
    if req.gpu:
        return find_gpu(req.gpu)
    if req.gpu_memory_gb is not None:
        return gpu_of_memory(req.gpu_memory_gb)
    if req.device == "cpu":
        return Gpu(name="CPU", product=None, memory_mib=0)
    raise QuantshipError("give --gpu NAME (see --help for the table) or --gpu-memory GB")


def _memory(req: Request, gpu: Gpu, weights: int, cuda: bool) -> dict:
    if not cuda:  # the engine's CPU path: an explicit budget, or a fixed cache with no free memory to speak of
        usable = gpu.memory_bytes or None
        return {"total_bytes": usable, "driver_reserved_bytes": 0, "context_bytes": 0, "usable_bytes": usable,
                "weight_bytes": weights, "free_bytes": None if usable is None else usable - weights}
    o = cuda_overhead()
    usable = gpu.memory_bytes - o.driver_reserved_bytes - o.context_bytes
    return {"total_bytes": gpu.memory_bytes, "driver_reserved_bytes": o.driver_reserved_bytes,
            "context_bytes": o.context_bytes, "usable_bytes": usable, "weight_bytes": weights,
            "free_bytes": usable - weights}


def _kv(config: ModelConfig, dtype: torch.dtype, per_token: int) -> dict:
    width, full = cache_width(config), full_kv_width(config)
    layout = (f"MLA latent: kv_lora_rank {config.kv_lora_rank} + rope {config.qk_rope_head_dim}" if config.is_mla
              else f"K and V: {config.num_key_value_heads} KV heads x {config.llama_head_dim} x 2")
    return {"layout": layout, "numbers_per_token_per_layer": width, "layers": config.num_hidden_layers,
            "bytes_per_token": per_token, "full_kv_bytes_per_token": full * config.num_hidden_layers * dtype.itemsize,
            "dtype": str(dtype).replace("torch.", "")}


class _Overheads:
    """Estimated memory besides weights and cache at a batch and context (engine/memory.py's models)."""

    def __init__(self, config, dtype, req: Request, decode_copies: int, gpu: Gpu, cuda: bool, dequantize: int = 0,
                 expert_chunk: int = 0):
        self.config, self.dtype, self.req, self.copies, self.cuda = config, dtype, req, decode_copies, cuda
        self.dequantize, self.expert_chunk = dequantize, expert_chunk
        self.slack = int(ALLOCATOR_SLACK * gpu.memory_bytes) if cuda else 0

    def parts(self, batch: int, context: int) -> dict[str, int]:
        c, d, r = self.config, self.dtype, self.req
        return {"activations": memory.peak_activation_bytes(c, d, r.max_num_batched_tokens, batch, context, self.cuda),
                "cuda_graphs": memory.graph_pool_bytes(c, d, batch, context, r.block_size) if self.cuda else 0,
                "int4_decode_copies": self.copies, "dequantized_weight": self._dequantized(batch, context),
                "allocator_slack": self.slack}

    def _dequantized(self, batch: int, context: int) -> int:
        """The largest quantized Linear written out dense by a step (kernels/wna16.py from
        dequantizes_from() rows on; QuantLinear at any size): one for eager prefill chunks, and on CUDA
        one more held in the graph pool once a graph (of a decode, or of chunks with their padding) has
        that many rows. An eager prefill step's chunk of packed routed experts (kernels/fused_moe.py)
        takes the eager one's place where larger, and in the pool too where a graph has the slots for it."""
        rows = memory.graph_rows(self.config, self.dtype, batch, context, self.req.block_size) if self.cuda else 0
        pooled = self.dequantize if rows >= wna16.dequantizes_from() else 0
        c = self.config
        if self.expert_chunk and fused_moe.block_m_for(rows * c.num_experts_per_tok, c.n_routed_experts) > 16:
            pooled = max(pooled, self.expert_chunk)
        return max(self.dequantize, self.expert_chunk) + pooled

    def __call__(self, batch: int, context: int) -> int:
        return sum(self.parts(batch, context).values())


def _oom_point(mem: dict, overheads: _Overheads, per_token: int, context: int, req: Request) -> int:
    """The most sequences whose cache plus the overheads of running them (at most batch_cap in one
    step) fit in free memory."""
    blocks_per_seq = -(-context // req.block_size)

    def fits(n: int) -> bool:
        return memory.cache_bytes(n * blocks_per_seq, req.block_size, per_token) + \
            overheads(min(max(n, 1), req.batch_cap), context) <= mem["free_bytes"]

    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _recommend_fraction(free: int | None, overheads: _Overheads, contexts: list[int], req: Request,
                        per_token: int) -> float:
    """The largest KV-cache fraction (0.05 to 0.95) whose reserve holds OVERHEAD_SAFETY times the
    estimated overheads of the batch it admits, at every planned context."""
    if free is None or not overheads.cuda:
        return memory.KV_CACHE_FRACTION
    for percent in range(95, 4, -1):
        budget = memory.kv_cache_budget(free, percent / 100)
        if budget < 2 * req.block_size * per_token:
            break
        blocks = memory.cache_blocks(budget, per_token, req.block_size, 2**40, 1)
        batches = [(min(max(memory.sequences_held(blocks, req.block_size, c), 1), req.batch_cap), c) for c in contexts]
        if all(OVERHEAD_SAFETY * overheads(b, c) <= free - budget for b, c in batches):
            return percent / 100
    return 0.05


class _Roofline:
    def __init__(self, config: ModelConfig, served: WeightMemory, per_token: int, gpu: Gpu, gpus: int):
        self.config, self.per_token, self.gpu, self.gpus = config, per_token, gpu, gpus
        fixed = served.weight_bytes - served.embedding_bytes - served.routed_expert_bytes
        self.fixed, self.experts = fixed / gpus, served.routed_expert_bytes / gpus
        self.flops_per_token = 2 * active_parameters(config) / gpus
        self.peak = gpu.bf16_tflops * 1e12 if gpu.bf16_tflops else None

    def _attention_flops(self, context: int) -> float:
        c = self.config
        per_key = (c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim) if c.is_mla
                   else 2 * c.num_attention_heads * c.llama_head_dim)
        return 2 * context * per_key * c.num_hidden_layers / self.gpus

    def step(self, batch: int, context: int) -> tuple[float, str]:
        c = self.config
        touched = 1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch if c.n_routed_experts else 0
        read = self.fixed + self.experts * touched + batch * context * self.per_token
        t_mem = read / self.gpu.bandwidth
        t_compute = batch * (self.flops_per_token + self._attention_flops(context)) / self.peak if self.peak else 0
        return (t_mem, "memory") if t_mem >= t_compute else (t_compute, "compute")

    def fill(self, row: Row, max_batch: int) -> None:
        rates = [b / self.step(b, row.context)[0] for b in range(1, max_batch + 1)]
        best = max(rates)
        batch = next(b for b, r in enumerate(rates, 1) if r >= OPTIMAL_SHARE * best)
        row.optimal_batch, row.optimal_tokens_per_s, row.best_tokens_per_s = batch, rates[batch - 1], best
        row.bound = self.step(batch, row.context)[1]

    def describe(self) -> dict:
        return {"bandwidth_bytes_per_s": self.gpu.bandwidth, "bandwidth_source": self.gpu.bandwidth_source,
                "bandwidth_label": self.gpu.bandwidth_label,
                "bf16_tflops": self.gpu.bf16_tflops, "active_parameters": int(self.flops_per_token / 2 * self.gpus),
                "note": "a model: decode step time = max(bytes read / bandwidth, FLOPs / BF16 peak); "
                        "not a measurement"}


__all__ = ["DEFAULT_CONTEXTS", "Plan", "Request", "Row", "UNQUANTIZED", "plan"]
