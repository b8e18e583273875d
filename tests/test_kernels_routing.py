"""The one-kernel routing against the plain torch routing (the model's own code).

On CPU the kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

import pytest
import torch

from quantship.kernels.routing import Routing, reference_route, route

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ROUTINGS = [  # (experts, routing): DeepSeek-V2-Lite, V2, V3, the bundled model, and odd sizes
    (64, Routing(6, "greedy", "softmax")),
    (160, Routing(6, "group_limited_greedy", "softmax", n_group=8, topk_group=3, scaling=16.0)),
    (256, Routing(8, "noaux_tc", "sigmoid", n_group=8, topk_group=4, scaling=2.5, normalize=True)),
    (8, Routing(2, "noaux_tc", "sigmoid", n_group=2, topk_group=1, scaling=1.0, normalize=True)),
    (24, Routing(3, "noaux_tc", "sigmoid", n_group=3, topk_group=2, normalize=True)),  # 3 groups of 8
    (20, Routing(1, "greedy", "sigmoid", normalize=True)),  # one expert: no normalization
    (12, Routing(4, "group_limited_greedy", "softmax", n_group=4, topk_group=2, normalize=True)),  # groups of 3
]


@pytest.mark.parametrize("experts,routing", ROUTINGS)
def test_route_equals_the_torch_routing(experts, routing):
    g = torch.Generator().manual_seed(experts + routing.top_k)
    logits = (torch.randn(37, experts, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE) if routing.method == "noaux_tc" else None
    weights, indices = route(logits, bias, routing)
    expected_weights, expected_indices = reference_route(logits, bias, routing)
    assert torch.equal(indices, expected_indices)  # both in descending order of the choice
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts,routing", ROUTINGS[1:3])
def test_route_keeps_to_the_groups(experts, routing):
    """Every chosen expert lies in one of the topk_group groups the reference ranks highest, also when one
    group holds the best experts but not the best group score (noaux_tc ranks by the sum of the best two)."""
    logits = torch.full((2, experts), -4.0)
    size = experts // routing.n_group
    logits[:, 0] = 6.0  # group 0: one outstanding expert ...
    logits[:, size:size + 2] = 3.0  # ... group 1: two good ones
    logits = logits.to(DEVICE)
    bias = torch.zeros(experts, device=DEVICE) if routing.method == "noaux_tc" else None
    weights, indices = route(logits, bias, routing)
    expected_weights, expected_indices = reference_route(logits, bias, routing)
    assert set(indices[0].tolist()[:3]) == set(expected_indices[0].tolist()[:3]) == {0, size, size + 1}
    groups = (indices // size).unique().tolist()
    assert len(groups) <= routing.topk_group
    torch.testing.assert_close(weights.sort(1).values, expected_weights.sort(1).values, rtol=1e-5, atol=1e-6)


def test_route_breaks_ties_by_the_lowest_index_and_picks_a_valid_top_k():
    """Equal scores: the lowest expert index first (torch's order among ties is unspecified, so the
    reference is held to the same chosen scores, not the same indices)."""
    routing = Routing(4, "greedy", "softmax")
    logits = torch.zeros(3, 16)
    logits[1, 5] = 1.0
    logits = logits.to(DEVICE)
    weights, indices = route(logits, None, routing)
    assert indices[0].tolist() == [0, 1, 2, 3]
    assert indices[1].tolist() == [5, 0, 1, 2]
    expected_weights, _ = reference_route(logits, None, routing)
    torch.testing.assert_close(weights, expected_weights)


def test_the_bundled_router_agrees_with_the_kernel():
    """The bundled model's router (V3's noaux_tc): the kernel and the torch routing of its logits choose
    the same experts with the same weights, and on a GPU its forward (the kernel) chooses them too."""
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model

    model = load_model(TINY_DIR, torch.float32, device=DEVICE)
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "enable_fused_kernels"))
    x = torch.randn(11, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    router = moe.gate
    logits = torch.nn.functional.linear(x.float(), router.weight.float())
    expected = reference_route(logits, router.e_score_correction_bias, router.routing)
    got = route(logits, router.e_score_correction_bias, router.routing)
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    if DEVICE == "cuda":  # where the router's forward takes the kernel (on the CPU it is the reference itself)
        assert torch.equal(router(x)[1], expected[1])


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # the interpreter's numpy max, on purpose
def test_route_keeps_indices_in_range_for_nan_scores_and_takes_no_tokens():
    """A NaN activation must not send the experts' kernels past the stack: every index stays below E."""
    routing = Routing(2, "noaux_tc", "sigmoid", n_group=2, topk_group=1, normalize=True)
    logits = torch.randn(3, 8)
    logits[1] = float("nan")
    logits = logits.to(DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    weights, indices = route(logits, bias, routing)
    assert ((indices >= 0) & (indices < 8)).all()
    assert torch.equal(indices[0], reference_route(logits, bias, routing)[1][0])
    empty = route(logits[:0], bias, routing)
    assert empty[0].shape == (0, 2) and empty[1].shape == (0, 2)


@pytest.mark.parametrize("experts,routing", [ROUTINGS[0], ROUTINGS[2], ROUTINGS[3]])
@pytest.mark.parametrize("shared", [1, 2])
def test_route_appends_the_folded_shared_experts_slots(experts, routing, shared):
    """With shared experts folded into the stacks, every token's top-k is followed by one slot of weight 1
    per shared piece (experts E, E + 1, ...), in the kernel as in the reference; the top-k is unchanged."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(experts + shared)
    logits = (torch.randn(5, experts, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE) if routing.method == "noaux_tc" else None
    folded = replace(routing, shared=shared)
    plain = reference_route(logits, bias, routing)
    for weights, indices in (route(logits, bias, folded), reference_route(logits, bias, folded)):
        assert indices.shape == weights.shape == (5, routing.top_k + shared)
        assert torch.equal(indices[:, :routing.top_k], plain[1])
        torch.testing.assert_close(weights[:, :routing.top_k], plain[0], rtol=1e-5, atol=1e-6)
        assert (indices[:, routing.top_k:] == torch.arange(experts, experts + shared, device=DEVICE)).all()
        assert (weights[:, routing.top_k:] == 1).all()
