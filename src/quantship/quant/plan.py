"""Mixed precision: choose a scheme per unit to minimise predicted damage under an average-bits budget.

Like NVIDIA ModelOpt's auto_quantize: each unit (a layer's attention, dense MLP, routed experts or
shared experts) has a measured damage for each candidate scheme (KL at the output when only that
unit is quantized so), damage is taken as additive, and the budget is the average stored bits per
weight over the quantizable Linear weights. The choice is a multiple-choice knapsack, solved by
the greedy on each unit's lower convex hull of (bits, damage), which is optimal up to one unit.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantship.errors import QuantshipError
from quantship.quant.scheme import get_scheme

ORIGINAL = "none"  # keep the original dtype
KEEPS_ORIGINAL = (ORIGINAL, "bf16", "fp16", "original")  # what a plan may say for "not quantized"
ORIGINAL_BITS = 16.0


def _hull(options: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Lower convex hull of (bits, damage, scheme), cheapest first: the only choices worth upgrading through."""
    options = sorted(options)
    hull: list[tuple[float, float, str]] = []
    for point in options:
        if hull and point[1] >= hull[-1][1]:
            continue  # more bits for no less damage: never worth it
        while len(hull) >= 2:
            (b1, d1, _), (b2, d2, _) = hull[-2], hull[-1]
            # Drop the middle point when it lies above the segment from hull[-2] to point.
            if (d2 - d1) * (point[0] - b1) >= (point[1] - d1) * (b2 - b1):
                hull.pop()
            else:
                break
        hull.append(point)
    return hull


def choose_plan(damage: dict[str, dict[str, float]], params: dict[str, int], bits: dict[str, float],
                budget_bits: float) -> dict[str, str]:
    """damage: unit -> {scheme: predicted KL}; params: unit -> weights; bits: scheme -> bits per weight."""
    bits = {**bits, ORIGINAL: ORIGINAL_BITS}
    hulls = {u: _hull([(bits[s], d, s) for s, d in {**opts, ORIGINAL: 0.0}.items()]) for u, opts in damage.items()}
    total = sum(params[u] for u in damage)
    level = {u: 0 for u in damage}
    used = sum(params[u] * hulls[u][0][0] for u in damage)
    if used > budget_bits * total + 1e-9:
        raise QuantshipError(f"--budget-bits {budget_bits} is below the smallest plan ({used / total:.3f} bits)")
    while True:
        best, best_gain = None, 0.0
        for u, hull in hulls.items():
            if level[u] + 1 >= len(hull):
                continue
            (b0, d0, _), (b1, d1, _) = hull[level[u]], hull[level[u] + 1]
            extra = params[u] * (b1 - b0)
            if used + extra > budget_bits * total + 1e-9:
                continue
            gain = (d0 - d1) / extra  # damage removed per extra stored bit
            if gain > best_gain:
                best, best_gain = u, gain
        if best is None:
            break
        b0, b1 = hulls[best][level[best]][0], hulls[best][level[best] + 1][0]
        used += params[best] * (b1 - b0)
        level[best] += 1
    return {u: hulls[u][level[u]][2] for u in damage}


def read_plan(path: Path) -> dict[str, str]:
    """Module name -> scheme (or 'none') from a plan file written by `quantship plan`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuantshipError("plan file not found", path) from None
    except OSError as exc:  # a directory, no permission
        raise QuantshipError(f"cannot read the plan file ({exc.strerror})", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantshipError(f"malformed plan JSON ({exc})", path) from None
    modules = data.get("modules") if isinstance(data, dict) else None
    if not isinstance(modules, dict) or not all(isinstance(v, str) for v in modules.values()):
        raise QuantshipError("expected an object 'modules' mapping module names to schemes", path)
    for module, scheme in modules.items():
        if scheme.lower() not in KEEPS_ORIGINAL:
            try:
                get_scheme(scheme)
            except QuantshipError as exc:
                raise QuantshipError(f"{module}: {exc.args[0]}", path) from None
    return modules
