"""Pure tensor functions comparing two models' next-token distributions, token by token."""

from __future__ import annotations

import torch


def token_kl(base_logits: torch.Tensor, quant_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_base ‖ P_quant) per position over the full vocabulary, in nats. Inputs [..., V]."""
    base = torch.log_softmax(base_logits.float(), dim=-1)
    quant = torch.log_softmax(quant_logits.float(), dim=-1)
    return (base.exp() * (base - quant)).sum(-1)


def top1_agreement(base_logits: torch.Tensor, quant_logits: torch.Tensor) -> torch.Tensor:
    """1.0 where both models put the same token first."""
    return (base_logits.argmax(-1) == quant_logits.argmax(-1)).float()
