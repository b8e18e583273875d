"""Calibration data and per-Linear input statistics.

Data: N windows of L tokens from a text or JSONL file (default: the bundled calibration text).
Statistics: for every Linear of a layer, the token count and (for GPTQ) the Hessian XᵀX of its
inputs. Routed experts get two sets: the tokens the router really sent them, and every
calibration token (so an expert the router starved still has valid statistics to fall back on).
The layer's output always keeps the real routing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantship.errors import QuantshipError
from quantship.files import read_text_file
from quantship.models.deepseek import MoE


def calibration_tokens(path: Path, tokenizer, samples: int, seq_len: int) -> tuple[torch.Tensor, dict]:
    """[n, seq_len] token windows spread evenly over the text; n = samples, or fewer if the text is short."""
    if samples < 1 or seq_len < 2:
        raise QuantshipError("--samples must be >= 1 and --seq-len >= 2")
    ids = tokenizer(read_text_file(path, "calibration file"), add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < seq_len:
        raise QuantshipError(f"calibration text has {len(ids)} tokens, fewer than one sample of {seq_len}", path)
    available = len(ids) // seq_len
    n = min(samples, available)
    stride = len(ids) // n
    windows = torch.tensor([ids[i * stride:i * stride + seq_len] for i in range(n)])
    info = {"source": str(path), "samples": n, "samples_requested": samples, "seq_len": seq_len,
            "tokens": n * seq_len, "text_tokens": len(ids)}
    return windows, info


@dataclass
class InputStats:
    tokens: int = 0
    hessian: torch.Tensor | None = None
    sum_sq: torch.Tensor | None = None  # per input column: sum of x² (llama.cpp's importance matrix, unnormalized)
    keep: int = 0  # input rows to keep as a sample (AWQ's clipping search), spread over all calls
    stride: int = 1
    sample: list[torch.Tensor] = field(default_factory=list)

    def add(self, x: torch.Tensor, want_hessian: bool) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        kept = sum(len(t) for t in self.sample)
        if self.keep > kept:
            # A copy: a slice is a view that would keep the whole batch's input alive (every Linear's,
            # for every batch: 24 GB on an H200 for DeepSeek-Coder-6.7B at 128 x 2048 tokens).
            self.sample.append(x[:: self.stride][: self.keep - kept].clone())
        self.tokens += x.shape[0]
        sq = (x * x).sum(0)
        self.sum_sq = sq if self.sum_sq is None else self.sum_sq + sq
        if want_hessian and x.shape[0]:
            h = x.T @ x
            self.hessian = h if self.hessian is None else self.hessian + h

    def rows(self) -> torch.Tensor | None:
        return torch.cat(self.sample) if self.sample else None


@dataclass
class LayerStats:
    routed: dict[str, InputStats] = field(default_factory=dict)  # every Linear, real routing
    all_tokens: dict[str, InputStats] = field(default_factory=dict)  # routed experts, every token
    expert_tokens: list[int] = field(default_factory=list)


def linear_names(layer: nn.Module) -> list[str]:
    return [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def collect_stats(layer: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, want_hessian: bool,
                  batch: int = 8, keep_rows: int = 0, experts: range | None = None, others: bool = True) -> LayerStats:
    """Statistics of the layer's Linears over the calibration inputs: of the routed experts in `experts`
    (None: all) and, with `others`, of every other Linear. The layer runs whole either way."""
    stats = LayerStats()
    names = [n for n in linear_names(layer) if _wanted(n, experts, others)]
    handles = []
    # Linears that read the very same tensor (q/k/v, gate/up, q_a/kv_a) share one statistics object,
    # so each Hessian is accumulated once.
    # Keyed by object identity; holding the tensor until the batch ends keeps its id from being reused.
    first_reader: dict[int, tuple[str, torch.Tensor]] = {}
    alias: dict[str, str] = {}

    def record(name: str, x: torch.Tensor) -> None:
        owner = first_reader.setdefault(id(x), (name, x))[0]
        if owner != name:
            alias[name] = owner
        else:
            stats.routed[name].add(x, want_hessian)

    for name in names:
        stride = max(1, hidden.shape[0] * hidden.shape[1] // keep_rows) if keep_rows else 1
        stats.routed[name] = InputStats(keep=keep_rows, stride=stride)
        module = layer.get_submodule(name)
        handles.append(module.register_forward_hook(lambda _m, inp, _out, n=name: record(n, inp[0])))
    moe = layer.mlp if isinstance(layer.mlp, MoE) else None
    try:
        for start in range(0, hidden.shape[0], batch):
            first_reader.clear()
            layer(hidden[start:start + batch].to(positions.device), positions)  # activations may live on the host
    finally:
        for h in handles:
            h.remove()
    for name, owner in alias.items():
        stats.routed[name] = stats.routed[owner]
    if moe is not None:
        chosen = range(len(moe.experts)) if experts is None else experts
        stats.expert_tokens = [stats.routed[f"mlp.experts.{e}.gate_proj"].tokens for e in chosen]
        _all_token_stats(layer, moe, hidden, positions, want_hessian, batch, stats, chosen)
    return stats


def _wanted(name: str, experts: range | None, others: bool) -> bool:
    if not name.startswith("mlp.experts."):
        return others
    return experts is None or int(name.split(".")[2]) in experts


def _all_token_stats(layer, moe: MoE, hidden, positions, want_hessian, batch, stats: LayerStats,
                     experts: range) -> None:
    """Run every token through each expert in `experts` for statistics only (outputs are discarded)."""
    shared_input = InputStats()
    downs = {e: InputStats() for e in experts}
    for start in range(0, hidden.shape[0], batch):
        x = hidden[start:start + batch].to(positions.device)
        x = x + layer.self_attn(layer.input_layernorm(x), positions)
        x = layer.post_attention_layernorm(x).reshape(-1, x.shape[-1])
        shared_input.add(x, want_hessian)
        for e in experts:
            expert = moe.experts[e]
            downs[e].add(F.silu(expert.gate_proj(x)) * expert.up_proj(x), want_hessian)
    for e in experts:
        for proj in ("gate_proj", "up_proj"):
            stats.all_tokens[f"mlp.experts.{e}.{proj}"] = shared_input
        stats.all_tokens[f"mlp.experts.{e}.down_proj"] = downs[e]
