"""Activation ranges for int8-static: the min and max of every Linear's input over calibration text,
what onnxruntime's MinMax calibrator records, measured with our model streamed one layer at a time.

An expert that no calibration token reached has no range of its own (the NaN-scale failure of other
tools): its gate/up take the range of the MoE input (what the shared experts see, every token), its
down_proj the widest range of the layer's other experts.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from quantship.models.bundled import TINY_DIR
from quantship.models.loader import Checkpoint
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.calibrate import calibration_tokens

BATCH = 8


def calibration_windows(ck: Checkpoint, calib: Path | None, samples: int, seq_len: int) -> tuple[torch.Tensor, dict]:
    path = Path(calib) if calib else TINY_DIR / "calib.txt"
    return calibration_tokens(path, load_tokenizer(ck.path), samples, seq_len)


@torch.no_grad()
def calibrate_ranges(ck: Checkpoint, calib: Path | None, samples: int, seq_len: int):
    """({full module name: (min, max)}, calibration info)."""
    tokens, info = calibration_windows(ck, calib, samples, seq_len)
    hidden = F.embedding(tokens, ck.outer_state()["model.embed_tokens.weight"].float())
    positions = torch.arange(tokens.shape[1])
    ranges: dict[str, tuple[float, float]] = {}
    fallbacks: list[str] = []
    for i, layer in ck.iter_layers(torch.float32):
        prefix = f"model.layers.{i}"
        found: dict[str, tuple[float, float]] = {}

        def record(name):
            def hook(_module, args):
                x = args[0]
                if x.numel():
                    low, high = float(x.min()), float(x.max())
                    old = found.get(name, (low, high))
                    found[name] = (min(old[0], low), max(old[1], high))
            return hook

        linears = [(n, m) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
        handles = [m.register_forward_pre_hook(record(n)) for n, m in linears]
        hidden = torch.cat([layer(hidden[s:s + BATCH], positions) for s in range(0, len(hidden), BATCH)])
        for h in handles:
            h.remove()
        fallbacks += [f"{prefix}.{n}" for n in _fill_unrouted(found, [n for n, _ in linears])]
        ranges.update({f"{prefix}.{n}": r for n, r in found.items()})
    info["fallbacks"] = fallbacks
    return ranges, info


def _fill_unrouted(found: dict, names: list[str]) -> list[str]:
    """Give every Linear without a range one (see the module docstring); returns their names."""
    missing = [n for n in names if n not in found]
    downs = [r for n, r in found.items() if n.startswith("mlp.experts.") and n.endswith("down_proj")]
    widest_down = (min(r[0] for r in downs), max(r[1] for r in downs)) if downs else None
    moe_input = found.get("mlp.shared_experts.gate_proj") or next(
        (r for n, r in found.items() if n.startswith("mlp.experts.") and not n.endswith("down_proj")), None)
    for n in missing:
        found[n] = widest_down if n.endswith("down_proj") else moe_input
        if found[n] is None:
            found[n] = (-1.0, 1.0)
    return missing
