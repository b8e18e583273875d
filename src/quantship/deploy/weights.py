"""Weight memory of a model under a quantization scheme, as the engine holds it: each decoder layer is
built on the meta device with the runtime Linear the loader would make (PackedLinear, QuantLinear,
Fp8BlockLinear) and measured with the engine's own `weight_bytes`, so no arithmetic is repeated and
no weight is read. A scheme is a preset name (W4A16, ...), "BF16" for the unquantized model, or None
for the checkpoint as stored (its own quantization_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from quantship.engine.memory import int4_decode_copy
from quantship.errors import QuantshipError
from quantship.formats.compressed_tensors import CompressedTensorsReader
from quantship.models.config import ModelConfig
from quantship.models.loader import ABSORBED
from quantship.models.quantized import quant_linear, weight_bytes
from quantship.quant.scheme import DEFAULT_IGNORE, PRESETS, get_scheme, is_ignored

UNQUANTIZED = "BF16"
# The schemes `quantship capacity` lists: what quantize writes and the engine serves.
LISTED = (UNQUANTIZED, "W8A16", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "W4A16", "W4A16_ASYM")


@dataclass(frozen=True)
class Spec:
    """One Linear's stored form: compressed-tensors `weights` args plus whether activations are quantized."""

    bits: int
    type: str = "int"
    strategy: str = "group"
    group_size: int | None = None
    symmetric: bool = True
    block: tuple[int, int] | None = None
    activations: str | None = None  # None, "int", "float"


@dataclass(frozen=True)
class WeightMemory:
    scheme: str
    weight_bytes: int  # everything the engine holds once loaded
    decode_copy_bytes: int  # int4 tinygemm copies made at the first CUDA decode (bf16 only)
    description: str
    routed_expert_bytes: int = 0  # of weight_bytes: routed experts (a decode step reads only those chosen)
    embedding_bytes: int = 0  # of weight_bytes: the input embedding (a step reads only its tokens' rows)
    dequantize_bytes: int = 0  # the largest packed Linear (merged as served) dequantized: a CUDA step's transient
    router_float32_bytes: int = 0  # the MoE routers' float32 weights the engine holds beside them on CUDA
    expert_dequantize_bytes: int = 0  # packed routed experts a CUDA prefill step dequantizes at once (fused MoE)


def _spec_from_group(group: dict) -> Spec:
    w, acts = group.get("weights") or {}, group.get("input_activations")
    block = w.get("block_structure")
    return Spec(bits=int(w.get("num_bits", 8)), type=w.get("type", "int"), strategy=w.get("strategy", "group"),
                group_size=w.get("group_size"), symmetric=bool(w.get("symmetric", True)),
                block=tuple(block) if block else ((128, 128) if w.get("strategy") == "block" else None),
                activations=acts.get("type", "int") if acts else None)


def _spec_from_scheme(name: str, in_features: int) -> Spec:
    scheme = get_scheme(name).fitted_to(in_features)
    w, acts = scheme.weights, scheme.input_activations
    return Spec(bits=w.num_bits, type=w.type, strategy=w.strategy, group_size=w.group_size, symmetric=w.symmetric,
                block=w.block, activations=acts.type if acts else None)


def runtime_linear(linear: nn.Linear, spec: Spec, dtype: torch.dtype) -> nn.Module:
    """The module the loader builds for this Linear under `spec`, on the meta device."""
    out, inp = linear.out_features, linear.in_features
    with torch.device("meta"):
        if spec.strategy == "block":
            from quantship.models.fp8_block import Fp8BlockLinear, block_grid

            return Fp8BlockLinear(torch.empty(out, inp, dtype=torch.float8_e4m3fn),
                                  torch.empty(block_grid((out, inp), spec.block), dtype=torch.float32), spec.block)
        values = torch.empty(out, inp, dtype=torch.float8_e4m3fn if spec.type == "float" else torch.int8)
        groups = inp // spec.group_size if spec.strategy == "group" and spec.group_size else 1
        scale = torch.empty(out, groups, dtype=dtype)
        zero = None if spec.symmetric else torch.empty(out, groups, dtype=torch.int8)
        return quant_linear(values, scale, zero, activations=spec.activations, bits=spec.bits)


class _Assigner:
    """Which Spec (or None: left in the model dtype) each decoder Linear gets."""

    def __init__(self, config: ModelConfig, scheme: str | None, source):
        self.scheme, self.reader, self.ignore = scheme, None, DEFAULT_IGNORE
        qconfig = config.raw.get("quantization_config") or {}
        if scheme is None and qconfig.get("quant_method") == "compressed-tensors":
            self.reader = CompressedTensorsReader(qconfig, source)
            self.ignore = tuple(qconfig.get("ignore") or ())

    def __call__(self, name: str, linear: nn.Linear) -> Spec | None:
        if is_ignored(name, self.ignore) or name.endswith(ABSORBED):  # the loader dequantizes MLA's kv_b_proj
            return None
        if self.reader is not None:
            group = self.reader.scheme_for(name)
            return _spec_from_group(group) if group else None
        if self.scheme in (None, UNQUANTIZED):
            return None
        return _spec_from_scheme(self.scheme, linear.in_features)


def describe(config: ModelConfig, scheme: str | None, dtype: torch.dtype) -> str:
    qconfig = config.raw.get("quantization_config") or {}
    if scheme == UNQUANTIZED or (scheme is None and not qconfig):
        return f"unquantized ({str(dtype).replace('torch.', '')})"
    if scheme is not None:
        return scheme
    if qconfig.get("quant_method") == "fp8":
        return "as stored: FP8 block source, dequantized when loaded"
    if qconfig.get("quant_method") == "compressed-tensors":
        return "as stored: compressed-tensors " + str(qconfig.get("format"))
    return f"as stored: {qconfig.get('quant_method')}"


def weight_memory(config: ModelConfig, scheme: str | None, dtype: torch.dtype, source=None) -> WeightMemory:
    """Bytes the engine holds for this model (embeddings, norms and lm_head in `dtype`)."""
    from quantship.models.causal_lm import CausalLM, build_layer

    if scheme is not None and scheme != UNQUANTIZED:
        if scheme.upper().replace("-", "_") not in PRESETS:
            raise QuantshipError(f"--scheme {scheme!r}: choose one of {', '.join(LISTED)} (or leave it out for "
                                 "the checkpoint as stored)")
        scheme = scheme.upper().replace("-", "_")
    assign = _Assigner(config, scheme, source)
    cache: dict[tuple, _LayerBytes] = {}
    layers_total = copies_total = experts_total = dequantize = expert_chunk = routers = 0
    shapes: dict[bool, list[tuple[str, nn.Linear]]] = {}
    for i in range(config.num_hidden_layers):
        kind = config.is_moe_layer(i)
        if kind not in shapes:
            with torch.device("meta"):
                shapes[kind] = [(n, m) for n, m in build_layer(config, i).named_modules() if isinstance(m, nn.Linear)]
        specs = tuple(assign(f"model.layers.{i}.{name}", linear) for name, linear in shapes[kind])
        if (kind, specs) not in cache:
            cache[(kind, specs)] = _layer_bytes(config, i, specs, dtype)
        b = cache[(kind, specs)]
        dequantize, expert_chunk = max(dequantize, b.largest_dequantized), max(expert_chunk, b.expert_chunk)
        layers_total += b.held
        copies_total += b.decode_copies
        experts_total += b.routed_experts
        routers += b.router_float32
    with torch.device("meta"):
        outer = CausalLM(config, layers=[]).to(dtype)
    embedding = 0 if config.tie_word_embeddings else weight_bytes(outer.model.embed_tokens)
    stored = "as stored" if config.raw.get("quantization_config") else UNQUANTIZED
    return WeightMemory(scheme or stored, layers_total + weight_bytes(outer),
                        copies_total if dtype == torch.bfloat16 else 0, describe(config, scheme, dtype), experts_total,
                        embedding, dequantize, routers, expert_chunk)


def active_parameters(config: ModelConfig) -> int:
    """Parameters one token's forward multiplies by (the FLOPs of a step are twice this per token):
    every Linear of the decoder, routed experts only for the chosen top-k, and lm_head."""
    from quantship.models.causal_lm import build_layer

    total = config.vocab_size * config.hidden_size
    per_kind: dict[bool, int] = {}
    for i in range(config.num_hidden_layers):
        kind = config.is_moe_layer(i)
        if kind not in per_kind:
            with torch.device("meta"):
                linears = [(n, m) for n, m in build_layer(config, i).named_modules() if isinstance(m, nn.Linear)]
            dense = sum(m.weight.numel() for n, m in linears if not _routed(n))
            routed = sum(m.weight.numel() for n, m in linears if _routed(n))
            share = config.num_experts_per_tok / config.n_routed_experts if config.n_routed_experts else 0
            per_kind[kind] = dense + int(routed * share)
        total += per_kind[kind]
    return total


def _routed(name: str) -> bool:
    return name.startswith("mlp.experts.")


class _LayerBytes(NamedTuple):
    """One layer as the engine serves it."""

    held: int
    decode_copies: int  # int4 tinygemm copies
    routed_experts: int  # of held
    largest_dequantized: int  # the largest packed Linear (merged as served) written out dense
    expert_chunk: int  # packed routed experts a CUDA prefill step dequantizes at once (fused MoE)
    router_float32: int  # the router's float32 weight the engine holds beside it once it fuses the experts


def _layer_bytes(config: ModelConfig, index: int, specs: tuple, dtype: torch.dtype) -> _LayerBytes:
    from quantship.kernels.fused_moe import dequantize_bytes
    from quantship.models.causal_lm import build_layer
    from quantship.models.merged import merge_projections
    from quantship.models.quantized import PackedLinear, QuantLinear

    with torch.device("meta"):
        layer = build_layer(config, index)
    linears = [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    copies = 0
    for (name, linear), spec in zip(linears, specs):
        if spec is None:
            continue
        new = runtime_linear(linear, spec, dtype)
        owner, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(owner) if owner else layer, attr, new)
        copies += int4_decode_copy(name, new)
    layer = layer.to(dtype)
    experts = sum(weight_bytes(m) for n, m in layer.named_modules() if _routed(n) and n.count(".") == 2)
    held = weight_bytes(layer)
    merge_projections(layer)  # as the engine runs it: a merged Linear dequantizes whole
    largest = max((m.out_features * m.in_features * dtype.itemsize for n, m in layer.named_modules()
                   if isinstance(m, (PackedLinear, QuantLinear)) and not _routed(n)), default=0)
    chunk = router = 0
    mlp = layer.mlp
    if hasattr(mlp, "fusable") and mlp.fusable():  # what enable_fused_kernels will take (models/deepseek.py)
        gate = mlp.experts[0].gate_proj
        if isinstance(gate, PackedLinear):
            stacked = len(mlp.experts) + mlp.foldable_shared()  # the shared experts' pieces join the stack
            chunk = dequantize_bytes(stacked, gate.in_features, gate.out_features, dtype.itemsize)
        if mlp.gate.weight.dtype != torch.float32:
            router = mlp.gate.weight.numel() * 4
    return _LayerBytes(held, copies, experts, largest, chunk, router)
