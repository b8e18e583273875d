"""compressed-tensors checkpoints, the format llm-compressor writes and vLLM loads, both ways.

Config classes and int packing come from the `compressed-tensors` package itself, so what we
write is what its readers expect: `pack-quantized` (W4A16*, W8A16), `int-quantized` (W8A8) and
`float-quantized` (FP8_DYNAMIC, FP8_BLOCK), or `mixed-precision` when a plan mixes them. Reading
turns a Linear's stored tensors back into a QuantizedTensor (models/quantized.py runs it).

This format is the "checkpoint" the data flow starts from and the quantizer ends in (checkpoint →
models.loader → quant.pipeline → ...), so unlike the rest of formats/ it comes before models/: of
the project it imports only plain data (quantized_tensor.py, errors, files), and the loader reads and
the pipeline writes through it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantship.errors import QuantshipError
from quantship.files import file_mode
from quantship.quantized_tensor import ActivationQuant, QuantizedTensor, WeightQuant, block_grid, matches_target

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "mixed-precision")
SHARD_BYTES = 2 * 2**30  # a shard never grows past this
FLUSH_BYTES = 64 * 2**20  # at a layer boundary, pending tensors beyond this go to disk (bounds memory)


def quantization_args(scheme) -> dict:
    """compressed-tensors' QuantizationArgs of a scheme (quant/scheme.py's Scheme: weights, input_activations)."""
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


def quantization_config(groups: list[tuple], ignore: list[str]) -> dict:
    """groups: (Scheme, targets) pairs; targets are "Linear" or module names / `re:` patterns."""
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


def pack_tensors(q: QuantizedTensor, scheme, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
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


class CompressedTensorsReader:
    """A checkpoint's `quantization_config`, checked: finds the config group of a module and turns the
    module's stored tensors back into a QuantizedTensor."""

    def __init__(self, quantization_config: dict, source):
        self.config = quantization_config
        fmt = quantization_config.get("format")
        if quantization_config.get("quant_method") != "compressed-tensors":
            raise QuantshipError(f"unsupported quant_method {quantization_config.get('quant_method')!r}", source)
        if fmt not in FORMATS:
            raise QuantshipError(f"unsupported compressed-tensors format {fmt!r}", source)
        self.groups = _checked_groups(quantization_config.get("config_groups") or {}, source)
        self.source = source

    def scheme_for(self, module_name: str) -> dict | None:
        """The first config group that targets the module and quantizes weights (None: kept as it is)."""
        for group in self.groups:
            if any(matches_target(module_name, t) for t in group.get("targets", [])) and group.get("weights"):
                return group
        return None

    def read_linear(self, module_name: str, tensors: dict[str, torch.Tensor], keep_packed: bool = False,
                    where: Path | None = None) -> tuple[QuantizedTensor, ActivationQuant | None]:
        """One Linear's weight and how its inputs are quantized (None: weight-only). `tensors` are the
        module's own (`weight_scale`, `weight_packed`, ...); the weight's are consumed, a bias is left.
        keep_packed: weight-only packed integers come as their stored words (QuantizedTensor.packed_rows,
        values None) where every row is whole words, for a runtime that keeps them packed anyway.
        where: the file holding the tensors, named by errors about them (default: the config)."""
        group = self.scheme_for(module_name)
        if group is None:
            raise QuantshipError(f"{module_name} holds quantized tensors but no config group targets it", self.source)
        args = _weight_quant(group["weights"])
        acts = group.get("input_activations")
        activations = ActivationQuant(type=acts.get("type", "int"), group_size=acts.get("group_size")) if acts else None
        if args.strategy == "block":
            return self._read_blocks(module_name, tensors, args, where or self.source), activations
        return unpack(tensors, args, module_name, where or self.source, keep_packed and activations is None), \
            activations

    def _read_blocks(self, module_name: str, tensors: dict[str, torch.Tensor], args: WeightQuant, where
                     ) -> QuantizedTensor:
        if "weight" not in tensors:
            raise QuantshipError(f"{module_name}: FP8 block weights need a weight beside weight_scale", where)
        values, scale = tensors.pop("weight"), tensors.pop("weight_scale")
        expected = block_grid(tuple(values.shape), args.block)
        if values.dtype != torch.float8_e4m3fn or tuple(scale.shape) != expected:
            raise QuantshipError(f"{module_name}: FP8 block weights need float8_e4m3fn values and scales of "
                                 f"shape {list(expected)}, got {values.dtype} and {list(scale.shape)}", where)
        return QuantizedTensor(values, scale, None, args)


def _checked_groups(groups, source) -> list[dict]:
    """The config groups, each validated by compressed-tensors' own QuantizationArgs (types, strategies,
    group sizes), so that a malformed config is refused by name before any tensor is read."""
    from compressed_tensors.quantization import QuantizationArgs
    from pydantic import ValidationError

    if not isinstance(groups, dict):
        raise QuantshipError("quantization_config.config_groups must be an object", source)
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("targets", []), list):
            raise QuantshipError(f"config group {name!r} must be an object with a list of targets", source)
        for part in ("weights", "input_activations"):
            if group.get(part) is None:
                continue
            try:
                args = QuantizationArgs.model_validate(group[part])
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                raise QuantshipError(f"config group {name!r}, {part}{'.' + where if where else ''}: {first['msg']}",
                                     source) from None
            if args.type == "int" and not 2 <= args.num_bits <= 8:
                raise QuantshipError(f"config group {name!r}, {part}: integers of {args.num_bits} bits are not "
                                     "supported (2-8)", source)
    return list(groups.values())


def _weight_quant(weights: dict) -> WeightQuant:
    strategy = weights.get("strategy") or "tensor"
    block = None
    if strategy == "block":
        structure = weights.get("block_structure") or [128, 128]
        block = (int(structure[0]), int(structure[1]))
    return WeightQuant(int(weights.get("num_bits", 8)), weights.get("type", "int"),
                       bool(weights.get("symmetric", True)), strategy, weights.get("group_size"),
                       weights.get("actorder"), block)


def unpack(tensors: dict[str, torch.Tensor], args: WeightQuant, module_name: str = "", source=None,
           keep_packed: bool = False) -> QuantizedTensor:
    """The inverse of pack_tensors: a Linear's stored tensors (names relative to it, consumed) as integers
    (int8 holding intN) or float8 values, with their scales, zero points and g_idx, their shapes checked
    against each other and the config. keep_packed: see CompressedTensorsReader.read_linear."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    def refuse(problem: str):
        raise QuantshipError(f"{module_name}: {problem}", source)

    if "weight_scale" not in tensors or not ({"weight_packed", "weight"} & tensors.keys()):
        refuse("a quantized weight needs weight_scale and weight_packed (or weight)")
    packed = "weight_packed" in tensors
    per_word = 32 // args.num_bits if packed else 0
    rows = values = None
    if packed:
        if args.type != "int":
            refuse(f"weight_packed holds integers, but the config gives {args.type} weights")
        shape, words = _packed_shape(tensors, args, refuse)
        if keep_packed and "weight_g_idx" not in tensors and shape[1] % per_word == 0:
            rows = words  # unpacking to int8 and packing again was most of the time a W4A16 model took to load
        else:
            values = unpack_from_int32(words, args.num_bits, shape)
    else:
        values = tensors.pop("weight")
        if values.dim() != 2:
            refuse(f"weight must be 2-D, got shape {list(values.shape)}")
        shape = values.shape
    scale = _checked_scale(tensors.pop("weight_scale"), shape, args, refuse)
    zero = tensors.pop("weight_zero_point", None)
    if zero is not None:
        if packed:  # pack-quantized zero points are packed along the output dim
            expected = [-(-shape[0] // per_word), scale.shape[1]]
            if list(zero.shape) != expected:
                refuse(f"packed weight_zero_point has shape {list(zero.shape)}, the scales imply {expected}")
            zero = unpack_from_int32(zero, args.num_bits, scale.shape, packed_dim=0)
        if scale.shape[1] == 1 and zero.numel() in (1, shape[0]):  # per tensor, or per channel stored 1-D
            zero = zero.reshape(-1, 1).expand(shape[0], 1)
        if zero.shape != scale.shape:
            refuse(f"weight_zero_point has shape {list(zero.shape)}, weight_scale {list(scale.shape)}")
        zero = zero.to(torch.int8).contiguous()
    g_idx = tensors.pop("weight_g_idx", None)
    if g_idx is not None and (list(g_idx.shape) != [shape[1]] or g_idx.is_floating_point()
                              or int(g_idx.min()) < 0 or int(g_idx.max()) >= scale.shape[1]):
        refuse(f"weight_g_idx must hold {shape[1]} group indices below {scale.shape[1]}")
    return QuantizedTensor(values, scale, zero, args, g_idx, rows)


def _checked_scale(scale: torch.Tensor, shape: torch.Size, args: WeightQuant, refuse) -> torch.Tensor:
    """weight_scale as [out, groups]: a per-tensor scale becomes one per output (the same grid), one per
    channel stored 1-D a column, and the number of groups must be what the config's strategy and group
    size give for this weight."""
    if not scale.is_floating_point():
        refuse(f"weight_scale is stored as {scale.dtype}, scales must be floating point")
    if scale.numel() == 1 and args.strategy in ("tensor", "channel"):
        return scale.reshape(1, 1).expand(shape[0], 1).contiguous()
    if scale.dim() == 1 and scale.numel() == shape[0] and args.strategy == "channel":
        return scale.reshape(-1, 1)
    # (a group strategy has a positive group_size: the reader's config check made sure)
    groups = -(-shape[1] // args.group_size) if args.strategy == "group" else 1
    if list(scale.shape) != [shape[0], groups]:
        refuse(f"weight_scale has shape {list(scale.shape)}, the config implies {[shape[0], groups]} for a "
               f"weight of shape {list(shape)}")
    return scale


def _packed_shape(tensors: dict[str, torch.Tensor], args: WeightQuant, refuse) -> tuple[torch.Size, torch.Tensor]:
    """weight_shape and weight_packed (consumed), checked against each other."""
    stored_shape, words = tensors.pop("weight_shape", None), tensors.pop("weight_packed")
    if (stored_shape is None or stored_shape.numel() != 2 or stored_shape.is_floating_point()
            or int(stored_shape.min()) < 1):
        refuse("weight_shape must be two positive integers beside weight_packed")
    shape = torch.Size([int(v) for v in stored_shape.tolist()])
    expected = [shape[0], -(-shape[1] // (32 // args.num_bits))]
    if words.dtype != torch.int32 or list(words.shape) != expected:
        refuse(f"weight_packed must be int32 of shape {expected} for weight_shape {list(shape)}, "
               f"got {words.dtype} {list(words.shape)}")
    return shape, words
