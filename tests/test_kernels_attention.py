"""Paged decode attention against its plain reference (CPU: under Triton's interpreter)."""

import pytest
import torch

from quantship.kernels import paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytest.importorskip("triton")


@pytest.mark.parametrize("seqs,heads,kv_heads,dim,lengths", [
    (1, 4, 4, 64, [1]),  # multi-head attention, a single key
    (3, 8, 2, 64, [5, 70, 130]),  # grouped queries; lengths across block edges
    (2, 28, 4, 128, [64, 200]),  # a group of 7 heads (padded to the dot tile)
    (4, 2, 1, 16, [3, 1, 17, 64]),
])
def test_decode_attention_equals_reference(seqs, heads, kv_heads, dim, lengths):
    g = torch.Generator().manual_seed(dim + seqs)
    slots = 512
    cache = torch.randn(slots, 2 * kv_heads * dim, generator=g).to(DEVICE)
    width = max(lengths) + 37  # padded key axis: slots past a sequence's length hold garbage
    key_slots = torch.randint(0, slots, (seqs, width), generator=g, dtype=torch.int64).to(DEVICE)
    q = torch.randn(seqs, heads, dim, generator=g).to(DEVICE)
    length = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = dim**-0.5
    expected = paged_attention.reference(q, cache, key_slots, length, kv_heads, scale)
    for dtype in [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []):
        out = paged_attention.decode_attention(q.to(dtype), cache.to(dtype), key_slots, length, kv_heads, scale)
        error = (out.float() - expected).norm() / expected.norm()
        assert out.dtype == dtype and error < (1e-5 if dtype == torch.float32 and DEVICE == "cpu" else 2e-2)


@pytest.mark.parametrize("seqs,heads,rank,rope,lengths", [
    (1, 4, 64, 8, [1]),  # a single key; rope narrower than a dot tile
    (3, 16, 128, 16, [5, 70, 130]),  # lengths across block edges
    (2, 20, 512, 64, [33, 100]),  # DeepSeek-V2/V3 latent sizes; heads beyond one block of 16
])
def test_mla_decode_attention_equals_reference(seqs, heads, rank, rope, lengths):
    g = torch.Generator().manual_seed(rank + seqs)
    slots = 256
    cache = torch.randn(slots, rank + rope, generator=g).to(DEVICE)
    key_slots = torch.randint(0, slots, (seqs, max(lengths) + 21), generator=g, dtype=torch.int64).to(DEVICE)
    q = torch.randn(seqs, heads, rank + rope, generator=g).to(DEVICE)
    length = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = 0.05
    expected = paged_attention.mla_reference(q, cache, key_slots, length, rank, scale)
    # The reference itself: what the engine's general path computes (SDPA over the gathered, expanded context).
    context = cache[key_slots[0, :lengths[0]]]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:1].transpose(0, 1)[None], context[None, None],
                                                            context[None, None, :, :rank], scale=scale)
    torch.testing.assert_close(sdpa[0].transpose(0, 1), expected[:1], atol=1e-4, rtol=1e-4)
    for dtype in [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []):
        out = paged_attention.mla_decode_attention(q.to(dtype), cache.to(dtype), key_slots, length, rank, scale)
        error = (out.float() - expected).norm() / expected.norm()
        assert out.shape == (seqs, heads, rank) and out.dtype == dtype
        assert error < (1e-5 if dtype == torch.float32 and DEVICE == "cpu" else 2e-2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim", [16, 64])
def test_decode_rotating_the_queries_in_the_kernel_equals_rotating_them_first(interleaved, dim):
    """Llama's queries as projected (a strided view of the merged q/k/v output) rotated inside the decode
    kernel give what the rope kernel's output gives; head sizes whose half is below a dot tile included."""
    from quantship.kernels import elementwise

    g = torch.Generator().manual_seed(dim + interleaved)
    seqs, heads, kv_heads = 3, 8, 2
    cache = torch.randn(128, 2 * kv_heads * dim, generator=g).to(DEVICE)
    key_slots = torch.randint(0, 128, (seqs, 80), generator=g, dtype=torch.int64).to(DEVICE)
    lengths = torch.tensor([1, 33, 80], dtype=torch.int32, device=DEVICE)
    projected = torch.randn(seqs, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE)
    q = projected[:, :heads * dim].unflatten(-1, (heads, dim))
    angles = torch.rand(seqs, dim // 2, generator=g).to(DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    for dtype in [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []):
        c, s_, qd = cos.to(dtype), sin.to(dtype), q.to(dtype)
        rotated = elementwise.reference_rope(qd.transpose(0, 1), c, s_, interleaved).transpose(0, 1)
        first = paged_attention.decode_attention(rotated, cache.to(dtype), key_slots, lengths, kv_heads, 0.1)
        fused = paged_attention.decode_attention(qd, cache.to(dtype), key_slots, lengths, kv_heads, 0.1,
                                                 rope=(c, s_, interleaved))
        exact = 0 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(fused, first, rtol=exact, atol=exact)
        expected = paged_attention.reference(rotated, cache.to(dtype), key_slots, lengths, kv_heads, 0.1)
        assert ((fused.float() - expected).norm() / expected.norm()) < (1e-5 if DEVICE == "cpu" else 2e-2)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_rotating_the_query_rope_in_the_kernel_equals_rotating_it_first(interleaved, splits):
    """The queries' rope part as projected (a strided view of the projection, interleaved pairs or two
    halves) rotated inside the kernel gives what the rope kernel's output concatenated to the latent
    queries gives: the same rounding, so in bf16 the same bits."""
    from quantship.kernels import elementwise

    g = torch.Generator().manual_seed(splits + interleaved)
    seqs, heads, rank, rope, nope = 3, 20, 64, 16, 24
    cache = torch.randn(128, rank + rope, generator=g).to(DEVICE)
    key_slots = torch.randint(0, 128, (seqs, 96), generator=g, dtype=torch.int64).to(DEVICE)
    lengths = torch.tensor([1, 40, 96], dtype=torch.int32, device=DEVICE)
    projected = torch.randn(seqs, heads, nope + rope, generator=g).to(DEVICE)  # q_nope ‖ q_rope, as split
    q_rope = projected[..., nope:]
    q_latent = torch.randn(heads, seqs, rank, generator=g).to(DEVICE).transpose(0, 1)  # an einsum's layout
    angles = torch.rand(seqs, rope // 2, generator=g).to(DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    for dtype in [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []):
        rotated = elementwise.reference_rope(q_rope.to(dtype).transpose(0, 1), cos.to(dtype), sin.to(dtype),
                                             interleaved).transpose(0, 1)  # as the model rotates: heads first
        q = torch.cat((q_latent.to(dtype), rotated), dim=-1)
        first = paged_attention.mla_decode_attention(q, cache.to(dtype), key_slots, lengths, rank, 0.1, splits=splits)
        fused = paged_attention.mla_decode_attention(
            q_latent.to(dtype), cache.to(dtype), key_slots, lengths, rank, 0.1, splits=splits,
            rope=(q_rope.to(dtype), cos.to(dtype), sin.to(dtype), interleaved))
        exact = 0 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(fused, first, rtol=exact, atol=exact)
        expected = paged_attention.mla_reference(q, cache.to(dtype), key_slots, lengths, rank, 0.1)
        assert ((fused.float() - expected).norm() / expected.norm()) < (1e-5 if DEVICE == "cpu" else 2e-2)


@pytest.mark.parametrize("splits", [1, 2, 5, paged_attention.MAX_SPLITS])
def test_split_keys_give_the_unsplit_result(splits):
    """Both kernels with their key axis cut into `splits` parts (flash-decoding) equal the reference:
    sequences shorter than a split's first key leave that split empty, a sequence with no keys (a CUDA
    graph's padding row) comes out 0, and lengths fall across block and split edges."""
    g = torch.Generator().manual_seed(splits)
    lengths = torch.tensor([1, 0, 70, 200], dtype=torch.int32, device=DEVICE)
    key_slots = torch.randint(0, 256, (4, 256), generator=g, dtype=torch.int64).to(DEVICE)
    # (reference, kernel, cache width, heads, query width, last argument): MLA rank 64 + rope 16; 2 K/V heads of 32
    cases = [(paged_attention.mla_reference, paged_attention.mla_decode_attention, 80, 20, 80, 64),
             (paged_attention.reference, paged_attention.decode_attention, 2 * 2 * 32, 8, 32, 2)]
    for reference, kernel, width, heads, q_width, last in cases:
        cache = torch.randn(256, width, generator=g).to(DEVICE)
        q = torch.randn(4, heads, q_width, generator=g).to(DEVICE)
        out = kernel(q, cache, key_slots, lengths, last, 0.1, splits=splits)
        assert not out[1].any()
        expected = reference(q[[0, 2, 3]], cache, key_slots[[0, 2, 3]], lengths[[0, 2, 3]], last, 0.1)
        error = (out[[0, 2, 3]].float() - expected).norm() / expected.norm()
        assert error < (1e-5 if DEVICE == "cpu" else 5e-3), (kernel.__name__, error.item())


def test_the_split_plan_fills_the_gpu_where_it_pays():
    """One V2-Lite head block at batch 1 is cut into as many splits as its key blocks allow (at most
    MAX_SPLITS); a batch that fills the GPU alone is not split, nor a bucket whose shorter half of
    contexts the split would spare fewer than MIN_BLOCKS_SAVED blocks; 132 SMs. (splits, keys per split)."""
    plan = paged_attention.split_plan
    assert plan(256, 32, 1, 132) == (8, 32)  # MLA's first bucket: a block a split, 3 spared at 128 keys
    assert plan(4096, 32, 1, 132) == (paged_attention.MAX_SPLITS, 256)
    assert plan(4096, 32, 8, 132) == (paged_attention.MAX_SPLITS, 256)
    assert plan(4096, 32, 64, 132) == (5, 832)  # 26 blocks a split, the last split shorter
    assert plan(1024, 64, 32, 132) == (8, 128)  # 9 wanted: 2 blocks a split makes 8
    assert plan(4096, 32, 512, 132) == (1, 4096)
    assert plan(1, 64, 1, 132) == (1, 64)
    assert plan(256, 64, 1, 132) == (1, 256)  # Llama's first bucket: 2 blocks at 128 keys, 1 spared
    assert plan(256, 32, 64, 132) == (1, 256)  # 5 splits of 2 blocks: 2 spared at 128 keys
    assert plan(4096, 64, 256, 132) == (1, 4096)  # 2 splits: the second is empty at 2,048 keys
    assert plan(256, 64, 1, 132, splits=3) == (2, 128)  # asked for 3: whole blocks make 2
    assert plan(256, 32, 1, 132, splits=paged_attention.MAX_SPLITS) == (8, 32)


def _decode_step_through_kernel_and_not(model, monkeypatch) -> list[torch.Tensor]:
    """Logits of one paged decode step of three sequences (prefilled to 5, 20 and 33 tokens), with
    attention through the decode kernel and through the gather + SDPA path."""
    from quantship.models import paged

    device = next(model.parameters()).device
    block, lengths = 16, [5, 20, 33]
    kv = [torch.zeros(16 * block, paged.cache_width(model.config), device=device) for _ in model.model.layers]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    ids = torch.randint(3, 1000, (sum(lengths) + 3,), generator=torch.Generator().manual_seed(0)).to(device)
    batch, positions = paged.PagedBatch.build(kv, tables, [0, 0, 0], lengths, block, device)
    step = []
    with torch.inference_mode():
        model.hidden_states(ids[None, :sum(lengths)], positions, batch)
        for kernel in (False, True):
            monkeypatch.setattr(paged, "use_decode_kernel", lambda q, kernel=kernel: kernel)
            batch, positions = paged.PagedBatch.build(kv, tables, lengths, [1, 1, 1], block, device)
            step.append(model(ids[None, sum(lengths):], positions, batch))
    return step


def _assert_close_for_device(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.device.type == "cpu":
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
        return
    # Triton's float32 dot runs in TF32 on the GPU: its rounding compounds over the layers, so the
    # logits are compared as a whole (a wrong context or mask moves them by far more).
    error = ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert error < 5e-3, error


def test_the_deepseek_decode_step_gives_the_same_logits_through_the_mla_kernel(monkeypatch):
    """The bundled DeepSeek-V3 (MLA + MoE) model's paged decode step, latent attention through the
    kernel against the gather + SDPA path."""
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model

    model = load_model(TINY_DIR, torch.float32, device=DEVICE)
    calls = []
    original = paged_attention.mla_decode_attention
    monkeypatch.setattr(paged_attention, "mla_decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    step = _decode_step_through_kernel_and_not(model, monkeypatch)
    assert len(calls) == model.config.num_hidden_layers  # every layer's decode went through the kernel
    _assert_close_for_device(*step)


def test_the_llama_decode_step_gives_the_same_logits_through_the_kernel(llama_dir, monkeypatch):
    """A Llama (GQA) model's paged decode step, attention through the kernel against the gather + SDPA path."""
    from quantship.models.loader import load_model

    model = load_model(llama_dir, torch.float32, device=DEVICE)
    _assert_close_for_device(*_decode_step_through_kernel_and_not(model, monkeypatch))


def test_mla_prefill_in_head_chunks_equals_one_call(monkeypatch):
    """A long prefill's latent attention runs its heads in chunks under a scores budget: same output."""
    from quantship.models import deepseek, paged
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model

    model = load_model(TINY_DIR, torch.float32)
    lengths, block = [40, 7], 16
    kv = [torch.zeros(8 * block, paged.cache_width(model.config)) for _ in model.model.layers]
    ids = torch.randint(3, 1000, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    out = []
    for budget in (deepseek.SCORES_BUDGET, 2 * 40 * 40 * 3):  # one call; then 3 of the 8 heads at a time
        monkeypatch.setattr(deepseek, "SCORES_BUDGET", budget)
        batch, positions = paged.PagedBatch.build(kv, [[0, 1, 2], [3]], [0, 0], lengths, block, torch.device("cpu"))
        with torch.inference_mode():
            out.append(model(ids[None], positions, batch))
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)


def test_mla_heads_folded_into_the_queries_equal_sdpa_over_keys_expanded_per_head(monkeypatch):
    """On the CPU MLA's latent attention folds the heads into the query axis (the keys every head shares
    are multiplied once); on CUDA it runs SDPA over the keys expanded per head. Same logits, for a padded
    step of decodes and a prompt chunk and for heads in chunks under the scores budget."""
    from quantship.models import deepseek, paged
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model

    folded = paged.PagedBatch.shared_attention

    def expanded(self, q, context, value_width, scale):  # the CUDA path, run here
        return folded(self, q, context, value_width, scale, fold=False)

    model = load_model(TINY_DIR, torch.float64)
    block, before, counts = 16, [5, 20, 10], [1, 9, 1]
    kv = [torch.zeros(12 * block, paged.cache_width(model.config), dtype=torch.float64) for _ in model.model.layers]
    tables = [[0, 1], [2, 3], [4, 5]]
    ids = torch.randint(3, 1000, (sum(before) + sum(counts),), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        batch, positions = paged.PagedBatch.build(kv, tables, [0] * 3, before, block, torch.device("cpu"))
        model.hidden_states(ids[None, :sum(before)], positions, batch)
        for budget in (deepseek.SCORES_BUDGET, 3 * 9 * 30 * 3):  # all heads at once; 3 at a time
            monkeypatch.setattr(deepseek, "SCORES_BUDGET", budget)
            out = []
            for attend in (folded, expanded):
                monkeypatch.setattr(paged.PagedBatch, "shared_attention", attend)
                step, positions = paged.PagedBatch.build(kv, tables, before, counts, block, torch.device("cpu"),
                                                         split=False)  # decodes padded to the chunk
                out.append(model(ids[None, sum(before):], positions, step))
            torch.testing.assert_close(out[0], out[1], atol=1e-10, rtol=1e-10)


def _mixed_step_split_and_padded(model, monkeypatch, kernel: bool) -> list[torch.Tensor]:
    """Logits of one step where three sequences decode and one prefills a 12-token chunk, built as
    parts (decodes apart from the chunk) and padded together as one batch."""
    from quantship.models import paged

    monkeypatch.setattr(paged, "use_decode_kernel", lambda q: kernel)
    device = next(model.parameters()).device
    block, before = 16, [5, 20, 10, 33]  # tokens each sequence holds before the step
    counts = [1, 1, 12, 1]  # a decode run, the chunk, a decode run: three parts
    kv = [torch.zeros(16 * block, paged.cache_width(model.config), device=device) for _ in model.model.layers]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    ids = torch.randint(3, 1000, (sum(before) + sum(counts),), generator=torch.Generator().manual_seed(1)).to(device)
    out = []
    with torch.inference_mode():
        batch, positions = paged.PagedBatch.build(kv, tables, [0] * 4, before, block, device)
        model.hidden_states(ids[None, :sum(before)], positions, batch)
        for split in (True, False):
            batch, positions = paged.PagedBatch.build(kv, tables, before, counts, block, device, split=split)
            if split:
                assert [(first, end) for _, first, end in batch.parts] == [(0, 2), (2, 14), (14, 15)]
                assert [part.mask.shape[2] for part, _, _ in batch.parts] == [1, 12, 1]  # no decode padded to 12
            else:
                assert not batch.parts and batch.mask.shape[2] == 12
            out.append(model(ids[None, sum(before):], positions, batch))
    return out


@pytest.mark.parametrize("kernel", [False, True])
def test_a_mixed_step_runs_decodes_apart_from_prompt_chunks_with_the_same_logits(llama_dir, monkeypatch, kernel):
    """Decodes beside a prompt chunk are not padded to the chunk's length (the decode kernel takes them
    where it runs): the step's logits equal those of the whole step padded together, MLA and Llama."""
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model

    for directory in (TINY_DIR, llama_dir):
        model = load_model(directory, torch.float32, device=DEVICE)
        _assert_close_for_device(*_mixed_step_split_and_padded(model, monkeypatch, kernel))
