"""The fused RMSNorm, SwiGLU product and rotary embedding against the plain ops the model runs
elsewhere (CPU: under Triton's interpreter), alone and inside whole decode steps."""

import pytest
import torch

from quantship.kernels import elementwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
pytest.importorskip("triton")


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    # float32: only the order of the mean's sum differs; bf16: a rounding step apart at most, rarely.
    tolerance = 1e-5 if out.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("shape", [(1, 384), (3, 5, 100), (2, 7168)])
def test_rms_norm_equals_the_plain_ops(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE)
    weight = torch.rand(shape[-1], generator=g).to(DEVICE) + 0.5
    for dtype in DTYPES:
        _close(elementwise.rms_norm(x.to(dtype), weight.to(dtype), 1e-6),
               elementwise.reference_rms_norm(x.to(dtype), weight.to(dtype), 1e-6))
    # A strided view (every other row) and a float32 weight on a narrower input keep torch's promotion.
    view = x.reshape(-1, shape[-1])[::2]
    _close(elementwise.rms_norm(view, weight, 1e-5), elementwise.reference_rms_norm(view, weight, 1e-5))


def test_add_rms_norm_equals_a_residual_step_then_the_norm():
    g = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(2, 3, 384, generator=g).to(DEVICE) for _ in range(2))
    weight = torch.rand(384, generator=g).to(DEVICE) + 0.5
    for dtype in DTYPES:
        a, d, w = x.to(dtype), delta.to(dtype), weight.to(dtype)
        total, normed = elementwise.add_rms_norm(a, d, w, 1e-6)
        assert torch.equal(total, a + d)  # the residual stream itself is rounded exactly as a + d
        _close(normed, elementwise.reference_rms_norm(a + d, w, 1e-6))


def test_silu_mul_equals_the_plain_ops_across_column_blocks():
    g = torch.Generator().manual_seed(1)
    both = (torch.randn(4, 2 * 1000, generator=g) * 4).to(DEVICE)
    gate, up = both[:, :1000], both[:, 1000:]  # strided halves of one tensor, as a fused gate_up gives
    for dtype in DTYPES:
        _close(elementwise.silu_mul(gate.to(dtype), up.to(dtype), block=256),
               elementwise.reference_silu_mul(gate.to(dtype), up.to(dtype)))
    _close(elementwise.silu_mul(gate[:1, None], up[:1, None]), elementwise.reference_silu_mul(gate[:1, None], up[:1, None]))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_rope_equals_the_plain_ops(interleaved, dim):
    g = torch.Generator().manual_seed(dim)
    tokens, heads = 7, 3
    positions = torch.tensor([0, 1, 2, 50, 51, 900, 4000])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions.float()[:, None] * inv_freq
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    # As the paged attention hands them over: q [T, H, D] transposed to [H, T, D], and a 2-D k.
    q = torch.randn(tokens, heads, dim + 32, generator=g).to(DEVICE)[..., 32:].transpose(0, 1)
    k = torch.randn(tokens, dim, generator=g).to(DEVICE)
    for dtype in DTYPES:
        for x in (q.to(dtype), k.to(dtype)):
            c, s = cos.to(dtype), sin.to(dtype)
            assert elementwise.rope_supports(x, c, s)
            out = elementwise.rope(x, c, s, interleaved)
            _close(out, elementwise.reference_rope(x, c, s, interleaved))
            # Laid out [T, heads, D]: what the paged attention transposes it back to, without a copy.
            assert (out.transpose(0, 1) if out.dim() == 3 else out).is_contiguous()


def _cache(width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((32, width), 7.0, dtype=dtype, device=DEVICE)


def _assert_writes_alike(write, reference, args: tuple, slots: torch.Tensor, width: int, dtype: torch.dtype):
    """A cache write kernel and its plain reference fill the same slots with the same entries and leave
    every other slot as it was; returns the two caches."""
    caches = [_cache(width, dtype) for _ in range(2)]
    write(*args, caches[0], slots)
    reference(*args, caches[1], slots)
    _close(caches[0], caches[1])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (caches[0][untouched.to(DEVICE)] == 7.0).all()
    return caches


@pytest.mark.parametrize("interleaved", [True, False])
def test_latent_write_equals_the_plain_ops(interleaved):
    """MLA's cache write in one kernel: the latent's norm and the rope key's rotation written into the
    cache slots, from rows that are a strided view of a wider projection (as the merged q/kv_a gives)."""
    g = torch.Generator().manual_seed(5)
    tokens, rank, rope = 5, 64, 16
    projection = (torch.randn(tokens, 48 + rank + rope, generator=g) * 3).to(DEVICE)
    latent = projection[:, 48:]
    weight = (torch.rand(rank, generator=g) + 0.5).to(DEVICE)
    angles = torch.tensor([0, 1, 7, 300, 4000])[:, None].float() * (1.0 / (10000 ** (torch.arange(0, rope, 2) / rope)))
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    slots = torch.tensor([9, 2, 30, 4, 17]).to(DEVICE)
    for dtype in DTYPES:
        args = latent.to(dtype), weight.to(dtype), 1e-6, cos.to(dtype), sin.to(dtype), interleaved
        assert elementwise.latent_write_supports(args[0], args[1], args[3], args[4], _cache(rank + rope, dtype))
        caches = _assert_writes_alike(elementwise.latent_write, elementwise.reference_latent_write, args, slots,
                                      rank + rope, dtype)
    # The norm is rounded once, to the cache's dtype: a float32 weight on a bf16 latent takes the plain path.
    assert not elementwise.latent_write_supports(latent.half(), weight, cos.half(), sin.half(), caches[0].half())
    assert not elementwise.latent_write_supports(latent, weight, cos[:4], sin[:4], caches[0].float())


@pytest.mark.parametrize("interleaved", [False, True])
def test_kv_write_equals_the_plain_ops(interleaved):
    """Llama's cache write in one kernel: every K/V head's key rotated, then the values, written into the
    cache slots, from a strided view of the merged q/k/v projection."""
    g = torch.Generator().manual_seed(6)
    tokens, kv_heads, dim = 5, 3, 16
    projection = (torch.randn(tokens, 40 + 2 * kv_heads * dim, generator=g) * 3).to(DEVICE)
    k = projection[:, 40:40 + kv_heads * dim].unflatten(-1, (kv_heads, dim))
    v = projection[:, 40 + kv_heads * dim:]
    angles = torch.tensor([0, 1, 7, 300, 4000])[:, None].float() * (1.0 / (10000 ** (torch.arange(0, dim, 2) / dim)))
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    slots = torch.tensor([9, 2, 30, 4, 17]).to(DEVICE)
    for dtype in DTYPES:
        args = k.to(dtype), v.to(dtype), cos.to(dtype), sin.to(dtype), interleaved
        assert elementwise.kv_write_supports(*args[:4], _cache(2 * kv_heads * dim, dtype))
        caches = _assert_writes_alike(elementwise.kv_write, elementwise.reference_kv_write, args, slots,
                                      2 * kv_heads * dim, dtype)
    assert not elementwise.kv_write_supports(k, v[:, :-2], cos, sin, caches[0].float())  # not the cache's row
    assert not elementwise.kv_write_supports(k.half(), v, cos, sin, caches[0].float())  # mixed dtypes


def test_rope_refuses_what_it_does_not_take():
    x = torch.randn(2, 3, 5, 8)  # 4-D: the contiguous-cache path's [B, H, T, D]
    cos = torch.randn(5, 4)
    assert not elementwise.rope_supports(x, cos, cos)
    strided = torch.randn(3, 5, 16)[..., ::2]  # [3, 5, 8] with a stride of 2 along the rotated axis
    assert not elementwise.rope_supports(strided, cos, cos) and elementwise.rope_supports(strided.contiguous(), cos, cos)
    assert not elementwise.rope_supports(x[0], cos[:4], cos[:4])  # one cos row per position


@pytest.mark.parametrize("which", ["deepseek", "llama"])
def test_a_decode_step_through_the_fused_ops_gives_the_same_logits(which, llama_dir, monkeypatch):
    """The bundled DeepSeek-V3 (MLA + MoE, interleaved rope, q/kv norms) and a Llama model: a paged
    prefill and decode step with every norm, rotary embedding and SwiGLU product fused (MLA's cache write
    too), against the plain ops."""
    from quantship.models import layers, paged
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model

    model = load_model(TINY_DIR if which == "deepseek" else llama_dir, torch.float32, device=DEVICE)
    calls = {"rms_norm": 0, "add_rms_norm": 0, "rope": 0, "silu_mul": 0} | (
        {"latent_write": 0} if which == "deepseek" else {"kv_write": 0})
    for name in calls:
        original = getattr(elementwise, name)
        monkeypatch.setattr(elementwise, name, lambda *a, name=name, original=original, **k:
                            calls.__setitem__(name, calls[name] + 1) or original(*a, **k))
    block, lengths = 16, [5, 20]
    ids = torch.randint(3, 1000, (sum(lengths) + 2,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits = []
    with torch.inference_mode():
        for fused in (False, True):
            monkeypatch.setattr(layers, "use_fused_ops", lambda x, fused=fused: fused)
            kv = [torch.zeros(8 * block, paged.cache_width(model.config), device=DEVICE) for _ in model.model.layers]
            batch, positions = paged.PagedBatch.build(kv, [[0, 1], [2, 3]], [0, 0], lengths, block, DEVICE)
            prefill = model(ids[None, :sum(lengths)], positions, batch)
            batch, positions = paged.PagedBatch.build(kv, [[0, 1], [2, 3]], lengths, [1, 1], block, DEVICE)
            logits.append((prefill, model(ids[None, sum(lengths):], positions, batch)))
    assert all(calls.values()), calls  # each kind of op went through its kernel
    if which == "llama":  # each residual step is the norm after it: one plain norm per forward, the first
        assert calls["rms_norm"] == 2 and calls["add_rms_norm"] == 2 * 2 * len(model.model.layers), calls
    # On a GPU the kernels' float32 reductions run in another order than torch's, and three layers of
    # MLA + MoE carry that rounding to ~3e-4 of the logits (seen on an H200); the interpreter keeps 1e-4.
    tolerance = 1e-3 if DEVICE == "cuda" else 1e-4
    for plain, fused in zip(*logits):
        torch.testing.assert_close(fused, plain, rtol=tolerance, atol=tolerance)
