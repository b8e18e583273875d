"""Synthetic checkpoints in DeepSeek-V3's published FP8 layout, made from a bf16 checkpoint.

Every decoder Linear becomes float8 e4m3 `weight` + float32 `weight_scale_inv` [ceil(out/128),
ceil(in/128)]; embeddings, norms, routers (and their bias) and lm_head stay bf16; config.json gets
DeepSeek's `quantization_config`. With `mtp`, a multi-token-prediction layer is appended the way
V3 stores layer 61: `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}` and a
full decoder layer (here a copy of the last one), with `num_nextn_predict_layers: 1`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantship.quant.fp8_block import block_quantize

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*_proj(_with_mqa)?\.weight$")


def _mtp_tensors(tensors: dict[str, torch.Tensor], last: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mtp = last + 1
    out = {n.replace(f"model.layers.{last}.", f"model.layers.{mtp}.", 1): t.clone()
           for n, t in tensors.items() if n.startswith(f"model.layers.{last}.")}
    bf16 = torch.bfloat16
    out[f"model.layers.{mtp}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    out[f"model.layers.{mtp}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    out[f"model.layers.{mtp}.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    out[f"model.layers.{mtp}.enorm.weight"] = (1 + 0.1 * torch.randn(hidden, generator=g)).to(bf16)
    out[f"model.layers.{mtp}.hnorm.weight"] = (1 + 0.1 * torch.randn(hidden, generator=g)).to(bf16)
    out[f"model.layers.{mtp}.eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) * 0.03).to(bf16)
    return out


def convert_to_fp8(source: Path, out: Path, mtp: bool = True, seed: int = 0, fp8: bool = True) -> Path:
    """Write `source` (a bf16 DeepSeek-V3 checkpoint, one shard or several) to `out` in the FP8 block layout
    (or, with fp8=False, as the bf16 checkpoint with the MTP layer added)."""
    out.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        tensors.update(load_file(source / shard))
    if mtp:
        tensors.update(_mtp_tensors(tensors, config["num_hidden_layers"] - 1, config["hidden_size"], seed))
        config["num_nextn_predict_layers"] = 1
    converted: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if fp8 and _QUANTIZED.match(name):
            values, scale = block_quantize(t.float())
            converted[name] = values
            converted[name + "_scale_inv"] = scale
        else:
            converted[name] = t
    # Two shards, the MTP layer in the second, as the published checkpoints spread layers over files.
    names = sorted(converted)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: converted[n].contiguous() for n in part}, str(out / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if fp8:
        config["quantization_config"] = dict(FP8_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in source.iterdir():
        if f.suffix in (".json", ".txt", ".jinja") and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out
