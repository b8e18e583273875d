"""Read a Hugging Face checkpoint directory lazily, one decoder layer at a time.

Tensors are read from safetensors shards on demand (memory-mapped), so walking all layers
holds about one layer plus the embeddings. Pickle files (.bin/.pt) are refused, never opened.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from quantship.errors import QuantshipError
from quantship.formats.compressed_tensors import CompressedTensorsReader
from quantship.models.causal_lm import CausalLM, build_layer
from quantship.models.config import ModelConfig, load_config
from quantship.models.fp8_block import SCALE_SUFFIX, Fp8Source, dequantize_state, is_fp8_block_source
from quantship.models.held import HeldLinear
from quantship.models.mtp import MTPLayer
from quantship.models.quantized import runtime_linear

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# transformers 5 may write routed experts fused as 3-D tensors; we split them into per-expert Linears.
_FUSED = re.compile(r"^(.*mlp\.experts\.)(gate_up_proj|down_proj)$")


ABSORBED = "self_attn.kv_b_proj"  # kept dequantized when loaded (see Checkpoint._swap_quantized)


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with transformers 5's fused expert tensors ([E, 2I, H] gate+up, [E, H, I] down) split
    into the per-expert Linear weights the published checkpoints and our model use (views, no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        fused = _FUSED.match(name)
        if not fused:
            out[name] = t
            continue
        prefix, kind = fused.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = t[e].chunk(2, dim=0)
            else:
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
    return out


def _all_finite(t: torch.Tensor) -> bool:
    # In chunks: isfinite on a whole bf16 embedding upcasts it, tripling the peak memory of a load.
    # float8 has no isfinite kernel; its chunks are upcast (they are small).
    upcast = t.element_size() == 1
    return all(bool(torch.isfinite(c.float() if upcast else c).all()) for c in t.reshape(-1).split(1 << 22))


class Checkpoint:
    """A validated model directory: its config and a map from tensor name to shard."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            raise QuantshipError("model directory not found", self.path)
        self.config: ModelConfig = load_config(self.path)
        qconfig = self.config.raw.get("quantization_config")
        # A DeepSeek FP8 source is read as the dense model it stands for; compressed-tensors stays quantized.
        config_path = self.path / "config.json"
        self.fp8_source = Fp8Source.from_config(qconfig, config_path) if is_fp8_block_source(qconfig) else None
        self.quantized = CompressedTensorsReader(qconfig, config_path) if qconfig and not self.fp8_source else None
        self.files = self._index()
        self.layer_tensors: dict[int, list[str]] = {}
        for name in self.files:
            m = _LAYER.match(name)
            if m:
                self.layer_tensors.setdefault(int(m.group(1)), []).append(name)

    def _index(self) -> dict[str, Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
                raise QuantshipError(f"malformed index ({exc})", index) from None
            files = {name: self.path / shard for name, shard in weight_map.items()}
            for shard in sorted(set(files.values())):
                if not shard.is_file():
                    raise QuantshipError(f"shard listed in {INDEX_FILE} is missing", shard)
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            pickles = [p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES]
            if pickles:
                raise QuantshipError(
                    f"pickle checkpoint ({pickles[0]}) refused: pickles can run code; convert it to safetensors",
                    self.path,
                )
            raise QuantshipError("no *.safetensors weights found", self.path)
        files: dict[str, Path] = {}
        for shard in shards:
            for name in self._open(shard).keys():
                files[name] = shard
        return files

    def _open(self, shard: Path):
        try:
            return safe_open(str(shard), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise QuantshipError(f"unreadable safetensors file ({exc})", shard) from None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read tensors, opening each shard once and closing it after, so no mapping outlives the call
        (a shard left mapped keeps every page it served resident)."""
        by_shard: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.files:
                raise QuantshipError(f"tensor {name} is missing from the checkpoint", self.path)
            by_shard.setdefault(self.files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard, shard_names in by_shard.items():
            handle = self._open(shard)
            for name in shard_names:
                try:
                    t = handle.get_tensor(name)
                except (SafetensorError, OSError, ValueError) as exc:
                    raise QuantshipError(f"cannot read tensor {name} ({exc})", shard) from None
                if t.is_floating_point() and not _all_finite(t):
                    raise QuantshipError(f"tensor {name} holds NaN or Inf values", shard)
                out[name] = t
            del handle
        return out

    def tensor(self, name: str) -> torch.Tensor:
        return self.read([name])[name]

    def layer_state(self, index: int, held: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
        """The tensors of decoder layer `index`, named relative to the layer, experts split per expert.
        FP8 sources come dequantized to float32, but for the Linears `held` names (kept as stored)."""
        prefix = f"model.layers.{index}."
        raw = self.read(self.layer_tensors.get(index, []))
        state = split_fused_experts({name[len(prefix):]: t for name, t in raw.items()})
        if self.fp8_source is not None:
            dequantize_state(state, self.fp8_source.block, prefix, self.files, held)
        return state

    def _fill(self, module: nn.Module, state: dict[str, torch.Tensor], where: str, dtype, device) -> nn.Module:
        expected = module.state_dict()
        missing = [k for k in expected if k not in state]
        if missing:
            raise QuantshipError(f"{where}: missing tensor(s) {', '.join(missing[:3])}", self.path)
        for key, ref in expected.items():
            if ref.is_floating_point() and not state[key].is_floating_point():  # a damaged header, or a mix-up
                raise QuantshipError(f"{where}.{key} is stored as {state[key].dtype}, a weight must be floating point",
                                     self.files.get(f"{where}.{key}", self.path))
            if tuple(state[key].shape) != tuple(ref.shape):
                raise QuantshipError(
                    f"{where}.{key} has shape {list(state[key].shape)}, the config implies {list(ref.shape)}",
                    self.files.get(f"{where}.{key}", self.path),
                )
        module.load_state_dict({k: state[k] for k in expected}, strict=True, assign=True)
        return module.to(device=device, dtype=dtype)

    @property
    def mtp_indices(self) -> list[int]:
        """The MTP layers present (declared by num_nextn_predict_layers and stored after the main layers)."""
        first = self.config.num_hidden_layers
        return [i for i in range(first, first + self.config.num_nextn_predict_layers) if i in self.layer_tensors]

    def layer(self, index: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              held: Callable[[str], bool] | None = None) -> nn.Module:
        """Decoder layer `index` in `dtype` on `device`; the Linears `held` names (relative to the layer)
        stay as the checkpoint stores them (models/held.py)."""
        if not 0 <= index < self.config.num_hidden_layers:
            raise IndexError(index)
        with torch.device("meta"):
            layer = build_layer(self.config, index)
        return self._load_layer(layer, index, dtype, device, held)

    def mtp_layer(self, index: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  held: Callable[[str], bool] | None = None) -> MTPLayer:
        if index not in self.mtp_indices:
            raise IndexError(index)
        with torch.device("meta"):
            layer = MTPLayer(self.config, index)
        return self._load_layer(layer, index, dtype, device, held)

    def _load_layer(self, layer: nn.Module, index: int, dtype, device, held=None) -> nn.Module:
        if self.quantized is not None:
            held = None  # a quantized checkpoint's Linears are swapped for the layers that run them
        state = self.layer_state(index, held)
        if self.quantized is not None:
            self._swap_quantized(layer, f"model.layers.{index}", state)
        if held is not None:
            self._hold(layer, held, state)
        return self._fill(layer, state, f"model.layers.{index}", dtype, device)

    def _hold(self, layer: nn.Module, held: Callable[[str], bool], state: dict[str, torch.Tensor]) -> None:
        """Swap the (meta) Linears `held` names for HeldLinears of the same shape, FP8 blocks where the
        state still has their scales; _fill then assigns the stored tensors as they are."""
        for name, module in list(layer.named_modules()):
            if type(module) is not nn.Linear or not held(name):
                continue
            block = self.fp8_source.block if name + SCALE_SUFFIX in state else None
            owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
            setattr(layer.get_submodule(owner), attr,
                    HeldLinear(module.in_features, module.out_features, block, module.bias is not None))

    def _swap_quantized(self, layer: nn.Module, prefix: str, state: dict[str, torch.Tensor]) -> None:
        """Replace every Linear of `layer` whose tensors in `state` are quantized by the layer that runs them;
        their stored tensors are consumed and the new layer's own put in their place."""
        for name, module in list(layer.named_modules()):
            if not isinstance(module, nn.Linear) or f"{name}.weight_scale" not in state:
                continue
            local = {k[len(name) + 1:]: state.pop(k) for k in list(state) if k.startswith(name + ".")}
            weight, activations = self.quantized.read_linear(f"{prefix}.{name}", local, keep_packed=True,
                                                             where=self.files.get(f"{prefix}.{name}.weight_scale"))
            new = runtime_linear(weight, activations, local.pop("bias", None))
            if name == ABSORBED:
                # MLA's decode absorbs this weight into the queries and the output, reading it whole in
                # every layer of every step: it is held dequantized, once (vLLM does the same), instead of
                # dequantized per step. A few percent of the weights (DeepSeek-V3: 1 GB more in W4A16).
                state[f"{name}.weight"] = new.dequantized_weight(torch.float32)
                continue
            owner, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(owner) if owner else layer, attr, new)
            state.update({f"{name}.{k}": v for k, v in new.state_dict().items()})

    def iter_layers(self, dtype: torch.dtype = torch.float32, device="cpu") -> Iterator[tuple[int, nn.Module]]:
        for i in range(self.config.num_hidden_layers):
            yield i, self.layer(i, dtype, device)

    def outer_state(self) -> dict[str, torch.Tensor]:
        """Embeddings, final norm and lm_head: everything outside the decoder layers."""
        if "lm_head.weight_scale" in self.files:
            raise QuantshipError("a quantized lm_head is not supported; keep lm_head in the ignore list", self.path)
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings or "lm_head.weight" in self.files:
            names.append("lm_head.weight")
        return self.read(names)

    def load_model(self, dtype: torch.dtype = torch.float32, device="cpu") -> CausalLM:
        layers = [layer for _, layer in self.iter_layers(dtype, device)]
        with torch.device("meta"):
            model = CausalLM(self.config, layers=[])
        model.model.layers = nn.ModuleList(layers)
        outer = self.outer_state()
        if self.config.tie_word_embeddings and "lm_head.weight" not in outer:
            outer["lm_head.weight"] = outer["model.embed_tokens.weight"]
        for name, tensor in outer.items():
            owner, attr = name.rsplit(".", 1)
            target = model.get_submodule(owner)
            current = getattr(target, attr)
            if tuple(current.shape) != tuple(tensor.shape):
                raise QuantshipError(
                    f"{name} has shape {list(tensor.shape)}, the config implies {list(current.shape)}",
                    self.files.get(name, self.path),
                )
            if not tensor.is_floating_point():
                raise QuantshipError(f"{name} is stored as {tensor.dtype}, a weight must be floating point",
                                     self.files.get(name, self.path))
            setattr(target, attr, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
        if self.config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval().requires_grad_(False)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.files.values()))


def load_model(path: Path | str, dtype: torch.dtype = torch.float32, device="cpu") -> CausalLM:
    return Checkpoint(path).load_model(dtype, device)
