"""`export --format gguf --imatrix`: llama.cpp's importance matrix, computed from our calibration text.

llama.cpp's `llama-imatrix` runs the full-precision model on a text and keeps, for every matrix
multiplication, the mean of the squared activations per input column (for a routed expert, over
the tokens routed to it); `llama-quantize --imatrix` then weighs each value's rounding error by
importance[column] * sqrt(sigma² + w²) (sigma² the row's mean square) when it fits a block's scale
and min (ggml-quants.c, the *_impl quantizers). Here the same statistics come from quantship's
layer-streamed calibration pass (quant/calibrate.py), and gguf_blocks.quantize applies the same
weighting. Experts that too few calibration tokens reach take the every-token statistics, as GPTQ
does. attn_k_b (whose input, the per-head query, is no Linear's input in our model) and
token_embd (a lookup, not a product; unless tied to the output) get none, which is also what
llama.cpp's file has for the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantship.models.bundled import TINY_DIR
from quantship.models.layers import RMSNorm
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.calibrate import calibration_tokens, collect_stats

MIN_EXPERT_TOKENS = 16


@dataclass
class Imatrix:
    columns: dict[str, torch.Tensor] = field(default_factory=dict)  # our weight name → mean x² per column
    dataset: str = ""
    chunks: int = 0
    tokens: int = 0

    def for_sources(self, sources: tuple[str, ...]) -> torch.Tensor | None:
        """Importance of a GGUF tensor's columns: [n], or [experts, n] for a stacked one; None if any is missing."""
        found = [self.columns.get(s) for s in sources]
        if not found or any(f is None for f in found):
            return None
        return torch.stack(found) if len(found) > 1 else found[0]


def _mean_sq(stats) -> torch.Tensor:
    return stats.sum_sq / max(stats.tokens, 1)


@torch.no_grad()
def collect_imatrix(ck, calib: Path | None, samples: int, seq_len: int) -> Imatrix:
    """Runs the full-precision model layer by layer over the calibration windows."""
    calib = Path(calib) if calib else TINY_DIR / "calib.txt"
    tokens, _ = calibration_tokens(calib, load_tokenizer(ck.path), samples, seq_len)
    result = Imatrix(dataset=calib.name, chunks=int(tokens.shape[0]), tokens=int(tokens.numel()))
    positions = torch.arange(tokens.shape[1])
    outer = ck.outer_state()
    embed = outer["model.embed_tokens.weight"].float()
    hidden = torch.nn.functional.embedding(tokens, embed)
    for i in range(ck.config.num_hidden_layers):
        layer = ck.layer(i, dtype=torch.float32)
        stats = collect_stats(layer, hidden, positions, want_hessian=False)
        for name, routed in stats.routed.items():
            chosen = routed
            if name in stats.all_tokens and routed.tokens < MIN_EXPERT_TOKENS:
                chosen = stats.all_tokens[name]  # a starved expert borrows the every-token statistics
            if chosen.sum_sq is not None:
                result.columns[f"model.layers.{i}.{name}.weight"] = _mean_sq(chosen)
        hidden = torch.cat([layer(hidden[s:s + 8], positions) for s in range(0, hidden.shape[0], 8)])
        del layer
    norm = RMSNorm(ck.config.hidden_size, ck.config.rms_norm_eps)
    norm.weight.data = outer["model.norm.weight"].float()
    x = norm(hidden.reshape(-1, hidden.shape[-1]))
    head = "model.embed_tokens.weight" if ck.config.tie_word_embeddings else "lm_head.weight"
    result.columns[head] = (x * x).mean(0)
    return result
