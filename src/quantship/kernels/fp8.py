"""FP8 (e4m3) matmul with per-token activation scales and per-channel weight scales (FP8_DYNAMIC).

Each row of the input is scaled by its own amax / 448 and rounded to float8, exactly as the
quantize-dequantize reference does (models/quantized.py); then one `torch._scaled_mm` multiplies
float8 by float8 with float32 accumulation and applies both scale vectors on the way out (the
"rowwise" scaling of Hopper's FP8 tensor cores: 2x bf16's peak, and half the weight bytes read).
The reference instead dequantizes the weight to the activation dtype and calls F.linear, which
rounds each weight to bf16 first; the two agree to bf16 rounding.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def available(x: torch.Tensor) -> bool:
    """Float8 tensor cores: Ada and Hopper (sm_89+), 16-bit activations."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def shapes_fit(in_features: int, out_features: int) -> bool:
    """_scaled_mm wants both matrix dimensions it reduces over and writes in multiples of 16."""
    return in_features % 16 == 0 and out_features % 16 == 0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] → (float8 values [M, K], float32 scales [M, 1]) with one scale per row."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16) @ (weight [N, K] float8 x weight_scale [N, 1]).T (+ bias) → [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    values, scale = quantize_rows(rows)
    # Rowwise scaling produces bf16; weight.t() is the column-major [K, N] the kernel expects.
    y = torch._scaled_mm(values, weight.t(), scale_a=scale, scale_b=weight_scale.float().reshape(1, -1),
                         out_dtype=torch.bfloat16)
    y = y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
