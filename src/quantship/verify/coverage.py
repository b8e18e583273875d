"""Calibration coverage: did the calibration data exercise what the evaluation text needs?

Tokens routed to each expert during calibration (from the quantizer's recipe), the share of the
vocabulary each text touches, how many evaluation tokens never occurred in calibration, the
per-layer activation RMS of calibration against evaluation text, and literal text overlap.
"""

from __future__ import annotations

import torch


def _long_lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) > 40}


def text_overlap(calib_text: str, eval_text: str) -> float:
    """Share of the evaluation text's long lines that also appear in the calibration text."""
    eval_lines = _long_lines(eval_text)
    return len(eval_lines & _long_lines(calib_text)) / len(eval_lines) if eval_lines else 0.0


@torch.no_grad()
def activation_rms(model, rows: torch.Tensor, device="cpu") -> list[float]:
    """RMS of the residual stream after each layer, averaged over rows [n, T]."""
    sums = torch.zeros(len(model.model.layers), dtype=torch.float64)
    for row in rows.to(device):
        x = model.model.embed_tokens(row[None])
        positions = torch.arange(row.shape[0], device=device)
        for i, layer in enumerate(model.model.layers):
            x = layer(x, positions)
            sums[i] += x.float().pow(2).mean().sqrt().item()
    return (sums / max(len(rows), 1)).tolist()


def coverage(model, calib_ids: list[int], eval_ids: list[int], calib_text: str, eval_text: str, vocab: int,
             tokens_per_expert: dict | None, sample_rows: int = 4, ctx: int = 256, device="cpu") -> dict:
    calib_set, eval_set = set(calib_ids), set(eval_ids)
    unseen = sum(1 for t in eval_ids if t not in calib_set) / max(len(eval_ids), 1)

    def rows(ids):
        n = min(sample_rows, len(ids) // ctx)
        return torch.tensor(ids[: n * ctx]).view(n, ctx)

    calib_rms, eval_rms = activation_rms(model, rows(calib_ids), device), activation_rms(model, rows(eval_ids), device)
    return {
        "tokens_per_expert": tokens_per_expert or {},
        "calib_tokens": len(calib_ids),
        "vocab_share_calib": len(calib_set) / vocab,
        "vocab_share_eval": len(eval_set) / vocab,
        "eval_tokens_unseen_in_calib": unseen,
        "activation_rms": [{"layer": i, "calib": c, "eval": e} for i, (c, e) in enumerate(zip(calib_rms, eval_rms))],
        "text_overlap": text_overlap(calib_text, eval_text),
    }
