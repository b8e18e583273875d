"""Quantizing DeepSeek's FP8 block source against the bf16 source of the same model: peak host memory and time.

loader_memory.py's synthetic DeepSeek-V3-shaped checkpoint (random bf16, 4 layers) is converted to
DeepSeek's published FP8 layout (tests/fp8_models.py: every decoder Linear e4m3 + weight_scale_inv
per 128x128 block, plus an MTP layer, which both runs keep). Each source is quantized W4A16 with
RTN and GPTQ on CPU in fresh processes (sides alternating), measuring peak RSS above a baseline
taken after the imports, and wall time. The FP8 route must not need more than one layer's worth of
extra memory: the table gives the difference in units of the largest decoder layer in float32.

    .venv/bin/python benchmarks/fp8_source_memory.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from loader_memory import write_checkpoint  # noqa: E402

from quantship.models.bundled import TINY_DIR  # noqa: E402

from _report import table, update_section, write_result  # noqa: E402
from fp8_models import convert_to_fp8  # noqa: E402

SAMPLES, SEQ_LEN = 16, 256
LAYERS = 4

PROBE = r"""
import json, sys
from pathlib import Path
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.pipeline import QuantizeOptions, quantize
def kb(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1])
load_tokenizer(Path(sys.argv[1]))
base = kb('VmRSS')
quantize(sys.argv[1], sys.argv[2], QuantizeOptions(method=sys.argv[3], samples=%d, seq_len=%d))
print(json.dumps({"baseline_kb": base, "peak_kb": kb('VmHWM')}))
""" % (SAMPLES, SEQ_LEN)


def _measure(model: Path, out: Path, method: str) -> tuple[int, float]:
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model), str(out), method], capture_output=True,
                          text=True, check=True)
    seconds = time.time() - started
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(out)
    return (r["peak_kb"] - r["baseline_kb"]) * 1024, seconds


def main() -> None:
    mb = 2**20
    rows, result = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = Path(tmp) / "bf16-source"
        bf16.mkdir()
        sizes = write_checkpoint(bf16, LAYERS)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(TINY_DIR / name, bf16 / name)
        with_mtp = convert_to_fp8(bf16, Path(tmp) / "bf16", fp8=False)
        fp8 = convert_to_fp8(bf16, Path(tmp) / "fp8")
        layer_f32 = max(v for k, v in sizes.items() if k != "outer") * 2
        disk = {side: sum(p.stat().st_size for p in d.glob("*.safetensors")) for side, d in
                (("bf16", with_mtp), ("fp8", fp8))}
        for method in ("rtn", "gptq"):
            runs = {}
            for side, model in (("bf16", with_mtp), ("fp8", fp8), ("bf16", with_mtp), ("fp8", fp8)):
                peak, seconds = _measure(model, Path(tmp) / "out", method)
                runs.setdefault(side, []).append((peak, seconds))
            for side in ("bf16", "fp8"):
                peak = min(p for p, _ in runs[side])  # the lower of two runs: other processes only add
                seconds = min(s for _, s in runs[side])
                result[f"{method}_{side}"] = {"peak_bytes": peak, "seconds": seconds, "source_bytes": disk[side]}
            extra = (result[f"{method}_fp8"]["peak_bytes"] - result[f"{method}_bf16"]["peak_bytes"]) / layer_f32
            result[f"{method}_fp8_extra_in_layers"] = extra
            for side in ("bf16", "fp8"):
                r = result[f"{method}_{side}"]
                rows.append([method.upper(), side, f"{r['source_bytes'] / mb:.0f}", f"{r['peak_bytes'] / mb:.0f}",
                             f"{r['seconds']:.1f}", f"{extra:+.2f}" if side == "fp8" else ""])
    result["largest_layer_float32_bytes"] = layer_f32
    write_result("fp8_source_memory", result)
    update_section("fp8_source_memory", "## Quantizing an FP8 block source: memory and time against bf16\n\n"
        "`benchmarks/fp8_source_memory.py`: loader_memory.py's synthetic DeepSeek-V3-shaped checkpoint "
        f"({LAYERS} layers, "
        "16 experts, random weights, plus an MTP layer) as bf16 and converted to DeepSeek's FP8 block layout; W4A16 "
        f"on CPU, {SAMPLES} x {SEQ_LEN} calibration tokens, fresh processes, the lower of two alternating runs per "
        "side. Peak RSS above a baseline taken after the imports. The last column is the FP8 route's extra peak in "
        f"units of the largest decoder layer in float32 ({layer_f32 / mb:.0f} MB).\n\n"
        + table(["method", "source", "source MB", "peak MB", "seconds", "FP8 extra (layers)"], rows))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
