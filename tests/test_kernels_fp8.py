"""FP8_DYNAMIC through float8 matmul (torch._scaled_mm, rowwise scales) against the quantize-dequantize
reference the CPU path runs. torch's CPU build has _scaled_mm too (rowwise scales from torch 2.13 on), so CI
checks the arithmetic; on a GPU the same tests run on CUDA."""

import pytest
import torch

from quantship.kernels import fp8
from quantship.models.quantized import QuantLinear
from quantship.quant.rtn import rtn_quantize
from quantship.quant.scheme import PRESETS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_dynamic_linear(out_features: int, in_features: int, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    q = rtn_quantize(w, PRESETS["FP8_DYNAMIC"].weights)
    bias = torch.randn(out_features, generator=g) * 0.01
    return QuantLinear(q.values, q.scale.float(), None, None, bias, activations="float")


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 32, 64), (7, 256, 128), (33, 48, 512)])
def test_scaled_linear_equals_the_quantize_dequantize_reference(rows, out_features, in_features):
    layer = _fp8_dynamic_linear(out_features, in_features, seed=rows)
    assert layer.weight_values.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (out_features, 1)
    # Outliers in some rows: the per-row scales must keep the other rows' resolution.
    x = torch.randn(2, rows, in_features, generator=torch.Generator().manual_seed(1))
    x = x * torch.logspace(-2, 2, rows)[:, None]
    x = x.bfloat16()
    expected = layer(x.float())  # CPU: the same bf16 inputs, activations and weights dequantized, float32 matmul
    device = layer.to(DEVICE)
    got = fp8.scaled_linear(x.to(DEVICE), device.weight_values, device.weight_scale, device.bias.bfloat16()).cpu()
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    error = (got.float() - expected).norm() / expected.norm()
    assert error < 1e-2  # bf16 output and bias rounding; a wrong scale or transposition gives O(1)
    values, scale = fp8.quantize_rows(x[0])
    assert scale.shape == (rows, 1) and (values.float().abs().amax(dim=1) == fp8.FP8_MAX).all()
    # e4m3 keeps 3 mantissa bits (relative step 2^-4); below 2^-6 of the range the steps are subnormal.
    error = (values.float() * scale - x[0].float()).abs()
    assert (error <= x[0].float().abs() * 2**-4 + scale * 2**-9).all()


def test_the_layer_takes_the_float8_path_where_tensor_cores_exist(monkeypatch):
    layer = _fp8_dynamic_linear(64, 128).to(DEVICE, torch.bfloat16)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEVICE)
    monkeypatch.setattr(fp8, "available", lambda x: False)
    reference = layer(x)  # dequantize + F.linear
    calls = []
    monkeypatch.setattr(fp8, "available", lambda x: True)  # as on an H200
    original = fp8.scaled_linear
    monkeypatch.setattr(fp8, "scaled_linear", lambda *a: calls.append(1) or original(*a))
    fast = layer(x)
    assert calls == [1]
    assert (fast.float() - reference.float()).norm() / reference.float().norm() < 1e-2
    odd = _fp8_dynamic_linear(40, 100).to(torch.bfloat16)  # not multiples of 16: stays on the reference path
    odd(torch.randn(3, 100).bfloat16())
    assert calls == [1]
