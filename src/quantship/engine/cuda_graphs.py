"""CUDA graphs for engine steps: one replay instead of hundreds of kernel launches.

An eager decode step of a 6.7B model spends ~45 ms of host time launching ~7 ms of GPU work, and an
eager 128-token prefill of V2-Lite's 27 layers spends about four times its kernels' time on the host.
A graph is captured the first time a shape bucket is needed (or ahead of traffic, `capture`):

- decode-only steps, per (batch size bucket, key length bucket): a step pads its sequences up to the
  bucket with dummy rows that write into a scratch block no sequence owns, and pads the key axis;
- steps of prompt chunks, per (sequences, longest chunk, key length) bucket, up to
  PREFILL_GRAPH_TOKENS padded tokens and PREFILL_GRAPH_BYTES of estimated temporaries (the pool keeps
  the largest graph's): each chunk is padded to the chunk bucket, the padding computed and written into
  the scratch block.

MoE models are graphed only where every MoE layer takes the fused kernels (kernels/fused_moe.py:
routing stays on the device); the host loop over quantized experts reads counts on the host, which
a graph cannot replay. Everything else runs eagerly, as on CPU.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from quantship.engine.memory import step_activation_bytes
from quantship.engine.sequence import Sequence
from quantship.models.causal_lm import CausalLM
from quantship.models.paged import PagedBatch


@functools.cache
def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One warm-up stream per device for every capture of every engine in the process: cuBLAS keeps a
    workspace for each stream it has run on, held by the allocator until the process ends (measured on
    an H200: 35 captures, each on a stream of its own, held 1.15 GB that no sequence could use)."""
    return torch.cuda.Stream(device)


def record(forward, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, object]:
    """Capture forward() as a graph in the shared memory pool: (graph, its output, the pool). Run twice
    first, outside the graph, for lazy allocations and kernel selection (the split-K workspace of
    kernels/wna16.py grows only then)."""
    side = warmup_stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out, graph.pool()


def buckets(limit: int, first: int) -> list[int]:
    """first, 2*first, 4*first, ... until one reaches limit."""
    out = [first]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


def key_buckets(max_len: int, block_size: int) -> list[int]:
    """The key length buckets of every graph: 256 keys (or a block) and doublings up to max_len."""
    return buckets(max_len, max(256, block_size))


def bucket(limits: list[int], value: int) -> int | None:
    """The smallest bucket that holds value, None past the last."""
    return next((b for b in limits if b >= value), None)


# Steps of chunks replay graphs up to this many padded tokens (sequences x longest chunk, both rounded up
# to their buckets): past it a step's kernels take long enough for the host to keep ahead of them.
PREFILL_GRAPH_TOKENS = 512
PREFILL_GRAPH_SEQS = 8
FIRST_CHUNK_BUCKET = 16
# Temporaries of one graphed step of chunks, as engine/memory.py estimates them: the graph pool keeps
# the largest graph's, for good, so longer contexts' chunks run eagerly instead.
PREFILL_GRAPH_BYTES = 128 << 20


def prefill_shapes(config, dtype: torch.dtype, max_len: int, block_size: int) -> set[tuple[int, int, int]]:
    """The (sequences, chunk, keys) buckets steps of chunks are graphed at (the engine and the capacity
    planner both read this)."""
    shapes = set()
    for key_len in key_buckets(max_len, block_size):
        for size in buckets(PREFILL_GRAPH_SEQS, 1):
            for queries in buckets(min(key_len, PREFILL_GRAPH_TOKENS // size), FIRST_CHUNK_BUCKET):
                if (size * queries <= PREFILL_GRAPH_TOKENS and queries <= key_len and
                        step_activation_bytes(config, dtype, size, queries, key_len, cuda=True) <= PREFILL_GRAPH_BYTES):
                    shapes.add((size, queries, key_len))
    return shapes


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: list[torch.Tensor], block_size: int, scratch_block: int,
                 max_seqs: int, max_len: int):
        self.model, self.kv, self.block_size, self.scratch = model, kv, block_size, scratch_block
        self.device = kv[0].device
        self.seq_buckets = buckets(max_seqs, 1)
        self.key_buckets = key_buckets(max_len, block_size)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None

    @staticmethod
    def supported(model: CausalLM) -> bool:
        moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "enable_fused_kernels")]
        return next(model.parameters()).is_cuda and all(m.fused is not None for m in moe)

    def fits(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        decode_only = all(count == 1 and seq.num_computed + 1 == seq.num_tokens for seq, count in scheduled)
        longest = max(seq.num_tokens for seq, _ in scheduled)
        return decode_only and len(scheduled) <= self.seq_buckets[-1] and longest <= self.key_buckets[-1]

    def _capture(self, size: int, key_len: int) -> tuple:
        # The graph's only input: one row per sequence of [token id, context length after the step, block
        # table...]. The step's batch (slots, masks, key slots) is derived from it on the device inside the
        # graph (PagedBatch.for_decode), so a step uploads this one small tensor. Rows start as padding.
        width = -(-key_len // self.block_size)
        staged = torch.zeros(size, 2 + width, dtype=torch.long, device=self.device)
        staged[:, 1], staged[:, 2:] = 1, self.scratch

        def forward() -> torch.Tensor:
            ids, lengths, tables = staged[:, 0], staged[:, 1], staged[:, 2:]
            batch, positions = PagedBatch.for_decode(self.kv, tables, lengths, self.block_size, key_len)
            return self.model.lm_head(self.model.hidden_states(ids[None], positions, batch)[0])

        graph, logits, self.pool = record(forward, self.device, self.pool)
        return graph, staged, logits

    def capture(self, max_seqs: int | None = None, max_key_len: int | None = None) -> int:
        """Capture ahead of traffic every batch bucket up to max_seqs (default all) at every key bucket up
        to max_key_len (default the first); returns how many graphs that added."""
        def upto(limits: list[int], limit: int | None) -> list[int]:
            return limits if limit is None else limits[:next((i for i, b in enumerate(limits) if b >= limit),
                                                             len(limits) - 1) + 1]

        added = 0
        with torch.inference_mode():
            for key_len in upto(self.key_buckets, max_key_len or self.key_buckets[0]):
                for size in upto(self.seq_buckets, max_seqs):
                    if (size, key_len) not in self.graphs:
                        self.graphs[(size, key_len)] = self._capture(size, key_len)
                        added += 1
        return added

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S, V] of a decode-only step; `tokens` [S] on the device in place of each sequence's last
        token (the previous step's, not read on the host yet)."""
        n = len(scheduled)
        size = next(b for b in self.seq_buckets if b >= n)
        key_len = next(b for b in self.key_buckets if b >= max(seq.num_tokens for seq, _ in scheduled))
        if (size, key_len) not in self.graphs:
            self.graphs[(size, key_len)] = self._capture(size, key_len)
        graph, staged, logits = self.graphs[(size, key_len)]
        upload(stage_rows(scheduled, size, staged.shape[1] - 2, self.scratch), staged)
        if tokens is not None:
            staged[:n, 0].copy_(tokens)
        graph.replay()
        return logits[:n]


def upload(rows: torch.Tensor, staged: torch.Tensor) -> None:
    """Host rows into a graph's input without waiting for the GPU: through pinned memory, non-blocking.
    PyTorch's blocking copy from pageable memory synchronises the stream, which would wait for every step
    still running: a step run ahead (engine.py) must not."""
    if staged.is_cuda:
        staged.copy_(rows.pin_memory(), non_blocking=True)  # the pinned block is reused only once copied
    else:
        staged.copy_(rows)


def stage_rows(scheduled: list[tuple[Sequence, int]], size: int, width: int, scratch: int) -> torch.Tensor:
    """[size, 2 + width] host rows [last token, context length, block table padded with the scratch
    block]; rows past the scheduled sequences are padding that writes into the scratch block. Filled in
    numpy, row slices at a time: 2.5x faster than nested lists at 64 sequences."""
    rows = np.full((size, 2 + width), scratch, dtype=np.int64)
    rows[:, 0], rows[:, 1] = 0, 1
    for i, (seq, _) in enumerate(scheduled):
        table = seq.block_table[:width]
        rows[i, 0], rows[i, 1] = seq.token_ids[-1], seq.num_tokens
        rows[i, 2:2 + len(table)] = table
    return torch.from_numpy(rows)


class PrefillGraphs:
    """Graphs of steps whose sequences compute chunks (prompts, or what the prefix cache left of them),
    in the decode graphs' memory pool."""

    def __init__(self, decode: DecodeGraphs, max_len: int):
        self.decode, self.model, self.kv = decode, decode.model, decode.kv
        self.block_size, self.scratch, self.device = decode.block_size, decode.scratch, decode.device
        self.key_buckets = decode.key_buckets
        self.shapes = prefill_shapes(self.model.config, self.kv[0].dtype, max_len, self.block_size)
        self.graphs: dict[tuple[int, int, int], tuple] = {}
        self.logits: torch.Tensor | None = None  # [PREFILL_GRAPH_SEQS, V], every graph's output

    def shape_of(self, scheduled: list[tuple[Sequence, int]]) -> tuple[int, int, int] | None:
        """The step's (sequences, chunk, keys) bucket, None where it is not graphed."""
        size = bucket(buckets(PREFILL_GRAPH_SEQS, 1), len(scheduled))
        queries = bucket(buckets(PREFILL_GRAPH_TOKENS, FIRST_CHUNK_BUCKET), max(count for _, count in scheduled))
        key_len = bucket(self.key_buckets, max(seq.num_computed + count for seq, count in scheduled))
        shape = (size, queries, key_len)
        return shape if shape in self.shapes else None

    def fits(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        return self.shape_of(scheduled) is not None

    def _capture(self, size: int, queries: int, key_len: int) -> tuple:
        # The only input: a row per sequence of [first position, token count, the chunk's tokens padded to
        # `queries`, block table...]; rows start as padding (no tokens, the scratch block).
        width = -(-key_len // self.block_size)
        staged = torch.zeros(size, 2 + queries + width, dtype=torch.long, device=self.device)
        staged[:, 2 + queries:] = self.scratch
        if self.logits is None:
            self.logits = torch.empty(PREFILL_GRAPH_SEQS, self.model.config.vocab_size, dtype=self.kv[0].dtype,
                                      device=self.device)

        def forward() -> torch.Tensor:
            starts, counts = staged[:, 0], staged[:, 1]
            ids, tables = staged[:, 2:2 + queries], staged[:, 2 + queries:]
            batch, positions = PagedBatch.for_prefill(self.kv, tables, starts, counts, self.block_size, queries,
                                                      key_len, self.scratch)
            hidden = self.model.hidden_states(ids.reshape(1, -1), positions, batch)[0]
            last = torch.arange(size, device=self.device) * queries + (counts - 1).clamp(min=0)
            return self.logits[:size].copy_(self.model.lm_head(hidden[last]))

        graph, _, self.decode.pool = record(forward, self.device, self.decode.pool)
        return graph, staged

    def capture(self, max_key_len: int | None = None) -> int:
        """Capture ahead of traffic the graphs of one sequence's chunks, every chunk bucket, at every key
        bucket up to max_key_len (default the first); returns how many that added."""
        added = 0
        limit = bucket(self.key_buckets, max_key_len or self.key_buckets[0]) or self.key_buckets[-1]
        with torch.inference_mode():
            for shape in sorted(self.shapes):
                if shape[0] == 1 and shape[2] <= limit and shape not in self.graphs:
                    self.graphs[shape] = self._capture(*shape)
                    added += 1
        return added

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor | None]:
        """What ModelRunner.run returns for the step: the sequences whose chunk reached their end, and
        their logits."""
        shape = self.shape_of(scheduled)
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(*shape)
        graph, staged = self.graphs[shape]
        upload(stage_chunks(scheduled, shape[0], shape[1], staged.shape[1] - 2 - shape[1], self.scratch), staged)
        graph.replay()
        done = [i for i, (seq, count) in enumerate(scheduled) if seq.num_computed + count == seq.num_tokens]
        if not done:
            return [], None
        logits = self.logits[:len(done)] if done == list(range(len(done))) else \
            self.logits[torch.tensor(done, device=self.device)]
        return [scheduled[i][0] for i in done], logits


def stage_chunks(scheduled: list[tuple[Sequence, int]], size: int, queries: int, width: int,
                 scratch: int) -> torch.Tensor:
    """[size, 2 + queries + width] host rows [first position, count, tokens padded with 0, block table
    padded with the scratch block]; rows past the scheduled sequences are padding (count 0)."""
    rows = np.zeros((size, 2 + queries + width), dtype=np.int64)
    rows[:, 2 + queries:] = scratch
    for i, (seq, count) in enumerate(scheduled):
        start, table = seq.num_computed, seq.block_table[:width]
        rows[i, 0], rows[i, 1] = start, count
        rows[i, 2:2 + count] = seq.token_ids[start:start + count]
        rows[i, 2 + queries:2 + queries + len(table)] = table
    return torch.from_numpy(rows)
