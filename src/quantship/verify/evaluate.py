"""Teacher-forced comparison of two models on held-out text, one chunk at a time.

Only per-token scalars are kept (KL, agreement, overlaps, probabilities, entropies), never
whole-vocabulary logits for more than one chunk, so long texts fit in memory.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from quantship.verify import metrics as M


@dataclass
class TokenRecords:
    """Per-token measurements, concatenated over chunks; `position` is the token's index in its chunk."""

    columns: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, **values: torch.Tensor) -> None:
        for name, v in values.items():
            self.columns.setdefault(name, []).append(v.detach().float().cpu().reshape(-1))

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.cat(self.columns[name])


def chunk_rows(ids: list[int], ctx: int, max_tokens: int | None) -> torch.Tensor:
    """Non-overlapping windows of ctx tokens (each predicts ctx - 1 next tokens)."""
    usable = len(ids) if max_tokens is None else min(len(ids), max(max_tokens, ctx))
    n = usable // ctx
    if n == 0:
        raise ValueError(f"the text holds {len(ids)} tokens, fewer than one window of {ctx}")
    return torch.tensor(ids[: n * ctx]).view(n, ctx)


def _versus(b: torch.Tensor, q: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-token columns that depend on the compared model's logits q."""
    return dict(kl=M.token_kl(b, q), top1=M.top1_agreement(b, q), top5=M.topk_overlap(b, q, 5),
                top10=M.topk_overlap(b, q, 10), logp_quant=M.true_token_logprob(q, target),
                entropy_quant=M.entropy(q), right_quant=(q.argmax(-1) == target).float())


@torch.no_grad()
def compare_each(base, others: dict, rows: torch.Tensor, device="cpu", progress=None) -> dict[str, TokenRecords]:
    """Run base once per row [n, ctx] and compare it with every model of `others`; per-token records for
    positions 1..ctx-1, one set per name. `compare` is the one-model case."""
    recs = {name: TokenRecords() for name in others}
    positions = torch.arange(1, rows.shape[1])
    for row in rows:
        row = row.to(device)[None]
        b = base(row)[0, :-1].float()
        target = row[0, 1:]
        own = dict(logp_base=M.true_token_logprob(b, target), entropy_base=M.entropy(b),
                   right_base=(b.argmax(-1) == target).float(), position=positions.float())
        for name, model in others.items():
            # The base itself stands in for a floor model of its own dtype (a copy would give the same logits).
            # Calling in the argument list frees each model's [ctx, vocab] logits before the next one's.
            recs[name].add(**own, **_versus(b, b if model is base else model(row)[0, :-1].float(), target))
        if progress is not None:
            progress()
    return recs


def compare(base, quant, rows: torch.Tensor, device="cpu", progress=None) -> TokenRecords:
    """Run both models over rows [n, ctx]; returns per-token records for positions 1..ctx-1."""
    return compare_each(base, {"quant": quant}, rows, device, progress)["quant"]


def headline(rec: TokenRecords, bootstrap: int = 1000) -> dict:
    kl = rec["kl"]
    nll_b, nll_q = -rec["logp_base"], -rec["logp_quant"]
    dp = rec["logp_quant"].exp() - rec["logp_base"].exp()
    right_b, right_q = rec["right_base"].bool(), rec["right_quant"].bool()
    out = {"kl_mean": float(kl.mean()), "kl_mean_ci95": M.bootstrap_mean_ci(kl, bootstrap)}
    out.update({f"kl_{k}": v for k, v in M.quantiles(kl, M.QUANTILES).items()})
    out["kl_max"] = float(kl.max())
    out.update({
        "top1_agreement": float(rec["top1"].mean()),
        "top5_overlap": float(rec["top5"].mean()),
        "top10_overlap": float(rec["top10"].mean()),
        "dp_true_mean": float(dp.mean()),
        "dp_true_rms": float(dp.pow(2).mean().sqrt()),
        **{f"dp_true_{k}": v for k, v in M.quantiles(dp, {"p01": 0.01, "p50": 0.5, "p99": 0.99}).items()},
        "entropy_base_mean": float(rec["entropy_base"].mean()),
        "entropy_quant_mean": float(rec["entropy_quant"].mean()),
        "entropy_shift_mean": float((rec["entropy_quant"] - rec["entropy_base"]).mean()),
        "ppl_base": math.exp(float(nll_b.mean())),
        "ppl_quant": math.exp(float(nll_q.mean())),
        "ln_ppl_ratio": float(nll_q.mean() - nll_b.mean()),
        "nll_correlation": M.correlation(nll_b, nll_q),
        "flips_right_to_wrong": int((right_b & ~right_q).sum()),
        "flips_wrong_to_right": int((~right_b & right_q).sum()),
    })
    out["ppl_ratio"] = math.exp(out["ln_ppl_ratio"])
    return out


def position_bins(ctx: int) -> list[int]:
    """Bin edges doubling from 16 up to the context: damage that grows with position shows as a slope."""
    edges, edge = [1], 16
    while edge < ctx:
        edges.append(edge)
        edge *= 2
    return edges + [ctx]


def by_position(rec: TokenRecords, ctx: int) -> dict:
    edges = position_bins(ctx)
    pos, kl = rec["position"], rec["kl"]
    out = {"bin_edges": edges, "tokens": [], "kl_mean": [], "kl_p99": [], "top1_agreement": [],
           "entropy_base": [], "entropy_quant": []}
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (pos >= lo) & (pos < hi)
        out["tokens"].append(int(m.sum()))
        out["kl_mean"].append(float(kl[m].mean()) if m.any() else float("nan"))
        out["kl_p99"].append(float(torch.quantile(kl[m].double(), 0.99)) if m.any() else float("nan"))
        out["top1_agreement"].append(float(rec["top1"][m].mean()) if m.any() else float("nan"))
        out["entropy_base"].append(float(rec["entropy_base"][m].mean()) if m.any() else float("nan"))
        out["entropy_quant"].append(float(rec["entropy_quant"][m].mean()) if m.any() else float("nan"))
    return out


@functools.cache
def reported_metrics() -> tuple[frozenset[str], frozenset[str]]:
    """(headline keys, by-position keys) that hold numbers, read off a comparison of two random
    four-token "models", so gates can be checked before an evaluation and the list never drifts."""
    generator = torch.Generator().manual_seed(0)

    def fake(row: torch.Tensor) -> torch.Tensor:
        return torch.randn(1, row.shape[1], 16, generator=generator)

    other = lambda row: fake(row)  # noqa: E731 -- a second object: compare() reuses the base's logits for itself
    rec = compare(fake, other, torch.zeros(1, 4, dtype=torch.long))
    headline_keys = {k for k, v in headline(rec, bootstrap=2).items() if isinstance(v, (int, float))}
    return frozenset(headline_keys), frozenset(by_position(rec, 4)) - {"bin_edges"}


def kl_histogram(rec: TokenRecords, bins: int = 40) -> dict:
    kl = rec["kl"].clamp_min(1e-8).log10()
    lo, hi = -8.0, max(1.0, float(kl.max()))
    edges = torch.linspace(lo, hi, bins + 1)
    counts = torch.histc(kl, bins=bins, min=lo, max=hi)
    return {"edges": [float(10**e) for e in edges], "counts": [int(c) for c in counts]}
