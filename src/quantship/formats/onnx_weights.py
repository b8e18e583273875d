"""What each Linear of a checkpoint becomes in the chosen ONNX type, read one decoder layer at a time.

A quantized checkpoint's integers are used as stored wherever the type can hold them (W4A16 and
W4A16_ASYM → MatMulNBits; W8A8 and per-channel W8A16 → int8 DequantizeLinear); a full-precision
source is rounded here with quantship's own RTN (the arithmetic `quantize --method rtn` uses).
Linears a quantized checkpoint kept in full precision stay float, as `verify` measured them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantship.errors import QuantshipError
from quantship.formats.onnx_linear import FloatWeight, Int4Weight, Int8Weight, nbits_block_ok
from quantship.models.loader import Checkpoint
from quantship.quant.rtn import rtn_quantize
from quantship.quantized_tensor import WeightQuant, dequantize

TYPES = ("fp32", "fp16", "int4", "int8-dynamic", "int8-static")
INT4_GROUPS = (128, 64, 32, 16)  # for RTN from full precision: the largest that tiles the row


@dataclass
class Stored:
    """A quantized Linear as the checkpoint stores it (integers unpacked by compressed-tensors)."""

    values: torch.Tensor  # int8 [out, in] (or float8)
    scale: torch.Tensor  # [out, groups]
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None
    bits: int
    integer: bool

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.values, self.scale, self.zero, self.g_idx).float()


def read_layer(ck: Checkpoint, index: int) -> tuple[dict[str, torch.Tensor], dict[str, Stored]]:
    """(float tensors, quantized Linears by module name), both relative to model.layers.{index}."""
    state = ck.layer_state(index)
    stored = {}
    for module in sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_scale")}):
        local = {k[len(module) + 1:]: state.pop(k) for k in list(state) if k.startswith(module + ".")}
        q, _ = ck.quantized.read_linear(f"model.layers.{index}.{module}", local)
        scale = q.scale.float()
        if scale.dim() == 1:
            scale = scale[:, None]
        zero = None if q.zero_point is None else q.zero_point.reshape(scale.shape)
        stored[module] = Stored(q.values, scale, zero, q.g_idx, q.args.num_bits, q.args.type == "int")
        if "bias" in local:
            state[f"{module}.bias"] = local.pop("bias")
    return state, stored


@dataclass
class Encoder:
    """Turns each Linear into the export type's weight; counts what it did for the summary."""

    type: str
    ranges: dict[str, tuple[float, float]] | None = None  # int8-static: module → calibrated (min, max)
    how: dict[str, int] = field(default_factory=dict)
    source: str = ""

    def encode(self, name: str, weight: torch.Tensor | Stored, bias: torch.Tensor | None):
        kind, w = self._encode(name, weight, bias)
        self.how[kind] = self.how.get(kind, 0) + 1
        return w

    def _encode(self, name: str, weight, bias):
        quantized = isinstance(weight, Stored)
        if self.type in ("fp32", "fp16") or (not quantized and self.source == "quantized"):
            kind = "dequantized to float" if quantized else ("kept float" if self.source == "quantized" else "float")
            return kind, FloatWeight(weight.dequantize() if quantized else weight.float(), bias)
        if self.type == "int4":
            return self._int4(name, weight, bias)
        return self._int8(name, weight, bias)

    def _int4(self, name: str, weight, bias):
        if isinstance(weight, Stored):
            group = weight.values.shape[1] // weight.scale.shape[1]
            if not (weight.integer and weight.bits == 4) or weight.g_idx is not None:
                why = "act-order groups (g_idx)" if weight.g_idx is not None else f"{weight.bits}-bit"
                raise QuantshipError(f"{name}: int4 export takes W4A16/W4A16_ASYM integers; this Linear is {why} "
                                     "(export fp32/fp16, or re-quantize without act-order)")
            if not nbits_block_ok(group, weight.values.shape[1]):
                raise QuantshipError(f"{name}: group {group} is not a MatMulNBits block size (16, 32, 64, 128, ...)")
            return "int4 from the checkpoint's integers", Int4Weight(weight.values, weight.scale, weight.zero, group,
                                                                     bias)
        inp = weight.shape[1]
        group = next((g for g in INT4_GROUPS if inp % g == 0), None)
        if group is None:
            return "kept float (row not a multiple of 16)", FloatWeight(weight.float(), bias)
        q = rtn_quantize(weight, WeightQuant(4, "int", True, "group", group))
        return f"int4 RTN group {group}", Int4Weight(q.values, q.scale, None, group, bias)

    def _int8(self, name: str, weight, bias):
        static = self.type == "int8-static"
        activation = activation_qparams(*self.ranges[name]) if static else None
        if isinstance(weight, Stored):
            if not (weight.integer and weight.bits == 8 and weight.scale.shape[1] == 1 and weight.zero is None):
                raise QuantshipError(f"{name}: int8 export takes per-channel symmetric int8 weights (W8A8, W8A16); "
                                     f"this Linear is {weight.bits}-bit with {weight.scale.shape[1]} group(s)")
            return "int8 from the checkpoint's integers", Int8Weight(weight.values, weight.scale[:, 0], bias,
                                                                     activation)
        q = rtn_quantize(weight, WeightQuant(8, "int", True, "channel", None), scale_dtype=torch.float32)
        return "int8 RTN per channel", Int8Weight(q.values, q.scale[:, 0], bias, activation)


def activation_qparams(low: float, high: float) -> tuple[float, int]:
    """Asymmetric int8 over [low, high] stretched to hold 0: onnxruntime.quantization's compute_scale_zp
    (QInt8 activations, MinMax calibration), computed the same way."""
    import numpy as np

    low, high = min(low, 0.0), max(high, 0.0)
    scale = (np.float64(high) - np.float64(low)) / 255.0
    if scale < np.finfo(np.float32).tiny:
        return 1.0, 0
    zero = int(np.round(-128 - np.float32(low) / scale))
    return float(np.float32(scale)), max(-128, min(127, zero))


class LayerWeights:
    """One layer's tensors for the graph builders: `tensor(name)` floats, `linear(module)` encoded.
    `scoped("self_attn.")` gives the same weights with names relative to a submodule."""

    def __init__(self, prefix: str, state: dict[str, torch.Tensor], stored: dict[str, Stored], encoder: Encoder,
                 scope: str = ""):
        self.prefix, self.state, self.stored, self.encoder, self.scope = prefix, state, stored, encoder, scope

    def scoped(self, scope: str) -> "LayerWeights":
        return LayerWeights(self.prefix, self.state, self.stored, self.encoder, self.scope + scope)

    def has(self, name: str) -> bool:
        return self.scope + name in self.state

    def has_linear(self, module: str) -> bool:
        return self.scope + module in self.stored or f"{self.scope}{module}.weight" in self.state

    def tensor(self, name: str) -> torch.Tensor:
        name = self.scope + name
        if name not in self.state:
            raise QuantshipError(f"tensor {self.prefix}.{name} is missing from the checkpoint")
        return self.state[name].float()

    def linear(self, module: str):
        weight = self.stored.get(self.scope + module) or self.tensor(f"{module}.weight")
        full = self.scope + module
        return self.encoder.encode(f"{self.prefix}.{full}", weight, self.state.get(f"{full}.bias"))
