"""Quantize a checkpoint one decoder layer at a time.

For each layer, streamed from the shards: run the calibration activations through it, quantize
its Linear layers (RTN, AWQ+RTN or GPTQ), run the *quantized* layer to make the next layer's
inputs (so errors propagate as they will at inference), write the layer out, free it. Peak
memory is about one layer plus the calibration activations, whatever the model's size.

Output goes to a hidden temporary directory beside OUT and is renamed at the very end, so an
interrupted run never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantship import __version__
from quantship.errors import QuantshipError
from quantship.formats.compressed_tensors import ShardWriter, pack_tensors, quantization_config
from quantship.models.bundled import TINY_DIR, resolve_model
from quantship.models.causal_lm import CausalLM
from quantship.models.loader import Checkpoint
from quantship.models.quantized import quant_linear
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.calibrate import LayerStats, calibration_tokens, collect_stats, linear_names
from quantship.quant.rtn import QuantizedTensor, rtn_quantize
from quantship.quant.scheme import DEFAULT_IGNORE, Scheme, get_scheme, is_ignored
from quantship.files import check_output_location, publish_directory

METHODS = ("rtn", "awq", "gptq")
CLIP_ROWS = 512  # input rows per Linear that AWQ's clipping search looks at
RECIPE_FILE = "quantship_recipe.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")


@dataclass
class QuantizeOptions:
    scheme: str = "W4A16"
    method: str = "rtn"
    calib: Path | None = None
    samples: int = 128
    seq_len: int = 512
    device: str = "cpu"
    ignore: list[str] = field(default_factory=list)
    group_size: int | None = None
    actorder: str | None = None
    dampening: float = 0.01
    min_expert_tokens: int = 16
    overwrite: bool = False
    # A plan (mixed precision) maps module names to schemes; None = one scheme for every target.
    plan: dict[str, str] | None = None


def _validate(ck: Checkpoint, out: Path, opts: QuantizeOptions) -> None:
    if ck.quantized is not None:
        raise QuantshipError("model is already quantized (config.json has a quantization_config)", ck.path)
    if opts.method not in METHODS:
        raise QuantshipError(f"unknown method {opts.method!r}; choose one of {', '.join(METHODS)}")
    if opts.actorder == "group":
        # GPTQ here supports it (weight_g_idx), but compressed-tensors 0.20 rejects actorder "group"
        # in config.json, and with it every reader built on that library (transformers, vLLM).
        raise QuantshipError("--actorder group (weight_g_idx) is no longer readable by compressed-tensors "
                             ">= 0.20 and the tools built on it; use --actorder static")
    if opts.actorder not in (None, "static"):
        raise QuantshipError("--actorder must be static")
    if opts.actorder and opts.method != "gptq":
        raise QuantshipError("--actorder applies to --method gptq only")
    if out.exists() and not opts.overwrite:
        raise QuantshipError("output directory exists (pass --overwrite to replace it)", out)
    if out.resolve() == ck.path.resolve():
        raise QuantshipError("output directory is the input model", out)
    if opts.samples < 1 or opts.seq_len < 2:
        raise QuantshipError("--samples must be >= 1 and --seq-len >= 2")
    if opts.seq_len > ck.config.max_position_embeddings:
        raise QuantshipError(f"--seq-len {opts.seq_len} exceeds the model's context of "
                             f"{ck.config.max_position_embeddings} tokens", ck.path)
    if not 0 < opts.dampening <= 1:  # also refuses NaN
        raise QuantshipError(f"--dampening must be in (0, 1], got {opts.dampening}")
    for pattern in (p for p in opts.ignore if p.startswith("re:")):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise QuantshipError(f"--ignore {pattern!r} is not a valid regular expression ({exc})") from None
    check_output_location(out, "output directory")


def plan_schemes(ck: Checkpoint, opts: QuantizeOptions) -> dict[str, Scheme]:
    """Scheme of every quantized Linear (full module name); the rest stay in the original dtype."""
    ignore = list(DEFAULT_IGNORE) + list(opts.ignore)
    base = get_scheme(opts.scheme, opts.group_size)
    if opts.actorder:
        base = base.with_actorder(opts.actorder)
    with torch.device("meta"):
        model = CausalLM(ck.config)
    chosen: dict[str, Scheme] = {}
    for i, layer in enumerate(model.model.layers):
        for name in linear_names(layer):
            full = f"model.layers.{i}.{name}"
            if is_ignored(full, ignore):
                continue
            scheme = base
            if opts.plan is not None:
                if full not in opts.plan or opts.plan[full] in ("none", "bf16", "fp16", "original"):
                    continue
                scheme = get_scheme(opts.plan[full])
                if opts.actorder:
                    scheme = scheme.with_actorder(opts.actorder)
            in_features = layer.get_submodule(name).in_features
            w = scheme.weights
            if w.strategy == "group" and in_features % w.group_size:
                raise QuantshipError(
                    f"{scheme.name} group size {w.group_size} does not divide {full}'s input dimension "
                    f"{in_features}; choose --group-size from the divisors or add it to --ignore", ck.path)
            chosen[full] = scheme
    if not chosen:
        raise QuantshipError("no Linear layer left to quantize (check --ignore)", ck.path)
    return chosen


def _config_groups(chosen: dict[str, Scheme]) -> list[tuple[Scheme, list[str]]]:
    by_scheme: dict[Scheme, list[str]] = {}
    for name, scheme in chosen.items():
        by_scheme.setdefault(scheme, []).append(name)
    if len(by_scheme) == 1:
        return [(next(iter(by_scheme)), ["Linear"])]
    return [(scheme, sorted(names)) for scheme, names in by_scheme.items()]


HESSIAN_BATCH_BYTES = 2 * 2**30  # cap on the Hessians stacked into one batched GPTQ call


def _quantize_weights(weights: dict[str, torch.Tensor], schemes: dict[str, Scheme], opts: QuantizeOptions,
                      stats: LayerStats, fallbacks: list[str]) -> dict[str, QuantizedTensor]:
    if opts.method != "gptq":
        return {n: rtn_quantize(w, schemes[n].weights) for n, w in weights.items()}
    from quantship.quant.gptq import gptq_quantize_many

    hessians = {}
    for name in weights:
        chosen = stats.routed[name]
        if name in stats.all_tokens and chosen.tokens < opts.min_expert_tokens:
            chosen = stats.all_tokens[name]  # a starved expert borrows the every-token statistics
            fallbacks.append(name)
        hessians[name] = chosen.hessian
    out = {}
    for name in [n for n, h in hessians.items() if h is None]:  # no token reached it at all
        fallbacks.append(name)
        out[name] = rtn_quantize(weights[name], schemes[name].weights)
    # Same-shaped weights with the same scheme (a layer's experts, q/k/v) share one column loop.
    batches: dict[tuple, list[str]] = {}
    for name, h in hessians.items():
        if h is not None:
            batches.setdefault((tuple(weights[name].shape), schemes[name]), []).append(name)
    for (shape, scheme), names in batches.items():
        step = max(1, HESSIAN_BATCH_BYTES // (shape[1] * shape[1] * 4))
        for start in range(0, len(names), step):
            chunk = names[start:start + step]
            results = gptq_quantize_many(torch.stack([weights[n] for n in chunk]),
                                         torch.stack([hessians[n] for n in chunk]), scheme.weights,
                                         dampening=opts.dampening)
            out.update(zip(chunk, results))
    return out


def _clip(weight: torch.Tensor, sample, scheme: Scheme, min_tokens: int) -> torch.Tensor:
    from quantship.quant.clip import clip_weight

    if sample.tokens < min_tokens:
        return weight  # too few routed tokens to choose a clip on: keep the full range
    return clip_weight(weight, sample.rows(), scheme.weights)[0]


def _swap(layer: nn.Module, name: str, q: QuantizedTensor, scheme: Scheme, dtype: torch.dtype) -> None:
    owner, attr = name.rsplit(".", 1)
    old = layer.get_submodule(name)
    acts = scheme.input_activations.type if scheme.input_activations else None
    new = quant_linear(q.values, q.scale.to(dtype), q.zero_point, q.g_idx,
                       None if old.bias is None else old.bias.data, activations=acts, bits=q.args.num_bits)
    setattr(layer.get_submodule(owner), attr, new)


def _run(layer: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, batch: int = 8) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([layer(hidden[s:s + batch], positions) for s in range(0, hidden.shape[0], batch)])


def _quantize_layer(layer: nn.Module, prefix: str, hidden: torch.Tensor, positions: torch.Tensor,
                    chosen: dict[str, Scheme], opts: QuantizeOptions, writer: ShardWriter,
                    out_dtype: torch.dtype) -> dict:
    """Calibrate, quantize and write one layer, leaving it quantized in place for the next layer's inputs."""
    schemes = {n: chosen[prefix + n] for n in linear_names(layer) if prefix + n in chosen}
    fallbacks: list[str] = []
    awq_report: dict[str, dict] = {}
    if opts.method == "awq" and schemes:
        from quantship.quant.awq import awq_layer

        # The search fake-quantizes with one scheme; under a plan, the first one of the layer stands in.
        report = awq_layer(layer, hidden, positions, next(iter(schemes.values())).weights,
                           min_expert_tokens=opts.min_expert_tokens, quantized=set(schemes))
        fallbacks += [f"mlp.experts.{e}" for e in report.pop("expert_fallbacks", [])]
        awq_report = {prefix + k: v for k, v in report.items()}
    stats = collect_stats(layer, hidden, positions, want_hessian=opts.method == "gptq",
                          keep_rows=CLIP_ROWS if opts.method == "awq" else 0)
    weights = {n: layer.get_submodule(n).weight.data for n in schemes}
    if opts.method == "awq":
        weights = {n: _clip(w, stats.routed[n], schemes[n], opts.min_expert_tokens) for n, w in weights.items()}
    quantized = _quantize_weights(weights, schemes, opts, stats, fallbacks)
    for name, q in quantized.items():
        _assert_finite(q, prefix + name)
        _swap(layer, name, q, schemes[name], out_dtype)
        for key, tensor in pack_tensors(q, schemes[name], out_dtype).items():
            writer.add(f"{prefix}{name}.{key}", tensor)
    for key, tensor in layer.state_dict().items():
        # Norms, routers, ignored Linears and biases stay in the original dtype.
        if key.rsplit(".", 1)[0] not in schemes or key.endswith(".bias"):
            writer.add(prefix + key, tensor.to(_tensor_dtype(key, out_dtype)))
    return {"expert_tokens": stats.expert_tokens, "fallbacks": [prefix + f for f in fallbacks], "awq": awq_report}


def _tensor_dtype(name: str, out_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith("e_score_correction_bias") else out_dtype


def quantize(model: str | Path | None, out: str | Path, opts: QuantizeOptions, progress: bool = True) -> dict:
    """Quantize MODEL into OUT; returns the recipe (also written to OUT/quantship_recipe.json)."""
    started = time.time()
    path = resolve_model(model)
    ck = Checkpoint(path)
    out = Path(out)
    _validate(ck, out, opts)
    chosen = plan_schemes(ck, opts)
    calib_path = Path(opts.calib) if opts.calib else TINY_DIR / "calib.txt"
    tokenizer = load_tokenizer(path)
    tokens, calib_info = calibration_tokens(calib_path, tokenizer, opts.samples, opts.seq_len)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QuantshipError("--device cuda asked for, but no CUDA device is available")
    out_dtype = getattr(torch, ck.config.torch_dtype, torch.bfloat16)
    compute_dtype = torch.float32  # GPTQ/AWQ arithmetic wants float32; activations are small
    tf32 = torch.backends.cuda.matmul.allow_tf32
    if device.type == "cuda":
        # TF32 matmuls for the forward passes and Hessians: ~8x faster, error far below 4-bit rounding.
        torch.backends.cuda.matmul.allow_tf32 = True

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writer = ShardWriter(tmp)
        outer = ck.outer_state()
        for name, tensor in outer.items():
            writer.add(name, tensor)
        embed = outer["model.embed_tokens.weight"].to(device, compute_dtype)
        hidden = torch.nn.functional.embedding(tokens.to(device), embed)
        del embed, outer
        writer.end_of_layer()
        positions = torch.arange(tokens.shape[1], device=device)
        expert_tokens: dict[str, list[int]] = {}
        fallbacks: list[str] = []
        awq_report: dict[str, dict] = {}
        for index, layer in _progress(ck, progress, compute_dtype, device):
            prefix = f"model.layers.{index}."
            done = _quantize_layer(layer, prefix, hidden, positions, chosen, opts, writer, out_dtype)
            if done["expert_tokens"]:
                expert_tokens[str(index)] = done["expert_tokens"]
            fallbacks += done["fallbacks"]
            awq_report.update(done["awq"])
            writer.end_of_layer()
            hidden = _run(layer, hidden, positions)
            del layer
            _release_freed_memory()
        shards = writer.finish()
        config = dict(ck.config.raw)
        config["quantization_config"] = quantization_config(_config_groups(chosen),
                                                            list(DEFAULT_IGNORE) + list(opts.ignore))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                shutil.copy(path / name, tmp / name)
        recipe = {
            "quantship_version": __version__,
            "source_model": str(path.resolve()),
            "scheme": opts.scheme if opts.plan is None else "plan",
            "schemes_used": sorted({s.name for s in chosen.values()}),
            "method": opts.method,
            "group_size": next(iter(chosen.values())).weights.group_size,
            "actorder": opts.actorder,
            "ignore": list(DEFAULT_IGNORE) + list(opts.ignore),
            "quantized_linears": len(chosen),
            "calibration": calib_info,
            "tokens_per_expert": expert_tokens,
            "min_expert_tokens": opts.min_expert_tokens,
            "fallbacks": sorted(set(fallbacks)),
            "device": str(device),
            "shards": shards,
            "seconds": round(time.time() - started, 2),
        }
        if awq_report:
            recipe["awq"] = awq_report
        if opts.plan is not None:
            recipe["plan"] = {n: s.name for n, s in chosen.items()}
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        publish_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return recipe


def _release_freed_memory() -> None:
    """Hand freed heap memory back to the OS between layers. glibc keeps it otherwise, and a
    layer-by-layer pipeline's footprint then creeps up with each layer's differently sized tensors."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _assert_finite(q: QuantizedTensor, name: str) -> None:
    if not torch.isfinite(q.scale).all():
        raise RuntimeError(f"non-finite scale computed for {name}")  # a bug, not bad input



def _progress(ck: Checkpoint, enabled: bool, dtype, device):
    layers = ck.config.num_hidden_layers
    if not enabled:
        yield from ck.iter_layers(dtype, device)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("[bold]quantize"), BarColumn(), MofNCompleteColumn(), TextColumn("layers"),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("layers", total=layers)
        for item in ck.iter_layers(dtype, device):
            yield item
            bar.advance(task)
