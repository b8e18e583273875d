"""GGUF files of the bundled model, measured like any checkpoint: ours (RTN, RTN weighted by an
importance matrix, GPTQ on the GGUF grid, a GPTQ W4A16 g32 checkpoint repacked losslessly) against
llama.cpp's own quantizer on the same model, with the time each export took.

llama.cpp's quantizer runs through llama-cpp-python (`make test-llama-cpp` installs it) on the F16
file we export; its rows are left out when it is not installed. Every file is read back by
quantship's GGUF reader and compared with the bf16 model on the held-out text (KL, top-1,
perplexity), so the figures are the file's weights; llama.cpp's runtime adds its 8-bit activation
rounding on top (see tests/test_gguf_llama_cpp.py).

Export times are wall-clock seconds of this run (kept in WORKDIR/times.json with the files, so a
reused file keeps the time it took); llama.cpp's quantizer is timed from the F16 file, so its
figure leaves out the F16 export. The W4A16 g32 GPTQ checkpoint takes ~20 minutes to quantize on
a shared 2-core host: without --with-checkpoint (and without it in WORKDIR) its row is carried over
from the previous results file, marked so.

    .venv/bin/python benchmarks/gguf_fidelity.py [WORKDIR] [--with-checkpoint]
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from quantship.files import read_text_file  # noqa: E402
from quantship.formats.gguf import GGUFOptions, export_gguf  # noqa: E402
from quantship.formats.gguf_read import GGUFCheckpoint  # noqa: E402
from quantship.models.bundled import TINY_DIR  # noqa: E402
from quantship.models.loader import Checkpoint  # noqa: E402
from quantship.models.tokenizer import load_tokenizer  # noqa: E402
from quantship.quant.pipeline import QuantizeOptions, quantize  # noqa: E402
from quantship.verify import evaluate as E  # noqa: E402

from _report import RESULTS, table, update_section, write_result  # noqa: E402

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


CHECKPOINT_ROW = "Q4_0 | quantship W4A16 g32 GPTQ checkpoint, repacked"


def produce(work: Path, with_checkpoint: bool) -> tuple[dict[str, Path], dict[str, float]]:
    """Every file of the table under `work` and its export seconds; a file already there is reused
    with its recorded time (the runs are deterministic)."""
    files: dict[str, Path] = {}
    times_file = work / "times.json"
    times: dict[str, float] = json.loads(times_file.read_text()) if times_file.exists() else {}

    def make(name: str, path: Path, build) -> None:
        if not path.exists():
            started = time.perf_counter()
            if build(path) is False:
                return
            times[name] = round(time.perf_counter() - started, 1)
            times_file.write_text(json.dumps(times, indent=1))
        files[name] = path

    f16 = work / "f16.gguf"
    make("F16 | quantship", f16, lambda p: export_gguf("tiny", p, GGUFOptions(type="F16")))
    for file_type in ("Q8_0", "Q4_0", "Q4_K_M", "Q6_K"):
        make(f"{file_type} | llama.cpp quantizer", work / f"llama-cpp-{file_type}.gguf",
             lambda p, t=file_type: llama_cpp_quantize(f16, p, t))
        variants = [("rtn", False), ("rtn", True), ("gptq", False)] if file_type in ("Q4_0", "Q4_K_M") else [
            ("rtn", False)]
        for method, imatrix in variants:
            label = method.upper() + (" + imatrix" if imatrix else "")
            make(f"{file_type} | quantship {label}", work / f"{file_type}-{method}{'-imatrix' * imatrix}.gguf",
                 lambda p, t=file_type, m=method, i=imatrix: export_gguf(
                     "tiny", p, GGUFOptions(type=t, method=m, imatrix=i, **CALIB)))
    checkpoint = work / "w4g32"
    if with_checkpoint and not checkpoint.exists():
        quantize("tiny", checkpoint, QuantizeOptions(scheme="W4A16", method="gptq", group_size=32, **CALIB))
    if checkpoint.exists():
        make(CHECKPOINT_ROW, work / "w4g32.gguf", lambda p: export_gguf(checkpoint, p, GGUFOptions()))
    return files, times


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    work = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="gguf-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    files, times = produce(work, "--with-checkpoint" in sys.argv)
    tokenizer = load_tokenizer(TINY_DIR)
    text = read_text_file(TINY_DIR / "eval.txt", "evaluation text")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    rows = E.chunk_rows(ids, CTX, TOKENS)
    base = Checkpoint(TINY_DIR).load_model()
    models = {name: GGUFCheckpoint(path).load_model() for name, path in files.items()}
    records = E.compare_each(base, models, rows)  # one base pass for every file
    results = {}
    for name, path in files.items():
        h = E.headline(records[name], bootstrap=200)
        results[name] = {"kl_mean": h["kl_mean"], "kl_p99": h["kl_p99"], "top1_agreement": h["top1_agreement"],
                         "ppl_base": h["ppl_base"], "ppl_quant": h["ppl_quant"], "mib": path.stat().st_size / 2**20,
                         "types": GGUFCheckpoint(path).file_type, "export_seconds": times.get(name)}
        print(name, results[name], flush=True)
    carried = CHECKPOINT_ROW not in results and (RESULTS / "gguf_fidelity.json").exists()
    if carried:
        previous = json.loads((RESULTS / "gguf_fidelity.json").read_text())["results"].get(CHECKPOINT_ROW)
        if previous:
            results[CHECKPOINT_ROW] = dict(previous, carried_over=True)
    rows_md = []
    for name, r in results.items():
        file_type, how = name.split(" | ")
        seconds = r.get("export_seconds")
        rows_md.append([file_type, how + (" (previous run)" if r.get("carried_over") else ""), f"{r['mib']:.1f}",
                        f"{r['kl_mean']:.4f}", f"{r['kl_p99']:.3f}", f"{r['top1_agreement']:.1%}",
                        f"{r['ppl_base']:.3f} → {r['ppl_quant']:.3f}", "–" if seconds is None else f"{seconds:.0f}"])
    load_after = os.getloadavg()[0]
    write_result("gguf_fidelity", {"calibration": CALIB, "eval_tokens": int(records[next(iter(records))]["kl"].numel()),
                                   "ctx": CTX, "load_average": [load_before, load_after], "results": results})
    update_section("gguf_fidelity", "## GGUF files: quantship against llama.cpp's quantizer\n\n"
                   "`benchmarks/gguf_fidelity.py` on the bundled model: every file read back by quantship's GGUF "
                   "reader and compared with the bf16 model on 8K held-out tokens (ctx 1024), one base pass for "
                   "all. llama.cpp's quantizer (llama-cpp-python 0.3.36) works from the F16 file quantship exports; "
                   "GPTQ and the importance matrix (`--imatrix`) use 64 x 256 calibration tokens. The bundled "
                   "model's 384-wide rows do not divide by 256, so in its Q4_K_M most tensors fall back to Q5_0, "
                   "as llama.cpp does (same types per tensor in both files). Export seconds are wall-clock on the "
                   f"shared 2-core host (load average {load_before:.1f} at the start, {load_after:.1f} at the end): "
                   "llama.cpp's quantizer is timed from the F16 file (its F16 export is the first row); quantship's "
                   "include reading the bf16 checkpoint and, for GPTQ/imatrix, the calibration pass."
                   + (" The repacked-checkpoint row is carried over from the previous run (its export is "
                      "unchanged; quantizing the checkpoint takes ~20 minutes here); no time was recorded."
                      if carried else "") + "\n\n"
                   + table(["type", "weights from", "MiB", "KL mean", "KL p99", "top-1", "ppl", "export s"], rows_md))


if __name__ == "__main__":
    main()
