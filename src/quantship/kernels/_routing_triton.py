"""The Triton kernel behind kernels.routing (imported only when launched)."""

import triton
import triton.language as tl

from quantship.kernels._pdl_triton import start_dependent

NEG = tl.constexpr(float("-inf"))


@triton.jit
def _first(values, best, where, none):
    """The smallest `where` among the entries of `values` equal to `best` (`none` if there is none)."""
    return tl.min(tl.min(tl.where(values == best, where, none), 1), 0)


@triton.jit
def route_kernel(logits_ptr, bias_ptr, weights_ptr, indices_ptr, E, GROUP_SIZE, TOP_K, TOPK_GROUP, scaling, SHARED,
                 SIGMOID: tl.constexpr, METHOD: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 GROUPS: tl.constexpr, GROUP_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One token's routing: its E logits as [groups, experts per group] (greedy: one group), scores,
    the kept groups (METHOD 1: by their best score, 2: by the sum of their best two), then TOP_K
    rounds of taking the best remaining expert, lowest index first among equals; then SHARED slots of
    weight 1 for the shared experts folded in after the E routed ones (indices E ..)."""
    start_dependent(PDL)
    t = tl.program_id(0)
    g = tl.arange(0, GROUPS)[:, None]
    j = tl.arange(0, GROUP_BLOCK)[None, :]
    pos = g * GROUP_SIZE + j
    ok = (j < GROUP_SIZE) & (pos < E)
    logits = tl.load(logits_ptr + t * E + pos, mask=ok, other=float("-inf"))
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        top = tl.max(tl.max(logits, 1), 0)
        ex = tl.where(ok, tl.exp(logits - top), 0.0)
        scores = ex / tl.sum(tl.sum(ex, 1), 0)
    scores = tl.where(ok, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + pos, mask=ok, other=0.0)
    choice = tl.where(ok, choice, NEG)
    if METHOD != 0:
        best = tl.max(choice, 1)
        if METHOD == 2:  # the best two of each group: take the first best out, the next best is the second
            first = tl.min(tl.where(choice == best[:, None], j, GROUP_BLOCK), 1)
            group_scores = best + tl.max(tl.where(j == first[:, None], NEG, choice), 1)
        else:
            group_scores = best
        gid = tl.arange(0, GROUPS)
        group_scores = tl.where(gid * GROUP_SIZE < E, group_scores, NEG)
        keep = gid < 0
        for _ in range(TOPK_GROUP):
            pick = tl.min(tl.where(group_scores == tl.max(group_scores, 0), gid, GROUPS), 0)
            keep = keep | (gid == pick)
            group_scores = tl.where(gid == pick, NEG, group_scores)
        if METHOD == 2:
            choice = tl.where(keep[:, None], choice, NEG)
        else:
            choice = tl.where(keep[:, None] | ~ok, choice, 0.0)
    kk = tl.arange(0, K_BLOCK)
    chosen_w = tl.zeros((K_BLOCK,), dtype=tl.float32)
    chosen_i = tl.zeros((K_BLOCK,), dtype=tl.int64)
    for i in range(TOP_K):
        # NaN scores (a NaN activation) match nothing: E - 1 then, never an index past the experts
        idx = tl.minimum(_first(choice, tl.max(tl.max(choice, 1), 0), pos, E), E - 1)
        weight = tl.sum(tl.sum(tl.where(pos == idx, scores, 0.0), 1), 0)
        chosen_w = tl.where(kk == i, weight, chosen_w)
        chosen_i = tl.where(kk == i, idx.to(tl.int64), chosen_i)
        choice = tl.where(pos == idx, NEG, choice)
    if NORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, 0) + 1e-20)
    shared = kk >= TOP_K
    chosen_w = tl.where(shared, 1.0, chosen_w * scaling)
    chosen_i = tl.where(shared, (E + kk - TOP_K).to(tl.int64), chosen_i)
    width = TOP_K + SHARED
    tl.store(weights_ptr + t * width + kk, chosen_w, mask=kk < width)
    tl.store(indices_ptr + t * width + kk, chosen_i, mask=kk < width)
