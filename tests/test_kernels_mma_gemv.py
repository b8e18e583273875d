"""The int4 GEMV on tensor cores (kernels.wna16_mma): against dequantize + matmul in float32 on a GPU (its inline
PTX cannot run under the interpreter; tests/test_kernels_compile.py compiles it for sm_90 on the CPU and checks the
layout its PTX relies on), and where it declines a call, the table's other kernels take it."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from quantship.kernels import wna16, wna16_mma
from quantship.kernels.wna16 import Blocks

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
TILE = Blocks("gemv_mma", 16, 256, 256, -1, 4, 1)


def _weight(n, k, group, asym, seed):
    g = torch.Generator().manual_seed(seed)
    packed = wna16.pack(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8), 4)
    groups = -(-k // group)
    scale = (torch.rand(groups, n, generator=g) * 0.1 + 0.01).bfloat16()
    zero = torch.randint(-8, 8, (groups, n), generator=g, dtype=torch.int8) if asym else None
    return packed, scale, zero


def test_group_steps_divide_the_group():
    assert wna16_mma.group_steps(128, 4096) == 4
    assert wna16_mma.group_steps(64, 4096) == 2
    assert wna16_mma.group_steps(96, 4096) == 3
    assert wna16_mma.group_steps(32, 4096) == 1
    assert wna16_mma.group_steps(160, 4096) == 1  # 5 K steps a group: only single steps stay inside one
    assert wna16_mma.group_steps(4096, 4096) == 4  # one scale for all of K


def test_a_tile_of_other_than_whole_warp_reps_is_declined():
    """A program's outputs are whole reps of its 4 warps' 32 each (a 64-output tile would be no tensor at all), at
    least one K step deep, its words in one or two stages of registers."""
    assert wna16_mma.tile_fits(TILE) and wna16_mma.tile_fits(Blocks("gemv_mma", 16, 128, 32, -1, 4, 1))
    assert wna16_mma.tile_fits(Blocks("gemv_mma", 16, 128, 1024, -1, 4, 2))
    assert not wna16_mma.tile_fits(Blocks("gemv_mma", 16, 64, 128, -1, 4, 1))
    assert not wna16_mma.tile_fits(Blocks("gemv_mma", 16, 256, 16, -1, 4, 1))
    assert not wna16_mma.tile_fits(Blocks("gemv_mma", 16, 256, 256, -1, 4, 3))


def test_it_declines_what_it_cannot_take():
    """float32 x (and the CPU): the call goes to the shared table's kernel for its rows, with the right answer."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed, scale, zero = _weight(64, 128, 128, False, 0)
    packed, scale = packed.to(device), scale.to(device)
    x = torch.randn(1, 128, device=device)
    assert not wna16_mma.fits(x, packed, 4, 128, 128)
    assert not wna16_mma.fits(x.bfloat16().cpu(), packed.cpu(), 4, 128, 128)  # off the GPU
    y = wna16.matmul(x, packed, scale, zero, 4, 128, 128, blocks=TILE)
    ref = wna16.reference_matmul(x, packed, scale, zero, 4, 128, 128)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5
    # 12 rows of a gated input: the shared table's 16-row tile, which takes x as it is, gets SwiGLU's product
    x = torch.randn(12, 256, device=device)
    y = wna16.matmul(x, packed, scale, zero, 4, 128, 128, blocks=TILE, gated=True)
    ref = wna16.reference_matmul(F.silu(x[:, :128]) * x[:, 128:], packed, scale, zero, 4, 128, 128)
    assert ((y - ref).norm() / ref.norm()).item() < (3e-3 if device == "cuda" else 1e-5)  # tf32 products on a GPU


@pytest.mark.skipif(not GPU, reason="inline PTX for mma.sync: a GPU of compute capability 8.0 or later")
@pytest.mark.parametrize("n,k,group,asym", [(4096, 4096, 128, False), (1000, 352, 32, True), (388, 2048, 64, False),
                                            (12288, 4096, 128, True), (4096, 11008, 128, False), (256, 512, 512, False)])
def test_it_equals_dequantize_and_matmul(n, k, group, asym):
    packed, scale, zero = _weight(n, k, group, asym, n + k)
    packed, scale = packed.cuda(), scale.cuda()
    zero = zero.cuda() if zero is not None else None
    x_all = torch.randn(16, k, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()
    # two stages: each group's words loaded while the group before computes; scaled: values scaled before their
    # products, in bf16
    for blocks in (TILE, Blocks("gemv_mma", 16, 128, 128, -1, 4, 1), Blocks("gemv_mma", 16, 512, 512, -1, 4, 1),
                   Blocks("gemv_mma", 16, 128, 1024, -1, 4, 2), Blocks("gemv_mma", 16, 256, 256, -1, 4, 2),
                   Blocks("gemv_mma", 16, 256, 256, -1, 4, 1, scaled_values=True),
                   Blocks("gemv_mma", 16, 128, 1024, -1, 4, 2, scaled_values=True)):
        for m in (1, 2, 5, 8, 9, 16):
            x = x_all[:m]
            assert wna16_mma.takes(x, packed, scale, zero, 4, group, k, blocks)
            ref = wna16.reference_matmul(x, packed, scale, zero, 4, k, group)
            out = wna16_mma.matmul(x, packed, scale, zero, k, group, blocks)
            assert out.shape == (m, n) and out.dtype == torch.bfloat16
            error = ((out.float() - ref).norm() / ref.norm()).item()
            assert error < 1e-2, (blocks, m, error)
            # twice in a row: the K split's workspace and counters were left as found (the atomic adds' order
            # may differ: within rounding)
            again = wna16_mma.matmul(x, packed, scale, zero, k, group, blocks).float()
            assert ((again - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(not GPU, reason="inline PTX for mma.sync: a GPU of compute capability 8.0 or later")
def test_values_scaled_before_their_products_round_as_dequantize_does():
    """Scaled in bf16 before the products ((q - z) * s, one rounding), the values are dequantize's own: the result
    is the bf16 reference's but for the order of float32 additions. Scales other than bf16 are declined."""
    packed, scale, zero = _weight(4096, 4096, 128, True, 5)
    packed, scale, zero = packed.cuda(), scale.cuda(), zero.cuda()
    x = torch.randn(16, 4096, generator=torch.Generator().manual_seed(3)).cuda().bfloat16()
    blocks = Blocks("gemv_mma", 16, 256, 256, -1, 4, 2, scaled_values=True)
    w = wna16.dequantize(packed, scale, zero, 4, 4096, 128, torch.bfloat16)  # [N, K], rounded to bf16
    ref = (x.double() @ w.double().T).bfloat16()
    out = wna16_mma.matmul(x, packed, scale, zero, 4096, 128, blocks)
    # the same bf16 output but where float32 sums in another order round the other way (an output whose exact
    # value lies within the sums' error of a rounding boundary: few)
    assert (out == ref).float().mean().item() > 0.97
    assert not wna16_mma.takes(x, packed, scale.float(), zero, 4, 128, 4096, blocks)
    assert wna16_mma.takes(x, packed, scale.float(), zero, 4, 128, 4096, replace(blocks, scaled_values=False))


@pytest.mark.skipif(not GPU, reason="inline PTX for mma.sync: a GPU of compute capability 8.0 or later")
def test_a_gated_input_is_swiglus_product():
    n, k = 4096, 11008
    packed, scale, zero = _weight(n, k, 128, False, 3)
    packed, scale = packed.cuda(), scale.cuda()
    x = torch.randn(11, 2 * k, generator=torch.Generator().manual_seed(2)).cuda().bfloat16()
    product = F.silu(x[:, :k]) * x[:, k:]  # bf16 ops, each rounded, as the kernel rounds them
    ref = wna16.reference_matmul(product, packed, scale, zero, 4, k, 128)
    out = wna16_mma.matmul(x, packed, scale, zero, k, 128, TILE, gated=True)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(not GPU, reason="inline PTX for mma.sync: a GPU of compute capability 8.0 or later")
def test_the_table_routes_a_row_to_it_where_asked_and_it_checks_first():
    packed, scale, zero = _weight(4096, 4096, 128, False, 4)
    packed, scale = packed.cuda(), scale.cuda()
    x = torch.randn(1, 4096).cuda().bfloat16()
    wna16_mma._CHECKED.clear()
    y = wna16.matmul(x, packed, scale, zero, 4, 4096, 128, blocks=TILE)
    assert list(wna16_mma._CHECKED.values()) == [True]  # this call's kind, checked against the reference first
    ref = wna16.reference_matmul(x, packed, scale, zero, 4, 4096, 128)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
