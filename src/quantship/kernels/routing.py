"""DeepSeek's expert routing after the router's logits, as one kernel: scores, group limits, top-k, weights.

Written with torch ops the selection is 6 (V2's greedy softmax) to 14 (V3's noaux_tc) small kernels per
MoE layer, each a few microseconds inside a CUDA graph however little it computes: at batch 1 they take
more of a decode layer than the routed experts' own W4A16 GEMVs. `route` does it in one program per
token; `reference_route` is the plain computation it must equal (the model's code everywhere else).

Methods: "greedy" (top-k of all scores), "group_limited_greedy" (V2: the topk_group groups with the
highest best score; other groups' scores zeroed) and "noaux_tc" (V3: the score correction bias steers
the choice, groups ranked by the sum of their top two, other groups excluded). Weights are the raw
scores of the chosen experts, normalized to sum 1 where asked, times routed_scaling_factor.

`shared` appends that many slots to every token after its top-k: experts E .. E + shared - 1 with weight
1.0. The serving engine folds the shared experts into the routed experts' stacks (models/deepseek.py),
so the fused kernels run them with the routed ones and add them into the same sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantship.kernels import dependent_launch


@dataclass(frozen=True)
class Routing:
    top_k: int
    method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    scoring: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    normalize: bool = False
    shared: int = 0  # slots appended per token for shared experts folded in after the E routed ones


def reference_route(logits: torch.Tensor, bias: torch.Tensor | None, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] float32 → (weights [N, k + shared] float32, expert indices [N, k + shared])."""
    experts = logits.shape[-1]
    scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores
    if r.method == "noaux_tc":
        # The bias only steers which experts are chosen; weights come from the raw scores.
        choice = scores + bias.float()
    if r.method != "greedy":
        grouped = choice.view(-1, r.n_group, experts // r.n_group)
        if r.method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(r.topk_group, dim=-1).indices, 1)
        keep = keep.bool()[..., None].expand_as(grouped).reshape(-1, experts)
        choice = choice.masked_fill(~keep, float("-inf") if r.method == "noaux_tc" else 0.0)
    indices = choice.topk(r.top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if r.normalize and r.top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * r.scaling
    if r.shared:
        n = logits.shape[0]
        shared = torch.arange(experts, experts + r.shared, device=indices.device).expand(n, r.shared)
        weights = torch.cat((weights, weights.new_ones(n, r.shared)), dim=1)
        indices = torch.cat((indices, shared), dim=1)
    return weights, indices


METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def route(logits: torch.Tensor, bias: torch.Tensor | None, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_route in one Triton launch (a program per token). Among equal scores the lowest
    expert index is chosen first (torch's top-k leaves that order unspecified)."""
    import triton

    from quantship.kernels._routing_triton import route_kernel

    n, experts = logits.shape
    if n == 0:
        return reference_route(logits, bias, r)
    groups = 1 if r.method == "greedy" else r.n_group
    group_size = experts // groups
    width = r.top_k + r.shared
    weights = torch.empty(n, width, dtype=torch.float32, device=logits.device)
    indices = torch.empty(n, width, dtype=torch.int64, device=logits.device)
    logits = logits.float().contiguous()
    bias = bias.float().contiguous() if bias is not None and r.method == "noaux_tc" else None
    route_kernel[(n,)](logits, logits if bias is None else bias, weights, indices, experts, group_size, r.top_k,
                       r.topk_group, r.scaling, r.shared, SIGMOID=r.scoring == "sigmoid", METHOD=METHODS[r.method],
                       NORMALIZE=r.normalize and r.top_k > 1, HAS_BIAS=bias is not None,
                       GROUPS=triton.next_power_of_2(groups), GROUP_BLOCK=triton.next_power_of_2(group_size),
                       K_BLOCK=triton.next_power_of_2(width), num_warps=1 if experts <= 64 else 2,
                       **dependent_launch(logits, default_off=True))
    return weights, indices
