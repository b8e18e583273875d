"""Per-layer sensitivity: KL at the output when only one module group of one layer is quantized.

Units are (layer, group) with groups attention, dense_mlp, experts (all routed experts) and
shared_experts. A unit is measured by swapping the quantized modules into the base model, running
a few chunks, and swapping back; the base's own log-probabilities are computed once.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from quantship.models.deepseek import MoE
from quantship.verify.metrics import token_kl


def units(model) -> list[tuple[int, str, str]]:
    """(layer index, group, module path inside the layer) for every unit the model has."""
    out = []
    for i, layer in enumerate(model.model.layers):
        out.append((i, "attention", "self_attn"))
        if isinstance(layer.mlp, MoE):
            out.append((i, "experts", "mlp.experts"))
            if layer.mlp.shared_experts is not None:
                out.append((i, "shared_experts", "mlp.shared_experts"))
        else:
            out.append((i, "dense_mlp", "mlp"))
    return out


def unit_name(layer: int, group: str) -> str:
    return f"model.layers.{layer}.{group}"


@contextmanager
def swapped(base: nn.Module, quant: nn.Module, layer: int, path: str):
    """Temporarily put quant's module at `path` of layer `layer` into base."""
    owner_path, _, attr = f"model.layers.{layer}.{path}".rpartition(".")
    owner = base.get_submodule(owner_path)
    original = getattr(owner, attr)
    setattr(owner, attr, quant.get_submodule(f"model.layers.{layer}.{path}"))
    try:
        yield
    finally:
        setattr(owner, attr, original)


@torch.no_grad()
def measure(base, quant, rows: torch.Tensor, device="cpu", progress=None) -> list[dict]:
    """Ranked [{module, layer, group, kl_mean}], most sensitive first."""
    rows = rows.to(device)
    reference = [base(r[None])[0] for r in rows]
    results = []
    for layer, group, path in units(base):
        with swapped(base, quant, layer, path):
            kl = torch.cat([token_kl(ref, base(r[None])[0]) for ref, r in zip(reference, rows)])
        results.append({"module": unit_name(layer, group), "layer": layer, "group": group,
                        "kl_mean": float(kl.mean())})
        if progress is not None:
            progress()
    return sorted(results, key=lambda r: r["kl_mean"], reverse=True)
