"""The noise-floor model: the base run in a lower precision (bf16 by default), built from the base already
in memory rather than read from disk a second time. Verify compares it with the base exactly as it compares
the quantized model, so the report shows how much KL mere rounding causes."""

from __future__ import annotations

import copy

import torch
from torch import nn

from quantship.models.loader import Checkpoint


def floor_model(base: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype, floor_dtype: torch.dtype, device):
    """`checkpoint.load_model(floor_dtype, device)`, bit for bit, given `base` is that checkpoint loaded in `dtype`."""
    if floor_dtype == dtype:
        return base  # a fresh load would be identical; evaluate.compare_each reuses the base's logits for it
    if dtype != torch.float32:
        # Casting an already-rounded copy (say bf16 to fp16) would round twice and differ from a fresh load.
        return checkpoint.load_model(dtype=floor_dtype, device=device)
    # An fp32 copy holds every checkpoint value exactly (torch casts fp64 through fp32 anyway), so casting it
    # equals casting the file.
    return cast_copy(base, floor_dtype)


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`copy.deepcopy(model).to(dtype)`, made one decoder layer at a time.

    Cost: the copy kept is the base's parameter count at dtype's width (bf16 from an fp32 base: half the base,
    e.g. ~32 GB for a 16B-parameter model), as the second load from disk cost. Copying whole and then casting
    would also hold a second fp32 base for a moment; per layer, the transient is one layer plus embeddings.
    """
    layers = model.model.layers
    # Seeding deepcopy's memo with the layer list makes the outer copy take the empty list as is.
    out = copy.deepcopy(model, {id(layers): nn.ModuleList()}).to(dtype)
    out.model.layers = nn.ModuleList(copy.deepcopy(layer).to(dtype) for layer in layers)
    return out
