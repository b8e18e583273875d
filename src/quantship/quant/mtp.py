"""What `quantize --mtp keep|quantize|drop` does with DeepSeek-V3's multi-token-prediction layer.

keep (the default): copied in the source precision, so vLLM can still draft with it. From an FP8
  source its FP8 Linears are written as they are, renamed to compressed-tensors' FP8_BLOCK
  (`weight_scale_inv` → `weight_scale`, same numbers) under a config group of their own; from a
  bf16 source the whole layer is on the ignore list.
quantize: its decoder block is quantized like a main layer, calibrated on what it really reads:
  eh_proj(enorm(embedding of token t+1) ‖ hnorm(the main model's final hidden state at t)).
drop: not written, and num_nextn_predict_layers becomes 0.
`eh_proj` and `shared_head.head` are never quantized (vLLM builds them as plain Linears).
"""

from __future__ import annotations

import dataclasses

import torch

from quantship.models.layers import RMSNorm
from quantship.models.loader import Checkpoint
from quantship.models.mtp import MTPLayer
from quantship.quant.scheme import Scheme, get_scheme

MTP_MODES = ("keep", "quantize", "drop")
MTP_IGNORE = ("re:.*\\.eh_proj$", "re:.*\\.shared_head\\.head$")


def layer_pattern(index: int) -> str:
    return f"re:model\\.layers\\.{index}\\."


def fp8_block_group(ck: Checkpoint, indices: list[int]) -> tuple[Scheme, list[str]]:
    """The config group that covers an FP8 source's MTP Linears copied as they are (the router is on
    the default ignore list; eh_proj is bf16 in the source and excluded by the pattern)."""
    base = get_scheme("FP8_BLOCK")
    scheme = dataclasses.replace(base, weights=dataclasses.replace(base.weights, block=ck.fp8_source.block))
    return scheme, [f"re:model\\.layers\\.{i}\\.(self_attn|mlp)\\." for i in indices]


def copy_layer(ck: Checkpoint, index: int, writer) -> None:
    """Every stored tensor of layer `index`, bytes unchanged; FP8 scales take compressed-tensors' name."""
    for name, tensor in ck.read(ck.layer_tensors[index]).items():
        if name.endswith(".weight_scale_inv"):
            name = name[: -len("_inv")]
        writer.add(name, tensor)


@torch.no_grad()
def calibration_input(layer: MTPLayer, tokens: torch.Tensor, hidden: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, batch: int = 8) -> torch.Tensor:
    """[N, T-1, H]: the MTP block's input at positions 0..T-2, from the last main layer's output `hidden`
    [N, T, H] (before the final norm) and the calibration tokens [N, T]."""
    device = next(layer.parameters()).device  # the activations may live on the host (pipeline._activation_store)
    norm = RMSNorm(hidden.shape[-1], eps).to(device)
    norm.weight.data = norm_weight.to(device, hidden.dtype)
    parts = []
    for s in range(0, hidden.shape[0], batch):
        ids = tokens[s:s + batch, 1:].to(device)
        parts.append(layer.block_input(ids, norm(hidden[s:s + batch, :-1].to(device))).to(hidden.device))
    return torch.cat(parts)
