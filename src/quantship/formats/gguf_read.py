"""Read a GGUF file (ours or llama.cpp's) as a model: config from its metadata, weights dequantized
block by block with gguf-py's own dequantizers, names and layouts mapped back to ours.

The result behaves like a Checkpoint for `verify`: `.config`, `.load_model(dtype, device)`.
Weights come back in float (llama.cpp computes with the dequantized values too), so what is
measured is exactly the file's numbers.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from quantship.errors import QuantshipError
from quantship.formats import gguf_blocks as blocks
from quantship.formats.gguf_layout import ROPE_FREQS, TensorSpec, model_params, ours_from_gguf, tensor_specs
from quantship.formats.gguf_metadata import config_from_gguf
from quantship.models.causal_lm import CausalLM, build_layer
from quantship.models.config import ModelConfig, config_from_dict


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def _field_value(field):
    """A reader field as a plain Python value (strings decoded, arrays as lists)."""
    if not field.types:
        return None
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if len(field.types) > 1 and field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]][0]
    if kind == gguf.GGUFValueType.FLOAT32:  # the shortest decimal that is this float32 (1e-06, not 9.99e-07)
        return float(str(value))
    return value.item()


class GGUFCheckpoint:
    """A GGUF file opened for reading (memory-mapped; tensors are dequantized when asked for)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as exc:
            raise QuantshipError(f"unreadable GGUF file ({exc})", self.path) from None
        skip = (gguf.Keys.Tokenizer.LIST, gguf.Keys.Tokenizer.MERGES, gguf.Keys.Tokenizer.TOKEN_TYPE,
                gguf.Keys.Tokenizer.SCORES)
        self.fields = {k: _field_value(f) for k, f in self.reader.fields.items() if k not in skip}
        self.tensors = {t.name: t for t in self.reader.tensors}
        try:
            raw = config_from_gguf(self.fields, lambda name: name in self.tensors)
            if not raw.get("vocab_size"):
                raw["vocab_size"] = int(self.tensors["token_embd.weight"].shape[1])
            self.config: ModelConfig = config_from_dict(raw, self.path)
        except (KeyError, TypeError) as exc:
            raise QuantshipError(f"GGUF metadata is missing {exc}", self.path) from None
        self._spec_cache: list[TensorSpec] | None = None
        self.quantized = None  # what Checkpoint calls a compressed-tensors reader; GGUF is read as floats
        self.file_type = self._file_type()

    def _file_type(self) -> str:
        value = self.fields.get(gguf.Keys.General.FILE_TYPE)
        try:
            return gguf.LlamaFileType(value).name.replace("MOSTLY_", "")
        except ValueError:
            return "unknown"

    def types(self) -> dict[str, str]:
        return {name: t.tensor_type.name for name, t in self.tensors.items()}

    def read(self, name: str) -> torch.Tensor:
        """One GGUF tensor dequantized to float32, in row-major (numpy) shape."""
        if name not in self.tensors:
            raise QuantshipError(f"tensor {name} is missing from the GGUF file", self.path)
        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        return blocks.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)

    def _specs(self) -> list[TensorSpec]:
        if self._spec_cache is None:
            self._spec_cache = tensor_specs(self.config, model_params(self.config))
        return self._spec_cache

    def state_dict(self, layer: int | None) -> dict[str, torch.Tensor]:
        """Our tensors (our names, our layouts) of one decoder layer, or of the outer part for None."""
        specs = [s for s in self._specs() if s.layer == layer]
        tensors = {}
        for spec in specs:
            t = self.read(spec.name)
            if tuple(t.shape) != spec.shape:
                raise QuantshipError(f"{spec.name} has shape {list(t.shape)}, the metadata implies {list(spec.shape)}",
                                     self.path)
            tensors[spec.name] = t
        ours = ours_from_gguf(specs, tensors)
        ours.pop(ROPE_FREQS, None)  # read back into the config (quantship.rope_scaling), not a weight
        return ours

    def load_model(self, dtype: torch.dtype = torch.float32, device="cpu") -> CausalLM:
        layers = []
        for i in range(self.config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            state = {k[len(prefix):]: v for k, v in self.state_dict(i).items()}
            with torch.device("meta"):
                layer = build_layer(self.config, i)
            layer.load_state_dict(state, strict=True, assign=True)
            layers.append(layer.to(device=device, dtype=dtype))
        with torch.device("meta"):
            model = CausalLM(self.config, layers=[])
        model.model.layers = nn.ModuleList(layers)
        outer = self.state_dict(None)
        if self.config.tie_word_embeddings:
            outer["lm_head.weight"] = outer["model.embed_tokens.weight"]
        for name, tensor in outer.items():
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr, nn.Parameter(tensor.to(device=device, dtype=dtype),
                                                                    requires_grad=False))
        if self.config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval().requires_grad_(False)


def gguf_info(path: str | Path) -> dict:
    """`quantship info` of a GGUF file: what llama.cpp reads (architecture, file type, tensor types,
    bits per weight, tokenizer) and the model quantship sees in it; nothing is dequantized."""
    ck = GGUFCheckpoint(path)
    c = ck.config
    parameters = sum(int(np.prod(t.shape)) for t in ck.tensors.values())
    weight_bytes = sum(int(t.n_bytes) for t in ck.tensors.values())
    types: dict[str, int] = {}
    for name in ck.types().values():
        types[name] = types.get(name, 0) + 1
    return {
        "path": str(ck.path.resolve()),
        "format": "gguf",
        "gguf_architecture": ck.fields.get(gguf.Keys.General.ARCHITECTURE),
        "architecture": c.architecture,
        "name": ck.fields.get(gguf.Keys.General.NAME),
        "file_type": ck.file_type,
        "parameters": parameters,
        "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "size_bytes": ck.path.stat().st_size,
        "bits_per_weight": 8 * weight_bytes / max(parameters, 1),
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1])),
        "tokenizer": {"model": ck.fields.get(gguf.Keys.Tokenizer.MODEL), "pre": ck.fields.get(gguf.Keys.Tokenizer.PRE),
                      "chat_template": gguf.Keys.Tokenizer.CHAT_TEMPLATE in ck.fields},
    }


def open_checkpoint(model: str | Path | None):
    """A model directory (or 'tiny') as a Checkpoint, or a .gguf file as a GGUFCheckpoint; (path, checkpoint)."""
    from quantship.models.bundled import resolve_model
    from quantship.models.loader import Checkpoint

    if model is not None and is_gguf(model):
        return Path(model), GGUFCheckpoint(model)
    path = resolve_model(model)
    return path, Checkpoint(path)
