"""Quantized Linear layers as the model definition runs them. formats/compressed_tensors.py reads them
from checkpoints as QuantizedTensors; `runtime_linear` turns one into the layer that runs it.

Weight-only integer weights (W4A16, W8A16) are held packed (PackedLinear: 8 or 4 values per int32,
in the kernel layout of kernels/wna16.py: the checkpoint's words transposed at load); on CUDA the
forward runs the fused Triton kernel, elsewhere it dequantizes and calls F.linear. Everything else
(float8, W8A8, act-order g_idx) stays one value per byte (QuantLinear) and dequantizes inside the
layer. W8A8/FP8 schemes also quantize activations per token on the fly, as vLLM does, so measured
fidelity matches what is served.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from quantship.kernels import fp8, int8, on_gpu_kernel, wna16
from quantship.models.fp8_block import Fp8BlockLinear
from quantship.quantized_tensor import FP8_MAX, ActivationQuant, QuantizedTensor, dequantize


def quantize_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Dynamic per-token quantize-dequantize: int8 symmetric or float8 e4m3."""
    if kind == "float":
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / FP8_MAX
        return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    values, step = int8.quantize_rows(x)
    return (values.float() * step).to(x.dtype)


class QuantLinear(nn.Module):
    """A Linear whose weight is stored quantized. Buffers are named as in the checkpoint."""

    cpu_kernel = False  # True (use_cpu_kernels): W8A8 on the CPU as one integer matmul (kernels/int8.py)

    def __init__(self, values, scale, zero=None, g_idx=None, bias=None, activations: str | None = None):
        super().__init__()
        self.out_features, self.in_features = values.shape
        self.register_buffer("weight_values", values)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", zero)
        self.register_buffer("weight_g_idx", g_idx)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.activations = activations  # None (weight-only), "int" or "float"

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight_values, self.weight_scale, self.weight_zero_point, self.weight_g_idx).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_tensor_cores(x):
            return fp8.scaled_linear(x, self.weight_values, self.weight_scale, self.bias)
        if self.cpu_kernel and x.device.type == "cpu":  # set only where int8_matmul() holds
            return int8.scaled_linear(x, self.weight_values, self.weight_scale, self.bias)
        if self.activations:
            x = quantize_activations(x, self.activations)
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def int8_matmul(self) -> bool:
        """W8A8 (int8 activations per token, int8 weights per channel) the CPU's integer matmul takes."""
        return self.activations == "int" and int8.supports(self.weight_values, self.weight_scale,
                                                            self.weight_zero_point, self.weight_g_idx)

    def fp8_tensor_cores(self, x: torch.Tensor) -> bool:
        """FP8_DYNAMIC (float8 weights with one scale per output channel, float8 activations per token)
        runs as one float8 matmul where the GPU has float8 tensor cores."""
        return (self.activations == "float" and self.weight_values.dtype == torch.float8_e4m3fn
                and self.weight_scale.shape[1] == 1 and self.weight_g_idx is None and fp8.available(x)
                and fp8.shapes_fit(self.in_features, self.out_features))

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must cast scales only: integer and float8 values keep their dtype.
        values, g_idx = self.weight_values, self.weight_g_idx
        zero = self.weight_zero_point
        super()._apply(fn, recurse)
        device = self.weight_scale.device
        self.weight_values = values.to(device)
        self.weight_g_idx = None if g_idx is None else g_idx.to(device)
        self.weight_zero_point = None if zero is None else zero.to(device)
        return self

    def extra_repr(self) -> str:
        kind = "fp8" if self.weight_values.dtype == torch.float8_e4m3fn else "int"
        return f"in={self.in_features}, out={self.out_features}, {kind}, groups={self.weight_scale.shape[1]}"


class PackedLinear(nn.Module):
    """A Linear whose integer weight stays packed on the device (weight-only: activations untouched)."""

    use_kernel = True  # False: CUDA takes the dequantize + F.linear reference path too (for comparisons)
    cpu_kernel = False  # True (use_cpu_kernels): on the CPU through PyTorch's int4/int8 kernels, bf16 inputs

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                 group_size: int, bias: torch.Tensor | None = None):
        super().__init__()
        self._hold(wna16.pack(values, bits), values.shape[1], scale, zero, bits, group_size, bias)

    def _hold(self, packed: torch.Tensor, in_features: int, scale: torch.Tensor, zero: torch.Tensor | None,
              bits: int, group_size: int, bias: torch.Tensor | None) -> None:
        """Take the weight in the kernel layout; scale and zero [N, G] as read, transposed here."""
        self.out_features, self.in_features = packed.shape[1], in_features
        self.bits, self.group_size = bits, group_size
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scale.t().contiguous())
        self.register_buffer("weight_zero_point", None if zero is None else zero.to(torch.int8).t().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._decode = None  # (weight, scales_and_zeros) in tinygemm's layout, made on the first CUDA decode

    @classmethod
    def from_rows(cls, rows: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                  group_size: int, bias: torch.Tensor | None = None) -> PackedLinear:
        """From compressed-tensors' stored words ([N, K/P] int32, K a whole number of words): the kernel
        layout holds the same words transposed, so loading is one transpose, no unpack and repack."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(wna16.from_rows(rows), rows.shape[1] * (32 // bits), scale, zero, bits, group_size, bias)
        return layer

    @classmethod
    def concatenated(cls, parts: list[PackedLinear]) -> PackedLinear:
        """One PackedLinear whose outputs are the parts' side by side. The packed layout holds an output
        per column ([K/P, N]), so the parts' packed values, scales and zero points concatenate along N
        as they are; they must share bits, group size, input size and zero points' presence."""
        first = parts[0]
        merged = cls.__new__(cls)
        nn.Module.__init__(merged)
        merged.in_features, merged.bits, merged.group_size = first.in_features, first.bits, first.group_size
        merged.out_features = sum(p.out_features for p in parts)
        for name in ("weight_packed", "weight_scale", "weight_zero_point"):
            tensors = [getattr(p, name) for p in parts]
            merged.register_buffer(name, None if tensors[0] is None else torch.cat(tensors, dim=1))
        # cat lays its result out along N: the merged words lie as the parts' do
        merged.weight_packed = wna16.hold(merged.weight_packed, wna16.held_along_k(first.weight_packed))
        biases = [p.bias for p in parts]
        merged.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases), requires_grad=False)
        merged._decode = None
        merged.cpu_kernel = all(p.cpu_kernel for p in parts)  # the engine merges after load_engine chose
        return merged

    def decode_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight also in the layout of PyTorch's own kernels: on a GPU int4 for tinygemm, which at batch
        sizes up to 8 measured as fast as or faster than our Triton tiles on an H200 (benchmarks/
        kernel_wna16.py); on the CPU int4 or per-channel int8 for its CPU kernels (used once
        use_cpu_kernels asked for them). Costs a second copy of the packed bytes; `quantship info` and
        the engine report both."""
        if self._decode is None:
            if self.weight_packed.device.type == "cpu":
                made = wna16.cpu_pack(self.weight_packed, self.weight_scale, self.weight_zero_point, self.bits,
                                      self.in_features, self.group_size)
            else:
                made = self.bits == 4 and wna16.tinygemm_pack(self.weight_packed, self.weight_scale,
                                                              self.weight_zero_point, self.in_features,
                                                              self.group_size)
            self._decode = made or False
        return self._decode or None

    def _apply(self, fn, recurse=True):
        self._decode = None  # made for the device and dtype the module had: made again on the next forward
        return super()._apply(fn, recurse)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return wna16.dequantize(self.weight_packed, self.weight_scale, self.weight_zero_point, self.bits,
                                self.in_features, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if on_gpu_kernel(x) and self.use_kernel:
            rows = x.numel() // self.in_features
            decode = self.decode_weights() if x.dtype == torch.bfloat16 and rows <= wna16.TINYGEMM_MAX_M else None
            if decode is not None:
                y = torch._weight_int4pack_mm(x.reshape(rows, -1), decode[0], self.group_size, decode[1])
                y = y.reshape(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias
            y = wna16.matmul(x, self.weight_packed, self.weight_scale, self.weight_zero_point, self.bits,
                             self.in_features, self.group_size)
            return y if self.bias is None else y + self.bias
        if x.device.type == "cpu" and self.cpu_kernel and self.use_kernel and (decode := self.decode_weights()):
            y = wna16.cpu_matmul(x, decode, self.bits, self.group_size, self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def gated(self, both: torch.Tensor) -> torch.Tensor | None:
        """This layer of SiLU(gate) * up, from an MLP's gate and up side by side in `both` [..., 2 * in]: on
        the GPU the GEMV makes the product as it loads x (one launch fewer per MLP and decode step).
        None where the call would not take the GEMV (more rows, the CPU): the caller multiplies first."""
        rows = both.numel() // (2 * self.in_features)
        if not (on_gpu_kernel(both) and self.use_kernel and wna16.takes_gated(rows, both, self.bits)):
            return None
        y = wna16.matmul(both, self.weight_packed, self.weight_scale, self.weight_zero_point, self.bits,
                         self.in_features, self.group_size, gated=True)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int{self.bits} packed, group={self.group_size}"


def use_cpu_kernels(model: nn.Module) -> int:
    """For serving on the CPU: packed Linears multiply through PyTorch's CPU kernels (int4, and int8 per
    channel), with bf16 activations (what W4A16/W8A16 mean, and what the GPU kernels do), instead of
    dequantizing the whole weight on every call: about 100x faster per 6.7B-shaped layer at one row and
    2-4x faster than the float32 layer itself; the bundled model decodes 1.6-2.4x faster, 0.8-1.4x its
    float32 original (benchmarks/cpu_packed.py). W8A8 Linears multiply int8 by int8 (kernels/int8.py).
    The quantizer and the verifier keep the exact float32 path, which the transformers and ONNX
    references are checked against. Returns how many layers take a kernel (shapes the kernels cannot take
    stay exact)."""
    taken = 0
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            layer.cpu_kernel = True
            taken += layer.decode_weights() is not None
        elif isinstance(layer, QuantLinear) and layer.int8_matmul():
            layer.cpu_kernel = True
            taken += 1
    return taken


def _packable(bits: int, group_size: int, in_features: int) -> bool:
    return wna16.supports(bits, group_size, in_features) and in_features % group_size == 0


def quant_linear(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                 g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None, activations: str | None = None,
                 bits: int = 8) -> nn.Module:
    """The runtime Linear for quantized tensors: packed where the fused kernel can take them."""
    in_features = values.shape[1]
    group_size = -(-in_features // scale.shape[1])
    weight_only_int = values.dtype == torch.int8 and activations is None and g_idx is None
    if weight_only_int and _packable(bits, group_size, in_features):
        return PackedLinear(values, scale, zero, bits, group_size, bias)
    return QuantLinear(values, scale, zero, g_idx, bias, activations)


def runtime_linear(q: QuantizedTensor, activations: ActivationQuant | None = None,
                   bias: torch.Tensor | None = None) -> nn.Module:
    """The layer that runs a quantized weight: FP8 blocks as Fp8BlockLinear, the rest through quant_linear.
    `activations`: how the layer's inputs are quantized on the fly (None: weight-only)."""
    if q.args.strategy == "block":
        group = activations.group_size if activations else None
        return Fp8BlockLinear(q.values, q.scale.float(), q.args.block, bias, activation_group=group)
    bits = q.args.num_bits
    if q.packed_rows is not None:
        in_features = q.packed_rows.shape[1] * (32 // bits)
        group_size = -(-in_features // q.scale.shape[1])
        if _packable(bits, group_size, in_features):
            return PackedLinear.from_rows(q.packed_rows, q.scale, q.zero_point, bits, group_size, bias)
        q = replace(q, values=q.integer_values(), packed_rows=None)
    return quant_linear(q.values, q.scale, q.zero_point, q.g_idx, bias,
                        activations=activations.type if activations else None, bits=bits)


def weight_bytes(module: nn.Module) -> int:
    """Bytes a model's weights take in memory: parameters, the buffers of quantized Linears, and the
    decode copies PackedLinear made for tinygemm."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [t for m in module.modules() if isinstance(m, PackedLinear) and m._decode for t in m._decode]
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_memory(module: nn.Module) -> dict:
    """What the loaded weights hold, for start-up logs and `info`: total bytes, and of them the packed
    W4A16/W8A16 Linears (values + scales + zero points) and how many there are."""
    packed = [m for m in module.modules() if isinstance(m, PackedLinear)]
    return {"weight_bytes": weight_bytes(module), "packed_linears": len(packed),
            "packed_linear_bytes": sum(weight_bytes(m) for m in packed)}
