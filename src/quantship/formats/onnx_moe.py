"""DeepSeek's routed mixture of experts inside the graph, mirroring models/deepseek.py's Router and MoE.

Routing: scores (sigmoid or softmax, float32), the correction bias and group-limited selection
(TopK over group scores, ScatterElements into a group mask), TopK experts, GatherElements of their
weights. Experts run sparsely: for each expert, NonZero finds the tokens routed to it, Gather takes
their rows, the expert MLP runs on those rows only, and ScatterND (reduction "add") adds the weighted
output back. An expert no token chose runs on zero rows, which costs nothing.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from quantship.formats.onnx_layers import Ctx, mlp

NEG_INF = float("-inf")


def route(ctx: Ctx, flat: str, w, path: str) -> tuple[str, str]:
    """flat [N, hidden] → (weights [N, k] float32, expert indices [N, k] int64)."""
    g, c = ctx.g, ctx.config
    gate = g.weight(f"{path}.weight", w.tensor("mlp.gate.weight").float().t().numpy())
    logits = g.op("MatMul", [ctx.to_f32(flat, f"{path}/input"), gate], f"{path}/MatMul")
    scores = g.op("Sigmoid" if c.scoring_func == "sigmoid" else "Softmax", [logits], f"{path}/Scores",
                  **({} if c.scoring_func == "sigmoid" else {"axis": -1}))
    choice = scores
    if c.topk_method == "noaux_tc":  # the bias steers the choice only; weights come from the raw scores
        bias = g.weight(f"{path}.e_score_correction_bias", w.tensor("mlp.gate.e_score_correction_bias").float().numpy())
        choice = g.op("Add", [scores, bias], f"{path}/Biased")
    if c.topk_method != "greedy":
        choice = _limit_groups(ctx, choice, path)
    _, indices = g.op("TopK", [choice, g.const([c.num_experts_per_tok])], f"{path}/TopK", outputs=2, axis=-1)
    weights = g.op("GatherElements", [scores, indices], f"{path}/Weights", axis=1)
    if c.norm_topk_prob and c.num_experts_per_tok > 1:
        total = g.op("ReduceSum", [weights, g.const([-1])], f"{path}/Sum", keepdims=1)
        weights = g.op("Div", [weights, g.op("Add", [total, g.const(np.float32(1e-20), np.float32)], f"{path}/Eps")],
                       f"{path}/Normalize")
    if c.routed_scaling_factor != 1.0:
        weights = g.op("Mul", [weights, g.const(np.float32(c.routed_scaling_factor), np.float32)], f"{path}/Scaling")
    return weights, indices


def _limit_groups(ctx: Ctx, choice: str, path: str) -> str:
    """Keep only the experts of the topk_group best groups (V3: group score = sum of its top 2; V2: max)."""
    g, c = ctx.g, ctx.config
    groups = g.op("Reshape", [choice, g.const([-1, c.n_group, c.n_routed_experts // c.n_group])], f"{path}/Groups")
    if c.topk_method == "noaux_tc":
        top2, _ = g.op("TopK", [groups, g.const([2])], f"{path}/GroupTop2", outputs=2, axis=-1)
        group_scores = g.op("ReduceSum", [top2, g.const([-1])], f"{path}/GroupScore", keepdims=0)
    else:
        group_scores = g.op("ReduceMax", [groups], f"{path}/GroupScore", axes=[-1], keepdims=0)
    _, best = g.op("TopK", [group_scores, g.const([c.topk_group])], f"{path}/GroupTopK", outputs=2, axis=-1)
    zeros = g.op("ConstantOfShape", [g.op("Shape", [group_scores], f"{path}/GroupShape")], f"{path}/GroupZeros",
                 value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
    ones = g.op("ConstantOfShape", [g.op("Shape", [best], f"{path}/BestShape")], f"{path}/GroupOnes",
                value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]))
    keep = g.op("ScatterElements", [zeros, best, ones], f"{path}/GroupMask", axis=1)  # [N, n_group]
    keep = g.op("Expand", [g.op("Unsqueeze", [keep, g.const([-1])], f"{path}/GroupMask3d"),
                           g.op("Shape", [groups], f"{path}/GroupsShape")], f"{path}/ExpertMask3d")
    keep = g.op("Cast", [g.op("Reshape", [keep, g.const([-1, c.n_routed_experts])], f"{path}/ExpertMask")],
                f"{path}/ExpertMaskBool", to=TensorProto.BOOL)
    dropped = NEG_INF if c.topk_method == "noaux_tc" else 0.0
    return g.op("Where", [keep, choice, g.const(np.float32(dropped), np.float32)], f"{path}/Limited")


def moe(ctx: Ctx, x: str, w, path: str) -> str:
    """x [B, S, hidden] → routed experts + shared experts, same shape."""
    g, c = ctx.g, ctx.config
    flat = g.op("Reshape", [x, g.const([-1, c.hidden_size])], f"{path}/Flatten")
    weights, indices = route(ctx, flat, w, f"{path}/gate")
    out = g.op("ConstantOfShape", [g.op("Shape", [flat], f"{path}/FlatShape")], f"{path}/Zeros",
               value=helper.make_tensor("zero", ctx.elem, [1], [0]))
    for e in range(c.n_routed_experts):
        p = f"{path}/experts.{e}"
        hit = g.op("Equal", [indices, g.const(e)], f"{p}/Hit")  # [N, k]
        chosen = g.op("ReduceMax", [g.op("Cast", [hit], f"{p}/HitInt", to=TensorProto.INT32)], f"{p}/Chosen",
                      axes=[1], keepdims=0)
        tokens = g.op("Reshape", [g.op("NonZero", [chosen], f"{p}/NonZero"), g.const([-1])], f"{p}/Tokens")
        weight = g.op("ReduceSum", [g.op("Where", [hit, weights, g.const(np.float32(0), np.float32)], f"{p}/Own"),
                                    g.const([1])], f"{p}/Weight", keepdims=0)  # [N]: each expert at most once per token
        rows = g.op("Gather", [flat, tokens], f"{p}/Rows", axis=0)
        y = mlp(ctx, rows, w, f"mlp.experts.{e}.", p)
        scale = g.op("Unsqueeze", [g.op("Gather", [weight, tokens], f"{p}/TokenWeight", axis=0), g.const([-1])],
                     f"{p}/TokenWeight2d")
        y = ctx.from_f32(g.op("Mul", [ctx.to_f32(y, f"{p}/y"), scale], f"{p}/Weighted"), f"{p}/y")
        out = g.op("ScatterND", [out, g.op("Unsqueeze", [tokens, g.const([-1])], f"{p}/Index"), y], f"{p}/ScatterAdd",
                   reduction="add")
    if c.n_shared_experts:
        out = g.op("Add", [out, mlp(ctx, flat, w, "mlp.shared_experts.", f"{path}/shared_experts")], f"{path}/Shared")
    return g.op("Reshape", [out, g.op("Shape", [x], f"{path}/InShape")], f"{path}/Unflatten")
