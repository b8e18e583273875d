"""A decode step's RMSNorms made inside the packed GEMVs after them (models.layers.NORM_IN_GEMV): a W4A16
Llama model, merged as the engine serves it, run through the fused ops (the GPU's path; here under Triton's
interpreter), gives the logits of the same step with every norm a launch of its own, and launches one norm
kernel per decode step instead of two per layer."""

import pytest
import torch

from quantship.kernels import elementwise
from quantship.models import layers, paged, quantized
from quantship.models.loader import load_model
from quantship.models.merged import merge_projections
from quantship.quant.rtn import rtn_quantize
from quantship.quant.scheme import get_scheme

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def packed_llama(llama_dir):
    """The test Llama with every decoder Linear RTN-quantized to W4A16 g128, packed and merged."""
    model = load_model(llama_dir, torch.float32, device=DEVICE)
    weights = get_scheme("W4A16").weights
    for layer in model.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, torch.nn.Linear):
                q = rtn_quantize(module.weight.data, weights, scale_dtype=torch.float32)
                parent, _, leaf = name.rpartition(".")
                setattr(layer.get_submodule(parent), leaf,
                        quantized.quant_linear(q.values, q.scale, q.zero_point, bits=4).to(DEVICE))
    assert merge_projections(model) == 2 * len(model.model.layers)
    return model


def test_norms_made_in_the_gemvs_give_the_logits_of_their_own_launches(llama_dir, monkeypatch):
    model = packed_llama(llama_dir)
    norms = {"rms_norm": 0, "add_rms_norm": 0}
    for name in norms:
        real = getattr(elementwise, name)
        monkeypatch.setattr(elementwise, name, lambda *a, name=name, real=real: norms.__setitem__(name, norms[name] + 1)
                            or real(*a))
    monkeypatch.setattr(layers, "use_fused_ops", lambda x: True)
    monkeypatch.setattr(quantized, "on_gpu_kernel", lambda x: True)
    block, lengths = 16, [7]
    ids = torch.randint(3, 8000, (sum(lengths) + 1,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits, counts = {}, {}
    with torch.inference_mode():
        for fold in (False, True):
            monkeypatch.setattr(layers, "NORM_IN_GEMV", fold)
            kv = [torch.zeros(4 * block, paged.cache_width(model.config), device=DEVICE) for _ in model.model.layers]
            batch, positions = paged.PagedBatch.build(kv, [[0, 1]], [0], lengths, block, DEVICE)
            model(ids[None, :sum(lengths)], positions, batch)  # the prompt: 7 rows, tensor-core tiles, no fold
            batch, positions = paged.PagedBatch.build(kv, [[0, 1]], lengths, [1], block, DEVICE)
            norms.update(rms_norm=0, add_rms_norm=0)
            logits[fold] = model(ids[None, sum(lengths):], positions, batch)
            counts[fold] = dict(norms)
    layer_count = len(model.model.layers)
    # each layer's input norm (but the first's, which has no residual step before it) and its post-attention norm,
    # then the final norm
    assert counts[False] == {"rms_norm": 1, "add_rms_norm": 2 * layer_count}
    assert counts[True] == {"rms_norm": 1, "add_rms_norm": 1}
    # float32 either way: the folded input is round(x * weight) and the sums are scaled after, not before
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
