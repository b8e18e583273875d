import pytest
import torch

from quantship.quant.gptq import gptq_quantize
from quantship.quant.rtn import rtn_quantize
from quantship.quantized_tensor import WeightQuant

OUT, IN = 256, 512
W4_SYM = WeightQuant(4, "int", True, "group", 128)
W4_ASYM = WeightQuant(4, "int", False, "group", 128)
W4_CHANNEL = WeightQuant(4, "int", True, "channel", None)
W8_CHANNEL = WeightQuant(8, "int", True, "channel", None)
FP8 = WeightQuant(8, "float", True, "channel", None)


@pytest.fixture(scope="module")
def problem():
    """Correlated inputs of unequal scale (a few outlier channels, as in real activations)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2048, 128, generator=g)
    x = z @ torch.randn(128, IN, generator=g) + 0.3 * torch.randn(2048, IN, generator=g)
    x[:, torch.randperm(IN, generator=g)[:8]] *= 20.0
    w = torch.randn(OUT, IN, generator=g) * 0.02
    return x, w, x.T @ x


def out_err(x, w, qt):
    return torch.linalg.norm(x @ (w - qt.dequantize()).T).item()


def ratio(problem, args, **kw):
    x, w, h = problem
    qt = gptq_quantize(w, h, args, **kw)
    assert torch.isfinite(qt.dequantize()).all()
    return out_err(x, w, qt) / out_err(x, w, rtn_quantize(w, args)), qt


@pytest.mark.parametrize(
    "args,limit", [(W4_SYM, 0.75), (W4_ASYM, 0.75), (W4_CHANNEL, 0.75), (W8_CHANNEL, 0.75), (FP8, 0.75)]
)
def test_beats_rtn(problem, args, limit):
    r, _ = ratio(problem, args)
    assert r < limit, f"GPTQ/RTN output error {r:.3f}"


def test_hessian_scale_does_not_matter(problem):
    x, w, h = problem
    a = gptq_quantize(w, h, W4_ASYM)
    b = gptq_quantize(w, h * (2 / x.shape[0]), W4_ASYM)
    assert (a.values != b.values).float().mean() < 1e-3
    assert torch.allclose(a.scale, b.scale, rtol=1e-2)


def test_block_size_does_not_change_result(problem):
    _, w, h = problem
    a = gptq_quantize(w, h, W4_SYM, block_size=128)
    b = gptq_quantize(w, h, W4_SYM, block_size=512)
    assert (a.values != b.values).float().mean() < 1e-3


def test_actorder(problem):
    args = WeightQuant(4, "int", True, "group", 128, "static")
    r, qt = ratio(problem, args)
    assert r < 0.75 * ratio(problem, W4_SYM)[0]  # outlier columns first is what act-order is for
    assert qt.values.dtype == torch.int8 and qt.scale.shape == (OUT, IN // 128) and qt.g_idx is None
    with pytest.raises(ValueError, match="actorder"):  # "group" (weight_g_idx) is not written by quantship
        gptq_quantize(problem[1], problem[2], WeightQuant(4, "int", True, "group", 128, "group"))


@pytest.mark.parametrize("args", [W4_SYM, W4_ASYM, W8_CHANNEL, WeightQuant(4, "int", False, "group", 32, "static")])
def test_ranges_and_shapes(problem, args):
    _, w, h = problem
    qt = gptq_quantize(w.to(torch.bfloat16), h, args)
    assert qt.values.dtype == torch.int8 and qt.values.shape == (OUT, IN)
    assert qt.values.min() >= args.qmin and qt.values.max() <= args.qmax
    assert qt.scale.dtype == torch.float32 and qt.scale.shape == (OUT, args.groups(IN))
    assert torch.equal(qt.scale, qt.scale.to(torch.bfloat16).float())
    if args.symmetric:
        assert qt.zero_point is None
    else:
        assert qt.zero_point.dtype == torch.int8 and qt.zero_point.shape == qt.scale.shape
        assert qt.zero_point.min() >= args.qmin and qt.zero_point.max() <= args.qmax


def test_fp8(problem):
    _, w, h = problem
    qt = gptq_quantize(w, h, FP8)
    assert qt.values.dtype == torch.float8_e4m3fn and qt.zero_point is None
    assert qt.scale.shape == (OUT, 1)


@pytest.mark.parametrize("args", [W4_SYM, W4_ASYM, W8_CHANNEL, FP8])
def test_zero_weight(problem, args):
    _, _, h = problem
    qt = gptq_quantize(torch.zeros(OUT, IN), h, args)
    assert torch.equal(qt.dequantize(), torch.zeros(OUT, IN))


def test_dead_columns_and_rank_deficient_hessian():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g)  # 16 tokens for 64 features: rank 16 at most
    x[:, :8] = 0  # columns never activated
    w = torch.randn(32, 64, generator=g)
    for args in (WeightQuant(4, "int", True, "group", 32), WeightQuant(4, "int", False, "group", 16, "static"), FP8):
        qt = gptq_quantize(w, x.T @ x, args)
        dq = qt.dequantize()
        assert torch.isfinite(dq).all()
        assert torch.equal(dq[:, :8], torch.zeros(32, 8))
    # No token at all: every column is dead, everything quantizes to zero.
    assert torch.equal(gptq_quantize(w, torch.zeros(64, 64), W4_CHANNEL).dequantize(), torch.zeros(32, 64))


def test_bad_input_raises():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize(w, -torch.eye(64), W4_CHANNEL)
    with pytest.raises(ValueError, match="NaN"):
        gptq_quantize(w, torch.full((64, 64), float("nan")), W4_CHANNEL)
    with pytest.raises(ValueError, match="multiple of group size"):
        gptq_quantize(w, torch.eye(64), W4_SYM)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 64, generator=g)
    w = torch.randn(32, 64, generator=g)
    args = WeightQuant(4, "int", False, "group", 32, "static")
    qt = gptq_quantize(w.cuda().half(), (x.T @ x).cuda(), args)
    assert qt.values.is_cuda and qt.scale.is_cuda
    cpu = gptq_quantize(w.half(), x.T @ x, args)
    assert (qt.values.cpu() != cpu.values).float().mean() < 0.02


def test_batched_equals_one_at_a_time(problem):
    """A layer's experts go through one column loop; each must come out as if quantized alone."""
    from quantship.quant.gptq import gptq_quantize_many

    x, w, h = problem
    weights = torch.stack([w, w.flip(0) * 0.5, torch.zeros_like(w)])
    hessians = torch.stack([h, h * 3 + torch.eye(IN), h])
    for args in (W4_SYM, W4_ASYM, WeightQuant(4, "int", True, "group", 128, "static")):
        many = gptq_quantize_many(weights, hessians, args)
        for k in range(3):
            one = gptq_quantize(weights[k], hessians[k], args)
            assert torch.equal(many[k].values, one.values) and torch.equal(many[k].scale, one.scale)
