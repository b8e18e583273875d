"""Quantize a checkpoint one decoder layer at a time.

For each layer, streamed from the shards: run the calibration activations through it, quantize
its Linear layers (RTN, AWQ+RTN or GPTQ), run the *quantized* layer to make the next layer's
inputs (so errors propagate as they will at inference), write the layer out, free it. Peak
memory is about one layer plus the calibration activations, whatever the model's size. RTN needs
no activations and runs no forward pass. DeepSeek-V3's MTP layer follows the main layers (quant/mtp.py).

Output goes to a hidden temporary directory beside OUT and is renamed at the very end, so an
interrupted run never leaves a checkpoint that looks complete; what it finished stays there for
--resume (quant/resume.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantship import __version__
from quantship.errors import QuantshipError, as_stop, raise_if_stopped
from quantship.files import check_output_location, publish_directory, sha256_file
from quantship.formats.compressed_tensors import ShardWriter, pack_tensors, quantization_config
from quantship.models.bundled import TINY_DIR, resolve_model
from quantship.models.causal_lm import CausalLM
from quantship.models.held import HeldLinear, float32_weight
from quantship.models.loader import Checkpoint
from quantship.models.mtp import MTPLayer
from quantship.models.quantized import runtime_linear
from quantship.models.tokenizer import load_tokenizer
from quantship.quant import mtp as M
from quantship.quant.calibrate import LayerStats, calibration_tokens, collect_stats, linear_names
from quantship.quant.distributed import DiscardingWriter, UnrecordedRun, Workers, from_environment
from quantship.quant.fp8_block import block_quantize
from quantship.quant.plan import KEEPS_ORIGINAL
from quantship.quant.resume import ResumableRun, source_fingerprint
from quantship.quant.rtn import rtn_quantize
from quantship.quant.scheme import DEFAULT_IGNORE, Scheme, get_scheme, is_ignored
from quantship.quantized_tensor import QuantizedTensor

CLIP_ROWS = 512  # input rows per Linear that AWQ's clipping search looks at
RECIPE_FILE = "quantship_recipe.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Method:
    """What a --method does to each layer: AWQ's transform (per-channel scales searched and folded, weights
    clipped) first, then RTN or GPTQ rounding. FP8 blocks are always rounded to nearest (data-free)."""

    name: str
    awq: bool = False  # search and fold per-channel scales, clip, before rounding
    gptq: bool = False  # round with GPTQ (needs each Linear's input Hessian); otherwise to nearest

    @property
    def calibrated(self) -> bool:
        """Runs the calibration text through the layers (RTN rounds each weight alone: no forward pass)."""
        return self.awq or self.gptq

    @property
    def kept_rows(self) -> int:
        return CLIP_ROWS if self.awq else 0  # input rows per Linear kept for AWQ's clipping search


METHODS = {m.name: m for m in (Method("rtn"), Method("awq", awq=True), Method("gptq", gptq=True))}


# GPTQ holds one Hessian per input of every Linear it solves. DeepSeek-V3's 256 routed experts take 57 GB
# of them in float32 (7168² for gate/up, 2048² for down, each expert): past this budget (GiB, the default
# of --expert-hessian-gb) the experts' statistics are gathered and solved a group at a time, one
# calibration pass of the layer per group: 7 passes of each V3 MoE layer at 8 GiB. The default keeps the
# V3 shape's peak within an 80 GB card (43.4 GiB measured on an H200 at 406 x 2048 tokens); a larger
# card can take all 256 experts' Hessians in one pass.
EXPERT_HESSIAN_GB = 8.0


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
    mtp: str = "keep"  # what happens to DeepSeek-V3's multi-token-prediction layer: keep, quantize, drop
    strict_groups: bool = False  # refuse a group size that does not divide a layer (no fallback)
    resume: bool = False  # continue an interrupted run into the same OUT from its first unfinished layer
    # GPTQ: GB of routed experts' Hessians gathered in one calibration pass of a MoE layer (see _expert_groups).
    expert_hessian_gb: float = EXPERT_HESSIAN_GB


def _validate(ck: Checkpoint, out: Path, opts: QuantizeOptions) -> None:
    if ck.quantized is not None:
        raise QuantshipError("model is already quantized (config.json has a quantization_config)", ck.path)
    if opts.method not in METHODS:
        raise QuantshipError(f"unknown method {opts.method!r}; choose one of {', '.join(METHODS)}")
    method = METHODS[opts.method]
    if opts.actorder not in (None, "static"):
        # Act-order "group" (a permuted weight_g_idx) is not offered: compressed-tensors >= 0.20 rejects it in
        # config.json, and with it every reader built on that library (transformers, vLLM).
        raise QuantshipError(f"--actorder must be static, got {opts.actorder!r}")
    if opts.actorder and not method.gptq:
        raise QuantshipError("--actorder applies to --method gptq only")
    if opts.mtp not in M.MTP_MODES:
        raise QuantshipError(f"unknown --mtp {opts.mtp!r}; choose one of {', '.join(M.MTP_MODES)}")
    if opts.plan is None and get_scheme(opts.scheme).weights.strategy == "block" and method.calibrated:
        raise QuantshipError("FP8_BLOCK is data-free (each block rounded to nearest); use --method rtn")
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
    if not 0 < opts.expert_hessian_gb < float("inf"):
        raise QuantshipError(f"--expert-hessian-gb must be a positive number of GiB, got {opts.expert_hessian_gb}")
    for pattern in (p for p in opts.ignore if p.startswith("re:")):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise QuantshipError(f"--ignore {pattern!r} is not a valid regular expression ({exc})") from None
    check_output_location(out, "output directory")


def _target_layers(ck: Checkpoint, opts: QuantizeOptions) -> list[tuple[int, nn.Module, bool]]:
    """(index, layer on the meta device, is MTP) of every layer whose Linears may be quantized."""
    with torch.device("meta"):
        layers = [(i, layer, False) for i, layer in enumerate(CausalLM(ck.config).model.layers)]
        if opts.mtp == "quantize":
            layers += [(i, MTPLayer(ck.config, i), True) for i in ck.mtp_indices]
    return layers


def plan_schemes(ck: Checkpoint, opts: QuantizeOptions) -> tuple[dict[str, Scheme], dict[str, str]]:
    """Scheme of every quantized Linear (full module name), the rest staying in the original dtype;
    and the Linears whose group size fell back, with what they got."""
    ignore = list(DEFAULT_IGNORE) + list(opts.ignore) + list(M.MTP_IGNORE)
    base = get_scheme(opts.scheme, opts.group_size)
    if opts.actorder:
        base = base.with_actorder(opts.actorder)
    chosen: dict[str, Scheme] = {}
    group_fallbacks: dict[str, str] = {}
    linears: set[str] = set()
    for i, layer, is_mtp in _target_layers(ck, opts):
        for name in linear_names(layer):
            full = f"model.layers.{i}.{name}"
            linears.add(full)
            if is_ignored(full, ignore):
                continue
            scheme = base
            if opts.plan is not None and not is_mtp:  # a plan covers the main layers; MTP takes --scheme
                if full not in opts.plan or opts.plan[full].lower() in KEEPS_ORIGINAL:
                    continue
                scheme = get_scheme(opts.plan[full])
                if opts.actorder:
                    scheme = scheme.with_actorder(opts.actorder)
            in_features = layer.get_submodule(name).in_features
            fitted = scheme.fitted_to(in_features)
            if fitted != scheme:
                if opts.strict_groups:
                    raise QuantshipError(
                        f"{scheme.name} group size {scheme.weights.group_size} does not divide {full}'s input "
                        f"dimension {in_features} (--strict-groups); choose --group-size from the divisors "
                        "or add it to --ignore", ck.path)
                group_fallbacks[full] = fitted.describe_weights()
            chosen[full] = fitted
    unknown = sorted(set(opts.plan or {}) - linears)
    if unknown:  # a plan made for another model (or edited by hand) would otherwise be half applied
        raise QuantshipError(f"the plan names {len(unknown)} module(s) this model does not have ({unknown[0]}"
                             f"{', ...' if len(unknown) > 1 else ''}): was it made for another model?", ck.path)
    if not chosen:
        raise QuantshipError("no Linear layer left to quantize (check --ignore)", ck.path)
    return chosen, group_fallbacks


def _config_groups(chosen: dict[str, Scheme]) -> list[tuple[Scheme, list[str]]]:
    by_scheme: dict[Scheme, list[str]] = {}
    for name, scheme in chosen.items():
        by_scheme.setdefault(scheme, []).append(name)
    if len(by_scheme) == 1:
        return [(next(iter(by_scheme)), ["Linear"])]
    return [(scheme, sorted(names)) for scheme, names in by_scheme.items()]


HESSIAN_BATCH_BYTES = 2 * 2**30  # cap on the Hessians stacked into one batched GPTQ call


def _round(weight: torch.Tensor, scheme: Scheme) -> QuantizedTensor:
    w = scheme.weights
    if w.strategy == "block":
        return QuantizedTensor(*block_quantize(weight, w.block), None, w)
    return rtn_quantize(weight, w)


def _quantize_weights(weights: _DenseWeights, schemes: dict[str, Scheme], opts: QuantizeOptions,
                      stats: LayerStats, fallbacks: list[str], workers: Workers) -> dict[str, QuantizedTensor]:
    # FP8 blocks are always rounded (data-free, as llm-compressor's FP8_BLOCK); a method applies to the rest.
    gptq = METHODS[opts.method].gptq
    rounded = {n for n, s in schemes.items() if not gptq or s.weights.strategy == "block"}
    out = {n: _round(weights[n], schemes[n]) for n in rounded}  # each weight widened as it is read
    pending = [n for n in weights if n not in rounded]
    if not pending:
        return out
    from quantship.quant.gptq import gptq_quantize_many

    hessians = {}
    for name in pending:
        chosen = stats.routed[name]
        if name in stats.all_tokens and chosen.tokens < opts.min_expert_tokens:
            chosen = stats.all_tokens[name]  # a starved expert borrows the every-token statistics
            fallbacks.append(name)
        hessians[name] = chosen.hessian
    for name in [n for n, h in hessians.items() if h is None]:  # no token reached it at all
        fallbacks.append(name)
        out[name] = rtn_quantize(weights[name], schemes[name].weights)
    # Several processes (torchrun) deal the Linears out; each solves its share, then all results are shared.
    solvable = [n for n, h in hessians.items() if h is not None]
    mine = set(workers.mine(solvable))
    # Same-shaped weights with the same scheme (a layer's experts, q/k/v) share one column loop.
    batches: dict[tuple, list[str]] = {}
    for name in solvable:
        if name in mine:
            batches.setdefault((weights.shape(name), schemes[name]), []).append(name)
    solved: dict[str, QuantizedTensor] = {}
    for (shape, scheme), names in batches.items():
        step = max(1, HESSIAN_BATCH_BYTES // (shape[1] * shape[1] * 4))
        for start in range(0, len(names), step):
            chunk = names[start:start + step]
            results = gptq_quantize_many(torch.stack([weights[n] for n in chunk]),
                                         torch.stack([hessians[n] for n in chunk]), scheme.weights,
                                         dampening=opts.dampening)
            solved.update(zip(chunk, results))
    template = {n: QuantizedTensor(None, None, None, schemes[n].weights) for n in solvable}
    out.update(workers.share(solved, solvable, template))
    return out


class _DenseWeights(Mapping):
    """name → float32 weight of a layer's Linears, made when read: held experts (models/held.py) are
    widened one at a time as the rounding or a GPTQ batch asks, never all at once. `transform(name, w)`
    (AWQ's clipping) is applied on each read, so its results are not all alive at once either."""

    def __init__(self, layer: nn.Module, names: list[str],
                 transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None):
        self.layer, self.names, self.known, self.transform = layer, list(names), set(names), transform

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.known:
            raise KeyError(name)
        weight = float32_weight(self.layer.get_submodule(name))
        return weight if self.transform is None else self.transform(name, weight)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.layer.get_submodule(name).weight.shape)


def _held_experts(prefix: str, chosen: dict[str, Scheme]) -> Callable[[str], bool]:
    """Which Linears of a layer stay on the device as the checkpoint stores them: the routed experts this
    run quantizes (AWQ's scales are folded into them as they are widened)."""
    return lambda name: _EXPERT.match(name + ".") is not None and prefix + name in chosen


def _count_held(layer: nn.Module, tallies: dict) -> None:
    """Tally the Linears a loaded layer holds as stored: the recipe reports what the run did, not what it meant to."""
    tallies["held_linears"] = tallies.get("held_linears", 0) + sum(isinstance(m, HeldLinear) for m in layer.modules())


def _clip(routed: dict, schemes: dict[str, Scheme], searched: dict, min_tokens: int, name: str,
          weight: torch.Tensor) -> torch.Tensor:
    """AWQ's clipping of one searched Linear's weight on its kept calibration rows (others as they are)."""
    from quantship.quant.clip import clip_weight

    sample = routed[name] if name in searched else None
    if sample is None or sample.tokens < min_tokens:
        return weight  # not searched, or too few routed tokens to choose a clip on: keep the full range
    return clip_weight(weight, sample.rows(), schemes[name].weights)[0]


def _swap(layer: nn.Module, name: str, q: QuantizedTensor, scheme: Scheme, dtype: torch.dtype) -> None:
    """Run the layer on as it will be read back: integer scales in the checkpoint dtype, FP8 block scales float32."""
    owner, attr = name.rsplit(".", 1)
    old = layer.get_submodule(name)
    bias = None if old.bias is None else old.bias.data
    if q.args.strategy != "block":
        q = dataclasses.replace(q, scale=q.scale.to(dtype))
    setattr(layer.get_submodule(owner), attr, runtime_linear(q, scheme.input_activations, bias))


def _run(layer: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """The layer's output for every calibration sequence, kept where `hidden` is (see _activation_store).
    Written into one tensor as it comes: gathering the pieces first would hold the output twice (30 GB more
    at DeepSeek-V3's width and 512 x 2048 tokens)."""
    device = positions.device
    out = torch.empty_like(hidden)
    with torch.no_grad():
        for s in range(0, hidden.shape[0], batch):
            out[s:s + batch] = layer(hidden[s:s + batch].to(device), positions)
    return out


# Calibration activations go to host memory once they would take more than this share of the GPU:
# two copies live while a layer runs (its input and its output), and at DeepSeek-V3's width 512
# samples of 2048 tokens are 30 GB each in float32. Batches of 8 sequences go to the GPU as needed.
OFFLOAD_SHARE = 0.1


def _activation_store(device: torch.device, tokens: int, hidden_size: int) -> torch.device:
    """Where the calibration activations (tokens x hidden_size, float32) live between layers: the compute
    device, or the host."""
    if device.type != "cuda":
        return device
    size = tokens * hidden_size * 4
    return torch.device("cpu") if size > OFFLOAD_SHARE * torch.cuda.get_device_properties(device).total_memory \
        else device


_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")


def _experts_per_group(hidden: int, intermediate: int, budget_gb: float) -> int:
    """Routed experts whose GPTQ Hessians fit the budget (gate and up share one, down has its own)."""
    return max(1, int(budget_gb * 2**30) // (4 * (hidden ** 2 + intermediate ** 2)))


def _expert_groups(layer: nn.Module, budget_gb: float) -> list[range | None]:
    """[None] (every expert in one pass), or ranges of routed experts whose Hessians fit the budget."""
    experts = getattr(layer.mlp, "experts", None)
    if not experts:
        return [None]
    size = _experts_per_group(experts[0].gate_proj.in_features, experts[0].down_proj.in_features, budget_gb)
    if size >= len(experts):
        return [None]
    return [range(start, min(start + size, len(experts))) for start in range(0, len(experts), size)]


def _in_group(name: str, group: range | None, first: bool) -> bool:
    """Whether a Linear is solved in this pass: its routed expert is in the group; any other, in the first."""
    match = _EXPERT.match(name)
    return (group is None or int(match.group(1)) in group) if match else first


def _quantize_layer(layer: nn.Module, prefix: str, hidden: torch.Tensor, positions: torch.Tensor,
                    chosen: dict[str, Scheme], opts: QuantizeOptions, writer: ShardWriter,
                    out_dtype: torch.dtype, workers: Workers) -> dict:
    """Calibrate, quantize and write one layer, leaving it quantized in place for the next layer's inputs."""
    method = METHODS[opts.method]
    schemes = {n: chosen[prefix + n] for n in linear_names(layer) if prefix + n in chosen}
    fallbacks: list[str] = []
    awq_report: dict[str, dict] = {}
    # AWQ searches and clips for the integer Linears; FP8 blocks are only rounded (folding still keeps them exact).
    searched = {n: s.weights for n, s in schemes.items() if s.weights.strategy != "block"}
    if method.awq and searched:
        from quantship.quant.awq import awq_layer

        report = awq_layer(layer, hidden, positions, searched, min_expert_tokens=opts.min_expert_tokens,
                           quantized=set(searched))
        fallbacks += [f"mlp.experts.{e}" for e in report.pop("expert_fallbacks", [])]
        awq_report = {prefix + k: v for k, v in report.items()}
    quantized: dict[str, QuantizedTensor] = {}
    expert_tokens: list[int] = []
    groups = _expert_groups(layer, opts.expert_hessian_gb) if method.gptq and hidden is not None else [None]
    for number, group in enumerate(groups):
        # With several groups each pass hooks one group of routed experts (the first pass also every other
        # Linear); statistics come from the unquantized layer in every pass, so the results are the same.
        names = [n for n in schemes if _in_group(n, group, number == 0)]
        if hidden is None:  # RTN: nothing to measure
            stats = LayerStats()
        else:
            stats = collect_stats(layer, hidden, positions, want_hessian=method.gptq, keep_rows=method.kept_rows,
                                  experts=group, others=number == 0)
        clip = partial(_clip, stats.routed, schemes, searched, opts.min_expert_tokens) if method.awq else None
        weights = _DenseWeights(layer, names, clip)
        quantized.update(_quantize_weights(weights, {n: schemes[n] for n in names}, opts, stats, fallbacks, workers))
        expert_tokens += stats.expert_tokens
        del stats, weights  # this group's Hessians
    for name, q in quantized.items():
        _assert_finite(q, prefix + name)
        _swap(layer, name, q, schemes[name], out_dtype)
        for key, tensor in pack_tensors(q, schemes[name], out_dtype).items():
            writer.add(f"{prefix}{name}.{key}", tensor)
    for key, tensor in layer.state_dict().items():
        # Norms, routers, ignored Linears and biases stay in the original dtype.
        if key.rsplit(".", 1)[0] not in schemes or key.endswith(".bias"):
            writer.add(prefix + key, tensor.to(_tensor_dtype(key, out_dtype)))
    return {"expert_tokens": expert_tokens, "fallbacks": [prefix + f for f in fallbacks], "awq": awq_report}


def _tensor_dtype(name: str, out_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith("e_score_correction_bias") else out_dtype


def quantize(model: str | Path | None, out: str | Path, opts: QuantizeOptions,
             progress: Callable[..., None] | None = None) -> dict:
    """Quantize MODEL into OUT; returns the recipe (also written to OUT/quantship_recipe.json), or {} in a
    helper process of a torchrun group (rank 0 writes).

    progress: called as progress("quantize", layers, done) once the layers start (done > 0 when resuming),
    then progress() after each decoder layer; the command line draws it."""
    started = time.time()
    path = resolve_model(model)
    ck = Checkpoint(path)
    out = Path(out)
    _validate(ck, out, opts)
    chosen, group_fallbacks = plan_schemes(ck, opts)
    calib_path = Path(opts.calib) if opts.calib else TINY_DIR / "calib.txt"
    tokenizer = load_tokenizer(path)
    tokens, calib_info = calibration_tokens(calib_path, tokenizer, opts.samples, opts.seq_len)
    if torch.device(opts.device).type == "cuda" and not torch.cuda.is_available():
        raise QuantshipError("--device cuda asked for, but no CUDA device is available")
    workers = from_environment(opts.device)
    if workers.world > 1 and opts.resume:
        raise QuantshipError("--resume continues a one-process run; start it again without torchrun")
    device = workers.device
    tf32 = torch.backends.cuda.matmul.allow_tf32
    if device.type == "cuda":
        # TF32 matmuls for the forward passes and Hessians: ~8x faster, error far below 4-bit rounding.
        torch.backends.cuda.matmul.allow_tf32 = True
    if not workers.writes:  # another process (rank 0) writes; this one solves its share of each layer
        try:
            _write_layers(ck, UnrecordedRun(), DiscardingWriter(), tokens, chosen, opts, workers, _silent, 0.0)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            workers.close()
        return {}

    out.parent.mkdir(parents=True, exist_ok=True)
    # One fixed name per OUT, so that a later --resume finds what an interrupted run kept.
    tmp = out.parent / f".{out.name}.partial"
    run = ResumableRun(tmp, _settings(path, ck, calib_path, opts), opts.resume)
    # Seconds spent by the interrupted runs this one continues count towards the recipe's total.
    clock = (run.state["tallies"]["seconds"] if run.state else 0.0) - started
    try:
        writer = ShardWriter(tmp)
        tallies = _write_layers(ck, run, writer, tokens, chosen, opts, workers, progress or _silent, clock)
        shards = writer.finish()
        ignore = _ignore_list(ck, opts)
        _write_config(ck, tmp, chosen, opts, ignore)
        recipe = build_recipe(ck, opts, chosen, group_fallbacks, ignore, tallies, device=device, shards=shards,
                              calibration=calib_info if METHODS[opts.method].calibrated else {},
                              resumed_from=run.resumed_from, seconds=round(clock + time.time(), 2))
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        run.finish()
        publish_directory(tmp, out)
    except BaseException as exc:
        # Kept for --resume: finished layers of a run stopped by Ctrl-C, SIGTERM or a crash (out of memory...).
        # Bad input is not kept: fixing it changes the source, which a resumed run would refuse anyway.
        # (A signal that native code turned into a read error is a stop, not bad input: as_stop.)
        if run.state is None or isinstance(as_stop(exc), QuantshipError):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            done = run.state["next_layer"]
            print(f"quantize stopped; {done} of {ck.config.num_hidden_layers} layers are kept in {tmp}: the same "
                  "command with --resume continues from there", file=sys.stderr)
        run.release()
        raise
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        workers.close()
    return recipe


def _settings(path: Path, ck: Checkpoint, calib_path: Path, opts: QuantizeOptions) -> dict:
    """Everything that decides the output's bytes: a resumed run must match them all."""
    # The Hessian budget only decides how many passes gather the same statistics: a resumed run may change it.
    chosen = {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("overwrite", "resume", "expert_hessian_gb")}
    chosen["calib"] = str(calib_path.resolve())
    return {**chosen, "source": str(path.resolve()), "quantship_version": __version__,
            "source_files": source_fingerprint(path, list(ck.files.values())),
            "calib_sha256": sha256_file(calib_path)}


def _silent(*_args, **_kwargs) -> None:
    pass


def _write_layers(ck: Checkpoint, run: ResumableRun, writer: ShardWriter, tokens: torch.Tensor,
                  chosen: dict[str, Scheme], opts: QuantizeOptions, workers: Workers,
                  progress: Callable[..., None], clock: float) -> dict:
    """Every decoder layer (and MTP layer) quantized and handed to the writer; returns the recipe's tallies.

    RTN rounds each weight alone, so it runs no calibration forward pass at all. clock + time.time() is
    the seconds spent so far, earlier interrupted runs included."""
    device = workers.device
    out_dtype = getattr(torch, ck.config.torch_dtype, torch.bfloat16)
    compute_dtype = torch.float32  # GPTQ/AWQ arithmetic wants float32; activations are small
    calibrated = METHODS[opts.method].calibrated
    positions = torch.arange(tokens.shape[1], device=device)
    store = _activation_store(torch.device(device), tokens.numel(), ck.config.hidden_size)
    if run.state:
        hidden, tallies = run.restore(writer)
        hidden = hidden.to(store) if hidden is not None else None
    else:
        outer = ck.outer_state()
        for name, tensor in outer.items():
            writer.add(name, tensor)
        embed = outer["model.embed_tokens.weight"]
        table = embed.to(device, compute_dtype)
        hidden = torch.cat([F.embedding(t.to(device), table).to(store) for t in tokens.split(8)]) if calibrated \
            else None
        del table
        del embed, outer
        writer.end_of_layer()
        tallies = {"expert_tokens": {}, "fallbacks": [], "awq": {}, "seconds": 0.0}
    progress("quantize", ck.config.num_hidden_layers, run.next_layer)
    for index in range(run.next_layer, ck.config.num_hidden_layers):
        raise_if_stopped()  # a signal whose exception native code swallowed stops the run here
        layer = ck.layer(index, compute_dtype, device, _held_experts(f"model.layers.{index}.", chosen))
        _count_held(layer, tallies)
        done = _quantize_layer(layer, f"model.layers.{index}.", hidden, positions, chosen, opts, writer, out_dtype,
                               workers)
        if done["expert_tokens"]:
            tallies["expert_tokens"][str(index)] = done["expert_tokens"]
        tallies["fallbacks"] += done["fallbacks"]
        tallies["awq"].update(done["awq"])
        writer.end_of_layer()
        if calibrated:
            hidden = _run(layer, hidden, positions)
        del layer
        _release_freed_memory()
        tallies["seconds"] = clock + time.time()
        run.record(index + 1, writer, hidden, tallies)
        progress()
    for index in _written_mtp_layers(ck, opts):
        if opts.mtp == "keep":
            M.copy_layer(ck, index, writer)
        else:
            layer = ck.mtp_layer(index, compute_dtype, device, _held_experts(f"model.layers.{index}.", chosen))
            _count_held(layer, tallies)
            mtp_hidden = None
            if calibrated:
                norm = ck.tensor("model.norm.weight")  # the MTP layer reads the main model's normed output
                mtp_hidden = M.calibration_input(layer, tokens, hidden, norm, ck.config.rms_norm_eps)
            done = _quantize_layer(layer, f"model.layers.{index}.", mtp_hidden, positions[:-1], chosen, opts,
                                   writer, out_dtype, workers)
            tallies["fallbacks"] += done["fallbacks"]
            tallies["awq"].update(done["awq"])
            del layer, mtp_hidden
        writer.end_of_layer()
    return tallies


def _written_mtp_layers(ck: Checkpoint, opts: QuantizeOptions) -> list[int]:
    return [] if opts.mtp == "drop" else ck.mtp_indices


def _ignore_list(ck: Checkpoint, opts: QuantizeOptions) -> list[str]:
    """config.json's ignore list: the defaults, --ignore, and the MTP layer's own patterns."""
    mtp_layers = _written_mtp_layers(ck, opts)
    ignore = list(DEFAULT_IGNORE) + list(opts.ignore)
    if mtp_layers:
        ignore += list(M.MTP_IGNORE)
    if mtp_layers and opts.mtp == "keep" and ck.fp8_source is None:
        ignore += [M.layer_pattern(i) for i in mtp_layers]
    return ignore


def _write_config(ck: Checkpoint, tmp: Path, chosen: dict[str, Scheme], opts: QuantizeOptions,
                  ignore: list[str]) -> None:
    """config.json with the quantization_config, and the tokenizer files."""
    mtp_layers = _written_mtp_layers(ck, opts)
    groups = _config_groups(chosen)
    if mtp_layers and opts.mtp == "keep" and ck.fp8_source is not None:
        groups.insert(0, M.fp8_block_group(ck, mtp_layers))  # first: our reader takes the first match
    config = dict(ck.config.raw)
    if "num_nextn_predict_layers" in config or mtp_layers:
        config["num_nextn_predict_layers"] = len(mtp_layers)
    config["quantization_config"] = quantization_config(groups, ignore)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (ck.path / name).is_file():
            shutil.copy(ck.path / name, tmp / name)


def _memory_plan(ck: Checkpoint, opts: QuantizeOptions, device: torch.device, tokens: int, held_linears: int) -> dict:
    """Where this run kept its calibration activations, in how many groups GPTQ solved each MoE layer's
    routed experts, and whether those stayed as stored (see _activation_store, _expert_groups and
    _held_experts; `held_linears` is how many Linears the loaded layers held as stored)."""
    c = ck.config
    offloaded = device.type == "cuda" and _activation_store(device, tokens, c.hidden_size).type == "cpu"
    held = held_linears > 0
    plan = {"activations": "none" if not tokens else "host" if offloaded else "device",
            "activation_bytes": tokens * c.hidden_size * 4, "expert_groups": 1,
            "routed_experts": ("fp8 blocks" if ck.fp8_source else "as stored") if held else "float32"}
    if METHODS[opts.method].gptq and c.n_routed_experts:
        plan["expert_groups"] = -(-c.n_routed_experts // _experts_per_group(c.hidden_size, c.moe_intermediate_size,
                                                                             opts.expert_hessian_gb))
    return plan


def build_recipe(ck: Checkpoint, opts: QuantizeOptions, chosen: dict[str, Scheme], group_fallbacks: dict[str, str],
                 ignore: list[str], tallies: dict, *, device: torch.device, shards: int, calibration: dict,
                 resumed_from: int | None, seconds: float) -> dict:
    """What quantship_recipe.json records of a run: the settings, what each Linear got, and the tallies."""
    mtp_layers = _written_mtp_layers(ck, opts)
    recipe = {
        "quantship_version": __version__,
        "source_model": str(ck.path.resolve()),
        "scheme": opts.scheme if opts.plan is None else "plan",
        "schemes_used": sorted({s.name for s in chosen.values()}),
        "method": opts.method,
        "group_size": next(iter(chosen.values())).weights.group_size,
        "actorder": opts.actorder,
        "ignore": ignore,
        "quantized_linears": len(chosen),
        "group_fallbacks": group_fallbacks,
        "tokens_per_expert": tallies["expert_tokens"],
        "min_expert_tokens": opts.min_expert_tokens,
        "fallbacks": sorted(set(tallies["fallbacks"])),
        "device": str(device),
        "shards": shards,
    }
    if tallies["awq"]:
        recipe["awq"] = tallies["awq"]
    if ck.mtp_indices or ck.config.num_nextn_predict_layers:
        recipe["mtp"] = {"mode": opts.mtp, "layers": mtp_layers,
                         "stored_as": _mtp_precision(ck, opts) if mtp_layers else "dropped"}
    if opts.plan is not None:
        recipe["plan"] = {n: s.name for n, s in chosen.items()}
    recipe["calibration"] = calibration
    recipe["memory"] = _memory_plan(ck, opts, device, calibration["tokens"] if calibration else 0,
                                    tallies.get("held_linears", 0))
    if resumed_from is not None:
        recipe["resumed_from_layer"] = resumed_from
    recipe["seconds"] = seconds
    return recipe


def _mtp_precision(ck: Checkpoint, opts: QuantizeOptions) -> str:
    if opts.mtp == "quantize":
        return f"{opts.scheme} (eh_proj and shared_head as in the source)"
    return "FP8_BLOCK, the source's own FP8 blocks" if ck.fp8_source is not None else "the source dtype"


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
