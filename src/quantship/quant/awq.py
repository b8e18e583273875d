"""Activation-aware weight scaling (AWQ), folded into a decoder layer in place.

A Linear computes the same thing with weight W·diag(s) on input x/s. Dividing the op that produces
x by s (an RMSNorm's weight, or a previous Linear's output rows) and multiplying the columns of every
Linear that reads x by s therefore leaves the layer's function unchanged in exact arithmetic, while
the input channels that carry large activations get larger weights, which group-wise rounding then
represents with a smaller relative error. Per balance group, s = mean|x|^α and α is chosen by the
error of the module that consumes the fake-quantized Linears. Nothing is quantized here: the caller
quantizes the scaled layer afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from quantship.models.deepseek import MoE
from quantship.models.held import HeldLinear, float32_weight
from quantship.quant.rtn import rtn_quantize
from quantship.quantized_tensor import WeightQuant

MEAN_FLOOR = 1e-8  # a channel that is always zero must still get a finite, positive scale
SCALE_RANGE = (1e-4, 1e4)


@dataclass
class BalanceGroup:
    """`prev`'s output feeds `linears` (quantized later) and `router` (kept in float, compensated
    exactly); `measured` is the module whose output error picks the scale. When `prev` is a Linear,
    `rows` lists its output rows that feed the linears, in the order of their input channels
    (None: all rows). `expert` is the routed-expert index of an expert's up → down group."""

    name: str
    prev: nn.Module
    linears: list[nn.Linear]
    measured: nn.Module
    rows: torch.Tensor | None = None
    router: nn.Module | None = None
    expert: int | None = None


def balance_groups(layer: nn.Module) -> list[BalanceGroup]:
    """Every (prev op → Linears) pair of a DeepSeek (MLA, dense or MoE) or Llama decoder layer."""
    attn, mlp, G = layer.self_attn, layer.mlp, BalanceGroup
    if hasattr(attn, "kv_b_proj"):  # DeepSeek MLA
        first = attn.q_proj if hasattr(attn, "q_proj") else attn.q_a_proj
        groups = [G("self_attn", layer.input_layernorm, [first, attn.kv_a_proj_with_mqa], attn)]
        if hasattr(attn, "q_b_proj"):
            groups.append(G("self_attn.q_b_proj", attn.q_a_layernorm, [attn.q_b_proj], attn.q_b_proj))
        # kv_a_layernorm normalizes only the latent part of kv_a_proj's output, so only kv_b_proj reads it.
        groups.append(G("self_attn.kv_b_proj", attn.kv_a_layernorm, [attn.kv_b_proj], attn.kv_b_proj))
        # kv_b_proj's output per head is [k_nope | v]; attention is linear in v, so v's rows can carry 1/s.
        # o_proj's input channel h*v_dim + d comes from row h*(nope+v_dim) + nope + d.
        per_head = attn.nope + attn.v_dim
        rows = (torch.arange(attn.heads)[:, None] * per_head + attn.nope + torch.arange(attn.v_dim)).flatten()
        groups.append(G("self_attn.o_proj", attn.kv_b_proj, [attn.o_proj], attn.o_proj, rows=rows))
    else:  # Llama
        groups = [G("self_attn", layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], attn)]
        # With GQA one v channel feeds several o_proj columns, so no single per-column scale folds exactly.
        if attn.kv_heads == attn.heads:
            groups.append(G("self_attn.o_proj", attn.v_proj, [attn.o_proj], attn.o_proj))
    if isinstance(mlp, MoE):
        mlps = [(f"mlp.experts.{e}", m, e) for e, m in enumerate(mlp.experts)]
        if mlp.shared_experts is not None:
            mlps.append(("mlp.shared_experts", mlp.shared_experts, None))
        router = mlp.gate  # reads the same normed input as the experts: compensated so routing is unchanged
    else:
        mlps, router = [("mlp", mlp, None)], None
    readers = [lin for _, m, _ in mlps for lin in (m.gate_proj, m.up_proj)]
    groups.append(G("mlp", layer.post_attention_layernorm, readers, mlp, router=router))
    # silu(gate)·up is linear in up's output, so up's rows can carry 1/s for down_proj's columns.
    groups += [G(f"{p}.down_proj", m.up_proj, [m.down_proj], m.down_proj, expert=e) for p, m, e in mlps]
    return groups


@torch.no_grad()
def _fold(group: BalanceGroup, s: torch.Tensor) -> None:
    """prev ÷ s, readers' columns × s, computed in float32 and written back in each tensor's dtype
    (a held expert records the fold and applies it at each widening, models/held.py)."""
    s = s.to(group.prev.weight.device, torch.float32)
    if isinstance(group.prev, nn.Linear):
        rows = slice(None) if group.rows is None else group.rows.to(s.device)
        tensors = [group.prev.weight, group.prev.bias]
        if isinstance(group.prev, HeldLinear):  # an expert's up_proj: every row feeds its down_proj
            assert group.rows is None, "a held Linear folds whole rows"
            group.prev.divide_rows(s)
            tensors = [group.prev.bias]
        for t in tensors:
            if t is not None:
                shape = (-1,) + (1,) * (t.dim() - 1)
                t.data[rows] = (t.data[rows].float() / s.view(shape)).to(t.dtype)
    else:
        w = group.prev.weight
        w.data.copy_(w.data.float() / s)
    for mod in group.linears + ([group.router] if group.router is not None else []):
        if isinstance(mod, HeldLinear):
            mod.scale_columns(s)
        else:
            mod.weight.data.copy_(mod.weight.data.float() * s)


def apply_scales(layer: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Fold per-input-channel scales {group name: s} into the layer; its function is unchanged."""
    groups = {g.name: g for g in balance_groups(layer)}
    for name, s in scales.items():
        _fold(groups[name], s)


def _weight_mean(linears: list[nn.Linear], args: WeightQuant) -> torch.Tensor:
    """Mean |w| per input channel, each weight relative to its group's largest (AutoAWQ's duo scaling).
    Summed one Linear at a time: a MoE's readers are every expert's gate and up (30 GB in float32 at
    DeepSeek-V3's shape), never concatenated."""
    total, rows = None, 0
    for lin in linears:
        w = float32_weight(lin).abs()
        grouped = w.view(w.shape[0], -1, args.group_width(w.shape[1]))
        part = (grouped / grouped.amax(-1, keepdim=True).clamp_min(1e-12)).view_as(w).sum(0)
        total, rows = part if total is None else total + part, rows + w.shape[0]
    return (total / rows).clamp_min(MEAN_FLOOR)


def _fake_quantized(w: torch.Tensor, s: torch.Tensor, args: WeightQuant) -> torch.Tensor:
    """What the Linear computes with after scaling by s, rounding and folding back (float32)."""
    return rtn_quantize(w * s, args).dequantize() / s


def _candidate(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    # Channels with large activations and small weights gain most from a larger scale.
    s = x_mean.pow(alpha) / w_mean.pow(1 - alpha)
    # Centre geometrically so the scales neither inflate nor shrink the weights overall.
    s = s / (s.max() * s.min()).sqrt()
    return s.clamp(*SCALE_RANGE)


def _search(linears: list[nn.Linear], x: torch.Tensor, run: Callable[[], torch.Tensor], args: WeightQuant,
            grid: int) -> tuple[torch.Tensor, dict]:
    """Best s for inputs x [tokens, in]; run() gives the measured module's output with current weights.
    Held experts fake-quantize at each use; other Linears get the fake-quantized weight per candidate."""
    reference = run()
    x_mean = x.abs().mean(0).clamp_min(MEAN_FLOOR)
    w_mean = _weight_mean(linears, args)
    originals = {lin: lin.weight.data for lin in linears if not isinstance(lin, HeldLinear)}
    best_s, best = torch.ones_like(x_mean), {"ratio": 0.0, "rtn_mse": float("inf"), "awq_mse": float("inf")}
    try:
        for i in range(grid):
            alpha = i / grid
            s = torch.ones_like(x_mean) if i == 0 else _candidate(x_mean, w_mean, alpha)
            for lin in linears:
                if isinstance(lin, HeldLinear):
                    lin.substitute = partial(_fake_quantized, s=s, args=args)
                else:
                    lin.weight.data = _fake_quantized(originals[lin], s, args)
            err = (run() - reference).pow(2).mean().item()
            if i == 0:
                best["rtn_mse"] = err
            if err < best["awq_mse"]:  # strict: ties keep the smaller α, and α=0 (plain RTN) first
                best_s, best["ratio"], best["awq_mse"] = s, alpha, err
    finally:
        for lin in linears:
            if isinstance(lin, HeldLinear):
                lin.substitute = None
            else:
                lin.weight.data = originals[lin]
    return best_s, best


@torch.no_grad()
def awq_layer(layer: nn.Module, hidden: torch.Tensor, positions: torch.Tensor,
              args: WeightQuant | dict[str, WeightQuant], *, grid: int = 20, max_tokens: int = 4096,
              min_expert_tokens: int = 16, quantized: set[str] | None = None) -> dict:
    """Search and fold AWQ scales into `layer` (in place) from its calibration input hidden [N, T, H].

    `args` is one scheme for every Linear, or one per Linear name (a group-size fallback or a plan):
    a balance group is searched with the scheme of its first quantized Linear.

    Returns {group name: {"ratio", "rtn_mse", "awq_mse"}, "expert_fallbacks": [expert indices whose
    routed tokens were fewer than min_expert_tokens, so all tokens were used instead]}.
    """
    params = list(layer.parameters())
    dtypes = [p.dtype for p in params]
    device = params[0].device
    # Search in float32 so bf16 rounding does not drown the quantization error being compared.
    for p in params:
        p.data = p.data.float()
    try:
        # Sub-sample whole sequences (attention needs them), cutting the tail if one alone is too long.
        n, t = hidden.shape[:2]
        keep_t = min(t, max_tokens)
        keep_n = min(n, max(1, max_tokens // keep_t))
        pick = torch.linspace(0, n - 1, keep_n).round().long()
        x = hidden[pick.to(hidden.device), :keep_t].to(device, torch.float32)
        positions = positions[:keep_t].to(device)

        groups = balance_groups(layer)
        names = {m: n for n, m in layer.named_modules()}
        # One float forward records what each measured module is called with (experts: their routed tokens).
        inputs: dict[nn.Module, tuple] = {}

        def record(module: nn.Module, call: tuple) -> None:  # returns None: the call's inputs stay as they are
            inputs.setdefault(module, call)

        hooks = [g.measured.register_forward_pre_hook(record) for g in groups]
        try:
            layer(x, positions)
        finally:
            for h in hooks:
                h.remove()

        report: dict = {"expert_fallbacks": []}
        chosen: list[tuple[BalanceGroup, torch.Tensor]] = []
        for g in groups:
            call = inputs.get(g.measured)
            if g.expert is not None and (call is None or call[0].shape[0] < min_expert_tokens):
                # Too few routed tokens to estimate its statistics: use every token the MoE saw.
                moe_in = inputs[layer.mlp][0].reshape(-1, x.shape[-1])
                expert = layer.mlp.experts[g.expert]
                call = (F.silu(expert.gate_proj(moe_in)) * expert.up_proj(moe_in),)
                report["expert_fallbacks"].append(g.expert)
            stats = call[0].reshape(-1, call[0].shape[-1])
            # Only the Linears that will be quantized are fake-quantized in the search (an ignored one
            # keeps its precision); the fold still scales every reader, which keeps the layer exact.
            targets = [lin for lin in g.linears if quantized is None or names[lin] in quantized]
            if not targets:
                continue
            group_args = args[names[targets[0]]] if isinstance(args, dict) else args
            s, report[g.name] = _search(targets, stats, partial(g.measured, *call), group_args, grid)
            chosen.append((g, s))
        # Fold only after every search: each search then sees the original weights and captured inputs.
        for g, s in chosen:
            _fold(g, s)
    finally:
        for p, dtype in zip(params, dtypes):
            p.data = p.data.to(dtype)
    return report
