"""GGUF files of the bundled model, measured like any checkpoint: ours (RTN, GPTQ on the GGUF grid,
a GPTQ W4A16 g32 checkpoint repacked losslessly) against llama.cpp's own quantizer on the same model.

llama.cpp's quantizer runs through llama-cpp-python (`make test-llama-cpp` installs it) on the F16
file we export; its rows are left out when it is not installed. Every file is read back by
quantship's GGUF reader and verified on the held-out text (KL, top-1, perplexity), so the figures
are the file's weights; llama.cpp's runtime adds its 8-bit activation rounding on top (see
tests/test_gguf_llama_cpp.py).

    .venv/bin/python benchmarks/gguf_fidelity.py
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _report import table, update_section, write_result  # noqa: E402

from quantship.formats.gguf import GGUFOptions, export_gguf  # noqa: E402
from quantship.quant.pipeline import QuantizeOptions, quantize  # noqa: E402
from quantship.verify.run import VerifyOptions, verify  # noqa: E402

CALIB = dict(samples=64, seq_len=256)
EVAL = VerifyOptions(ctx=1024, max_tokens=8192, sensitivity=False, generations=False, bootstrap=200)


def llama_cpp_quantize(src: Path, dst: Path, file_type: str) -> bool:
    try:
        import gguf
        import llama_cpp
    except ImportError:
        return False
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(getattr(gguf.LlamaFileType, f"MOSTLY_{file_type}"))
    params.nthread = 2
    return llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


def main() -> None:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        f16 = export_gguf("tiny", root / "f16.gguf", GGUFOptions(type="F16")).path
        files: dict[str, tuple[Path, float | None]] = {}
        for file_type in ("Q8_0", "Q4_0", "Q4_K_M", "Q6_K"):
            start = time.time()
            if llama_cpp_quantize(f16, root / f"llama-cpp-{file_type}.gguf", file_type):
                files[f"{file_type} | llama.cpp quantizer"] = (root / f"llama-cpp-{file_type}.gguf", time.time() - start)
            for method in ("rtn", "gptq") if file_type in ("Q4_0", "Q4_K_M") else ("rtn",):
                start = time.time()
                out = export_gguf("tiny", root / f"{file_type}-{method}.gguf",
                                  GGUFOptions(type=file_type, method=method, **CALIB)).path
                files[f"{file_type} | quantship {method.upper()}"] = (out, time.time() - start)
        start = time.time()
        quantize("tiny", root / "w4g32", QuantizeOptions(scheme="W4A16", method="gptq", group_size=32, **CALIB),
                 progress=False)
        out = export_gguf(root / "w4g32", root / "w4g32.gguf", GGUFOptions()).path
        files["Q4_0 | quantship W4A16 g32 GPTQ checkpoint, repacked"] = (out, time.time() - start)
        for name, (path, seconds) in files.items():
            h = verify("tiny", path, EVAL)["headline"]
            results[name] = {"kl_mean": h["kl_mean"], "kl_p99": h["kl_p99"], "top1_agreement": h["top1_agreement"],
                             "ppl_base": h["ppl_base"], "ppl_quant": h["ppl_quant"],
                             "mib": path.stat().st_size / 2**20, "seconds": seconds}
            print(name, results[name], flush=True)
    rows = []
    for name, r in results.items():
        file_type, how = name.split(" | ")
        rows.append([file_type, how, f"{r['mib']:.1f}", f"{r['kl_mean']:.4f}", f"{r['kl_p99']:.3f}",
                     f"{r['top1_agreement']:.1%}", f"{r['ppl_base']:.3f} → {r['ppl_quant']:.3f}", f"{r['seconds']:.0f}"])
    write_result("gguf_fidelity", {"calibration": CALIB, "eval_tokens": EVAL.max_tokens, "ctx": EVAL.ctx,
                                   "results": results})
    update_section("gguf_fidelity", "## GGUF files: quantship against llama.cpp's quantizer\n\n"
                   "`benchmarks/gguf_fidelity.py` on the bundled model (2 CPU cores): every file read back by "
                   "quantship's GGUF reader and verified on 8K held-out tokens (ctx 1024). llama.cpp's quantizer "
                   "(llama-cpp-python 0.3.36) works from the F16 file quantship exports; GPTQ uses 64 x 256 "
                   "calibration tokens. The bundled model's 384-wide rows do not divide by 256, so in its "
                   "Q4_K_M most tensors fall back to Q5_0, as llama.cpp does. Seconds: quantization and writing "
                   "(for the repacked row, GPTQ quantization included).\n\n"
                   + table(["type", "weights from", "MiB", "KL mean", "KL p99", "top-1", "ppl", "seconds"], rows))


if __name__ == "__main__":
    main()
