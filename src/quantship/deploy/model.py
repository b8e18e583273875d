"""What a deployment needs to know about a model: name, size on disk, context, quantization.

MODEL is a checkpoint directory, `tiny`, or a *description*: a directory holding only config.json
(e.g. DeepSeek-V3's), so manifests for a 671B model can be made and checked on a laptop. A
description's size is estimated from the parameter count and the bits its quantization_config
stores per weight, unless the caller states it (`--size-gb`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from quantship.errors import QuantshipError
from quantship.models.bundled import TINY_DIR, resolve_model
from quantship.models.config import ModelConfig, load_config

RECIPE_FILE = "quantship_recipe.json"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
# Files that make up a served model: weights, configs, tokenizer. Texts, reports and READMEs are not.
MODEL_FILE_PATTERNS = ("*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.jinja", "merges.txt",
                       "vocab.txt")


@dataclass
class ModelFacts:
    name: str  # DNS-1123 name for every object and the served model name
    source: str
    architecture: str
    parameters: int
    size_bytes: int
    size_source: str  # "weights on disk", "estimated from config.json", "--size-gb"
    max_position_embeddings: int
    num_attention_heads: int
    quant_method: str | None  # "compressed-tensors", "fp8", ... or None for the original dtype
    quant_format: str | None  # e.g. "pack-quantized"
    writer_version: str | None  # quantship version that wrote the checkpoint (its recipe), if any
    files: list[str] = field(default_factory=list)  # relative paths covered by SHA256SUMS: the whole directory

    @property
    def checkpoint_format(self) -> str:
        return format_name(self.quant_method, self.quant_format)


def format_name(quant_method: str | None, quant_format: str | None) -> str:
    if not quant_method:
        return "safetensors"
    return f"{quant_method}/{quant_format}" if quant_format else quant_method


def checkpoint_identity(path: Path) -> tuple[str, str | None]:
    """(format, writer version) from config.json and the recipe alone: no weight is opened, so a
    corrupted shard still gets a verdict instead of a load error. An ONNX export is 'onnx/<type>'."""
    onnx_info = path / "quantship_onnx.json"
    if onnx_info.is_file() and (path / "model.onnx").is_file():
        try:
            info = json.loads(onnx_info.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QuantshipError(f"malformed ONNX export description ({exc})", onnx_info) from None
        writer = str(info.get("writer", ""))
        return f"onnx/{info.get('type', 'fp32')}", writer.split(" ", 1)[1] if writer.startswith("quantship ") else None
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantshipError(f"unreadable config.json ({exc})", path) from None
    qconfig = raw.get("quantization_config") or {}
    return format_name(qconfig.get("quant_method"), qconfig.get("format")), _writer_version(path)


def k8s_name(text: str) -> str:
    """A DNS-1123 label short enough for suffixes like '-model-cache' (63 characters in all)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name)[:40].rstrip("-")
    if not name or not name[0].isalpha():
        name = f"model-{name}".rstrip("-")
    return name


def model_files(path: Path) -> list[str]:
    found = {p for pattern in MODEL_FILE_PATTERNS for p in path.glob(pattern) if p.is_file()}
    return sorted(p.relative_to(path).as_posix() for p in found)


def directory_files(path: Path) -> list[str]:
    """Every file SHA256SUMS covers: all of the directory but hidden entries (.git, .cache) and the
    sums themselves, so a file added after the deploy (a pickle a loader might prefer) shows up."""
    found = [p.relative_to(path) for p in path.rglob("*") if p.is_file()]
    return sorted(p.as_posix() for p in found if not any(part.startswith(".") for part in p.parts)
                  and p.as_posix() not in ("SHA256SUMS", "quantship-manifest.json"))


def has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()


def _layer_parameters(config: ModelConfig) -> int:
    """Parameters of all decoder layers, counted on meta-device copies of one layer per kind, so a
    61-layer, 256-expert description costs two layer constructions instead of a whole model."""
    import torch

    from quantship.models.causal_lm import build_layer

    per_kind: dict[bool, int] = {}
    total = 0
    for i in range(config.num_hidden_layers):
        kind = config.is_moe_layer(i)
        if kind not in per_kind:
            with torch.device("meta"):
                per_kind[kind] = sum(p.numel() for p in build_layer(config, i).parameters())
        total += per_kind[kind]
    return total


def count_parameters(config: ModelConfig) -> tuple[int, int]:
    """(decoder-layer parameters, the rest: embeddings, final norm, lm_head)."""
    outside = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2) + config.hidden_size
    return _layer_parameters(config), outside


def _stored_bits(qconfig: dict | None, dtype_bits: int) -> float:
    """Bits per stored decoder weight: the widest config group's bits plus its scales."""
    if not qconfig:
        return dtype_bits
    if qconfig.get("quant_method") == "fp8":
        return 8.0
    bits = []
    for group in (qconfig.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        scale_bits = 16 / w["group_size"] if w.get("strategy") == "group" and w.get("group_size") else 0.0
        bits.append(float(w.get("num_bits", dtype_bits)) + scale_bits)
    return max(bits) if bits else dtype_bits


def estimate_size(config: ModelConfig) -> tuple[int, int]:
    """(bytes, parameters) of a checkpoint described only by its config: decoder weights at the
    quantized width, embeddings and lm_head in the model dtype (quantizers leave them alone)."""
    layers, outside = count_parameters(config)
    dtype_bytes = DTYPE_BYTES.get(config.torch_dtype.replace("torch.", ""), 2)
    bits = _stored_bits(config.raw.get("quantization_config"), dtype_bytes * 8)
    return int(layers * bits / 8 + outside * dtype_bytes), layers + outside


def _writer_version(path: Path) -> str | None:
    recipe = path / RECIPE_FILE
    if not recipe.is_file():
        return None
    try:
        return str(json.loads(recipe.read_text(encoding="utf-8"))["quantship_version"])
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise QuantshipError(f"malformed recipe ({exc})", recipe) from None


def read_model(model: str | Path, name: str | None = None, size_gb: float | None = None) -> ModelFacts:
    path = resolve_model(model)
    bundled = path.resolve() == TINY_DIR.resolve()
    if has_weights(path):
        from quantship.models.info import model_info

        info = model_info(path)
        parameters, size, size_source = info["parameters"], info["size_bytes"], "weights on disk"
        config = load_config(path)
    else:
        config = load_config(path)
        size, parameters = estimate_size(config)
        size_source = "estimated from config.json"
    if size_gb is not None:
        if not 0 < size_gb < 1e9:  # also refuses NaN and infinity
            raise QuantshipError(f"--size-gb must be a positive number of gigabytes, got {size_gb}")
        size, size_source = int(size_gb * 1e9), "--size-gb"
    if name is not None and k8s_name(name) != name:
        raise QuantshipError(f"--name {name!r} is not a DNS-1123 label of at most 40 characters "
                             f"(lowercase letters, digits, '-'; e.g. {k8s_name(name)!r})")
    qconfig = config.raw.get("quantization_config") or {}
    return ModelFacts(
        name=name or k8s_name("tiny" if bundled else path.resolve().name),
        source="tiny" if bundled else str(path.resolve()),
        architecture=config.architecture,
        parameters=parameters,
        size_bytes=size,
        size_source=size_source,
        max_position_embeddings=config.max_position_embeddings,
        num_attention_heads=config.num_attention_heads,
        quant_method=qconfig.get("quant_method"),
        quant_format=qconfig.get("format"),
        writer_version=_writer_version(path),
        files=directory_files(path),
    )
