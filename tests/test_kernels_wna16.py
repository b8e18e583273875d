"""The fused W4A16/W8A16 kernel against its float32 reference (dequantize, then matmul).

On CPU these run under Triton's interpreter (conftest sets TRITON_INTERPRET=1) with small shapes; on
a GPU the same tests run on CUDA, plus the 6.7B Linear shapes.
"""

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from quantship.kernels import wna16
from quantship.models.quantized import PackedLinear, QuantLinear, quant_linear, use_cpu_kernels, weight_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton = pytest.importorskip("triton")
tl = triton.language

from quantship.kernels._wna16_triton import _x_pairs  # noqa: E402  (needs triton)


def random_quantized(n, k, bits, group, symmetric, seed):
    g = torch.Generator().manual_seed(seed)
    qmax = 1 << (bits - 1)
    values = torch.randint(-qmax, qmax, (n, k), generator=g, dtype=torch.int8)
    groups = -(-k // group)
    scale = torch.rand(groups, n, generator=g) * 0.02 + 0.001
    zero = None if symmetric else torch.randint(-qmax, qmax, (groups, n), generator=g, dtype=torch.int8)
    return values, scale, zero


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [8, 96, 200, 1000])
def test_pack_round_trips_and_matches_compressed_tensors(bits, k):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")

    values, _, _ = random_quantized(24, k, bits, k, True, seed=k)
    packed = wna16.pack(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (-(-k // (32 // bits)), 24)
    assert torch.equal(wna16.unpack(packed, bits, k), values)
    if k % 8 == 0:  # the checkpoint's own packing, transposed: one documented repack at load
        assert torch.equal(packed.t(), helpers.pack_to_int32(values, bits))


CASES = [  # (bits, group, symmetric, m, n, k): odd sizes, every group, M across the kernel's classes
    (4, 32, True, 1, 40, 96),
    (4, 64, False, 5, 72, 128),
    (4, 128, True, 1, 64, 1024),  # long K: the decode class splits K (atomic partial sums)
    (4, 128, False, 3, 80, 512),
    (4, 32, False, 17, 33, 160),
    (4, 200, True, 70, 64, 200),  # per-channel, K not a multiple of the tile
    (4, 64, True, 300, 48, 192),
    (8, 128, True, 16, 48, 256),
    (8, 32, False, 2, 56, 96),
    (8, 1000, False, 65, 24, 1000),
    (4, 64, False, 4, 40, 2048),  # the decode (gemv) class with split K
    (8, 32, True, 2, 24, 64),
    (4, 32, False, 12, 40, 160),  # the swap tile: asymmetric, K padded to two x blocks, tiles span groups
    (4, 96, True, 9, 24, 96),  # the swap tile, per-channel, K inside one x block
    (4, 384, False, 10, 24, 768),  # the swap tile: groups longer than a tile that its tiles still straddle
    (8, 64, False, 40, 32, 320),  # the swap tile, 8 bits: x blocks of 64 inputs, K not a whole number of tiles
]


@pytest.mark.parametrize("along_k", [True, False])
@pytest.mark.parametrize("kind,m", [("gemv", 1), ("gemv_bf16x2", 1), ("swap_dot", 5), ("swap_x", 9),
                                    ("swap_bf16x2", 12), ("dequantize", 20)])
def test_every_kernel_reads_the_words_held_along_k_or_along_n(kind, m, along_k, monkeypatch):
    monkeypatch.setattr(wna16, "WORDS_ALONG_K", along_k)
    values, scale, zero = random_quantized(40, 512, 4, 64, False, seed=m)
    packed = wna16.pack(values, 4).to(DEVICE)
    assert packed.shape == (64, 40) and packed.stride() == ((1, 64) if along_k else (40, 1))
    scale, zero = scale.to(DEVICE), zero.to(DEVICE)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    expected = wna16.reference_matmul(x, packed, scale, zero, 4, 512, 64)
    table = {b.kind: b for _, b in wna16.BLOCKS_BY_M}  # tiles of the table (its last class of a kind), and two sweep candidates
    table.update(swap_dot=wna16.Blocks("swap_dot", 16, 32, 128, 2, 4, 1), swap_x=wna16.Blocks("swap_x", 16, 32, 128, 2))
    blocks = replace(table[kind], block_n=32, num_stages=1)
    for x_in, tolerance in ((x, 3e-3), (x.bfloat16(), 1e-2)) if DEVICE == "cuda" else ((x, 3e-3),):
        out = wna16.matmul(x_in, packed, scale, zero, 4, 512, 64, blocks=blocks).float()
        assert ((out - expected).norm() / expected.norm()) < tolerance, (x_in.dtype, kind)


def test_words_from_a_checkpoint_are_held_without_a_copy_and_merged_in_the_same_layout(monkeypatch):
    values, scale, _ = random_quantized(24, 256, 4, 128, True, seed=1)
    rows = wna16.pack(values, 4).t().contiguous()  # compressed-tensors' [N, K/8]
    for along_k in (True, False):
        monkeypatch.setattr(wna16, "WORDS_ALONG_K", along_k)
        held = wna16.from_rows(rows)
        assert torch.equal(held, rows.t()) and (held.data_ptr() == rows.data_ptr()) == along_k
        assert wna16.held_along_k(held) == along_k
        parts = [PackedLinear.from_rows(rows, scale.t(), None, 4, 128) for _ in range(2)]
        monkeypatch.setattr(wna16, "WORDS_ALONG_K", not along_k)  # merging follows the parts, not the setting
        merged = PackedLinear.concatenated(parts).weight_packed
        assert torch.equal(merged, torch.cat([rows.t(), rows.t()], dim=1))
        assert merged.stride() == ((1, 32) if along_k else (48, 1))


@pytest.mark.parametrize("bits,group,symmetric,m,n,k", CASES)
def test_kernel_equals_reference(bits, group, symmetric, m, n, k):
    values, scale, zero = random_quantized(n, k, bits, group, symmetric, seed=m * n + k)
    packed = wna16.pack(values, bits).to(DEVICE)
    scale, zero = scale.to(DEVICE), None if zero is None else zero.to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    expected = wna16.reference_matmul(x, packed, scale, zero, bits, k, group)
    for dtype, tolerance in ((torch.float32, 1e-5 if DEVICE == "cpu" else 3e-3), (torch.bfloat16, 1e-2)):
        if dtype == torch.bfloat16 and DEVICE == "cpu":
            continue  # the interpreter's bf16 dot goes through numpy float32: nothing more to learn on CPU
        out = wna16.matmul(x.to(dtype), packed, scale.to(dtype), zero, bits, k, group)
        assert out.shape == (m, n) and out.dtype == dtype
        error = (out.float() - expected).norm() / expected.norm()
        assert error < tolerance, (dtype, error.item())


@pytest.mark.parametrize("blocks", [wna16.Blocks("gemv", 1, 32, 64, 3), wna16.Blocks("gemv", 1, 16, 32, 1),
                                    wna16.Blocks("gemv", 1, 32, 256, -1, 1),  # tiles span groups of 64
                                    wna16.Blocks("swap_dot", 16, 32, 256, 3, 4, 1),  # two x blocks, spans groups
                                    wna16.Blocks("swap_dot", 16, 16, 64, -1, 4, 1),  # raised to 128: spans
                                    wna16.Blocks("swap_dot", 32, 64, 128, 1, 4, 1),  # one split, rows masked
                                    wna16.Blocks("swap_dot", 16, 16, 128, 0, 4, 1),  # splits to fill the GPU
                                    wna16.Blocks("swap_dot", 16, 16, 128, 3, 4, 1, finish=False),  # memset, cast
                                    wna16.Blocks("gemv", 1, 32, 64, -1, 1, 1, finish=False),
                                    wna16.Blocks("swap_x", 16, 32, 256, 3, 4, 1),  # x as it is, spans groups
                                    wna16.Blocks("swap_x", 32, 16, 128, 0, 4, 2),  # rows masked, splits
                                    # a register cap: ptxas' on a GPU (the interpreter has none to cap)
                                    wna16.Blocks("swap_bf16x2", 16, 32, 128, 2, 4, 1, max_registers=128),
                                    wna16.Blocks("dequantize", 0, 32, 64),
                                    # each GPU's own tiles as the table holds them (wna16.DEVICE_TILES)
                                    *(b for own in wna16.DEVICE_TILES.values() for b in own.values())])
def test_every_tile_shape_and_split_agrees(blocks):
    """In float32, and on a GPU in bf16 too (what the bf16x2 PTX takes; on CPU those kinds run their
    float32 form with the same tiles)."""
    values, scale, zero = random_quantized(50, 512, 4, 64, False, seed=3)
    packed = wna16.pack(values, 4).to(DEVICE)
    x = torch.randn(7, 512).to(DEVICE)
    scale, zero = scale.to(DEVICE), zero.to(DEVICE)
    expected = wna16.reference_matmul(x, packed, scale, zero, 4, 512, 64)
    for x_in, tolerance in ((x, 3e-3), (x.bfloat16(), 1e-2)) if DEVICE == "cuda" else ((x, 3e-3),):
        out = wna16.matmul(x_in, packed, scale, zero, 4, 512, 64, blocks=blocks).float()
        assert ((out - expected).norm() / expected.norm()) < tolerance, x_in.dtype


@pytest.mark.parametrize("kind", ["swap_x", "swap_dot"])
@pytest.mark.parametrize("split", [1, 3])
def test_swap_tiles_over_several_row_blocks_in_either_grid_order(kind, split):
    """A swap tile over three row blocks of x (a short prompt's rows), its grid walking the output tiles
    first or the row blocks (rows_first: a weight tile's programs together, for L2): the same result either
    way, a K split finished in the kernel included (each tile's counter is its own in both orders)."""
    values, scale, zero = random_quantized(50, 512, 4, 64, False, seed=11)
    packed, scale, zero = wna16.pack(values, 4).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = wna16.reference_matmul(x, packed, scale, zero, 4, 512, 64)
    outs = [wna16.matmul(x, packed, scale, zero, 4, 512, 64,
                         blocks=wna16.Blocks(kind, 16, 32, 128, split, 4, 2, rows_first=first)) for first in (False, True)]
    for out in outs:
        assert ((out - expected).norm() / expected.norm()) < (1e-5 if DEVICE == "cpu" else 3e-3)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_a_split_finished_in_the_kernel_leaves_its_workspace_clean():
    """A K split adds its partial sums into one float32 workspace per device and the last program of each
    tile writes y and clears what it used: calls in a row, of different shapes and kernels, each equal the
    reference and the path that zeroes y first and casts after, and leave the sums and counters at zero."""
    values, scale, zero = random_quantized(70, 640, 4, 64, False, seed=5)
    packed, scale, zero = wna16.pack(values, 4).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)
    calls = [(3, wna16.Blocks("gemv", 1, 32, 64, -1, 1, 1)), (20, wna16.Blocks("swap_dot", 16, 32, 128, 3, 4, 1)),
             (5, wna16.Blocks("gemv", 1, 16, 128, 2, 1, 1)), (3, wna16.Blocks("gemv", 1, 32, 64, -1, 1, 1))]
    for m, blocks in calls:
        x = torch.randn(m, 640, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        expected = wna16.reference_matmul(x, packed, scale, zero, 4, 640, 64)
        out = wna16.matmul(x, packed, scale, zero, 4, 640, 64, blocks=blocks)
        unfinished = wna16.matmul(x, packed, scale, zero, 4, 640, 64, blocks=replace(blocks, finish=False))
        assert ((out - expected).norm() / expected.norm()) < 3e-3
        torch.testing.assert_close(out, unfinished, rtol=1e-5, atol=1e-5)
        sums, counters = wna16.split_workspace(x.device, 0, 0)
        assert not sums.any() and not counters.any()


@pytest.mark.parametrize("bits,group,symmetric,m,n,k", [(4, 32, False, 5, 40, 200), (4, 128, True, 17, 48, 384),
                                                          (8, 64, False, 33, 24, 320), (8, 1000, True, 3, 16, 1000),
                                                          (4, 64, True, 64, 72, 256)])
def test_swap_tile_reading_x_as_it_is_equals_the_reference(bits, group, symmetric, m, n, k):
    """The swap tile reading x as it is (swap_x): odd K (a last tile cut short, words padded), zero points,
    per-channel scales, groups narrower than the tile, both widths, rows masked, K split or not; it loads
    x's next tile ahead by hand, so a tile past a split's end must read nothing."""
    values, scale, zero = random_quantized(n, k, bits, group, symmetric, seed=n * k)
    packed = wna16.pack(values, bits).to(DEVICE)
    scale, zero = scale.to(DEVICE), None if zero is None else zero.to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    expected = wna16.reference_matmul(x, packed, scale, zero, bits, k, group)
    for blocks in (wna16.Blocks("swap_x", 16, 32, 128, 0, 4, 2), wna16.Blocks("swap_x", 64, 16, 256, 2, 4, 2),
                   wna16.Blocks("swap_x", 32, 64, 128, -1, 4, 3, finish=False)):
        out = wna16.matmul(x, packed, scale, zero, bits, k, group, blocks=blocks)
        error = (out - expected).norm() / expected.norm()
        assert error < (1e-5 if DEVICE == "cpu" else 3e-3), (blocks, error.item())


@pytest.mark.parametrize("bits,group,symmetric,m,n,k", [(4, 128, True, 16, 48, 512), (4, 32, False, 5, 40, 200),
                                                          (4, 64, True, 33, 24, 320), (4, 1000, False, 3, 16, 1000),
                                                          (4, 16, True, 4, 32, 96), (8, 64, False, 9, 24, 128)])
def test_bf16x2_swap_tile_equals_the_reference(bits, group, symmetric, m, n, k):
    """The swap tile with one product per K tile (swap_bf16x2): its words spread to the pair order and x
    permuted to match must give the reference for odd K (a last tile cut short, words padded), zero points,
    groups of 32 to per-channel (the tile shrinks to stay inside one), rows masked, K split or not, either
    grid order, x permuted per tile or copied to that order first. On a GPU with bf16 x its values come two
    per bf16x2 instruction (PTX the interpreter cannot run), float32 x takes the shifts and masks; groups of
    16 and int8 take swap_x's products."""
    values, scale, zero = random_quantized(n, k, bits, group, symmetric, seed=n * k + m)
    packed = wna16.pack(values, bits).to(DEVICE)
    scale, zero = scale.to(DEVICE), None if zero is None else zero.to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    expected = wna16.reference_matmul(x, packed, scale, zero, bits, k, group)
    for dtype in (torch.float32, torch.bfloat16) if DEVICE == "cuda" else (torch.float32,):
        for blocks in (wna16.Blocks("swap_bf16x2", 16, 32, 256, 0, 4, 2),
                       wna16.Blocks("swap_bf16x2", 32, 16, 64, 2, 4, 3, rows_first=True),
                       wna16.Blocks("swap_bf16x2", 16, 64, 128, -1, 4, 2, finish=False),
                       # x copied to the pair order first (K a multiple of 32; otherwise permuted per tile)
                       wna16.Blocks("swap_bf16x2", 16, 32, 64, 2, 4, 2, x_paired=True),
                       # x and the words copied by TMA (zeros past K and M), x permuted per tile or paired first
                       wna16.Blocks("swap_bf16x2", 16, 32, 128, 0, 4, 2, tma=True),
                       wna16.Blocks("swap_bf16x2", 32, 16, 64, 2, 4, 3, rows_first=True, x_paired=True, tma=True),
                       # the same through TMA in equal runs of all the K tiles (stream-K)
                       wna16.Blocks("swap_bf16x2", 16, 32, 128, 0, 4, 2, tma=True, stream=2),
                       wna16.Blocks("swap_bf16x2", 32, 16, 64, 2, 4, 3, x_paired=True, tma=True, stream=1),
                       # the table's prefill tiles: two warp groups, rows first
                       wna16.choose_blocks(128), wna16.choose_blocks(256)):
            out = wna16.matmul(x.to(dtype), packed, scale.to(dtype), zero, bits, k, group, blocks=blocks)
            error = (out.float() - expected).norm() / expected.norm()
            tolerance = 1e-5 if DEVICE == "cpu" else 1e-2 if dtype == torch.bfloat16 else 3e-3
            assert out.dtype == dtype and error < tolerance, (dtype, blocks, error.item())


@pytest.mark.parametrize("per_sm", [1, 2, 3, 7])
@pytest.mark.parametrize("finish", [True, False])
def test_stream_runs_share_tiles_in_every_way_and_leave_the_workspace_clean(per_sm, finish, monkeypatch):
    """The stream kernel's equal runs of all the K tiles: depending on how many programs there are, a run lies
    inside one tile, takes tiles whole, or starts and ends inside tiles it shares with other runs (through the
    workspace and the tiles' counters, or, where no workspace may be grown as in CUDA-graph capture, added into
    a zeroed float32 y); over several row blocks of x and a last K tile cut short. Each equals the reference,
    runs the stream kernel (not the K split), and leaves the workspace at zero for the next call."""
    streamed = []
    launch = wna16._swap_bf16x2_stream
    monkeypatch.setattr(wna16, "_swap_bf16x2_stream", lambda *a, **kw: streamed.append(a[5]) or launch(*a, **kw))
    if not finish:
        monkeypatch.setattr(wna16, "split_workspace", lambda *a: None)
    blocks = wna16.Blocks("swap_bf16x2", 16, 32, 64, 4, 4, 2, tma=True, stream=per_sm)
    # groups of 32 (tiles 32 deep, 17 of them), one group over K (tiles 64 deep, the last 36)
    for k, group in ((544, 32), (548, 548)):
        values, scale, zero = random_quantized(72, k, 4, group, False, seed=per_sm + k)
        packed, scale, zero = wna16.pack(values, 4).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)
        for m in (3, 40):  # one row block, three
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
            out = wna16.matmul(x, packed, scale, zero, 4, k, group, blocks=blocks)
            expected = wna16.reference_matmul(x, packed, scale, zero, 4, k, group)
            error = (out - expected).norm() / expected.norm()
            assert out.dtype == x.dtype and error < (1e-5 if DEVICE == "cpu" else 3e-3), (k, m, error.item())
    assert streamed == [blocks] * 4
    monkeypatch.undo()
    sums, counters = wna16.split_workspace(x.device, 0, 0)
    assert not sums.any() and not counters.any()


def test_tma_tile_only_where_its_copies_can_read():
    """TMA copies need 16-byte aligned starts and row strides: x contiguous with K a multiple of 16 bytes, the
    words held along N with N a multiple of 4. Where they are not, the same tiles run without TMA and give the
    same numbers."""
    values, scale, _ = random_quantized(40, 198, 4, 198, True, seed=3)
    packed = wna16.pack(values, 4).to(DEVICE)
    scale = scale.to(DEVICE)
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert wna16.tma_fits(x, packed)
    assert not wna16.tma_fits(x[:, :198].contiguous(), packed)  # 792 bytes a row
    assert not wna16.tma_fits(x.view(-1)[1:801].view(4, 200), packed)  # starts 4 bytes past an aligned one
    assert not wna16.tma_fits(x, packed[:, :38].contiguous())  # 38 outputs: rows of 152 bytes
    assert not wna16.tma_fits(x, wna16.hold(packed, along_k=True))
    tma = wna16.Blocks("swap_bf16x2", 16, 32, 64, 0, 4, 2, tma=True)
    expected = wna16.reference_matmul(x[:, :198], packed, scale, None, 4, 198, 198)
    out = wna16.matmul(x[:, :198], packed, scale, None, 4, 198, 198, blocks=tma)  # falls back: same numbers
    assert (out.float() - expected).norm() / expected.norm() < (1e-5 if DEVICE == "cpu" else 3e-3)


def test_bf16x2_ptx_only_where_its_pairs_are_checked():
    """The swap_bf16x2 PTX runs only on Hopper's wgmma operand registers (64 outputs a warp group), for bf16 x,
    and once its tile shape agreed with the plain path on this device; on a CPU, for float32 x or tiles of
    32 outputs (mma.sync, where Triton lays the pairs out otherwise) never."""
    wide, narrow = wna16.Blocks("swap_bf16x2", 16, 128, 256, 0, 4, 3), wna16.Blocks("swap_bf16x2", 16, 32, 256, 0, 4, 3)
    x = torch.zeros(4, 512, dtype=torch.bfloat16, device=DEVICE)
    assert not wna16.pairs_in_registers(x.float(), wide, 256) and not wna16.pairs_in_registers(x, narrow, 256)
    hopper = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
    assert wna16.pairs_in_registers(x, wide, 256) == hopper


def test_pairs_fit_int4_in_groups_of_32_or_more():
    """swap_bf16x2 takes int4 weights whose K tiles (32 inputs at least) lie inside one group."""
    assert wna16.pairs_fit(4, 128, 4096) and wna16.pairs_fit(4, 32, 96) and wna16.pairs_fit(4, 1000, 1000)
    assert not wna16.pairs_fit(8, 128, 4096) and not wna16.pairs_fit(4, 16, 96) and not wna16.pairs_fit(4, 48, 96)


@pytest.mark.parametrize("group,symmetric,m,n,k,block_k", [(128, True, 1, 72, 1024, 64), (32, False, 3, 40, 160, 64),
                                                             (64, False, 2, 56, 512, 128), (512, True, 1, 24, 512, 64)])
def test_bf16x2_gemv_equals_the_reference(group, symmetric, m, n, k, block_k):
    """The two-values-per-instruction GEMV (bf16x2 PTX, a sweep candidate): on a GPU within bf16's
    rounding of the reference, for tiles inside and across groups, with and without zero points; where
    it cannot run (CPU, the interpreter) the plain GEMV takes the call."""
    values, scale, zero = random_quantized(n, k, 4, group, symmetric, seed=n + k)
    packed = wna16.pack(values, 4).to(DEVICE)
    scale, zero = scale.to(DEVICE), None if zero is None else zero.to(DEVICE)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)
    expected = wna16.reference_matmul(x, packed, scale, zero, 4, k, group)
    out = wna16.matmul(x, packed, scale.to(dtype), zero, 4, k, group,
                       blocks=wna16.Blocks("gemv_bf16x2", 1, 32, block_k, -1, 1, 1))
    error = (out.float() - expected).norm() / expected.norm()
    assert error < (1e-2 if DEVICE == "cuda" else 1e-5), error.item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the vector reduction is PTX: the interpreter cannot run it")
@pytest.mark.parametrize("block_n,warps,gated", [(512, 4, False), (1024, 4, True), (256, 2, False)])
def test_bf16x2_gemv_adding_its_sums_four_at_once_equals_the_reference(block_n, warps, gated, monkeypatch):
    """wna16.GEMV_QUADS: the GEMV's K split (one K tile a program) added four sums per vector reduction, over N
    that is not a whole tile and several rows: within bf16's rounding of the reference, each sum added once, and
    the workspace left clean for the next call."""
    monkeypatch.setattr(wna16, "GEMV_QUADS", True)
    n, k, group = 1028, 1024, 128
    blocks = wna16.Blocks("gemv_bf16x2", 1, block_n, 64, -1, warps, 1)
    assert wna16._quads(n, blocks, spans=False)
    values, scale, zero = random_quantized(n, k, 4, group, False, seed=block_n)
    packed, scale, zero = wna16.pack(values, 4).cuda(), scale.cuda(), zero.cuda()
    x = torch.randn(3, 2 * k if gated else k, generator=torch.Generator().manual_seed(7)).cuda().bfloat16()
    inputs = F.silu(x[:, :k].float()) * x[:, k:].float() if gated else x.float()
    expected = wna16.reference_matmul(inputs, packed, scale, zero, 4, k, group)
    for _ in range(2):  # the second call finds the workspace as the first left it
        out = wna16.matmul(x, packed, scale.bfloat16(), zero, 4, k, group, blocks=blocks, gated=gated)
        assert ((out.float() - expected).norm() / expected.norm()) < 1e-2
    assert int(wna16.split_workspace(x.device, 1, 1)[0].count_nonzero()) == 0


def test_sums_go_four_at_once_only_where_no_thread_shares_a_quad(monkeypatch):
    """_quads: whole quads of N, a tile of whole multiples of 4 outputs a thread (4 warps of 32: 512, 1024), and no
    tile spanning groups (its row sums come sliced from a 2-D layout that holds them in several threads); and only
    when asked (GEMV_QUADS, off by default until a GPU has timed it)."""
    tile = wna16.Blocks("gemv_bf16x2", 1, 512, 64, -1, 4, 1)
    assert not wna16._quads(4096, tile, spans=False)
    monkeypatch.setattr(wna16, "GEMV_QUADS", True)
    assert wna16._quads(4096, tile, spans=False) and wna16._quads(4096, replace(tile, block_n=1024), spans=False)
    assert not wna16._quads(4098, tile, spans=False) and not wna16._quads(4096, tile, spans=True)
    assert not wna16._quads(4096, replace(tile, block_n=256), spans=False)  # 2 outputs a thread: quads shared
    assert wna16._quads(4096, replace(tile, block_n=256, num_warps=2), spans=False)


def test_packed_linear_holds_packed_bytes_and_matches_the_unpacked_layer():
    values, scale, zero = random_quantized(64, 256, 4, 32, False, seed=1)
    bias = torch.randn(64)
    packed = quant_linear(values, scale.t(), zero.t(), bias=bias, bits=4)
    plain = QuantLinear(values, scale.t(), zero.t(), bias=bias)
    assert isinstance(packed, PackedLinear)
    weight_and_bias = 64 * 256 // 2 + (256 // 32) * 64 * (4 + 1) + 64 * 4  # int4 + fp32 scales + int8 zeros
    assert weight_bytes(packed) == weight_and_bias < weight_bytes(plain)
    x = torch.randn(5, 256)
    assert torch.allclose(packed(x), plain(x), atol=1e-5)  # the exact path: dequantize + F.linear
    assert weight_bytes(packed) == weight_and_bias
    # Serving on the CPU, int4 goes through PyTorch's kernel with bf16 activations (W4A16): within bf16's
    # rounding, and the kernel's weight copy is counted.
    assert use_cpu_kernels(packed) == 1
    error = (packed(x) - plain(x)).norm() / plain(x).norm()
    assert 0 < error < 1e-2, error.item()
    assert weight_bytes(packed) == weight_and_bias + sum(t.numel() * t.element_size() for t in packed._decode)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, True), (4, 64, False), (4, 128, True), (4, 256, False),
                                                  (8, 512, True)])
def test_cpu_kernels_match_the_reference_with_bf16_activations(bits, group, symmetric):
    """PyTorch's CPU kernels, which PackedLinear uses on the CPU when serving: int4 (zero points as offsets)
    and int8 per channel; the product equals the reference on bf16-rounded inputs to bf16's precision,
    for one row (decode) and many (prefill)."""
    n, k = 48, 512
    values, scale, zero = random_quantized(n, k, bits, group, symmetric, seed=group + symmetric)
    packed = wna16.pack(values, bits)
    made = wna16.cpu_pack(packed, scale.bfloat16(), zero, bits, k, group)
    assert made is not None
    for m in (1, 37):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        expected = wna16.reference_matmul(x.bfloat16().float(), packed, scale.bfloat16().float(), zero, bits, k,
                                          group)
        out = wna16.cpu_matmul(x, made, bits, group, n)
        assert out.dtype == x.dtype and out.shape == (m, n)
        error = (out - expected).norm() / expected.norm()
        assert error < 5e-3, (m, error.item())


def test_cpu_kernels_are_skipped_where_they_cannot_run():
    """int4 with outputs not a multiple of 16 or groups of 16, int8 grouped or with zero points: no kernel
    weight, PackedLinear stays exact (dequantize + F.linear); a module moved to another dtype drops the
    weight it made and makes it again."""
    values, scale, _ = random_quantized(40, 128, 4, 32, True, seed=3)
    assert wna16.cpu_pack(wna16.pack(values, 4), scale, None, 4, 128, 32) is None  # N = 40
    values, scale, zero = random_quantized(64, 128, 8, 32, False, seed=3)  # int8 takes one symmetric scale per row
    assert wna16.cpu_pack(wna16.pack(values, 8), scale, None, 8, 128, 32) is None
    assert wna16.cpu_pack(wna16.pack(values, 8), scale[:1], zero[:1], 8, 128, 128) is None
    values, scale, _ = random_quantized(64, 128, 4, 16, True, seed=4)
    layer = quant_linear(values, scale.t(), bits=4)
    x = torch.randn(3, 128)
    assert use_cpu_kernels(layer) == 0 and layer.decode_weights() is None
    assert torch.allclose(layer(x), QuantLinear(values, scale.t())(x), atol=1e-5)
    values, scale, _ = random_quantized(64, 128, 4, 32, True, seed=5)
    layer = quant_linear(values, scale.t(), bits=4)
    assert use_cpu_kernels(layer) == 1
    layer(x)
    first = layer._decode
    assert first
    layer.to(torch.bfloat16)
    assert layer._decode is None and layer(x.bfloat16()).dtype == torch.bfloat16 and layer._decode is not first


def test_w8a8_on_the_cpu_is_one_integer_matmul_equal_to_the_reference(monkeypatch):
    """W8A8 served on the CPU multiplies int8 activations (a scale per token) by int8 weights (a scale per
    channel) in one exact integer matmul: equal to the quantize-dequantize reference to float32 rounding,
    for one row and many, with a bias and odd shapes; grouped or asymmetric weights keep the reference."""
    from quantship.kernels import int8

    g = torch.Generator().manual_seed(8)
    for n, k in ((48, 512), (30, 100)):
        values = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale, bias = torch.rand(n, 1, generator=g) * 0.01, torch.randn(n, generator=g)
        layer = QuantLinear(values, scale, bias=bias, activations="int")
        reference = QuantLinear(values, scale, bias=bias, activations="int")
        assert use_cpu_kernels(layer) == 1 and layer.cpu_kernel and not reference.cpu_kernel
        calls = []
        original = int8.scaled_linear
        monkeypatch.setattr(int8, "scaled_linear", lambda *a, **kw: calls.append(1) or original(*a, **kw))
        for m in (1, 37):
            x = torch.randn(2, m, k, generator=g)
            out, expected = layer(x), reference(x)
            assert out.shape == expected.shape == (2, m, n) and out.dtype == x.dtype
            assert torch.allclose(out, expected, atol=1e-4, rtol=1e-4), (out - expected).abs().max()
        monkeypatch.undo()
        assert len(calls) == 2
    values = torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8)
    grouped = QuantLinear(values, torch.rand(16, 2, generator=g), activations="int")
    asymmetric = QuantLinear(values, torch.rand(16, 1, generator=g), torch.ones(16, 1, dtype=torch.int8),
                             activations="int")
    weight_only = QuantLinear(values, torch.rand(16, 1, generator=g))
    assert use_cpu_kernels(torch.nn.Sequential(grouped, asymmetric, weight_only)) == 0


def test_layers_the_kernel_cannot_take_stay_unpacked():
    values, scale, _ = random_quantized(16, 96, 4, 32, True, seed=2)
    assert isinstance(quant_linear(values, scale.t(), bits=4, activations="int"), QuantLinear)  # W8A8-style
    assert isinstance(quant_linear(values, scale.t(), g_idx=torch.arange(96) // 32, bits=4), QuantLinear)
    assert isinstance(quant_linear(values, scale.t(), bits=3), QuantLinear)  # no 3-bit kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode path (tinygemm) and dispatch by M need CUDA")
@pytest.mark.parametrize("symmetric", [True, False])
def test_packed_linear_on_cuda_matches_reference_for_every_batch_size(symmetric):
    values, scale, zero = random_quantized(256, 2048, 4, 128, symmetric, seed=7)
    layer = quant_linear(values, scale.t().bfloat16(), None if zero is None else zero.t(), bits=4).cuda()
    if hasattr(torch, "_weight_int4pack_mm"):  # PyTorch's decode kernel must take this layer, not fall back
        assert layer.decode_weights() is not None
    for m in (1, 3, 16, 17, 64, 300):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        expected = wna16.reference_matmul(x, layer.weight_packed, layer.weight_scale, layer.weight_zero_point, 4,
                                          2048, 128)
        error = (layer(x).float() - expected).norm() / expected.norm()
        assert error < 1e-2, (m, error.item())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, 96])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cpu_dequantize_is_the_quantized_tensors_own(bits, group, symmetric):
    """The CPU forward of a packed Linear multiplies by exactly the weight the quantizer made (scales
    broadcast over each group's rows, for every group size a packed Linear takes)."""
    from quantship.quant.rtn import rtn_quantize
    from quantship.quantized_tensor import WeightQuant

    k = 288 if group == 96 else 256
    q = rtn_quantize(torch.randn(40, k, generator=torch.Generator().manual_seed(bits + group)) * 0.02,
                     WeightQuant(num_bits=bits, group_size=group, symmetric=symmetric, strategy="group"))
    packed = wna16.pack(q.values, bits)
    zero = None if q.zero_point is None else q.zero_point.to(torch.int8).t().contiguous()
    weight = wna16.dequantize(packed, q.scale.t().contiguous(), zero, bits, k, group)
    assert torch.equal(weight, q.dequantize().float())


def test_table_gives_one_row_the_bf16x2_gemv_only_where_its_ptx_applies():
    """Where the table gives one row the bf16x2 GEMV (int4 with bf16 x on a GPU), anything else (int8,
    fp16, CPU) takes the float32 GEMV's own measured entry instead; two rows on take a tensor-core tile
    whatever the dtype, and past the table's last class dequantize + cuBLAS."""
    first, plain = wna16.choose_blocks(1), wna16.choose_blocks(1, bf16x2=False)
    assert plain.kind != "gemv_bf16x2"
    if first.kind == "gemv_bf16x2":
        assert plain.kind == "gemv" and plain == wna16.BLOCKS_BY_M[1][1]
    else:
        assert plain == first
    classes = [limit for limit, _ in wna16.BLOCKS_BY_M if limit is not None]
    last = max(classes)
    for m in (2, 16, 17, 33, last, last + 1, 300):
        chosen = wna16.choose_blocks(m)
        assert chosen == wna16.choose_blocks(m, bf16x2=False)
        if m > last:
            assert chosen.kind == "dequantize"
        else:
            assert chosen.kind in ("swap_dot", "swap_x", "swap_bf16x2")


def test_a_gpus_own_tiles_replace_the_tables_in_their_class_only():
    """DEVICE_TILES changes tiles, never the classes or their kernels (so what dequantizes, and from how many
    rows, is the same on every GPU), but for the GEMV on tensor cores in a bf16 class of up to 16 rows, which
    declines what it cannot take to that class's kernel; a GPU without tiles of its own, or no GPU, takes
    BLOCKS_BY_M."""
    def kernel(limit, b):
        return b.kind if b.kind != "gemv_mma" else wna16.choose_blocks(limit, mma=False).kind

    kinds = [(limit, b.kind) for limit, b in wna16.BLOCKS_BY_M]
    for device, own in wna16.DEVICE_TILES.items():
        table = wna16.table_for(device)
        assert [(limit, kernel(limit, b)) for limit, b in table] == kinds
        assert [entry for entry in table if entry not in wna16.BLOCKS_BY_M] == [
            (limit, b) for (limit, _), b in own.items()]
        for (limit, kind), blocks in own.items():
            assert kernel(limit, blocks) == kind
            assert blocks.kind != "gemv_mma" or (kind in ("gemv_bf16x2", "swap_bf16x2") and limit <= 16)
            assert kind == "gemv" or wna16.choose_blocks(limit, device=device) == blocks
    assert wna16.table_for("a GPU without tiles of its own") == wna16.table_for(None) == wna16.BLOCKS_BY_M
    # one row without the bf16x2 PTX takes the float32 GEMV's entry, on a GPU whose own tiles are bf16x2 ones too
    for device, own in wna16.DEVICE_TILES.items():
        if (1, "gemv") not in own:
            assert wna16.choose_blocks(1, bf16x2=False, device=device) == wna16.choose_blocks(1, bf16x2=False)


def test_pair_order_puts_each_input_where_the_spread_words_put_its_weight():
    """pair_order_x moves input 32b + 8t + 4h + 2c + d (value 4h + 2c + d of word row 4b + t) to
    32b + 16c + 8d + 2t + h, the column _pair_words gives that value: every input once, per 32-input block."""
    x = torch.arange(2 * 64, dtype=torch.float32).view(2, 64)
    paired = wna16.pair_order_x(x)
    for b, t, h, c, d in itertools.product(range(2), range(4), range(2), range(2), range(2)):
        assert paired[1, 32 * b + 16 * c + 8 * d + 2 * t + h] == 64 + 32 * b + 8 * t + 4 * h + 2 * c + d
    assert sorted(paired[0].tolist()) == x[0].tolist()


@pytest.mark.parametrize("bits,k", [(4, 300), (8, 64), (4, 128)])
def test_permuted_x_puts_each_value_positions_inputs_side_by_side(bits, k):
    """permute_x moves input j*P + i of each block of 16 word rows to 16*i + j, zero-padded to whole
    blocks: what the swap tile's contiguous loads assume."""
    per_word = 32 // bits
    x = torch.arange(2 * k, dtype=torch.float32).reshape(2, k) + 1
    out = wna16.permute_x(x, bits)
    block = 16 * per_word
    assert out.shape == (2, -(-k // block) * block)
    for column in range(out.shape[1]):
        b, within = divmod(column, block)
        i, j = divmod(within, 16)
        source = b * block + j * per_word + i
        expected = x[:, source] if source < k else torch.zeros(2)
        assert torch.equal(out[:, column], expected), column


@pytest.mark.parametrize("k,k0,gated", [(1024, 128, False), (200, 128, False), (131, 64, False), (200, 128, True)])
def test_bf16x2_gemv_pairs_inputs_i_and_i_plus_4_of_each_word_row(k, k0, gated):
    """The bf16x2 GEMV's x operands, built from one load of the tile (the PTX that takes them runs only on a
    GPU, the pairing runs here): pair i of word row r holds input k0 + 8r + i in its low half and k0 + 8r
    + i + 4 in its high half, as bf16 bits, 0 past K; gated, the inputs are SiLU(gate) * up of a row that
    holds gate and up side by side, rounded as elementwise.silu_mul rounds."""
    from quantship.kernels import elementwise

    rows = 16
    row = torch.randn(2 * k if gated else k, generator=torch.Generator().manual_seed(k)).to(DEVICE, torch.bfloat16)
    out = torch.zeros(rows, 4, dtype=torch.int32, device=DEVICE)
    pairs_kernel[(1,)](row, out, k, k0, ROWS=rows, GATED=gated)
    x = elementwise.silu_mul(row[:k], row[k:]) if gated else row
    bits = (x.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    for r in range(rows):
        for i in range(4):
            low, high = (bits[j] if j < k else 0 for j in (k0 + 8 * r + i, k0 + 8 * r + i + 4))
            word = low | (high << 16)
            assert out[r, i].item() == (word - (1 << 32) if word >= 1 << 31 else word), (r, i)


@pytest.mark.parametrize("bits,group,symmetric,k", [(4, 32, False, 200), (4, 128, True, 512), (8, 64, True, 96)])
def test_a_gated_gemv_multiplies_swiglus_product_made_in_its_loads(bits, group, symmetric, k):
    """matmul(gated=True) takes an MLP's gate and up side by side [M, 2K] and equals the down projection
    of elementwise.silu_mul(gate, up): for one row (the table's GEMV) and for a few rows run as GEMV rows;
    the tensor-core tiles refuse it (takes_gated says which take it)."""
    from quantship.kernels import elementwise

    n = 40
    values, scale, zero = random_quantized(n, k, bits, group, symmetric, seed=k + bits)
    packed = wna16.pack(values, bits).to(DEVICE)
    scale, zero = scale.to(DEVICE), None if zero is None else zero.to(DEVICE)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    both = torch.randn(3, 2 * k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)
    for rows, blocks in ((1, None), (3, wna16.Blocks("gemv", 1, 32, 64, -1, 2, 1))):
        x = both[:rows]
        expected = wna16.reference_matmul(elementwise.silu_mul(x[:, :k], x[:, k:]), packed, scale, zero, bits, k,
                                          group)
        out = wna16.matmul(x, packed, scale.to(dtype), zero, bits, k, group, blocks=blocks, gated=True)
        assert out.shape == (rows, n)
        error = (out.float() - expected).norm() / expected.norm()
        assert error < (1e-5 if DEVICE == "cpu" else 1e-2), (rows, error.item())
    assert wna16.takes_gated(1, both, bits) and not wna16.takes_gated(2, both, bits)
    with pytest.raises(ValueError, match="GEMV only"):
        wna16.matmul(both, packed, scale.to(dtype), zero, bits, k, group, gated=True)


def test_an_mlp_with_packed_projections_makes_swiglus_product_in_the_down_gemv(monkeypatch):
    """On the fused-ops path (the GPU's, here under the interpreter) an MLP with merged packed gate/up and a
    packed down runs one row as two GEMVs, no SwiGLU kernel between them, with the output of the separate
    product; a batch of rows (tensor-core tiles on a GPU, which do not take the gated input) keeps it."""
    from quantship.kernels import elementwise
    from quantship.models import layers, quantized
    from quantship.models.merged import merge_projections

    hidden, inter, group = 64, 96, 32

    def packed(out, inp, seed):
        values, scale, zero = random_quantized(out, inp, 4, group, False, seed)
        return quant_linear(values, scale.t(), zero.t(), bits=4)

    mlp = layers.MLP(hidden, inter)
    mlp.gate_proj, mlp.up_proj = packed(inter, hidden, 1), packed(inter, hidden, 2)
    mlp.down_proj = packed(hidden, inter, 3)
    mlp.to(DEVICE)
    x = (torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)) * 20).to(DEVICE)
    with torch.no_grad():
        # the float64 reference: dequantized weights, torch's SiLU
        weight = {name: getattr(mlp, name).dequantized_weight(torch.float64) for name in ("gate_proj", "up_proj",
                                                                                          "down_proj")}
        wide = x.double()
        separate = (F.silu(wide @ weight["gate_proj"].t()) * (wide @ weight["up_proj"].t())) @ weight["down_proj"].t()
        separate = separate.float()
        assert merge_projections(mlp) == 1
        products = []
        real = elementwise.silu_mul
        monkeypatch.setattr(elementwise, "silu_mul", lambda g, u: products.append(g.shape) or real(g, u))
        monkeypatch.setattr(layers, "use_fused_ops", lambda t: True)
        monkeypatch.setattr(quantized, "on_gpu_kernel", lambda t: True)
        one = mlp(x[:1])
        assert products == []  # made inside the down projection's GEMV
        torch.testing.assert_close(one, separate[:1], rtol=1e-4, atol=1e-5)
        assert wna16.takes_gated(1, x, 4) and not wna16.takes_gated(3, x, 4)  # 3 rows take the swap_x tile
        three = mlp(x)
        if DEVICE == "cpu":
            # float32 sums in another order than the float64 reference: rounding of outputs up to about 200 (this
            # machine's interpreter put 3e-5 on an output of 0.18; 2e-7 of the whole)
            assert ((three - separate).norm() / separate.norm()).item() < 1e-6
        else:  # the swap tile's float32 product runs on tensor cores as TF32 there
            assert ((three - separate).norm() / separate.norm()).item() < 1e-2
        assert products == [(3, inter)]


@pytest.mark.parametrize("bits,group,symmetric,n,k", [(4, 32, False, 200, 96), (4, 128, True, 136, 256),
                                                      (8, 64, False, 72, 128)])
def test_dequantize_then_matmul_equals_the_reference(bits, group, symmetric, n, k):
    """Past the tiles' rows, dequantize + cuBLAS: the transposed dense weight is dequantize's, and the
    product the reference's."""
    values, scale, zero = random_quantized(n, k, bits, group, symmetric, seed=n + k)
    packed = wna16.pack(values, bits).to(DEVICE)
    scale, zero = scale.to(DEVICE), None if zero is None else zero.to(DEVICE)
    past_tiles = max(limit for limit, _ in wna16.BLOCKS_BY_M if limit is not None) + 5
    x = torch.randn(past_tiles, k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    whole = wna16.dequantize_transposed(packed, scale, zero, bits, k, group, torch.float32)
    torch.testing.assert_close(whole, wna16.dequantize(packed, scale, zero, bits, k, group).t().contiguous())
    assert wna16.choose_blocks(x.shape[0]).kind == "dequantize"
    torch.testing.assert_close(wna16.matmul(x, packed, scale, zero, bits, k, group),
                               wna16.reference_matmul(x, packed, scale, zero, bits, k, group), rtol=1e-4, atol=1e-4)


def test_dequantizing_starts_at_the_tables_first_dequantize_class(monkeypatch):
    """Where the capacity planner starts reserving a dense copy: past the tiles, also when a sweep gives
    rows past the tiles up to 256 dequantize tiles of their own. A swap_bf16x2 class of more than 64 rows
    counts: the weights it cannot take go to dequantize + cuBLAS."""
    first = wna16.dequantizes_from()
    chosen = wna16.choose_blocks(first)
    assert chosen.kind == "dequantize" or (chosen.kind == "swap_bf16x2" and chosen.block_m > 64)
    assert wna16.choose_blocks(first - 1).kind != "dequantize" and wna16.choose_blocks(first - 1).block_m <= 64
    values, scale, _ = random_quantized(24, 128, 8, 128, True, seed=1)  # int8: what swap_bf16x2 hands on
    x = torch.randn(first, 128, generator=torch.Generator().manual_seed(2))
    calls = []
    original = wna16.dequantize_transposed
    monkeypatch.setattr(wna16, "dequantize_transposed", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    out = wna16.matmul(x.to(DEVICE), wna16.pack(values, 8).to(DEVICE), scale.to(DEVICE), None, 8, 128, 128)
    assert calls == [1] and out.shape == (first, 24)
    monkeypatch.undo()
    limit, last = wna16.BLOCKS_BY_M[-1]
    monkeypatch.setattr(wna16, "BLOCKS_BY_M", [*wna16.BLOCKS_BY_M[:-1], (256, replace(last, block_n=64)),
                                               (limit, last)])
    assert wna16.dequantizes_from() == first and wna16.choose_blocks(300) == last


@triton.jit
def pairs_kernel(x_ptr, out_ptr, K, k0, ROWS: tl.constexpr, GATED: tl.constexpr):
    """Writes the bf16x2 GEMV's x pairs of one K tile ([R, 4] int32)."""
    r = tl.arange(0, ROWS)
    p0, p1, p2, p3 = _x_pairs(x_ptr, k0, r, K, GATED)
    rows = out_ptr + r[:, None] * 4
    tl.store(rows, p0)
    tl.store(rows + 1, p1)
    tl.store(rows + 2, p2)
    tl.store(rows + 3, p3)
