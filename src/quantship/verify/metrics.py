"""Pure tensor functions comparing two models' next-token distributions, token by token,
and the statistics that summarize them."""

from __future__ import annotations

import torch


def token_kl(base_logits: torch.Tensor, quant_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_base ‖ P_quant) per position over the full vocabulary, in nats. Inputs [..., V]."""
    base = torch.log_softmax(base_logits.float(), dim=-1)
    quant = torch.log_softmax(quant_logits.float(), dim=-1)
    return (base.exp() * (base - quant)).sum(-1).clamp_min(0)


def top1_agreement(base_logits: torch.Tensor, quant_logits: torch.Tensor) -> torch.Tensor:
    """1.0 where both models put the same token first."""
    return (base_logits.argmax(-1) == quant_logits.argmax(-1)).float()


def topk_overlap(base_logits: torch.Tensor, quant_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Share of the base's top-k tokens that are also in the quant's top-k."""
    a = base_logits.topk(k, dim=-1).indices
    b = quant_logits.topk(k, dim=-1).indices
    return (a[..., :, None] == b[..., None, :]).any(-1).float().mean(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def true_token_logprob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999}


def quantiles(values: torch.Tensor, qs: dict[str, float]) -> dict[str, float]:
    v = values.double()
    return {name: float(torch.quantile(v, q)) for name, q in qs.items()} if v.numel() else {n: float("nan") for n in qs}


def bootstrap_mean_ci(values: torch.Tensor, samples: int = 1000, seed: int = 0, level: float = 0.95) -> list[float]:
    """Percentile bootstrap interval of the mean (resampling tokens with replacement)."""
    v = values.double()
    if v.numel() < 2:
        return [float(v.mean()), float(v.mean())] if v.numel() else [float("nan")] * 2
    gen = torch.Generator().manual_seed(seed)
    means = torch.stack([v[torch.randint(0, v.numel(), (v.numel(),), generator=gen)].mean()
                         for _ in range(samples)])
    low, high = (1 - level) / 2, 1 - (1 - level) / 2
    return [float(torch.quantile(means, low)), float(torch.quantile(means, high))]


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    denom = (a.norm() * b.norm()).item()
    return float((a * b).sum() / denom) if denom > 0 else float("nan")


def repetition_rate(tokens: list[int], n: int = 4) -> float:
    """Share of n-grams that already occurred earlier in the sequence (loops show up as high values)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0
