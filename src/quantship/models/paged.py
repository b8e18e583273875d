"""How the model reads and writes a paged cache during one engine step.

The engine packs the new tokens of several sequences into one flat row [N] (sequence by sequence),
so every Linear and the MoE run once over the whole batch. Attention is the only per-sequence part:
queries are gathered into a padded [S, Q] layout and each sequence's keys are gathered from its
cache blocks into [S, K]; one masked SDPA call then covers prefill chunks and decodes alike. A step
that mixes decodes with prompt chunks runs them as separate parts (PagedBatch.each): padded together,
every decode would be padded to the chunk's length, and with 255 decodes beside a 257-token chunk
of an 8K prompt a step of the V2-Lite shape took 6 s on an H200 instead of a fraction of one.

Each layer's cache is one tensor [num_slots, width] (slot = block * block_size + offset): the MLA
latent (c_kv ‖ k_rope) for DeepSeek, (k ‖ v) for Llama.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from quantship.kernels import on_gpu_kernel, paged_attention
from quantship.models.config import ModelConfig

# cuDNN's SDPA builds a new execution graph for every new key length (about 1.3 ms of host time per
# call on an H200 machine), and a decode step has a new key length every time: keep it out.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cache_width(config: ModelConfig) -> int:
    """Numbers cached per token per layer: the MLA latent, or Llama's full K and V."""
    if config.is_mla:
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_key_value_heads * config.llama_head_dim


def full_kv_width(config: ModelConfig) -> int:
    """What an MLA model would cache per token per layer without the latent trick (K and V per head)."""
    if config.is_mla:
        return config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    return cache_width(config)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return cache_width(config) * config.num_hidden_layers * dtype.itemsize


def use_decode_kernel(q: torch.Tensor) -> bool:
    """The decode kernel runs on CUDA (a function, so a test can send CPU tensors to Triton's interpreter)."""
    return on_gpu_kernel(q)


@dataclass
class PagedBatch:
    kv: list[torch.Tensor]  # per layer [num_slots, width]
    slots: torch.Tensor  # [N] where each new token's entry is written
    # The attention fields; None in a step split into parts, whose parts have their own.
    query_index: torch.Tensor | None  # [S, Q] flat index of each sequence's queries (padding points at 0)
    query_valid: torch.Tensor | None  # [S, Q] bool
    unpad_index: torch.Tensor | None  # [N] positions of the valid queries in the flattened [S * Q]
    key_slots: torch.Tensor | None  # [S, K] cache slot of each sequence's keys, positions 0..K-1
    mask: torch.Tensor | None  # [S, 1, Q, K] bool: causal and within the sequence's context
    key_lengths: torch.Tensor | None  # [S] int32: keys each sequence's last query sees (its context after the step)
    # True where `mask` is the plain causal mask for every sequence (each computes its positions 0 .. Q-1 and
    # sees no padded key: a prompt prefilled whole, or equal prompts), so attention can say so instead of
    # passing the mask: SDPA's flash kernel takes no mask, and with one the masked half is computed too. (A
    # later chunk's mask is causal from the bottom right; torch.nn.attention.bias says that, but importing
    # it imports the compiler, a second of a server's time.)
    causal: bool = False
    _rope: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # (part, first flat token, end): consecutive sequences that all decode, or all prefill chunks.
    parts: tuple[tuple[PagedBatch, int, int], ...] = ()

    def each(self, q: torch.Tensor, attend) -> torch.Tensor:
        """attend(q, batch) → [n, ...] over this step's queries [N, ...], run once per part of a split
        step (the parts are consecutive ranges of the flat tokens, so their outputs concatenate in order)."""
        if not self.parts:
            return attend(q, self)
        return torch.cat([attend(q[first:end], part) for part, first, end in self.parts])

    def cos_sin(self, rotary, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope tables of this step's positions, computed once for all layers (one model, one rope)."""
        if self._rope is None:
            cos, sin = rotary.cos_sin(positions)
            self._rope = (cos.to(dtype), sin.to(dtype))
        return self._rope

    def write(self, layer: int, entries: torch.Tensor) -> None:
        self.kv[layer][self.slots] = entries.to(self.kv[layer].dtype)

    def context(self, layer: int) -> torch.Tensor:
        """[S, K, width]: every cached entry each sequence attends to, this step's included."""
        return self.kv[layer][self.key_slots]

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """[N, ...] → [S, Q, ...]."""
        return flat[self.query_index]

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[S, Q, ...] → [N, ...], in the flat order (an index, not a mask: no device sync)."""
        return padded.flatten(0, 1)[self.unpad_index]

    def takes_decode(self, q: torch.Tensor, kv_heads: int) -> bool:
        """Whether attention of [N, H, D] queries runs through the decode kernel: one query per sequence
        (not a step made of parts), on CUDA."""
        return use_decode_kernel(q) and self.query_index is not None and self.query_index.shape[1] == 1 \
            and paged_attention.supports(q.shape[2], q.shape[1], kv_heads)

    def decode_attention(self, layer: int, q: torch.Tensor, kv_heads: int, scale: float,
                         rope: tuple | None = None) -> torch.Tensor | None:
        """For a decode step on CUDA (one query per sequence): attention over [N, H, D] queries read
        straight from the paged cache (kernels/paged_attention.py), the queries rotated there where `rope`
        (cos, sin, interleaved) is given. None where the general path must run."""
        if not self.takes_decode(q, kv_heads):
            return None
        return paged_attention.decode_attention(q, self.kv[layer], self.key_slots, self.key_lengths, kv_heads, scale,
                                                rope=rope)

    def takes_latent_decode(self, q: torch.Tensor, rank: int, rope: int) -> bool:
        """Whether MLA's attention of this step runs through the decode kernel: one query per sequence
        (not a step made of parts), on CUDA."""
        return use_decode_kernel(q) and self.query_index is not None and self.query_index.shape[1] == 1 \
            and paged_attention.mla_supports(rank, rope)

    def latent_decode_attention(self, layer: int, q: torch.Tensor, rank: int, scale: float,
                                rope: tuple | None = None) -> torch.Tensor | None:
        """MLA's decode step on CUDA: absorbed queries [N, H, rank + rope] (or [N, H, rank] and `rope`, the
        queries' rope part to rotate in the kernel: paged_attention.mla_decode_attention) over the latent
        entries read straight from the paged cache → [N, H, rank]. None where the general path must run."""
        width = rope[0].shape[-1] if rope is not None else q.shape[-1] - rank
        if not self.takes_latent_decode(q, rank, width):
            return None
        return paged_attention.mla_decode_attention(q, self.kv[layer], self.key_slots, self.key_lengths, rank, scale,
                                                    rope=rope)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [S, H, Q, D] over k/v [S, H, K, *] under this step's causal-and-length mask."""
        with sdpa_kernel(ATTENTION_BACKENDS):
            if self.causal:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale)

    def shared_attention(self, q: torch.Tensor, context: torch.Tensor, value_width: int, scale: float,
                         fold: bool | None = None) -> torch.Tensor:
        """q [S, H, Q, D] over keys [S, K, D] every head shares (MLA's latent), values their first
        `value_width` columns → [S, H, Q, value_width]. On the CPU (fold) the heads fold into the query
        axis, so the keys are multiplied as they are: SDPA's math backend, given the keys expanded per
        head, scales a copy of them for every head (a tenth of a CPU decode step of the bundled model at
        batch 32). On CUDA SDPA over the expanded keys: the H200 out-of-memory points the capacity
        planner is fitted to ran that path."""
        s, heads, queries, dim = q.shape
        if not (q.device.type == "cpu" if fold is None else fold):
            keys = context[:, None].expand(-1, heads, -1, -1)
            return self.attention(q, keys, keys[..., :value_width], scale)
        keys = context.shape[1]
        scores = torch.bmm(q.reshape(s, heads * queries, dim), context.transpose(1, 2)).mul_(scale)
        scores = scores.view(s, heads, queries, keys).masked_fill_(~self.mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # no row is all masked: padding queries see key 0
        del scores
        out = torch.bmm(weights.view(s, heads * queries, keys), context[..., :value_width])
        return out.view(s, heads, queries, value_width)

    @classmethod
    def build(cls, kv: list[torch.Tensor], block_tables: list[list[int]], starts: list[int], counts: list[int],
              block_size: int, device: torch.device, key_len: int | None = None,
              split: bool = True) -> tuple[PagedBatch, torch.Tensor]:
        """Sequence s computes tokens starts[s] .. starts[s]+counts[s]-1 and sees keys 0 .. that end.

        key_len pads the key axis (masked), for CUDA graphs that need fixed shapes. With `split`, a step
        mixing decodes (one token) and chunks (more) is made of parts, each run of them padded alone.
        Returns the batch and the positions [N] of the flat tokens.
        """
        runs = _runs(counts)
        if split and len(runs) > 1 and key_len is None:
            parts, positions, first = [], [], 0
            for i, j in runs:
                part, at = cls.build(kv, block_tables[i:j], starts[i:j], counts[i:j], block_size, device, split=False)
                end = first + sum(counts[i:j])
                parts.append((part, first, end))
                positions.append(at)
                first = end
            slots = torch.cat([part.slots for part, _, _ in parts])
            return cls(kv, slots, None, None, None, None, None, None, parts=tuple(parts)), torch.cat(positions)
        s, q, k = len(counts), max(counts), max(a + n for a, n in zip(starts, counts))
        k = max(k, key_len or 0)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        offsets = torch.tensor([0] + counts[:-1], dtype=torch.long).cumsum(0)
        start = torch.tensor(starts, dtype=torch.long)
        count = torch.tensor(counts, dtype=torch.long)
        qpos = torch.arange(q)
        query_valid = qpos[None, :] < count[:, None]
        query_index = torch.where(query_valid, offsets[:, None] + qpos, 0)
        query_positions = torch.where(query_valid, start[:, None] + qpos, 0)  # padding sees key 0 only: no NaN rows
        positions = query_positions[query_valid]
        kpos = torch.arange(k)
        blocks = tables.gather(1, (kpos // block_size).clamp(max=width - 1).expand(s, -1))
        key_slots = blocks * block_size + kpos % block_size
        mask = kpos[None, None, :] <= query_positions[:, :, None]
        slots = key_slots.gather(1, query_positions)[query_valid]
        unpad_index = query_valid.flatten().nonzero()[:, 0]
        causal = set(starts) == {0} and len(set(counts)) == 1 and k == counts[0]
        batch = cls(kv, slots.to(device), query_index.to(device), query_valid.to(device), unpad_index.to(device),
                    key_slots.to(device), mask[:, None].to(device), (start + count).to(torch.int32).to(device),
                    causal=causal)
        return batch, positions.to(device)

    @classmethod
    def for_decode(cls, kv: list[torch.Tensor], tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                   key_len: int) -> tuple[PagedBatch, torch.Tensor]:
        """The batch of a decode-only step made from device tensors alone (what `build` makes from host
        lists for count 1 per sequence): tables [S, W] block ids, lengths [S] each sequence's context
        after the step. Static shapes and no host reads, so a CUDA graph captures it and a step
        uploads only its token ids, lengths and tables."""
        s, width = tables.shape
        device = tables.device
        kpos = torch.arange(key_len, device=device)
        blocks = tables.gather(1, (kpos // block_size).clamp(max=width - 1).expand(s, -1))
        key_slots = blocks * block_size + kpos % block_size
        positions = lengths - 1
        mask = (kpos[None, :] <= positions[:, None])[:, None, None, :]
        slots = key_slots.gather(1, positions[:, None])[:, 0]
        rows = torch.arange(s, device=device)
        batch = cls(kv, slots, rows[:, None], torch.ones(s, 1, dtype=torch.bool, device=device), rows, key_slots,
                    mask, lengths.to(torch.int32))
        return batch, positions

    @classmethod
    def for_prefill(cls, kv: list[torch.Tensor], tables: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                    block_size: int, queries: int, key_len: int, scratch_block: int) -> tuple[PagedBatch, torch.Tensor]:
        """The batch of a step of chunks made from device tensors alone, at fixed shapes for a CUDA graph:
        sequence s computes `counts[s]` tokens from `starts[s]`, its tokens padded to `queries`, so the
        flat tokens are [S * queries] row by row (padding included: it is computed, and written into the
        scratch block). Padding queries sit at position 0 and see key 0 alone, as in `build`; a padding
        row (count 0) has only padding. Needs starts + counts <= key_len."""
        s, width = tables.shape
        device = tables.device
        qpos = torch.arange(queries, device=device)
        valid = qpos[None, :] < counts[:, None]
        query_positions = torch.where(valid, starts[:, None] + qpos, 0)
        kpos = torch.arange(key_len, device=device)
        blocks = tables.gather(1, (kpos // block_size).clamp(max=width - 1).expand(s, -1))
        key_slots = blocks * block_size + kpos % block_size
        mask = (kpos[None, None, :] <= query_positions[:, :, None])[:, None]
        scratch = scratch_block * block_size + qpos % block_size
        slots = torch.where(valid, key_slots.gather(1, query_positions), scratch).flatten()
        flat = torch.arange(s * queries, device=device)
        batch = cls(kv, slots, flat.view(s, queries), valid, flat, key_slots, mask, (starts + counts).to(torch.int32))
        return batch, query_positions.flatten()


def _runs(counts: list[int]) -> list[tuple[int, int]]:
    """[i, j) ranges of consecutive sequences that all decode (count 1) or all prefill (count > 1)."""
    runs = []
    for i, count in enumerate(counts):
        if runs and (counts[runs[-1][0]] == 1) == (count == 1):
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(i, j) for i, j in runs]


def dense_weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight matrix of a Linear or a QuantLinear (dequantized), for absorbing it into attention."""
    dequantize = getattr(linear, "dequantized_weight", None)
    return dequantize(dtype) if dequantize is not None else linear.weight.to(dtype)
