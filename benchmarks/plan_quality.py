"""Mixed precision from measured sensitivity against uniform W4A16 and a fixed llama.cpp-style rule.

On the bundled model, every checkpoint quantized with RTN (so only the bit allocation differs):
  - uniform W4A16 g128 and uniform W8A16,
  - Q4_K_M-like rule: W8A16 for the first and last eighth of the layers and for the value
    (kv_b_proj, whose rows make V in MLA) and down projections, W4A16 elsewhere,
  - quantship plans at 4.5 and 5.0 average bits (sensitivity measured on the calibration text).
Each is verified on the held-out evaluation text (KL, top-1); verify's time per 1,000 tokens is
measured too. Average bits are over the quantized Linear weights (scales included).

    .venv/bin/python benchmarks/plan_quality.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

from quantship.models.bundled import TINY_DIR  # noqa: E402
from quantship.models.causal_lm import CausalLM  # noqa: E402
from quantship.models.loader import Checkpoint  # noqa: E402
from quantship.quant.pipeline import QuantizeOptions, quantize  # noqa: E402
from quantship.quant.scheme import get_scheme  # noqa: E402
from quantship.verify.mixed_precision import measure_units, plan_from  # noqa: E402
from quantship.verify.run import VerifyOptions, verify  # noqa: E402

from _report import table, update_section, write_result  # noqa: E402

CALIB = dict(samples=64, seq_len=256)
EVAL = VerifyOptions(ctx=1024, max_tokens=8192, sensitivity=False, generations=False, bootstrap=200)


def heuristic_plan(linears: dict[str, list[str]], layers: int) -> dict[str, str]:
    edge = max(1, layers // 8)
    plan = {}
    for names in linears.values():
        for name in names:
            layer = int(name.split(".")[2])
            high = layer < edge or layer >= layers - edge or name.endswith(("kv_b_proj", "v_proj", "down_proj"))
            plan[name] = "W8A16" if high else "W4A16"
    return plan


def avg_bits(plan: dict[str, str], params: dict[str, int]) -> float:
    bits = {s: get_scheme(s).bits_per_weight for s in ("W4A16", "W8A16")}
    total = sum(params.values())
    return sum(params[n] * bits[s] for n, s in plan.items()) / total


def main() -> None:
    measured = measure_units("tiny", ["W4A16", "W8A16"], **CALIB)
    ck = Checkpoint(TINY_DIR)
    with torch.device("meta"):
        meta = CausalLM(ck.config)
    model_params = {n: meta.get_submodule(n).weight.numel() for names in measured["linears"].values() for n in names}
    candidates = {
        "uniform W4A16 g128": {n: "W4A16" for n in model_params},
        "Q4_K_M-like rule": heuristic_plan(measured["linears"], ck.config.num_hidden_layers),
        "plan 4.5 bits": plan_from(measured, 4.5)["modules"],
        "plan 5.0 bits": plan_from(measured, 5.0)["modules"],
        "uniform W8A16": {n: "W8A16" for n in model_params},
    }
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in candidates.items():
            out = Path(tmp) / name.replace(" ", "_")
            quantize("tiny", out, QuantizeOptions(plan=plan, **CALIB))
            start = time.time()
            report = verify("tiny", out, EVAL)
            seconds = time.time() - start
            h = report["headline"]
            results[name] = {"avg_bits": avg_bits(plan, model_params), "kl_mean": h["kl_mean"],
                             "kl_p99": h["kl_p99"], "top1_agreement": h["top1_agreement"],
                             "verify_seconds_per_1k_tokens": seconds / report["tokens"] * 1000}
            r = results[name]
            rows.append([name, f"{r['avg_bits']:.3f}", f"{r['kl_mean']:.4f}", f"{r['kl_p99']:.3f}",
                         f"{r['top1_agreement']:.1%}",
                         f"{r['kl_mean'] / results['uniform W4A16 g128']['kl_mean']:.2f}"])
    per_1k = sum(r["verify_seconds_per_1k_tokens"] for r in results.values()) / len(results)
    results["verify_seconds_per_1k_tokens_mean"] = per_1k
    write_result("plan_quality", results)
    update_section("plan_quality", "## Mixed precision: plan vs uniform and a fixed rule\n\n"
        "`benchmarks/plan_quality.py` on the bundled model: all RTN, 64 x 256 calibration tokens; KL and top-1 on "
        f"8K held-out tokens (ctx 1024). Plans are chosen from sensitivity measured on the calibration text. "
        f"verify (base, quant and noise-floor passes) took {per_1k:.2f} s per 1,000 tokens on 2 CPU cores.\n\n"
        + table(["checkpoint", "avg bits", "KL mean", "KL p99", "top-1", "KL / uniform W4"], rows))
    print(results)


if __name__ == "__main__":
    main()
