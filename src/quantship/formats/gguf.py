"""`quantship export --format gguf`: a checkpoint (bf16, or quantized by quantship) to one GGUF file.

What each tensor becomes:
- From a quantship W4A16/W8A16 checkpoint whose grid is one of llama.cpp's (symmetric int4 group 32
  = Q4_0, asymmetric = Q4_1, int8 group 32 = Q8_0), the stored integers and scales are repacked:
  the file dequantizes to exactly our weights. attn_k_b, which llama.cpp wants transposed, cannot
  keep the grid; it is written exactly in F16 (F32 where F16 would round).
- Tensors a quantized source kept in full precision (embeddings, lm_head, routers, ignored Linears)
  stay in its dtype: the file then behaves like the checkpoint `verify` measured.
- Everything else is quantized here into the chosen type, tensor by tensor with llama.cpp's mix
  (gguf_mix.py): round-to-nearest, or GPTQ onto the same grid with `method="gptq"` (gguf_gptq.py).
The file is written layer by layer through gguf-py's GGUFWriter (tensor infos first, then data),
into a temporary file renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from quantship.errors import QuantshipError
from quantship.formats import gguf_blocks as blocks
from quantship.formats.gguf_layout import (
    ROPE_FREQS,
    TensorSpec,
    forward_rows,
    gguf_arch,
    model_params,
    rope_freq_factors,
    tensor_specs,
    to_gguf_layout,
)
from quantship.formats.gguf_metadata import add_metadata
from quantship.formats.gguf_mix import FILE_TYPES, ModelShape, choose_types
from quantship.formats.gguf_vocab import add_tokenizer
from quantship.models.bundled import resolve_model
from quantship.models.loader import Checkpoint
from quantship.quantized_tensor import QuantizedTensor

METHODS = ("rtn", "gptq")
_DTYPE_TYPES = {"bfloat16": T.BF16, "float16": T.F16, "float32": T.F32}


@dataclass
class GGUFOptions:
    type: str | None = None  # a key of FILE_TYPES; None = the source's lossless type, else Q4_K_M
    method: str = "rtn"
    calib: Path | None = None
    samples: int = 128
    seq_len: int = 512
    dampening: float = 0.01
    overwrite: bool = False
    pre_tokenizer: str | None = None  # llama.cpp's name, when it cannot be identified (gguf_pretok.py)
    imatrix: bool = False  # weigh RTN's rounding by an importance matrix from the calibration text


@dataclass
class Planned:
    spec: TensorSpec
    qtype: T
    how: str  # "packed" (lossless), "exact" (float copy of quantized values), "kept", "quantized", "f32"
    fallback_from: T | None = None


@dataclass
class ExportResult:
    path: Path
    file_type: str
    arch: str
    tensors: list[Planned]
    errors: dict[str, float] = field(default_factory=dict)  # GGUF name → relative error (0 = bit-exact)
    tokenizer: dict = field(default_factory=dict)
    seconds: float = 0.0
    bytes: int = 0
    method: str = "rtn"
    imatrix_tokens: int = 0  # calibration tokens behind the importance matrix (0: none used)
    imatrix_tensors: int = 0  # tensors whose rounding it weighed
    gptq: list[str] = field(default_factory=list)  # GGUF names of the tensors GPTQ rounded (method "gptq")


def export_gguf(source: str | Path | None, output: str | Path, opts: GGUFOptions) -> ExportResult:
    started = time.time()
    ck = Checkpoint(resolve_model(source))
    output = Path(output)
    _check_output(output, opts.overwrite)
    if opts.method not in METHODS:
        raise QuantshipError(f"unknown method {opts.method!r} for GGUF; choose one of {', '.join(METHODS)}")
    if opts.imatrix and opts.method == "gptq":
        raise QuantshipError("--imatrix weighs round-to-nearest; GPTQ already uses the full input Hessian")
    if opts.method == "gptq" and ck.quantized is not None:
        raise QuantshipError("--method gptq quantizes a full-precision model; this one is already quantized", ck.path)
    linears = _linears(ck)
    file_type = opts.type.upper().replace("-", "_") if opts.type else _default_type(ck, linears)
    if file_type not in FILE_TYPES:
        raise QuantshipError(f"unknown GGUF type {opts.type!r}; choose one of {', '.join(FILE_TYPES)}")
    specs = tensor_specs(ck.config, model_params(ck.config))
    plan = _plan(ck, specs, linears, file_type)
    if opts.method == "gptq":
        from quantship.formats.gguf_gptq import output_last

        plan = output_last(plan, ck.config)  # its Hessian is known only once every layer has run
    imatrix = None
    if opts.imatrix:
        from quantship.formats.gguf_imatrix import collect_imatrix

        imatrix = collect_imatrix(ck, opts.calib, opts.samples, opts.seq_len)

    tmp = output.parent / f".{output.name}.partial-{os.getpid()}"
    gptq_names: set[str] = set()
    writer = gguf.GGUFWriter(tmp, gguf_arch(ck.config))
    try:
        add_metadata(writer, ck.config, ck.path.name, file_type)
        tokenizer = add_tokenizer(writer, ck.path, ck.config.vocab_size, opts.pre_tokenizer)
        if imatrix is not None:  # the keys llama-quantize writes for an imatrix
            writer.add_string("quantize.imatrix.file", f"quantship calibration pass on {imatrix.dataset}")
            writer.add_string("quantize.imatrix.dataset", imatrix.dataset)
            writer.add_int32("quantize.imatrix.entries_count", len(imatrix.columns))
            writer.add_int32("quantize.imatrix.chunks_count", imatrix.chunks)
        for p in plan:
            writer.add_tensor_info(p.spec.name, p.spec.shape, np.dtype(np.float32), _nbytes(p), raw_dtype=p.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if opts.method == "gptq":
            from quantship.formats.gguf_gptq import gptq_tensors

            produced = gptq_tensors(ck, plan, opts, gptq_names)
        else:
            produced = _rtn_tensors(ck, plan, imatrix)
        errors: dict[str, float] = {}
        for p, data, reference in produced:
            writer.write_tensor_data(data)
            if p.spec.is_matrix:
                errors[p.spec.name] = _relative_error(data, p.qtype, reference)
        writer.close()
        os.replace(tmp, output)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return ExportResult(output, file_type, gguf_arch(ck.config), plan, errors, tokenizer,
                        round(time.time() - started, 2), output.stat().st_size, opts.method,
                        imatrix.tokens if imatrix is not None else 0,
                        sum(p.qtype in blocks.IMATRIX_TYPES and importance(p, imatrix) is not None for p in plan),
                        sorted(gptq_names))


def _check_output(output: Path, overwrite: bool) -> None:
    if output.is_dir():
        raise QuantshipError("output is a directory; give a file name ending in .gguf", output)
    if output.suffix != ".gguf":
        raise QuantshipError("output file name must end in .gguf", output)
    if output.exists() and not overwrite:
        raise QuantshipError("output file exists (pass --overwrite to replace it)", output)
    if not output.parent.is_dir():
        raise QuantshipError("output directory does not exist", output.parent)


@dataclass(frozen=True)
class Grid:
    """How the source checkpoint stores one Linear quantized (from its config groups)."""

    bits: int
    symmetric: bool
    group: int  # columns per scale; the row length for per-channel
    weight_only: bool = True
    integer: bool = True
    act_order_groups: bool = False


def lossless_type(grid: Grid | None) -> T | None:
    """The GGUF type whose blocks hold this grid exactly, if there is one."""
    if grid is None or not (grid.integer and grid.weight_only) or grid.act_order_groups or grid.group != 32:
        return None
    return {(4, True): T.Q4_0, (4, False): T.Q4_1, (8, True): T.Q8_0}.get((grid.bits, grid.symmetric))


def _linears(ck: Checkpoint) -> dict[str, tuple[tuple[int, int], Grid | None]]:
    """Every Linear weight of the decoder layers → ([out, in], its grid when stored quantized).
    Layers are built on the meta device: shapes without reading any weight."""
    from quantship.models.causal_lm import build_layer

    out = {}
    for i in range(ck.config.num_hidden_layers):
        with torch.device("meta"):
            layer = build_layer(ck.config, i)
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                full = f"model.layers.{i}.{name}"
                grid = _grid(ck, full, module.in_features) if f"{full}.weight_scale" in ck.files else None
                out[full + ".weight"] = ((module.out_features, module.in_features), grid)
    return out


def _grid(ck: Checkpoint, module: str, in_features: int) -> Grid:
    group = ck.quantized.scheme_for(module) or {}
    w = group.get("weights") or {}
    width = w.get("group_size") if w.get("strategy") == "group" else in_features
    return Grid(int(w.get("num_bits", 0)), bool(w.get("symmetric", True)), int(width or in_features),
                weight_only=not group.get("input_activations"), integer=w.get("type", "int") == "int",
                act_order_groups=w.get("actorder") == "group")


def _default_type(ck: Checkpoint, linears: dict) -> str:
    if ck.quantized is None:
        return "Q4_K_M"
    kinds = {lossless_type(grid) for _, grid in linears.values() if grid is not None}
    if len(kinds) == 1 and None not in kinds:
        return next(iter(kinds)).name
    raise QuantshipError("this quantized checkpoint has no GGUF type that holds its grid exactly (that takes "
                         "W4A16/W4A16_ASYM/W8A16 with --group-size 32); pass --type to re-quantize it", ck.path)


def _f16_holds(ck: Checkpoint, module: str, grid: Grid) -> bool:
    """Whether every value a quantized Linear can hold (integer x its bf16 scale) is exact in F16."""
    scale = ck.read([f"{module}.weight_scale"])[f"{module}.weight_scale"].float().reshape(-1, 1)
    low, high = -(1 << (grid.bits - 1)), (1 << (grid.bits - 1)) - 1
    if not grid.symmetric:  # q - z spans twice the range
        low, high = low - high, high - low
    steps = scale * torch.arange(low, high + 1, dtype=torch.float32)
    return torch.equal(steps.half().float(), steps)


def _plan(ck: Checkpoint, specs: list[TensorSpec], linears: dict, file_type: str) -> list[Planned]:
    c = ck.config
    shape = ModelShape(gguf_arch(c), c.num_hidden_layers, c.n_routed_experts, c.num_attention_heads,
                       c.num_key_value_heads)
    choices = choose_types({s.name: (s.shape[-1], len(s.shape)) for s in specs}, file_type, shape)
    source_type = _DTYPE_TYPES.get(c.torch_dtype, T.BF16)
    plan = []
    for spec in specs:
        choice = choices.get(spec.name)
        if choice is None:  # norms, router, biases: F32 as llama.cpp keeps them
            plan.append(Planned(spec, T.F32, "f32"))
            continue
        grids = [linears[s][1] if s in linears else None for s in spec.sources]
        if ck.quantized is not None and None in grids:
            plan.append(Planned(spec, source_type, "kept"))  # the source chose full precision here
        elif lossless_type(grids[0]) == choice.qtype:
            if spec.transform != "k_b":
                plan.append(Planned(spec, choice.qtype, "packed"))
            else:  # the transpose leaves the grid: store the values themselves, exactly
                exact = T.F16 if _f16_holds(ck, spec.sources[0][: -len(".weight")], grids[0]) else T.F32
                plan.append(Planned(spec, exact, "exact"))
        else:
            plan.append(Planned(spec, choice.qtype, "quantized", choice.fallback_from))
    return plan


def _nbytes(p: Planned) -> int:
    count = int(np.prod(p.spec.shape))
    block, size = gguf.GGML_QUANT_SIZES[p.qtype]
    return count // block * size


# --- producing the data -----------------------------------------------------------------------

def _unpack(ck: Checkpoint, module: str, state: dict[str, torch.Tensor]) -> QuantizedTensor:
    """A quantized Linear's stored tensors (consumed) → its integers and float32 scales."""
    q, _ = ck.quantized.read_linear(module, state)
    return dataclasses.replace(q, scale=q.scale.float())


def source_layers(ck: Checkpoint):
    """(layer index or None for the outer tensors, {our full name: float tensor or QuantizedTensor})."""
    outer = {k: v.float() for k, v in ck.outer_state().items()}
    if ck.config.rope.type == "llama3":
        outer[ROPE_FREQS] = rope_freq_factors(ck.config)
    yield None, outer
    for i in range(ck.config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        state = ck.layer_state(i)
        tensors: dict[str, object] = {}
        for module in sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_scale")}):
            local = {k[len(module) + 1:]: state.pop(k) for k in list(state) if k.startswith(module + ".")}
            tensors[f"{prefix}{module}.weight"] = _unpack(ck, prefix + module, local)
        tensors.update({prefix + k: v.float() for k, v in state.items()})
        yield i, tensors


def _group(plan: list[Planned], layer: int | None) -> list[Planned]:
    return [p for p in plan if p.spec.layer == layer]


def float_weight(source) -> torch.Tensor:
    return source.dequantize() if isinstance(source, QuantizedTensor) else source.float()


def reference(p: Planned, tensors: dict, config) -> torch.Tensor:
    """The spec's tensor in float32, in GGUF layout: what the file must reproduce."""
    parts = [to_gguf_layout(p.spec, float_weight(tensors[s]), config) for s in p.spec.sources]
    return torch.stack(parts) if p.spec.transform == "stack" else parts[0]


def encode(p: Planned, tensors: dict, config, ref: torch.Tensor, imatrix=None) -> np.ndarray:
    if p.how != "packed":
        return blocks.quantize(ref, p.qtype, importance(p, imatrix))
    packed = [_pack(p, tensors[s], config) for s in p.spec.sources]
    return np.stack(packed) if p.spec.transform == "stack" else packed[0]


def _pack(p: Planned, stored: QuantizedTensor, config) -> np.ndarray:
    values, scale, zero = stored.values, stored.scale, stored.zero_point
    rows = forward_rows(p.spec, config, values.shape[0])
    if rows is not None:
        values, scale, zero = values[rows], scale[rows], None if zero is None else zero[rows]
    if p.qtype == T.Q4_0:
        data = blocks.pack_q4_0(values, scale)
    elif p.qtype == T.Q4_1:
        data = blocks.pack_q4_1(values, scale, zero)
    else:
        data = blocks.pack_q8_0(values, scale)
    return data.reshape(*p.spec.shape[:-1], -1) if p.spec.transform != "stack" else data


def importance(p: Planned, imatrix) -> torch.Tensor | None:
    """The imatrix rows for a tensor quantized here, in its column order; None where there is none."""
    if imatrix is None or p.how != "quantized" or p.spec.transform == "k_b":
        return None  # attn_k_b's columns are per-head query dims, which no Linear of ours reads
    return imatrix.for_sources(p.spec.sources)


def _rtn_tensors(ck: Checkpoint, plan: list[Planned], imatrix=None):
    for layer, tensors in source_layers(ck):
        for p in _group(plan, layer):
            ref = reference(p, tensors, ck.config)
            yield p, encode(p, tensors, ck.config, ref, imatrix), ref


def _relative_error(data: np.ndarray, qtype: T, ref: torch.Tensor) -> float:
    got = blocks.dequantize(data, qtype).reshape(ref.shape)
    if torch.equal(got, ref):
        return 0.0
    return float((got - ref).norm() / ref.norm().clamp(min=1e-30))


def summary_lines(result: ExportResult) -> list[str]:
    counts: dict[str, int] = {}
    for p in result.tensors:
        counts[p.qtype.name] = counts.get(p.qtype.name, 0) + 1
    mix = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    lines = [f"wrote {result.path}: GGUF {result.file_type} ({result.arch}), {len(result.tensors)} tensors "
             f"({mix}), {result.bytes / 2**20:.1f} MiB, {result.seconds:.1f}s"]
    mapped = [p for p in result.tensors if p.how in ("packed", "exact")]
    if mapped:
        same = sum(result.errors.get(p.spec.name) == 0.0 for p in mapped)
        lines.append(f"lossless: {same} of {len(mapped)} quantized tensors dequantize bit for bit to the checkpoint's "
                     "weights (its integers repacked into llama.cpp's blocks)")
    exact = [p for p in result.tensors if p.how == "exact"]
    if exact:
        types = "/".join(sorted({p.qtype.name for p in exact}))
        lines.append(f"attn_k_b ({len(exact)} tensors): transposed for llama.cpp's MLA, so off the checkpoint's grid; "
                     f"its values stored exactly in {types}")
    requantized = [p for p in result.tensors if p.how == "quantized"]
    if requantized:
        errs = [result.errors[p.spec.name] for p in requantized if p.spec.name in result.errors]
        how = "GPTQ" if result.method == "gptq" else "round-to-nearest"
        if result.imatrix_tokens:
            how += f", {result.imatrix_tensors} weighted by an imatrix of {result.imatrix_tokens} calibration tokens"
        lines.append(f"quantized here ({how}): {len(requantized)} tensors, relative weight error "
                     f"median {np.median(errs):.4f}, max {max(errs):.4f}")
        if result.method == "gptq":
            rtn = sorted(p.spec.name for p in requantized if p.spec.name not in result.gptq)
            lines.append(f"GPTQ: {len(result.gptq)} tensors (attn_k_b per head on its query: "
                         f"{sum('attn_k_b' in n for n in result.gptq)}; output matrix: "
                         f"{'yes' if {'output.weight', 'token_embd.weight'} & set(result.gptq) else 'no'}); "
                         f"round-to-nearest: {', '.join(rtn) if rtn else 'none'}")
    kept = [p for p in result.tensors if p.how == "kept"]
    if kept:
        lines.append(f"kept as the checkpoint stores them ({kept[0].qtype.name}): "
                     + ", ".join(sorted({p.spec.name.split('.', 2)[-1] if p.spec.layer is not None else p.spec.name
                                         for p in kept})))
    falls: dict[tuple, list[str]] = {}
    for p in result.tensors:
        if p.fallback_from is not None:
            falls.setdefault((p.fallback_from.name, p.qtype.name, p.spec.shape[-1]), []).append(p.spec.name)
    for (old, new, cols), names in sorted(falls.items()):
        lines.append(f"fallback {old} -> {new} (row length {cols} is not a multiple of {blocks.block_size(T[old])}): "
                     f"{len(names)} tensors, e.g. {names[0]}")
    t = result.tokenizer
    how = {"hash": "by its probe hash", "splits": "by its splits", "override": "as given"}.get(t.get("pre_how"), "")
    lines.append(f"tokenizer: gpt2 BPE, pre-tokenizer {t['pre']} ({how}), {t['tokens']} tokens, {t['merges']} merges"
                 + (", chat template" if t.get("chat_template") else ""))
    lines.append(f"run it: llama-server -m {result.path}")
    return lines

