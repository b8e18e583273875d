"""`quantship verify`: everything the report holds, measured in one pass over the inputs."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from quantship import __version__
from quantship.errors import QuantshipError
from quantship.files import read_text_file
from quantship.formats.gguf_read import GGUFCheckpoint, open_checkpoint
from quantship.models.bundled import bundled_texts, resolve_model
from quantship.models.loader import Checkpoint
from quantship.models.reference_loop import generate_tokens
from quantship.models.tokenizer import eos_ids, load_tokenizer
from quantship.verify import evaluate as E, sensitivity as S
from quantship.verify.coverage import coverage
from quantship.verify.floor import floor_model
from quantship.verify.gates import check_metrics, default_gates_file, evaluate_gates, parse_gates
from quantship.verify.metrics import repetition_rate

DEFAULT_PROMPTS = ("def parse_args(argv):\n", "class Stack:\n    \"\"\"", "KING HENRY.\n", "The `json` module")
RECIPE_FILE = "quantship_recipe.json"
# Code shares boilerplate lines (licence headers, imports); only a real overlap is worth a warning.
OVERLAP_WARNING = 0.05


@dataclass
class VerifyOptions:
    text: Path | None = None
    ctx: int | None = None
    max_tokens: int = 32768
    gates: str | None = None  # a YAML path, "default", or None
    sensitivity: bool = True
    sensitivity_rows: int = 2
    sensitivity_ctx: int = 512
    generations: bool = True
    max_new_tokens: int = 48
    noise_floor_dtype: str = "bfloat16"
    device: str = "cpu"
    bootstrap: int = 1000


def _open_quant(quant):
    """QUANT as (path, checkpoint): an ONNX export directory is run by ONNX Runtime, not rebuilt in torch."""
    if quant is not None and (Path(quant) / "model.onnx").is_file():
        from quantship.formats.onnx_runtime import OnnxCheckpoint

        return Path(quant), OnnxCheckpoint(quant)
    return open_checkpoint(quant)


def _recipe(path: Path, ck) -> dict:
    if hasattr(ck, "recipe"):  # an ONNX export says what it holds
        return ck.recipe()
    if isinstance(ck, GGUFCheckpoint):
        # Default gates by bits: Q8_0 and the float types are held to W8A16's thresholds, the rest to W4A16's.
        return {"scheme": f"GGUF {ck.file_type}",
                "gates_scheme": "W8A16" if ck.file_type in ("Q8_0", "F16", "BF16", "ALL_F32") else "W4A16"}
    file = path / RECIPE_FILE
    return json.loads(file.read_text()) if file.is_file() else {}


def _generations(base, quant, tokenizer, stop, max_new: int) -> list[dict]:
    out = []
    for prompt in DEFAULT_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        b = list(generate_tokens(base, ids, max_new, stop_ids=stop))
        q = list(generate_tokens(quant, ids, max_new, stop_ids=stop))
        diverge = next((i for i, (x, y) in enumerate(zip(b, q)) if x != y), None)
        if diverge is None and len(b) != len(q):
            diverge = min(len(b), len(q))
        out.append({"prompt": prompt, "base": tokenizer.decode(b, skip_special_tokens=True),
                    "quant": tokenizer.decode(q, skip_special_tokens=True), "tokens_to_divergence": diverge,
                    "repetition_base": repetition_rate(b), "repetition_quant": repetition_rate(q),
                    "eos_base": bool(b and b[-1] in stop), "eos_quant": bool(q and q[-1] in stop)})
    return out


def verify(base: str | Path | None, quant: str | Path, opts: VerifyOptions, progress=None) -> dict:
    """Compare QUANT with BASE; returns the report dict (gates included when asked for)."""
    base_path = resolve_model(base)
    base_ck = Checkpoint(base_path)
    quant_path, quant_ck = _open_quant(quant)  # a model directory, a .gguf file or an ONNX export
    if base_ck.config.architecture != quant_ck.config.architecture:
        raise QuantshipError(f"architectures differ: BASE is {base_ck.config.architecture}, QUANT is "
                             f"{quant_ck.config.architecture}", quant_path)
    if base_ck.config.vocab_size != quant_ck.config.vocab_size:
        raise QuantshipError("BASE and QUANT have different vocabularies; compare a model with its own quantization",
                             quant_path)
    recipe = _recipe(quant_path, quant_ck)
    gates_path, gates = _read_gates(opts.gates, recipe)  # now, not after minutes of evaluation
    ctx = _window(opts, base_ck.config.max_position_embeddings)
    text_path = opts.text or bundled_texts()["eval_text"]
    eval_text = read_text_file(Path(text_path), "evaluation text")
    tokenizer = load_tokenizer(base_path)
    ids = tokenizer(eval_text, add_special_tokens=False, verbose=False)["input_ids"]
    try:
        rows = E.chunk_rows(ids, ctx, opts.max_tokens)
    except ValueError as exc:
        raise QuantshipError(str(exc), text_path) from None

    device = torch.device(opts.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    base_model = base_ck.load_model(dtype=dtype, device=device)
    quant_model = quant_ck.load_model(dtype=dtype, device=device)
    floor = floor_model(base_model, base_ck, dtype, getattr(torch, opts.noise_floor_dtype), device)
    step = progress or (lambda *_: None)
    step("compare + noise floor", len(rows))
    # One pass: each window's base logits serve both comparisons.
    both = E.compare_each(base_model, {"quant": quant_model, "floor": floor}, rows, device, progress=lambda: step())
    del floor  # the copy is not needed by sensitivity, coverage or generations
    records, floor_records = both["quant"], both["floor"]
    report = {
        "schema_version": 1, "quantship_version": __version__, "base": str(base_path), "quant": str(quant_path),
        "text": str(text_path), "ctx": ctx, "tokens": int(records["kl"].numel()),
        "quant_scheme": recipe.get("scheme"),
        "headline": E.headline(records, opts.bootstrap),
        "noise_floor": {**E.headline(floor_records, opts.bootstrap), "dtype": opts.noise_floor_dtype},
        "kl_histogram": E.kl_histogram(records),
        "by_position": E.by_position(records, ctx),
    }
    if opts.sensitivity and getattr(quant_ck, "swappable_layers", True):
        srows = E.chunk_rows(ids, min(ctx, opts.sensitivity_ctx), None)[: opts.sensitivity_rows]
        step("sensitivity", len(S.units(base_model)))
        report["sensitivity"] = S.measure(base_model, quant_model, srows, device, progress=lambda: step())
    calib_source = Path(recipe.get("calibration", {}).get("source") or bundled_texts()["calib_text"])
    if calib_source.is_file():
        calib_text = read_text_file(calib_source, "calibration file")
        calib_ids = tokenizer(calib_text, add_special_tokens=False, verbose=False)["input_ids"]
        report["coverage"] = coverage(base_model, calib_ids, ids, calib_text, eval_text, base_ck.config.vocab_size,
                                      recipe.get("tokens_per_expert"), device=device)
        report["coverage"]["calib_source"] = str(calib_source)
        if report["coverage"]["text_overlap"] > OVERLAP_WARNING:
            warnings.warn(f"{report['coverage']['text_overlap']:.1%} of the evaluation text's lines also appear in "
                          f"the calibration text ({calib_source}): the comparison flatters the quantization")
    if opts.generations:
        report["generations"] = _generations(base_model, quant_model, tokenizer,
                                             eos_ids(tokenizer, base_ck.config.eos_token_id), opts.max_new_tokens)
    if gates:
        report["gates"] = evaluate_gates(report, gates, gates_path)
    return report


def _read_gates(gates: str | None, recipe: dict) -> tuple[Path | None, list]:
    if not gates:
        return None, []
    path = default_gates_file(recipe.get("gates_scheme", recipe.get("scheme"))) if gates == "default" else Path(gates)
    parsed = parse_gates(path)
    check_metrics(parsed, path)
    return path, parsed


def _window(opts: VerifyOptions, positions: int) -> int:
    """Tokens per window: --ctx, else the model's context up to 4096; never more than --max-tokens,
    which would evaluate a whole window beyond what was asked for."""
    if opts.ctx is not None and not 2 <= opts.ctx <= positions:
        raise QuantshipError(f"--ctx must be in 2..{positions} (the model's positions), got {opts.ctx}")
    if opts.max_tokens < 2:
        raise QuantshipError(f"--max-tokens must be at least 2, got {opts.max_tokens}")
    if opts.ctx is not None and opts.max_tokens < opts.ctx:
        raise QuantshipError(f"--max-tokens {opts.max_tokens} is less than one window of --ctx {opts.ctx} tokens; "
                             "raise --max-tokens or lower --ctx")
    return opts.ctx if opts.ctx is not None else min(positions, 4096, opts.max_tokens)
