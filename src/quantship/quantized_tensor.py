"""What a quantized weight is, as plain data every stage shares: the arguments of its grid (spelled as
compressed-tensors spells them), the values on that grid and how they dequantize, and which modules a
quantization targets.

The quantizers (quant/) make QuantizedTensors, formats/ writes and reads them, models/ runs them.
This module imports nothing of the project, so any of them may use it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # the largest float8 e4m3 value


@dataclass(frozen=True)
class WeightQuant:
    num_bits: int = 4
    type: str = "int"  # "int" or "float" (FP8 e4m3)
    symmetric: bool = True
    strategy: str = "group"  # "group", "channel" or "block" (FP8_BLOCK)
    group_size: int | None = 128
    actorder: str | None = None  # None or "static" (GPTQ); "group" only in checkpoints other tools wrote
    block: tuple[int, int] | None = None  # [out, in] block of one scale, strategy "block" only

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def groups(self, in_features: int) -> int:
        return in_features // self.group_size if self.strategy == "group" else 1

    def group_width(self, in_features: int) -> int:
        return self.group_size if self.strategy == "group" else in_features


@dataclass(frozen=True)
class ActivationQuant:
    num_bits: int = 8
    type: str = "int"
    symmetric: bool = True
    strategy: str = "token"  # "token", or "group" (per token and group of group_size channels)
    dynamic: bool = True
    group_size: int | None = None


@dataclass
class QuantizedTensor:
    """values [out, in] (int8 holding intN, or float8), scale [out, groups] (or one per 2-D block when
    args.strategy is "block"), zero_point like scale or None, g_idx [in] (the group of each input column)
    when act-order "group" permuted the groups (read from other tools' checkpoints; we never write it).

    packed_rows: instead of values, integer weights as compressed-tensors stores them, int32 [out, in/P]
    (P = 32 // bits values per word, value + 2^(bits-1) at bits i*bits; `in` a whole number of words),
    read so for the runtime's packed Linears (models/quantized.py); values is None then."""

    values: torch.Tensor | None
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    args: WeightQuant
    g_idx: torch.Tensor | None = None
    packed_rows: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.args.strategy == "block":
            return dequantize_blocks(self.values, self.scale, self.args.block, dtype)
        return dequantize(self.integer_values(), self.scale, self.zero_point, self.g_idx).to(dtype)

    def integer_values(self) -> torch.Tensor:
        """values, unpacked from packed_rows where they were kept packed (compressed-tensors' own unpacking,
        as the loader's)."""
        if self.values is not None:
            return self.values
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        bits, rows = self.args.num_bits, self.packed_rows
        return unpack_from_int32(rows, bits, torch.Size([rows.shape[0], rows.shape[1] * (32 // bits)]))


def expand_groups(t: torch.Tensor, in_features: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Per-group parameter [out, groups] → per-column [out, in]."""
    if t.shape[1] == 1:
        return t.expand(-1, in_features)
    if g_idx is not None:
        return t[:, g_idx.long()]
    return t.repeat_interleave(in_features // t.shape[1], dim=1)


def dequantize(values, scale, zero=None, g_idx=None) -> torch.Tensor:
    in_features = values.shape[1]
    q = values.float()
    if zero is not None:
        q = q - expand_groups(zero.float(), in_features, g_idx)
    return q * expand_groups(scale.float(), in_features, g_idx)


def block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Scales a [out, in] weight needs: one per block, the edge blocks partial."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_blocks(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [out, in] (float8) x the scale of each one's block → [out, in] in `dtype`.

    One block row at a time, so the only full-size allocation is the result."""
    out, inp = values.shape
    result = torch.empty(out, inp, dtype=dtype, device=values.device)
    for r in range(scale.shape[0]):
        rows = slice(r * block[0], min((r + 1) * block[0], out))
        columns = scale[r].float().repeat_interleave(block[1])[:inp]
        result[rows] = (values[rows].float() * columns).to(dtype)
    return result


def matches_target(name: str, target: str) -> bool:
    """compressed-tensors' target syntax: `Linear` (the class), an exact module name, or `re:` + a regex."""
    if target == "Linear":  # a class-name target; only Linear modules are ever asked about
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or name.endswith("." + target)
