"""`quantship plan`: measure each unit's sensitivity under each candidate scheme, then choose.

Sensitivity is measured on the calibration text, never on the held-out evaluation text, so a
plan does not overfit what `verify` will judge it on.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

from torch import nn

from quantship.errors import QuantshipError
from quantship.files import check_output_location, read_text_file, write_atomic
from quantship.models.bundled import TINY_DIR, resolve_model
from quantship.models.loader import Checkpoint
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.quant.plan import ORIGINAL, ORIGINAL_BITS, choose_plan
from quantship.quant.scheme import DEFAULT_IGNORE, get_scheme, is_ignored
from quantship.verify import sensitivity as S
from quantship.verify.evaluate import chunk_rows


def _unit_linears(model, layer: int, path: str) -> list[str]:
    module = model.get_submodule(f"model.layers.{layer}.{path}")
    prefix = f"model.layers.{layer}.{path}"
    return [f"{prefix}.{n}" for n, m in module.named_modules() if isinstance(m, nn.Linear)
            and not is_ignored(f"{prefix}.{n}", DEFAULT_IGNORE)]


def measure_units(model: str | Path | None, schemes: list[str], method: str = "rtn", calib: Path | None = None,
                  samples: int = 32, seq_len: int = 256, rows: int = 4, ctx: int = 256, device: str = "cpu",
                  progress=None) -> dict:
    """Damage of every unit under every candidate scheme, and the unit sizes: what a plan is chosen from."""
    path = resolve_model(model)
    base_ck = Checkpoint(path)
    calib_path = Path(calib) if calib else TINY_DIR / "calib.txt"
    tokenizer = load_tokenizer(path)
    text = read_text_file(calib_path, "calibration file")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    # Take the measurement rows from the end of the calibration text, away from the quantizer's first samples.
    measure_rows = chunk_rows(ids[::-1][: rows * ctx][::-1], ctx, None)
    base = base_ck.load_model(device=device)
    units = S.units(base)
    linears = {S.unit_name(layer, group): _unit_linears(base, layer, p) for layer, group, p in units}
    params = {u: sum(base.get_submodule(n).weight.numel() for n in names) for u, names in linears.items()}
    damage: dict[str, dict[str, float]] = {u: {} for u in linears}
    work = Path(tempfile.mkdtemp(prefix=".quantship-plan-"))
    try:
        for scheme in schemes:
            out = work / scheme
            quantize(path, out, QuantizeOptions(scheme=scheme, method=method, calib=calib, samples=samples,
                                                seq_len=seq_len, device=device))
            quant = Checkpoint(out).load_model(device=device)
            for r in S.measure(base, quant, measure_rows, device, progress=progress):
                damage[r["module"]][scheme] = r["kl_mean"]
            del quant
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"model": str(path), "schemes": schemes, "method": method, "measured_on": str(calib_path),
            "damage": damage, "params": params, "linears": linears}


def plan_from(measured: dict, budget_bits: float) -> dict:
    damage, params, linears, schemes = (measured[k] for k in ("damage", "params", "linears", "schemes"))
    bits = {s: get_scheme(s).bits_per_weight for s in schemes}
    choice = choose_plan(damage, params, bits, budget_bits)
    total = sum(params.values())
    all_bits = {**bits, ORIGINAL: ORIGINAL_BITS}
    return {
        "model": measured["model"], "budget_bits": budget_bits, "schemes": schemes, "method": measured["method"],
        "measured_on": measured["measured_on"],
        "predicted_avg_bits": sum(params[u] * all_bits[s] for u, s in choice.items()) / total,
        "predicted_kl": sum(damage[u].get(s, 0.0) for u, s in choice.items()),
        "units": [{"unit": u, "params": params[u], "scheme": choice[u], "damage": damage[u]} for u in damage],
        "modules": {name: choice[u] for u, names in linears.items() for name in names},
    }


def make_plan(model: str | Path | None, budget_bits: float, schemes: list[str], out: Path | None = None,
              **kwargs) -> dict:
    # What can be refused without measuring is refused before minutes of measuring.
    if not schemes:
        raise QuantshipError("--schemes needs at least one candidate scheme")
    cheapest = min(get_scheme(s).bits_per_weight for s in schemes)  # unknown schemes fail here
    if not cheapest <= budget_bits < math.inf:
        raise QuantshipError(f"--budget-bits {budget_bits} is below the smallest plan ({cheapest:.3f} bits: every "
                             f"unit in the cheapest of {', '.join(schemes)})")
    if out is not None:
        check_output_location(Path(out), "plan")
    return plan_from(measure_units(model, schemes, **kwargs), budget_bits)


def write_plan(plan: dict, out: Path) -> None:
    write_atomic(Path(out), json.dumps(plan, indent=2) + "\n", "plan")
