"""Fused MoE kernels against the plain expert loop; expert alignment on the device.

On CPU these run under Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

import pytest
import torch

from quantship.kernels import fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytest.importorskip("triton")


def routing(n, experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(n)])
    weights = torch.rand(n, top_k, generator=g)
    return weights.to(DEVICE), indices.to(DEVICE)


@pytest.mark.parametrize("n,experts,top_k,block_m", [(1, 8, 2, 16), (7, 8, 3, 16), (50, 4, 2, 16), (300, 4, 2, 64)])
def test_alignment_places_every_slot_once_in_its_experts_blocks(n, experts, top_k, block_m):
    _, indices = routing(n, experts, top_k, seed=n)
    sorted_ids, block_expert = fused_moe.align_by_expert(indices, experts, block_m)
    slots = n * top_k
    real = sorted_ids[sorted_ids < slots].long()
    assert sorted(real.tolist()) == list(range(slots))
    flat = indices.flatten()
    for b, expert in enumerate(block_expert.tolist()):
        block = sorted_ids[b * block_m:(b + 1) * block_m].long()
        members = block[block < slots]
        if expert == experts:  # past the end: padding only
            assert members.numel() == 0
        else:
            assert (flat[members] == expert).all()
    assert sorted_ids.numel() == block_expert.numel() * block_m


@pytest.mark.parametrize("n,experts,top_k,hidden,inter", [(1, 8, 2, 64, 32), (6, 8, 3, 96, 48), (33, 4, 2, 64, 80),
                                                          (260, 4, 2, 32, 16)])
def test_fused_moe_equals_the_expert_loop(n, experts, top_k, hidden, inter):
    g = torch.Generator().manual_seed(hidden + n)
    x = torch.randn(n, hidden, generator=g).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(DEVICE)
    weights, indices = routing(n, experts, top_k, seed=n + 1)
    expected = fused_moe.reference(x, gate_up, down, weights, indices)
    dtypes = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
    for dtype in dtypes:
        out = fused_moe.fused_moe(x.to(dtype), gate_up.to(dtype), down.to(dtype), weights, indices)
        assert out.dtype == dtype and out.shape == x.shape
        error = (out.float() - expected).norm() / expected.norm()
        assert error < (1e-5 if DEVICE == "cpu" else 2e-2), (dtype, error.item())


def test_the_bundled_moe_layer_gives_the_same_output_fused_and_looped():
    """The DeepSeek MoE module's own routing, through the fused kernels and through its expert loop."""
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model

    model = load_model(TINY_DIR, torch.float32)
    layer = next(layer for layer in model.model.layers if hasattr(layer.mlp, "fusable"))
    moe = layer.mlp
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, indices = moe.gate(x)
    looped = moe.routed(x, weights, indices)
    assert moe.fusable()
    fused = fused_moe.fused_moe(x, *moe.stacked_weights(), weights, indices)
    assert torch.allclose(fused, looped, atol=1e-5, rtol=1e-4)
    assert torch.equal(moe.routed(x, weights, indices), looped)  # the experts now hold views: same answer
