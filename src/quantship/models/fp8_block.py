"""FP8 weights with one scale per 2-D block: DeepSeek's published checkpoints and FP8_BLOCK outputs.

DeepSeek-V3/V3.1/R1 store each decoder Linear as `weight` (float8 e4m3) and `weight_scale_inv`
(float32, one per 128x128 block, edge blocks partial): the real weight is the value times its
block's number ("inverse" because quantizing divided by it). compressed-tensors' FP8_BLOCK is the
same arithmetic under the name `weight_scale`. The loader turns a DeepSeek source into plain
Linears one layer at a time (`dequantize_state`); `Fp8BlockLinear` runs an FP8_BLOCK checkpoint
kept in FP8, quantizing its inputs per token and group of 128 on the fly, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantship.errors import QuantshipError
from quantship.quantized_tensor import FP8_MAX, block_grid, dequantize_blocks

SCALE_SUFFIX = ".weight_scale_inv"


def is_fp8_block_source(qconfig: dict | None) -> bool:
    return isinstance(qconfig, dict) and qconfig.get("quant_method") == "fp8"


@dataclass(frozen=True)
class Fp8Source:
    """The `quantization_config` of a DeepSeek FP8 checkpoint, checked."""

    block: tuple[int, int]

    @classmethod
    def from_config(cls, qconfig: dict, source: Path) -> Fp8Source:
        def fail(problem: str) -> QuantshipError:
            return QuantshipError(f"quantization_config (fp8): {problem}", source)

        if qconfig.get("fmt", "e4m3") != "e4m3":
            raise fail(f"fmt {qconfig.get('fmt')!r} is not supported (only e4m3)")
        if qconfig.get("activation_scheme", "dynamic") != "dynamic":
            raise fail(f"activation_scheme {qconfig.get('activation_scheme')!r} is not supported (only dynamic)")
        block = qconfig.get("weight_block_size")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise fail(f"weight_block_size must be two positive integers, got {block!r}")
        return cls((block[0], block[1]))


def dequantize_state(state: dict[str, torch.Tensor], block: tuple[int, int], prefix: str,
                     files: Mapping[str, Path], held: Callable[[str], bool] | None = None) -> None:
    """Replace every (weight, weight_scale_inv) pair of a layer's state by the float32 weight, in place;
    the pairs of the modules `held` names are checked and left as they are (models/held.py).

    Names are relative to the layer; `prefix` + name is the checkpoint name, for error messages."""
    kept = set()
    for key in [k for k in state if k.endswith(SCALE_SUFFIX)]:
        module = key[: -len(SCALE_SUFFIX)]
        weight_key = module + ".weight"
        where = files.get(prefix + key, "")
        if weight_key not in state:
            raise QuantshipError(f"{prefix}{key} has no {weight_key} beside it", where)
        values, scale = state.pop(weight_key), state.pop(key)
        if values.dtype != torch.float8_e4m3fn or values.dim() != 2:
            raise QuantshipError(f"{prefix}{weight_key} should be a 2-D float8_e4m3fn tensor beside its "
                                 f"weight_scale_inv, got {values.dtype} {list(values.shape)}", where)
        expected = block_grid(tuple(values.shape), block)
        if tuple(scale.shape) != expected:
            raise QuantshipError(f"{prefix}{key} has shape {list(scale.shape)}; {block[0]}x{block[1]} blocks over "
                                 f"{list(values.shape)} need {list(expected)}", where)
        if held is not None and held(module):
            state[weight_key], state[key] = values, scale
            kept.add(weight_key)
            continue
        state[weight_key] = dequantize_blocks(values, scale, block)
    stray = [k for k, t in state.items() if t.dtype == torch.float8_e4m3fn and k not in kept]
    if stray:
        raise QuantshipError(f"{prefix}{stray[0]} is float8 without a weight_scale_inv",
                             files.get(prefix + stray[0], ""))


def quantize_activations_per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """Dynamic FP8 quantize-dequantize per token and group of `group` input channels (the last may be short)."""
    width = x.shape[-1]
    padded = math.ceil(width / group) * group
    xf = F.pad(x.float(), (0, padded - width)).unflatten(-1, (-1, group))
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (xf / scale).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2)[..., :width].to(x.dtype)


class Fp8BlockLinear(nn.Module):
    """A Linear stored as FP8 values with per-block float32 scales (compressed-tensors FP8_BLOCK)."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None, activation_group: int | None = 128):
        super().__init__()
        self.out_features, self.in_features = values.shape
        self.block, self.activation_group = block, activation_group
        self.register_buffer("weight", values)
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_group:
            x = quantize_activations_per_group(x, self.activation_group)
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) moves these tensors but must not cast them: the values stay float8 and the
        # scales float32 (as vLLM keeps them); only a bias follows the model dtype.
        values, scale = self.weight, self.weight_scale
        super()._apply(fn, recurse)
        device = self.weight.device
        self.weight, self.weight_scale = values.to(device), scale.to(device)
        return self

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 blocks {self.block[0]}x{self.block[1]}"
