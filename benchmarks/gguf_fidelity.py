"""GGUF files of the bundled model, measured like any checkpoint: ours (RTN, GPTQ on the GGUF grid,
a GPTQ W4A16 g32 checkpoint repacked losslessly) against llama.cpp's own quantizer on the same model.

llama.cpp's quantizer runs through llama-cpp-python (`make test-llama-cpp` installs it) on the F16
file we export; its rows are left out when it is not installed. Every file is read back by
quantship's GGUF reader and compared with the bf16 model on the held-out text (KL, top-1,
perplexity), so the figures are the file's weights; llama.cpp's runtime adds its 8-bit activation
rounding on top (see tests/test_gguf_llama_cpp.py).

    .venv/bin/python benchmarks/gguf_fidelity.py [WORKDIR]   # files in WORKDIR are kept and reused
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _report import table, update_section, write_result  # noqa: E402

from quantship.formats.gguf import GGUFOptions, export_gguf  # noqa: E402
from quantship.formats.gguf_read import GGUFCheckpoint  # noqa: E402
from quantship.models.bundled import TINY_DIR  # noqa: E402
from quantship.models.loader import Checkpoint  # noqa: E402
from quantship.models.tokenizer import load_tokenizer  # noqa: E402
from quantship.quant.calibrate import read_text_file  # noqa: E402
from quantship.quant.pipeline import QuantizeOptions, quantize  # noqa: E402
from quantship.verify import evaluate as E  # noqa: E402

CALIB = dict(samples=64, seq_len=256)
CTX, TOKENS = 1024, 8192


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


def produce(work: Path) -> dict[str, Path]:
    """Every file of the table under `work`; a file already there is reused (the runs are deterministic)."""
    files: dict[str, Path] = {}

    def make(name: str, path: Path, build) -> None:
        if not path.exists():
            build(path)
        files[name] = path

    f16 = work / "f16.gguf"
    make("F16 | quantship", f16, lambda p: export_gguf("tiny", p, GGUFOptions(type="F16")))
    for file_type in ("Q8_0", "Q4_0", "Q4_K_M", "Q6_K"):
        theirs = work / f"llama-cpp-{file_type}.gguf"
        if theirs.exists() or llama_cpp_quantize(f16, theirs, file_type):
            files[f"{file_type} | llama.cpp quantizer"] = theirs
        for method in ("rtn", "gptq") if file_type in ("Q4_0", "Q4_K_M") else ("rtn",):
            make(f"{file_type} | quantship {method.upper()}", work / f"{file_type}-{method}.gguf",
                 lambda p, t=file_type, m=method: export_gguf("tiny", p, GGUFOptions(type=t, method=m, **CALIB)))
    checkpoint = work / "w4g32"
    if not checkpoint.exists():
        quantize("tiny", checkpoint, QuantizeOptions(scheme="W4A16", method="gptq", group_size=32, **CALIB),
                 progress=False)
    make("Q4_0 | quantship W4A16 g32 GPTQ checkpoint, repacked", work / "w4g32.gguf",
         lambda p: export_gguf(checkpoint, p, GGUFOptions()))
    return files


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="gguf-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    files = produce(work)
    tokenizer = load_tokenizer(TINY_DIR)
    ids = tokenizer(read_text_file(TINY_DIR / "eval.txt"), add_special_tokens=False, verbose=False)["input_ids"]
    rows = E.chunk_rows(ids, CTX, TOKENS)
    base = Checkpoint(TINY_DIR).load_model()
    models = {name: GGUFCheckpoint(path).load_model() for name, path in files.items()}
    records = E.compare_each(base, models, rows)  # one base pass for every file
    results = {}
    for name, path in files.items():
        h = E.headline(records[name], bootstrap=200)
        results[name] = {"kl_mean": h["kl_mean"], "kl_p99": h["kl_p99"], "top1_agreement": h["top1_agreement"],
                         "ppl_base": h["ppl_base"], "ppl_quant": h["ppl_quant"], "mib": path.stat().st_size / 2**20,
                         "types": GGUFCheckpoint(path).file_type}
        print(name, results[name], flush=True)
    rows_md = []
    for name, r in results.items():
        file_type, how = name.split(" | ")
        rows_md.append([file_type, how, f"{r['mib']:.1f}", f"{r['kl_mean']:.4f}", f"{r['kl_p99']:.3f}",
                        f"{r['top1_agreement']:.1%}", f"{r['ppl_base']:.3f} → {r['ppl_quant']:.3f}"])
    write_result("gguf_fidelity", {"calibration": CALIB, "eval_tokens": int(records[next(iter(records))]["kl"].numel()),
                                   "ctx": CTX, "results": results})
    update_section("gguf_fidelity", "## GGUF files: quantship against llama.cpp's quantizer\n\n"
                   "`benchmarks/gguf_fidelity.py` on the bundled model: every file read back by quantship's GGUF "
                   "reader and compared with the bf16 model on 8K held-out tokens (ctx 1024), one base pass for "
                   "all. llama.cpp's quantizer (llama-cpp-python 0.3.36) works from the F16 file quantship exports; "
                   "GPTQ uses 64 x 256 calibration tokens. The bundled model's 384-wide rows do not divide by "
                   "256, so in its Q4_K_M most tensors fall back to Q5_0, as llama.cpp does (same types per "
                   "tensor in both files). Times are not reported: the shared 2-core host ran at a load of 12.\n\n"
                   + table(["type", "weights from", "MiB", "KL mean", "KL p99", "top-1", "ppl"], rows_md))


if __name__ == "__main__":
    main()
