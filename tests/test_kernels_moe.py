"""Fused MoE kernels against the plain expert loop; expert alignment on the device.

On CPU these run under Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

import pytest
import torch

from quantship.kernels import fused_moe, wna16
from quantship.kernels.fused_moe import ExpertWeights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytest.importorskip("triton")


def routing(n, experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(n)])
    weights = torch.rand(n, top_k, generator=g)
    return weights.to(DEVICE), indices.to(DEVICE)


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("n,experts,top_k,block_m", [(1, 8, 2, 16), (7, 8, 3, 16), (50, 4, 2, 16), (300, 4, 2, 64),
                                                     (5, 256, 8, 16), (9, 6, 2, 16)])
def test_alignment_places_every_slot_once_in_its_experts_blocks(n, experts, top_k, block_m, one_program):
    _, indices = routing(n, experts, top_k, seed=n)
    sorted_ids, block_expert = fused_moe.align_by_expert(indices, experts, block_m, one_program)
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


@pytest.mark.parametrize("n,experts,top_k,block_m", [(1, 64, 6, 16), (33, 256, 8, 16), (40, 5, 2, 64), (12, 8, 1, 16)])
def test_alignment_in_one_program_equals_the_sort(n, experts, top_k, block_m):
    """The one-launch alignment (decode) gives exactly the torch sort's placement, including a batch where
    every token picks the same experts and experts that get no slot."""
    _, indices = routing(n, experts, top_k, seed=7 * n)
    same = indices[:1].expand(n, top_k).contiguous()
    for case in (indices, same):
        one = fused_moe.align_by_expert(case, experts, block_m, one_program=True)
        sort = fused_moe.align_by_expert(case, experts, block_m, one_program=False)
        assert torch.equal(one[0], sort[0]) and torch.equal(one[1], sort[1])


def dense_experts(experts, out, inp, g):
    return ExpertWeights((torch.randn(experts, out, inp, generator=g) / inp**0.5).to(DEVICE), inp)


def packed_experts(experts, out, inp, g, bits, group, symmetric):
    qmax = 1 << (bits - 1)
    values = torch.randint(-qmax, qmax, (experts, out, inp), generator=g, dtype=torch.int8)
    groups = -(-inp // group)  # a group longer than the input: one (per-channel)
    scale = torch.rand(experts, groups, out, generator=g) * 0.02 / inp**0.5 * 8
    zero = None if symmetric else torch.randint(-qmax, qmax, (experts, groups, out), generator=g,
                                                dtype=torch.int8)
    packed = torch.stack([wna16.pack(v, bits) for v in values])
    return ExpertWeights(packed.to(DEVICE), inp, scale.to(DEVICE), None if zero is None else zero.to(DEVICE), bits,
                         group)


def layer_experts(experts, hidden, inter, quant, g):
    """Gate, up and down of every expert: dense (quant None) or packed as quant = (bits, group, symmetric)."""
    if quant is None:
        return (dense_experts(experts, inter, hidden, g), dense_experts(experts, inter, hidden, g),
                dense_experts(experts, hidden, inter, g))
    return (packed_experts(experts, inter, hidden, g, *quant), packed_experts(experts, inter, hidden, g, *quant),
            packed_experts(experts, hidden, inter, g, *quant))


CASES = [  # (n, experts, top_k, hidden, inter, quantization)
    (1, 8, 2, 64, 32, None), (6, 8, 3, 96, 48, None), (33, 4, 2, 64, 80, None), (260, 4, 2, 32, 16, None),
    (3, 8, 2, 128, 64, (4, 64, True)), (20, 4, 2, 128, 128, (4, 64, False)), (5, 4, 3, 128, 64, (8, 64, True)),
    (4, 8, 2, 256, 128, (8, 128, True)),  # groups longer than a tile
    (3, 8, 2, 256, 96, (4, 32, False)),  # W4 tiles of 128 span groups of 32: scales gathered per word row
    (2, 4, 2, 96, 48, (4, 96, True)),  # per-channel, K shorter than one W4 tile
    (140, 4, 2, 128, 64, (4, 32, False)),  # prefill blocks of 64 rows: whole dequantized tiles spanning groups
    (140, 4, 2, 256, 128, (4, 128, False)),  # prefill blocks, tiles inside groups: one scale row per tile
]


@pytest.mark.parametrize("n,experts,top_k,hidden,inter,quant", CASES)
def test_fused_moe_equals_the_expert_loop(n, experts, top_k, hidden, inter, quant):
    g = torch.Generator().manual_seed(hidden + n)
    x = torch.randn(n, hidden, generator=g).to(DEVICE)
    gate, up, down = layer_experts(experts, hidden, inter, quant, g)
    weights, indices = routing(n, experts, top_k, seed=n + 1)
    expected = fused_moe.reference(x, gate, up, down, weights, indices)
    dtypes = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
    for dtype in dtypes:
        cast = [ExpertWeights(w.weight.to(dtype) if w.bits == 0 else w.weight, w.in_features,
                              None if w.scale is None else w.scale.to(dtype), w.zero, w.bits, w.group_size)
                for w in (gate, up, down)]
        # prefill-sized steps of packed experts: dequantized once (the default) and in-kernel (64-row blocks)
        prefill = gate.bits and fused_moe.dequantizes_experts(n * top_k, experts, gate.bits)
        variants = [{"dequantize": dequantize} for dequantize in ((None, False) if prefill else (None,))]
        for options in variants:
            out = fused_moe.fused_moe(x.to(dtype), *cast, weights, indices, **options)
            assert out.dtype == dtype and out.shape == x.shape
            error = (out.float() - expected).norm() / expected.norm()
            assert error < (1e-5 if DEVICE == "cpu" else 2e-2), (dtype, options, error.item())


@pytest.mark.parametrize("quant", [(4, 32, False), (4, 128, True), (8, 64, False)])
def test_packed_experts_dequantized_in_chunks_equal_the_loop(monkeypatch, quant):
    """A prefill step over packed experts, dequantized a few experts at a time (the budget shrunk so that
    gate/up and down each take several chunks, one of them short): every slot is computed once, by its
    expert's chunk, and the result equals the loop and the in-kernel blocks."""
    n, experts, top_k, hidden, inter = 170, 5, 2, 256, 96  # 68 slots per expert: prefill blocks
    per_expert = 2 * hidden * inter * 4  # float32 gate + up
    monkeypatch.setattr(fused_moe, "DEQUANTIZE_BUDGET", 2 * per_expert)  # gate/up: 3 chunks, down: 2
    assert fused_moe.dequantize_bytes(experts, hidden, inter, 4) == 2 * per_expert
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, hidden, generator=g).to(DEVICE)
    gate, up, down = layer_experts(experts, hidden, inter, quant, g)
    weights, indices = routing(n, experts, top_k, seed=5)
    expected = fused_moe.reference(x, gate, up, down, weights, indices)
    chunked = fused_moe.fused_moe(x, gate, up, down, weights, indices, dequantize=True)
    # a prefill-sized step takes this route by default
    assert torch.equal(fused_moe.fused_moe(x, gate, up, down, weights, indices), chunked)
    blocks = fused_moe.fused_moe(x, gate, up, down, weights, indices, dequantize=False)
    tolerance = 1e-5 if DEVICE == "cpu" else 5e-3  # float32 sums in another order (TF32 on the GPU)
    assert ((chunked - expected).norm() / expected.norm()) < tolerance
    assert ((chunked - blocks).norm() / blocks.norm()) < tolerance


@pytest.mark.parametrize("n,experts,top_k,hidden,inter,quant,split", [
    (1, 8, 2, 256, 64, None, 3), (3, 8, 2, 512, 192, (4, 64, True), 2), (5, 4, 3, 384, 128, (4, 32, False), 4),
    (4, 8, 2, 512, 128, (8, 128, True), 8)])
def test_decode_blocks_split_over_k_equal_the_expert_loop(n, experts, top_k, hidden, inter, quant, split):
    """Decode blocks with K split over programs (gate/up's SiLU product and down's sums finished by the last
    split of each tile through the float32 workspace) equal the loop and the unsplit kernels, and each
    call leaves the workspace clear for the next (two routings in a row: every expert of a batch picking
    the same ones included)."""
    g = torch.Generator().manual_seed(hidden + n + split)
    x = torch.randn(n, hidden, generator=g).to(DEVICE)
    gate, up, down = layer_experts(experts, hidden, inter, quant, g)
    weights, indices = routing(n, experts, top_k, seed=n + 2)
    for chosen in (indices, indices[:1].expand(n, top_k).contiguous()):
        expected = fused_moe.reference(x, gate, up, down, weights, chosen)
        whole = fused_moe.fused_moe(x, gate, up, down, weights, chosen, split_k=1)
        out = fused_moe.fused_moe(x, gate, up, down, weights, chosen, split_k=split)
        # Triton's float32 dot runs in TF32 on the GPU; a split changes only the order of the sums.
        assert ((out.float() - expected).norm() / expected.norm()) < (1e-5 if DEVICE == "cpu" else 5e-3)
        torch.testing.assert_close(out, whole, rtol=1e-5 if DEVICE == "cpu" else 1e-4, atol=1e-5)
        sums, counters = wna16.split_workspace(x.device, 0, 0)
        assert not sums.any() and not counters.any()


@pytest.mark.parametrize("quantize", [False, True])
def test_the_bundled_moe_layer_gives_the_same_output_fused_and_looped(quantize):
    """The DeepSeek MoE module's own routing, through the fused kernels and through its expert loop,
    with its bf16-trained experts as they are and RTN-quantized to packed W4A16 g64."""
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model
    from quantship.models.quantized import quant_linear
    from quantship.quant.rtn import rtn_quantize
    from quantship.quantized_tensor import WeightQuant

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(TINY_DIR, torch.float32, device=device)
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "enable_fused_kernels"))
    if quantize:
        for expert in moe.experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                q = rtn_quantize(getattr(expert, name).weight.data, WeightQuant(num_bits=4, group_size=64))
                setattr(expert, name, quant_linear(q.values, q.scale.float(), q.zero_point, bits=4))
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    weights, indices = moe.gate(x)
    looped = moe.routed(x, weights, indices)
    assert moe.enable_fused_kernels()
    fused = fused_moe.fused_moe(x, *moe.fused, weights, indices)
    tolerance = 1e-4 if device.type == "cpu" else 5e-3  # Triton's float32 dot runs in TF32 on the GPU
    assert torch.allclose(fused, looped, atol=tolerance, rtol=tolerance)
    # On CPU the loop runs (over views of the stack); on CUDA the module itself takes the fused path.
    assert torch.equal(moe.routed(x, weights, indices), fused if device.type == "cuda" else looped)


@pytest.mark.parametrize("n,experts,top_k,hidden,inter,quant", [
    (1, 64, 6, 256, 128, (4, 128, True)),  # V2-Lite's routing at batch 1
    (2, 64, 8, 256, 192, (4, 64, False)),  # V3's top-8 at batch 2, asymmetric
    (3, 16, 2, 384, 96, (4, 32, False)),  # GEMV tiles of 64 inputs span groups of 32: scales per word row
    (1, 8, 3, 256, 128, (8, 128, True)),  # W8A16
    (2, 8, 2, 96, 48, (4, 96, True)),  # per-channel, K shorter than one tile
])
def test_slot_gemv_equals_the_expert_loop_and_the_blocks(n, experts, top_k, hidden, inter, quant):
    """Packed experts as one GEMV row per slot (decode steps of few slots) equal the loop and the 16-row
    blocks, with K split (finished in the kernel) and unsplit, each call leaving the workspace clear for the
    next (two routings in a row: a batch whose tokens all pick the same experts included)."""
    g = torch.Generator().manual_seed(hidden + 3 * n)
    x = torch.randn(n, hidden, generator=g).to(DEVICE)
    gate, up, down = layer_experts(experts, hidden, inter, quant, g)
    weights, indices = routing(n, experts, top_k, seed=n + 5)
    for chosen in (indices, indices[:1].expand(n, top_k).contiguous()):
        expected = fused_moe.reference(x, gate, up, down, weights, chosen)
        blocks = fused_moe.fused_moe(x, gate, up, down, weights, chosen, slot_gemv=False)
        out = fused_moe.fused_moe(x, gate, up, down, weights, chosen, slot_gemv=True)
        assert ((out.float() - expected).norm() / expected.norm()) < 1e-5  # float32 FMAs, GPU included
        # the blocks' float32 tensor-core products run in TF32 on the GPU
        assert ((out.float() - blocks.float()).norm() / blocks.float().norm()) < (1e-5 if DEVICE == "cpu" else 5e-3)
        sums, counters = wna16.split_workspace(x.device, 0, 0)
        assert not sums.any() and not counters.any()


def test_slot_gemv_without_a_workspace_sums_each_tokens_slots_in_one_program(monkeypatch):
    """Where the split workspace cannot be had (it would grow during CUDA-graph capture), gate/up runs
    unsplit and down takes a program per token looping over its slots: the same result."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 256, generator=g).to(DEVICE)
    gate, up, down = layer_experts(64, 256, 128, (4, 64, False), g)
    weights, indices = routing(3, 64, 6, seed=9)
    expected = fused_moe.reference(x, gate, up, down, weights, indices)
    monkeypatch.setattr(wna16, "split_workspace", lambda *args: None)
    out = fused_moe.fused_moe(x, gate, up, down, weights, indices, slot_gemv=True)
    assert ((out.float() - expected).norm() / expected.norm()) < 1e-5


def test_slot_gemv_is_taken_for_decode_steps_of_few_slots_over_packed_experts():
    assert fused_moe.uses_slot_gemv(6, 64, 4) and fused_moe.uses_slot_gemv(64, 256, 4)
    assert not fused_moe.uses_slot_gemv(6, 64, 0)  # bf16 experts keep the blocks
    assert fused_moe.uses_slot_gemv(48, 64, 4)  # V2-Lite batch 8: the GEMV measured faster than the blocks
    assert not fused_moe.uses_slot_gemv(96, 64, 4)  # V2-Lite batch 16: the blocks measured faster
    assert not fused_moe.uses_slot_gemv(192, 64, 4)  # batch 32 of V2-Lite: several slots per expert


def _moe_layer(shared, hidden=256, inter=128, experts=16, top_k=4, quant=None, shared_quant=None, seed=0):
    """A DeepSeek-V2-style MoE layer from a fixed seed (softmax greedy top-k), its experts RTN-quantized
    (bits, group) where asked (the shared experts to shared_quant if given), gate and up of the shared
    experts merged as the engine merges them."""
    from quantship.models.config import config_from_dict
    from quantship.models.deepseek import MoE
    from quantship.models.merged import merge_projections
    from quantship.models.quantized import quant_linear
    from quantship.quant.rtn import rtn_quantize
    from quantship.quantized_tensor import WeightQuant

    torch.manual_seed(seed)
    config = config_from_dict(dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=64, hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=inter, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=experts, n_shared_experts=shared, num_experts_per_tok=top_k, topk_method="greedy",
        first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=64))
    moe = MoE(config)
    with torch.no_grad():
        moe.gate.weight.normal_()
    if quant is not None:
        for mlp in [*moe.experts, moe.shared_experts]:
            bits, group = shared_quant if shared_quant and mlp is moe.shared_experts else quant
            for name in ("gate_proj", "up_proj", "down_proj"):
                q = rtn_quantize(getattr(mlp, name).weight.data, WeightQuant(num_bits=bits, group_size=group))
                setattr(mlp, name, quant_linear(q.values, q.scale.float(), q.zero_point, bits=bits))
    merge_projections(moe)
    return moe.to(DEVICE)


@pytest.mark.parametrize("shared,quant,n", [
    (2, None, 3),  # V2-Lite: two shared experts of a routed expert's width each, dense
    (2, (4, 64), 1),  # packed W4A16 at batch 1: the slot GEMV takes the shared slots too
    (2, (4, 64), 20),  # 20 tokens: the 16-row blocks
    (1, (8, 128), 2),  # V3: one shared expert, W8A16
])
def test_shared_experts_folded_into_the_stacks_give_the_layers_output(shared, quant, n):
    """Folded into the routed stacks (a slot of weight 1 per piece, appended by the router), the shared
    experts give the same layer output as the separate dense MLP, through every route of the kernels, and
    the layer's weight bytes stay what they were (the stack holds them once)."""
    from quantship.models.quantized import weight_bytes

    moe = _moe_layer(shared, quant=quant)
    x = torch.randn(n, 256, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    expected, held = moe(x).float(), weight_bytes(moe)
    assert moe.foldable_shared() == shared
    assert moe.enable_fused_kernels()
    assert moe.folded_shared == shared and moe.shared_experts is None
    assert moe.fused[0].weight.shape[0] == 16 + shared and weight_bytes(moe) == held
    weights, indices = moe.gate(x)
    assert indices.shape == (n, 4 + shared) and (indices[:, 4:] == torch.arange(16, 16 + shared, device=DEVICE)).all()
    assert (weights[:, 4:] == 1).all()
    routes = [dict(slot_gemv=False), dict(slot_gemv=True)] if quant and n < 8 else [dict()]
    for route in routes:
        out = fused_moe.fused_moe(x, *moe.fused, weights, indices, shared=shared, **route).float()
        assert ((out - expected).norm() / expected.norm()) < (1e-5 if DEVICE == "cpu" else 5e-3), route
    assert ((moe(x).float() - expected).norm() / expected.norm()) < (1e-5 if DEVICE == "cpu" else 5e-3)


def test_shared_experts_of_another_scheme_stay_a_dense_mlp():
    """Shared experts quantized with other groups than the routed experts' (128 against 64) are not folded:
    the layer keeps its own shared MLP and the router its top-k."""
    moe = _moe_layer(2, quant=(4, 64), shared_quant=(4, 128))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = moe(x)
    assert moe.foldable_shared() == 0 and moe.enable_fused_kernels()
    assert moe.folded_shared == 0 and moe.shared_experts is not None
    assert moe.gate(x)[1].shape == (2, 4)
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, slot_gemv", [(6, True), (8, False)])
def test_the_slot_gemv_counts_the_folded_shared_slots(tokens, slot_gemv):
    """The slot GEMV re-reads each folded shared piece once per token: V2-Lite's 64 experts top-6 with
    two shared pieces keep it at 6 tokens (48 slots of 66 experts) and take the blocks at 8 (64 slots),
    where its 48 routed slots alone would have kept it; both give the layer's output."""
    calls = []
    original = fused_moe._slot_gemv
    try:
        fused_moe._slot_gemv = lambda *args: calls.append(args[-1].shape) or original(*args)
        moe = _moe_layer(2, experts=64, top_k=6, inter=64, quant=(4, 64))
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        expected = moe(x)
        moe.enable_fused_kernels()
        weights, indices = moe.gate(x)
        got = fused_moe.fused_moe(x, *moe.fused, weights, indices, shared=moe.folded_shared)
    finally:
        fused_moe._slot_gemv = original
    assert calls == ([(tokens, 8)] if slot_gemv else [])
    # The looped layer's packed Linears run tensor-core tiles (TF32 on the GPU) where the slot GEMV does not.
    assert ((got - expected).norm() / expected.norm()) < (2e-5 if DEVICE == "cpu" else 5e-3)
