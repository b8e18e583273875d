"""Our model definition against transformers, on the same weights, in float32."""

import pytest
import torch

from quantship.models.loader import Checkpoint

from reference_models import CONFIGS

SEQ = 200  # beyond original_max_position_embeddings (64) of the YaRN configs


def _ids(vocab=512, batch=2, seq=SEQ, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(reference_dirs, name):
    directory, reference = reference_dirs[name]
    ours = Checkpoint(directory).load_model()
    ids = _ids()
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    # The positions past the original context are where a wrong YaRN would show.
    torch.testing.assert_close(got[:, 64:], expected[:, 64:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["deepseek_v3", "llama", "llama3"])
def test_rope_scaling_is_exercised(reference_dirs, name):
    """Dropping the rope scaling must change the logits, or the parity test above proves nothing about it."""
    import dataclasses

    from quantship.models.config import RopeConfig

    directory, reference = reference_dirs[name]
    ck = Checkpoint(directory)
    assert ck.config.rope.type in ("yarn", "linear", "llama3")
    ck.config = dataclasses.replace(ck.config, rope=RopeConfig(theta=ck.config.rope.theta))
    plain = ck.load_model()
    ids = _ids()
    with torch.no_grad():
        assert (plain(ids) - reference(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_group", "llama", "qwen2", "qwen3"])
def test_layers_streamed_one_at_a_time_match_full_forward(reference_dirs, name):
    directory, _ = reference_dirs[name]
    ck = Checkpoint(directory)
    full = ck.load_model()
    ids = _ids(batch=1, seq=40)
    positions = torch.arange(40)
    with torch.no_grad():
        x = full.model.embed_tokens(ids)
        for index, layer in ck.iter_layers():
            x = layer(x, positions)
        streamed = full.lm_head(full.model.norm(x))
        torch.testing.assert_close(streamed, full(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_greedy", "llama", "qwen2", "qwen3"])
def test_cached_decoding_matches_full_forward(reference_dirs, name):
    directory, _ = reference_dirs[name]
    model = Checkpoint(directory).load_model()
    ids = _ids(batch=1, seq=30)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :17], cache=cache)]  # a chunk, then one token at a time
        for t in range(17, 30):
            parts.append(model(ids[:, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_group"])
def test_transformers_in_memory_state_dict_loads_into_ours(reference_dirs, name):
    """transformers 5 holds routed experts fused ([E, 2I, H] gate+up, [E, H, I] down) in memory;
    split_fused_experts maps them onto our per-expert Linears (the GPU benchmarks share weights this way)."""
    from quantship.models.causal_lm import CausalLM
    from quantship.models.loader import split_fused_experts

    directory, reference = reference_dirs[name]
    state = reference.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # the layout this test is about
    with torch.device("meta"):
        ours = CausalLM(Checkpoint(directory).config)
    ours.load_state_dict(split_fused_experts(state), assign=True)
    ids = _ids(batch=1, seq=40)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=2e-5, rtol=1e-4)
