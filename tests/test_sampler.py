"""The sampler: seeded draws repeat, top-k/top-p keep what they promise, nothing syncs on the GPU."""

import pytest
import torch

from quantship.engine.sampler import sample, sample_row
from quantship.engine.sampling_params import SamplingParams


def test_seeded_draws_repeat_and_filters_hold():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    first = [int(sample_row(logits, params, torch.Generator().manual_seed(7))) for _ in range(3)]
    assert len(set(first)) == 1  # the same seed draws the same token
    top5 = set(logits.topk(5).indices.tolist())
    g = torch.Generator().manual_seed(1)
    assert {int(sample_row(logits, params, g)) for _ in range(200)} <= top5
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6)  # only the most likely token survives
    assert int(sample_row(logits, nucleus, g)) == int(logits.argmax())


def test_sample_mixes_greedy_and_drawn_rows_with_logprobs():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0)]
    tokens, logprobs = sample(logits, params, [None, torch.Generator().manual_seed(3), None], [True, True, False])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    expected = torch.log_softmax(logits[1], -1)[tokens[1]].item()
    assert logprobs[1] == pytest.approx(expected) and logprobs[2] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation exists only with a device")
def test_drawing_a_token_never_waits_for_the_gpu():
    logits = torch.randn(32000, device="cuda")
    generator = torch.Generator("cuda").manual_seed(0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=40, top_p=0.9)):
            sample_row(logits, params, generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 1e-6, 1e30, 1e300, float("inf")])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 1e-300])
@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_extreme_numbers_draw_a_valid_token_never_a_nan_error(temperature, top_p, top_k):
    # Found by the server fuzz: a temperature of 1e-300 divided the logits into +-inf, whose softmax is
    # NaN, and multinomial's error stopped the engine thread. Any value the API admits must draw a token.
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 5
    logits[1, 7] = logits[1].max() + 1e-3  # a near tie at the top
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=1)
    tokens, _ = sample(logits, [params, params], [torch.Generator().manual_seed(1)] * 2, [False, False])
    assert all(0 <= t < 50 for t in tokens)
    if temperature < 1e-5 or top_k == 1:  # effectively greedy
        assert tokens == logits.argmax(-1).tolist()
    if top_k == 3:
        assert all(t in logits[i].topk(3).indices.tolist() for i, t in enumerate(tokens))
