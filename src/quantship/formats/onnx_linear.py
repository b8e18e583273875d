"""One Linear layer as ONNX nodes, in each of the export types.

- float: MatMul against the transposed weight (fp32 or fp16).
- int4: `com.microsoft` MatMulNBits. Our signed integers v in [-8, 7] are stored as v + 8 (two per
  byte, the even column in the low nibble); with the default zero point 8 ONNX Runtime computes
  (q - 8) * scale = v * scale, our dequantized weight bit for bit. Asymmetric zero points z are
  stored as z + 8 the same way, so q - zp = v - z.
- int8: DequantizeLinear of int8 [in, out] with per-output-channel scales, then MatMul; the input
  goes through a QuantizeLinear/DequantizeLinear pair first, per token (dynamic: scale = max|x| /
  127 of each row, what quantship's W8A8 and vLLM do) or per tensor with a scale and zero point
  calibrated beforehand (static, as onnxruntime.quantization.quantize_static writes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto, helper

from quantship.formats.onnx_graph import MS_DOMAIN, Graph


@dataclass
class FloatWeight:
    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None


@dataclass
class Int4Weight:
    values: torch.Tensor  # int8 [out, in], each in [-8, 7]
    scale: torch.Tensor  # [out, in / group]
    zero: torch.Tensor | None  # int8 like scale, asymmetric only
    group: int
    bias: torch.Tensor | None = None


@dataclass
class Int8Weight:
    values: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # [out] (per output channel)
    bias: torch.Tensor | None = None
    activation: tuple[float, int] | None = None  # static (scale, zero point); None = dynamic per token


def pack_nibbles(q: torch.Tensor) -> np.ndarray:
    """uint4 values (0..15) [..., 2n] → bytes [..., n]: element 2i in the low nibble, 2i+1 in the high."""
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).numpy()


def matmul_nbits_tensors(w: Int4Weight, dtype) -> dict[str, np.ndarray]:
    """B [N, blocks, group/2] uint8, scales [N * blocks], zero_points [N * ceil(blocks/2)] uint8."""
    out, inp = w.values.shape
    blocks = inp // w.group
    tensors = {
        "B": pack_nibbles((w.values.to(torch.int16) + 8).reshape(out, blocks, w.group)),
        "scales": w.scale.float().numpy().astype(dtype).reshape(-1),
    }
    if w.zero is not None:
        zero = w.zero.to(torch.int16) + 8
        if blocks % 2:
            zero = torch.cat((zero, torch.full((out, 1), 8, dtype=zero.dtype)), dim=1)
        tensors["zero_points"] = pack_nibbles(zero).reshape(-1)
    return tensors


def nbits_block_ok(group: int, in_features: int) -> bool:
    """MatMulNBits takes power-of-two blocks of at least 16 that tile the row."""
    return group >= 16 and group & (group - 1) == 0 and in_features % group == 0


def emit_linear(g: Graph, x: str, path: str, w, dtype) -> str:
    """x [..., in] → [..., out]; `path` names the nodes (/model/layers.0/self_attn/q_proj)."""
    if isinstance(w, Int4Weight):
        out, inp = w.values.shape
        t = matmul_nbits_tensors(w, dtype)
        inputs = [x, g.weight(f"{path}.weight_Q4", t["B"]), g.weight(f"{path}.weight_scales", t["scales"])]
        if "zero_points" in t:
            inputs.append(g.weight(f"{path}.weight_zp", t["zero_points"]))
        y = g.op("MatMulNBits", inputs, f"{path}/MatMulNBits", domain=MS_DOMAIN, K=inp, N=out, bits=4,
                 block_size=w.group, accuracy_level=0)
    elif isinstance(w, Int8Weight):
        y = _int8_matmul(g, x, path, w, dtype)
    else:
        weight = g.weight(f"{path}.weight", w.weight.float().t().numpy().astype(dtype))
        y = g.op("MatMul", [x, weight], f"{path}/MatMul")
    if w.bias is not None:
        y = g.op("Add", [y, g.weight(f"{path}.bias", w.bias.float().numpy().astype(dtype))], f"{path}/Add")
    return y


def _int8_matmul(g: Graph, x: str, path: str, w: Int8Weight, dtype) -> str:
    fp16 = dtype == np.float16
    if fp16:  # opset 17's QuantizeLinear/DequantizeLinear take float32 only
        x = g.op("Cast", [x], f"{path}/CastIn", to=TensorProto.FLOAT)
    if w.activation is None:
        x = _dynamic_qdq(g, x, path)
    else:
        scale, zero = w.activation
        s, z = g.const(np.float32(scale), np.float32), g.const(np.int8(zero), np.int8)
        q = g.op("QuantizeLinear", [x, s, z], f"{path}/input_QuantizeLinear")
        x = g.op("DequantizeLinear", [q, s, z], f"{path}/input_DequantizeLinear")
    values = g.weight(f"{path}.weight_quantized", w.values.to(torch.int8).t().contiguous().numpy())
    scale = g.weight(f"{path}.weight_scale", w.scale.float().reshape(-1).numpy())
    zero = g.weight(f"{path}.weight_zero_point", np.zeros(w.values.shape[0], dtype=np.int8))
    weight = g.op("DequantizeLinear", [values, scale, zero], f"{path}/weight_DequantizeLinear", axis=1)
    y = g.op("MatMul", [x, weight], f"{path}/MatMul")
    return g.op("Cast", [y], f"{path}/CastOut", to=TensorProto.FLOAT16) if fp16 else y


def _dynamic_qdq(g: Graph, x: str, path: str) -> str:
    """Per-token symmetric int8: each row of x [..., K] gets scale max|row| / 127 (at least 1e-8 / 127)."""
    p = f"{path}/input_dynamic"
    k = g.op("Slice", [g.op("Shape", [x], f"{p}/Shape"), g.const([-1]), g.const([2**62])], f"{p}/K")
    rows = g.op("Reshape", [x, g.op("Concat", [g.const([-1]), k], f"{p}/RowShape", axis=0)], f"{p}/Rows")
    amax = g.op("ReduceMax", [g.op("Abs", [rows], f"{p}/Abs")], f"{p}/ReduceMax", axes=[1], keepdims=0)
    scale = g.op("Div", [g.op("Max", [amax, g.const(np.float32(1e-8), np.float32)], f"{p}/Clamp"),
                         g.const(np.float32(127.0), np.float32)], f"{p}/Scale")
    zero = g.op("ConstantOfShape", [g.op("Shape", [scale], f"{p}/ScaleShape")], f"{p}/Zero",
                value=helper.make_tensor("zero", TensorProto.INT8, [1], [0]))
    q = g.op("QuantizeLinear", [rows, scale, zero], f"{p}/QuantizeLinear", axis=0)
    d = g.op("DequantizeLinear", [q, scale, zero], f"{p}/DequantizeLinear", axis=0)
    return g.op("Reshape", [d, g.op("Shape", [x], f"{p}/InShape")], f"{p}/Restore")
