"""Decode throughput of ONNX Runtime (CPU) on quantship's ONNX exports of the bundled model, against
quantship's engine and transformers on the same weights, in one run; and the size of each export.

Weights per row: fp32 = the bundled bf16 checkpoint computed in float32; int8-dynamic = a W8A8 RTN
checkpoint (ONNX: QDQ with per-token activation scales; engine: our W8A8 Linears); int4 = a W4A16
RTN group-128 checkpoint (ONNX: MatMulNBits repacked from its integers; engine: our W4A16 Linears).
transformers runs the same checkpoints where it can load them (compressed-tensors for the quantized
ones); a side that cannot is recorded with the reason.

Decode tokens/s: every side generates greedily from the same batch of equal-length prompts (EOS
ignored), once with 1 new token and once with NEW new tokens; decode rate = batch * (NEW - 1) /
(t_NEW - t_1), so prefill cancels out. The median of ROUNDS alternating rounds. All sides use the
same thread count (torch and ONNX Runtime intra-op threads = THREADS). Ratios are against
transformers fp32 at the same batch, measured in the same run.

    .venv/bin/python benchmarks/onnx_throughput.py [WORKDIR]    # exports in WORKDIR are kept and reused
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from quantship.formats.onnx import OnnxOptions, export_onnx  # noqa: E402
from quantship.formats.onnx_runtime import OnnxModel  # noqa: E402
from quantship.models.bundled import TINY_DIR  # noqa: E402
from quantship.models.loader import Checkpoint  # noqa: E402
from quantship.models.quantized import use_cpu_kernels  # noqa: E402
from quantship.quant.pipeline import QuantizeOptions, quantize  # noqa: E402

from _report import table, update_section, write_result  # noqa: E402

THREADS = 2
PROMPT, NEW, BATCHES, ROUNDS = 32, 33, (1, 8), 3
TYPES = {"fp32": None, "int8-dynamic": "W8A8", "int4": "W4A16"}  # ONNX type → checkpoint scheme (None: bf16)


def prepare(work: Path) -> dict[str, dict]:
    """Checkpoint and ONNX export per type; existing ones in `work` are reused."""
    out = {}
    for kind, scheme in TYPES.items():
        source = TINY_DIR
        if scheme:
            source = work / scheme.lower()
            if not source.exists():
                quantize("tiny", source, QuantizeOptions(scheme=scheme, method="rtn"))
        export = work / f"onnx-{kind}"
        seconds = None
        if not export.exists():
            started = time.perf_counter()
            export_onnx(source, export, OnnxOptions(type=kind))
            seconds = round(time.perf_counter() - started, 1)
        files = {p.name: p.stat().st_size for p in export.iterdir()}
        out[kind] = {"source": source, "export": export, "export_seconds": seconds,
                     "mib": sum(files.values()) / 2**20,
                     "weights_mib": (files.get("model.onnx.data", 0) + files.get("model.onnx", 0)) / 2**20}
    return out


# --- one generation per side: (batch of prompts, new tokens) → seconds -----------------------------

def ort_generate(model: OnnxModel, prompts: np.ndarray, new: int) -> float:
    start = time.perf_counter()
    cache, past, ids = model.empty_cache(len(prompts)), 0, prompts
    for _ in range(new):
        logits, cache = model.step(ids, cache, past)
        past += ids.shape[1]
        ids = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
    return time.perf_counter() - start


def engine_generate(model, prompts: np.ndarray, new: int) -> float:
    from quantship.engine.config import EngineConfig
    from quantship.engine.engine import LLMEngine
    from quantship.engine.sampling_params import SamplingParams

    batch = len(prompts)
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT, max_model_len=PROMPT + NEW + 16,
                          kv_cache_bytes=1 << 30, enable_prefix_caching=False)
    engine = LLMEngine(model, config)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=new, ignore_eos=True))
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    assert produced == batch * new
    return time.perf_counter() - start


def hf_generate(model, prompts: np.ndarray, new: int) -> float:
    ids = torch.from_numpy(prompts)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + new
    return time.perf_counter() - start


def load_hf(source: Path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=True).eval()


def main() -> None:
    torch.set_num_threads(THREADS)
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="onnx-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    prepared = prepare(work)
    sides: dict[str, object] = {}  # "side | type" → callable(prompts, new) → seconds
    skipped: dict[str, str] = {}
    for kind, p in prepared.items():
        ort_model = OnnxModel(p["export"], threads=THREADS)
        sides[f"ONNX Runtime | {kind}"] = lambda pr, n, m=ort_model: ort_generate(m, pr, n)
        ours = Checkpoint(p["source"]).load_model(dtype=torch.float32)
        use_cpu_kernels(ours)  # as `serve` runs it: int4 through PyTorch's CPU kernel, W8A8 as int8 x int8
        sides[f"quantship engine | {kind}"] = lambda pr, n, m=ours: engine_generate(m, pr, n)
        try:
            hf = load_hf(p["source"])
            sides[f"transformers | {kind}"] = lambda pr, n, m=hf: hf_generate(m, pr, n)
        except Exception as exc:  # noqa: BLE001 — the reason goes into the table
            skipped[f"transformers | {kind}"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    rng = np.random.default_rng(0)
    results: dict[str, dict] = {}
    with torch.inference_mode():
        for batch in BATCHES:
            prompts = rng.integers(3, 8192, (batch, PROMPT)).astype(np.int64)
            for run in sides.values():
                run(prompts, 2)  # warm-up
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(ROUNDS):
                for name, run in sides.items():
                    one, full = run(prompts, 1), run(prompts, NEW)
                    times[name].append(batch * (NEW - 1) / max(full - one, 1e-9))
            for name, rates in times.items():
                results[f"{name} | {batch}"] = {"batch": batch, "decode_tok_s": statistics.median(rates),
                                                "rounds": rates}
                print(name, batch, f"{statistics.median(rates):.1f} tok/s", flush=True)
    load_after = os.getloadavg()[0]
    rows = []
    for batch in BATCHES:
        reference = results.get(f"transformers | fp32 | {batch}", {}).get("decode_tok_s")
        for kind, p in prepared.items():
            for side in ("ONNX Runtime", "quantship engine", "transformers"):
                key = f"{side} | {kind}"
                if key in skipped:
                    if batch == BATCHES[0]:
                        rows.append([kind, side, "–", "not run", "–",
                                     f"{p['mib']:.1f}" if side == "ONNX Runtime" else "–"])
                    continue
                rate = results[f"{key} | {batch}"]["decode_tok_s"]
                ratio = f"{rate / reference:.2f}x" if reference else "–"
                size = f"{p['mib']:.1f}" if side == "ONNX Runtime" else "–"
                rows.append([kind, side, batch, f"{rate:.1f}", ratio, size])
    write_result("onnx_throughput", {
        "threads": THREADS, "prompt_tokens": PROMPT, "new_tokens": NEW, "rounds": ROUNDS,
        "load_average": [load_before, load_after], "results": results, "not_run": skipped,
        "exports": {k: {"mib": p["mib"], "weights_mib": p["weights_mib"], "export_seconds": p["export_seconds"],
                        "source": str(p["source"].name)} for k, p in prepared.items()}})
    notes = "".join(f"\n- {k} not run: {v}" for k, v in skipped.items())
    update_section("onnx_throughput", "## ONNX Runtime decode throughput (CPU)\n\n"
                   "`benchmarks/onnx_throughput.py` on the bundled model: greedy decode tokens/s of ONNX Runtime "
                   "(CPU provider) on quantship's exports, quantship's engine and transformers on the same weights "
                   f"(fp32: the bf16 checkpoint in float32; int8-dynamic: a W8A8 RTN checkpoint; int4: a W4A16 RTN "
                   f"group-128 checkpoint). {PROMPT}-token prompts, decode rate = batch x {NEW - 1} / (t({NEW} new) "
                   f"- t(1 new)), median of {ROUNDS} alternating rounds, {THREADS} threads for every side, ratio "
                   "against transformers fp32 at the same batch in the same run. MiB is the whole export directory "
                   "(graph, weights, tokenizer). Shared 2-core host, load average "
                   f"{load_before:.1f} at the start and {load_after:.1f} at the end: compare within a batch size, "
                   "not across runs. transformers reads the W4A16 checkpoint through its compressed-tensors "
                   "integration; quantship's engine runs its int4 Linears as `serve` does on the CPU, through "
                   "PyTorch's CPU int4 kernel (bf16 activations), and its W8A8 ones through one int8 x int8 matmul "
                   "(torch._int_mm)." + notes + "\n\n"
                   + table(["type", "runtime", "batch", "decode tok/s", "vs transformers fp32", "export MiB"], rows))


if __name__ == "__main__":
    main()
