"""Merged projections (models/merged.py): the same logits as the unmerged model for every reference
architecture and for packed W4A16 weights; what cannot merge is left as it was; experts stay apart."""

import pytest
import torch
from torch import nn

from quantship.models.loader import load_model
from quantship.models.merged import MergedLinear, concatenate, merge_projections
from quantship.models.quantized import PackedLinear
from quantship.quant.pipeline import QuantizeOptions, quantize

from reference_models import CONFIGS


def _logits(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_merged_model_gives_the_same_logits(reference_dirs, name):
    path = reference_dirs[name][0]
    plain, merged = load_model(path, torch.float64), load_model(path, torch.float64)
    count = merge_projections(merged)
    layers = merged.model.layers
    assert count >= 2 * len(layers)  # every attention and every dense or shared MLP
    assert all(isinstance(layer.self_attn.merged, MergedLinear) for layer in layers)
    for layer in layers:  # the stacked experts of an MoE layer are left for the fused kernels
        for expert in getattr(layer.mlp, "experts", []):
            assert getattr(expert, "merged", None) is None and hasattr(expert, "gate_proj")
    ids = torch.randint(0, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(merged, ids), _logits(plain, ids), rtol=1e-10, atol=1e-10)
    assert merge_projections(merged) == 0  # merging twice changes nothing


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    out = tmp_path_factory.mktemp("merged") / "tiny-w4a16"
    quantize("tiny", out, QuantizeOptions(scheme="W4A16_ASYM", method="rtn", samples=4, seq_len=32), progress=False)
    return out


def test_packed_weights_merge_as_they_are_stored(w4a16):
    plain, merged = load_model(w4a16, torch.float32), load_model(w4a16, torch.float32)
    assert merge_projections(merged) > 0
    attn = merged.model.layers[1].self_attn
    stacked = attn.merged.linear
    parts = [getattr(plain.model.layers[1].self_attn, n) for n in plain.model.layers[1].self_attn.input_names()]
    assert type(stacked) is PackedLinear and all(type(p) is PackedLinear for p in parts)
    assert stacked.weight_zero_point is not None  # asymmetric: the zero points stacked too
    torch.testing.assert_close(stacked.dequantized_weight(torch.float32),
                               torch.cat([p.dequantized_weight(torch.float32) for p in parts]), rtol=0, atol=0)
    ids = torch.randint(3, 8000, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(merged, ids), _logits(plain, ids), rtol=1e-5, atol=1e-5)


def test_what_cannot_share_one_matmul_is_left_alone():
    linear = nn.Linear(8, 4)
    no_bias = nn.Linear(8, 4, bias=False)
    assert concatenate([linear, no_bias]) is None  # a bias on one only
    assert concatenate([linear, nn.Linear(8, 4).double()]) is None  # different dtypes
    values = torch.randint(-8, 8, (16, 128), dtype=torch.int8)
    scale = torch.rand(16, 1) + 0.1
    int4 = PackedLinear(values, scale, None, 4, 128)
    int8 = PackedLinear(values, scale, None, 8, 128)
    assert concatenate([int4, int8]) is None and concatenate([int4, no_bias]) is None
    both = concatenate([int4, int4])
    x = torch.randn(3, 128)
    torch.testing.assert_close(both(x), torch.cat([int4(x), int4(x)], dim=-1))
