"""Peak host memory of quantizing synthetic multi-shard checkpoints on CPU, one layer at a time.

Uses loader_memory.py's DeepSeek-V3-shaped checkpoint (random bf16) at 4 and 16 layers (about 0.3
and 0.9 GB) and quantizes each W4A16 with RTN, GPTQ and AWQ in fresh processes, measuring peak RSS
(VmHWM) above a baseline taken after the imports. Streaming shows as a peak that does not grow
with the number of layers. The floor is what the pipeline must hold: the largest decoder layer in
float32 plus a layer's input and output activations in float32.

    .venv/bin/python benchmarks/quantize_memory.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from loader_memory import CONFIG, write_checkpoint  # noqa: E402

from quantship.models.bundled import TINY_DIR  # noqa: E402

from _report import table, update_section, write_result  # noqa: E402

SAMPLES, SEQ_LEN = 16, 256
METHODS = ("rtn", "gptq", "awq")

PROBE = r"""
import json, sys
from pathlib import Path
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.pipeline import QuantizeOptions, quantize
def kb(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1])
load_tokenizer(Path(sys.argv[1]))  # transformers' import is code, not data: count it in the baseline
base = kb('VmRSS')
quantize(sys.argv[1], sys.argv[2], QuantizeOptions(method=sys.argv[3], samples=%d, seq_len=%d))
print(json.dumps({"baseline_kb": base, "peak_kb": kb('VmHWM')}))
""" % (SAMPLES, SEQ_LEN)


def main() -> None:
    rows, result = [], {}
    mb = 2**20
    for layers in (4, 16):
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(tmp) / "model"
            model.mkdir()
            sizes = write_checkpoint(model, layers)
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(TINY_DIR / name, model / name)
            for method in METHODS:
                proc = subprocess.run([sys.executable, "-c", PROBE, str(model), str(Path(tmp) / f"out-{method}"),
                                       method], capture_output=True, text=True, check=True)
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                peak = (r["peak_kb"] - r["baseline_kb"]) * 1024
                total = sum(sizes.values())
                activations = 2 * SAMPLES * SEQ_LEN * CONFIG["hidden_size"] * 4
                floor = max(v for k, v in sizes.items() if k != "outer") * 2 + activations
                result[f"{method}_{layers}_layers"] = {"checkpoint_bytes": total, "peak_bytes": peak,
                                                       "floor_bytes": floor}
                rows.append([method.upper(), layers, f"{total / mb:.0f}", f"{peak / mb:.0f}", f"{floor / mb:.0f}",
                             f"{peak / total:.2f}"])
    for method in METHODS:
        small, large = result[f"{method}_4_layers"], result[f"{method}_16_layers"]
        result[f"{method}_peak_growth_4_to_16_layers"] = large["peak_bytes"] / small["peak_bytes"]
        result[f"{method}_checkpoint_growth"] = large["checkpoint_bytes"] / small["checkpoint_bytes"]
    write_result("quantize_memory", result)
    growth = ", ".join(f"{m.upper()} x{result[f'{m}_peak_growth_4_to_16_layers']:.2f}" for m in METHODS)
    update_section("quantize_memory", "## Quantization: peak host memory\n\n"
        "`benchmarks/quantize_memory.py`: W4A16 on CPU of synthetic DeepSeek-V3-shaped checkpoints (16 experts) with 4 "
        f"and 16 layers, {SAMPLES} x {SEQ_LEN} calibration tokens; peak RSS above a baseline taken after the imports, "
        "in fresh processes. The floor is the largest decoder layer in float32 plus a layer's input and output "
        "activations in float32. Checkpoint x{:.1f}, peak: {}.\n\n".format(
            result["rtn_checkpoint_growth"], growth)
        + table(["method", "layers", "checkpoint MB", "peak MB", "floor MB", "peak / checkpoint"], rows))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
