"""Write compressed-tensors checkpoints, the format llm-compressor writes and vLLM loads.

Config classes and int packing come from the `compressed-tensors` package itself, so what we
write is what its readers expect: `pack-quantized` (W4A16*, W8A16), `int-quantized` (W8A8) and
`float-quantized` (FP8_DYNAMIC, FP8_BLOCK), or `mixed-precision` when a plan mixes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantship.files import file_mode
from quantship.quant.rtn import QuantizedTensor
from quantship.quant.scheme import Scheme

SHARD_BYTES = 2 * 2**30  # a shard never grows past this
FLUSH_BYTES = 64 * 2**20  # at a layer boundary, pending tensors beyond this go to disk (bounds memory)


def quantization_args(scheme: Scheme) -> dict:
    from compressed_tensors.quantization import QuantizationArgs

    w = scheme.weights
    weights = QuantizationArgs(num_bits=w.num_bits, type=w.type, symmetric=w.symmetric, strategy=w.strategy,
                               group_size=w.group_size if w.strategy == "group" else None,
                               block_structure=list(w.block) if w.strategy == "block" else None,
                               actorder=w.actorder if w.actorder else None, dynamic=False)
    acts = None
    if scheme.input_activations is not None:
        a = scheme.input_activations
        acts = QuantizationArgs(num_bits=a.num_bits, type=a.type, symmetric=a.symmetric, strategy=a.strategy,
                                group_size=a.group_size, dynamic=a.dynamic)
    return {"weights": weights, "input_activations": acts}


def quantization_config(groups: list[tuple[Scheme, list[str]]], ignore: list[str]) -> dict:
    """groups: (scheme, targets) pairs; targets are "Linear" or module names / `re:` patterns."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    formats = {scheme.format for scheme, _ in groups}
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
    # Under mixed-precision each group names its own format, which is how readers pick a decompressor.
    config_groups = {
        f"group_{i}": QuantizationScheme(targets=targets, **quantization_args(scheme),
                                         format=scheme.format if fmt == "mixed-precision" else None)
        for i, (scheme, targets) in enumerate(groups)
    }
    config = QuantizationConfig(config_groups=config_groups, ignore=list(ignore), format=fmt,
                                quantization_status="compressed")
    dumped = config.model_dump(exclude_none=True)
    for group in dumped["config_groups"].values():
        group.setdefault("input_activations", None)  # weight-only, spelled out as vLLM's configs do
    return dumped


def pack_tensors(q: QuantizedTensor, scheme: Scheme, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A quantized Linear's tensors under compressed-tensors' names (relative to the module)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    if q.args.strategy == "block":
        scale_dtype = torch.float32  # block scales stay float32, as DeepSeek's and vLLM's are
    out = {"weight_scale": q.scale.to(scale_dtype).contiguous()}
    if scheme.format == "pack-quantized":
        out["weight_packed"] = pack_to_int32(q.values, q.args.num_bits)  # on the values' device: fast on GPU
        out["weight_shape"] = torch.tensor(list(q.values.shape), dtype=torch.int64)
        if q.zero_point is not None:
            out["weight_zero_point"] = pack_to_int32(q.zero_point.to(torch.int8), q.args.num_bits, packed_dim=0)
    else:
        out["weight"] = q.values.contiguous()
        if q.zero_point is not None:
            out["weight_zero_point"] = q.zero_point.to(torch.int8)
    if q.g_idx is not None:
        out["weight_g_idx"] = q.g_idx.to(torch.int32)
    return {k: v.cpu().contiguous() for k, v in out.items()}


class ShardWriter:
    """Writes tensors into size-capped safetensors shards as they arrive, then the index.

    Shards get their final `model-0000i-of-0000N` names only at the end, when N is known.
    """

    def __init__(self, directory: Path, shard_bytes: int = SHARD_BYTES, flush_bytes: int = FLUSH_BYTES):
        self.directory, self.shard_bytes, self.flush_bytes = directory, shard_bytes, flush_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor.detach().cpu().contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def end_of_layer(self) -> None:
        """Called between layers: what is pending is written once it is worth a shard of its own."""
        if self.pending_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.directory / f"shard-{len(self.shards):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        os.chmod(path, file_mode())  # safetensors writes 0600; pods reading the model run as another user
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        self.flush()
        weight_map = {}
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(path, self.directory / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return len(self.shards)
