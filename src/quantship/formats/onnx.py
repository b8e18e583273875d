"""`quantship export --format onnx`: a checkpoint (full precision, or quantized by quantship) to a
directory ONNX Runtime runs: a decoder with a KV cache (model.onnx + model.onnx.data), the tokenizer,
a genai_config.json, and SHA256SUMS.

Why the graph is built by hand with the `onnx` helper API rather than traced with torch.onnx: the
exporters trace one forward, and ours has data-dependent pieces they cannot capture faithfully
(sparse MoE dispatch, a growing cache object, packed int4 Linears that exist only as integers);
the dynamo exporter also needs onnxscript and changes with every torch release. A builder of a few
hundred lines (onnx_graph.py, onnx_layers.py, onnx_moe.py) mirrors models/ piece by piece, names
every node, emits `com.microsoft` MatMulNBits and QDQ pairs directly from quantship's integers, and
streams each layer's weights to the external data file as it is read (a model larger than memory
or than protobuf's 2 GB limit exports the same way). Parity with models/ is what the tests check.

Types: fp32, fp16 (float weights; a quantized source is dequantized), int4 (MatMulNBits), int8-dynamic
(QDQ, per-token activation scales computed at run time), int8-static (QDQ, per-tensor activation
scales calibrated on text beforehand, as onnxruntime's quantize_static does). Everything is written
into a temporary directory renamed into place at the end: a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from quantship import __version__
from quantship.errors import QuantshipError
from quantship.files import check_output_location, publish_directory, sha256_file
from quantship.formats.onnx_decoder import build_decoder, cache_names
from quantship.formats.onnx_graph import Graph
from quantship.formats.onnx_weights import TYPES, Encoder
from quantship.models.bundled import resolve_model
from quantship.models.config import ModelConfig
from quantship.models.loader import Checkpoint

MODEL_FILE, DATA_FILE = "model.onnx", "model.onnx.data"
INFO_FILE, GENAI_FILE, SUMS_FILE = "quantship_onnx.json", "genai_config.json", "SHA256SUMS"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "tokenizer.model")
JSON_NAMES = {str: "string", list: "list", dict: "object"}
GENAI_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass
class OnnxOptions:
    type: str = "fp32"
    calib: Path | None = None
    samples: int = 128
    seq_len: int = 512
    overwrite: bool = False


@dataclass
class OnnxExportResult:
    path: Path
    type: str
    architecture: str
    linears: dict[str, int]
    bytes: int
    seconds: float
    nodes: int
    calibration: dict = field(default_factory=dict)


def export_onnx(source: str | Path | None, output: str | Path, opts: OnnxOptions) -> OnnxExportResult:
    started = time.time()
    if opts.type not in TYPES:
        raise QuantshipError(f"unknown ONNX type {opts.type!r}; choose one of {', '.join(TYPES)}")
    ck = Checkpoint(resolve_model(source))
    output = Path(output)
    _check_output(output, opts.overwrite)
    if ck.quantized is not None and opts.type == "int8-static":
        raise QuantshipError("int8-static calibrates a full-precision model; this one is already quantized "
                             "(export it as int8-dynamic, int4 or fp32)", ck.path)
    encoder = Encoder(opts.type, source="quantized" if ck.quantized is not None else "float")
    calibration = {}
    if opts.type == "int8-static":
        from quantship.formats.onnx_calibrate import calibrate_ranges

        encoder.ranges, calibration = calibrate_ranges(ck, opts.calib, opts.samples, opts.seq_len)

    tmp = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        dtype = np.float16 if opts.type == "fp16" else np.float32
        g = Graph(tmp / DATA_FILE)
        try:
            build_decoder(ck, g, dtype, encoder)
        finally:
            g.data.close()
        model = g.finish("quantship", __version__, {"quantship.type": opts.type, "quantship.source": ck.path.name})
        onnx.save(model, tmp / MODEL_FILE)
        check_model(tmp / MODEL_FILE)
        _write_side_files(ck, tmp, opts.type, encoder.how, calibration)
        publish_directory(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in output.iterdir())
    return OnnxExportResult(output, opts.type, ck.config.architecture, dict(encoder.how), size,
                            round(time.time() - started, 2), len(model.graph.node), calibration)


def check_model(path: Path) -> None:
    """onnx.checker's full check (schemas, then shape inference) on the saved model and its data."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise QuantshipError(f"the exported graph fails onnx.checker ({' '.join(str(exc).split())[:300]})",
                             path) from None


def _check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise QuantshipError("output exists and is not a directory (ONNX exports are directories)", output)
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise QuantshipError("output directory exists and is not empty (pass --overwrite to replace it)", output)
    check_output_location(output, "ONNX export")


def genai_config(config: ModelConfig) -> dict:
    """ONNX Runtime GenAI's description of the decoder (its `model`/`search` keys); MLA's latent cache is
    named under `past_names`/`present_names`, which GenAI itself does not know (see the README)."""
    c = config
    if c.is_mla:
        inputs = {"past_names": "past_key_values.%d.latent"}
        outputs = {"present_names": "present.%d.latent"}
        heads = {"num_key_value_heads": 1, "head_size": c.kv_lora_rank + c.qk_rope_head_dim}
    else:
        inputs = {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
        outputs = {"present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
        heads = {"num_key_value_heads": c.num_key_value_heads, "head_size": c.llama_head_dim}
    eos = c.eos_token_id if c.eos_token_id is not None else 0
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": MODEL_FILE, "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_hidden_layers, **heads,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   **inputs},
        "outputs": {"logits": "logits", **outputs},
    }
    model = {"bos_token_id": c.bos_token_id if c.bos_token_id is not None else 0,
             "context_length": c.max_position_embeddings, "decoder": decoder, "eos_token_id": eos,
             "pad_token_id": eos[0] if isinstance(eos, list) else eos,
             "type": GENAI_TYPES.get(c.architecture, c.raw.get("model_type", "deepseek_v3")),
             "vocab_size": c.vocab_size}
    search = {"do_sample": False, "max_length": c.max_position_embeddings, "min_length": 0, "num_beams": 1,
              "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
              "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    return {"model": model, "search": search}


def _write_side_files(ck: Checkpoint, directory: Path, kind: str, how: dict, calibration: dict) -> None:
    config = {k: v for k, v in ck.config.raw.items() if k != "quantization_config"}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / GENAI_FILE).write_text(json.dumps(genai_config(ck.config), indent=2) + "\n")
    info = {"format": "onnx", "type": kind, "writer": f"quantship {__version__}", "source": str(ck.path),
            "architecture": ck.config.architecture, "cache": cache_names(ck.config), "linears": how}
    if calibration:
        info["calibration"] = calibration
    (directory / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (ck.path / name).is_file():
            shutil.copyfile(ck.path / name, directory / name)
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    (directory / SUMS_FILE).write_text("".join(f"{sha256_file(directory / n)}  {n}\n" for n in files))


def is_onnx_export(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / MODEL_FILE).is_file() and (path / INFO_FILE).is_file()


def onnx_info(path: str | Path) -> dict:
    """`quantship info` of an export directory, from its own files (quantship_onnx.json, config.json,
    the graph's inputs and operators); the weights in model.onnx.data are not read."""
    from collections import Counter

    from google.protobuf.message import DecodeError

    from quantship.models.config import load_config

    path = Path(path)
    try:
        written = json.loads((path / INFO_FILE).read_text(encoding="utf-8"))
        graph = onnx.load(str(path / MODEL_FILE), load_external_data=False).graph
    except (OSError, ValueError, DecodeError) as exc:
        raise QuantshipError(f"unreadable ONNX export ({exc})", path) from None
    expected = {"type": str, "writer": str, "source": str, "cache": list, "linears": dict}
    if not isinstance(written, dict):
        raise QuantshipError(f"{INFO_FILE} must hold an object", path)
    for key, kind in expected.items():
        if not isinstance(written.get(key, kind()), kind):
            raise QuantshipError(f"{INFO_FILE}: {key} must be a JSON {JSON_NAMES[kind]}", path)
    config = load_config(path)
    operators = Counter(node.op_type for node in graph.node)
    return {
        "path": str(path.resolve()), "format": "onnx", "type": written.get("type"),
        "architecture": config.architecture, "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position_embeddings,
        "size_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        "writer": written.get("writer"), "source": written.get("source"), "cache": written.get("cache"),
        "linears": written.get("linears"), "calibration": written.get("calibration"),
        "nodes": len(graph.node), "inputs": len(graph.input), "outputs": len(graph.output),
        "operators": dict(operators.most_common()),
    }


def summary_lines(result: OnnxExportResult) -> list[str]:
    how = ", ".join(f"{v} {k}" for k, v in sorted(result.linears.items(), key=lambda kv: -kv[1]))
    lines = [f"wrote {result.path}: ONNX {result.type} ({result.architecture}), {result.nodes} nodes, "
             f"{result.bytes / 2**20:.1f} MiB, {result.seconds:.1f}s",
             f"linears: {how}",
             "checked: onnx.checker full check passed"]
    if result.calibration:
        c = result.calibration
        lines.append(f"calibrated: {c['samples']} x {c['seq_len']} tokens of {c['source']}")
    lines.append(f"run it: onnxruntime.InferenceSession('{result.path / MODEL_FILE}') (inputs and cache names "
                 f"in {result.path / GENAI_FILE})")
    return lines
