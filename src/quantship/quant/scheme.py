"""Quantization schemes as plain data, named like llm-compressor's presets.

A scheme says how weights (and, for W8A8/FP8, activations) are quantized and which
compressed-tensors format stores them. Targets are every Linear of the decoder layers; the
default ignore list keeps lm_head and the MoE routers in the original dtype (embeddings and
norms are not Linear layers and are never quantized).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quantship.errors import QuantshipError
from quantship.quantized_tensor import ActivationQuant, WeightQuant, matches_target


@dataclass(frozen=True)
class Scheme:
    name: str
    weights: WeightQuant
    input_activations: ActivationQuant | None = None
    format: str = "pack-quantized"

    @property
    def bits_per_weight(self) -> float:
        """Average stored bits per weight, scales and zero points included (bf16 scales)."""
        w = self.weights
        if w.strategy == "block":
            return w.num_bits + 32 / (w.block[0] * w.block[1])  # float32 block scales
        if w.strategy != "group":
            return float(w.num_bits)
        extra = 16 + (0 if w.symmetric else w.num_bits)
        return w.num_bits + extra / w.group_size

    def with_group_size(self, group_size: int) -> "Scheme":
        # W8A16 is per-channel by default; grouped, it is what llama.cpp's Q8_0 blocks hold (group 32).
        weight_only_int8 = self.name == "W8A16"
        if self.weights.strategy != "group" and not weight_only_int8:
            raise QuantshipError(f"--group-size applies to grouped schemes (W4A16*, W8A16), not {self.name}")
        weights = dataclasses.replace(self.weights, strategy="group", group_size=group_size)
        return dataclasses.replace(self, weights=weights)

    def with_actorder(self, actorder: str | None) -> "Scheme":
        return dataclasses.replace(self, weights=dataclasses.replace(self.weights, actorder=actorder))

    def fitted_to(self, in_features: int) -> "Scheme":
        """This scheme, or what a Linear with `in_features` inputs falls back to when the group size does
        not divide them: the largest smaller group of GROUP_SIZES that does, else one scale per channel
        (DeepSeek-V2-Lite's dense down_proj, 10944 wide, takes group 64 under W4A16)."""
        w = self.weights
        if w.strategy != "group" or in_features % w.group_size == 0:
            return self
        for size in sorted((g for g in GROUP_SIZES if g < w.group_size), reverse=True):
            if in_features % size == 0:
                return dataclasses.replace(self, weights=dataclasses.replace(w, group_size=size))
        return dataclasses.replace(self, weights=dataclasses.replace(w, strategy="channel", group_size=None))

    def describe_weights(self) -> str:
        w = self.weights
        if w.strategy == "group":
            return f"group {w.group_size}"
        return f"block {w.block[0]}x{w.block[1]}" if w.strategy == "block" else f"per {w.strategy}"


PRESETS: dict[str, Scheme] = {
    "W4A16": Scheme("W4A16", WeightQuant(4, "int", True, "group", 128)),
    "W4A16_ASYM": Scheme("W4A16_ASYM", WeightQuant(4, "int", False, "group", 128)),
    "W8A16": Scheme("W8A16", WeightQuant(8, "int", True, "channel", None)),
    "W8A8": Scheme("W8A8", WeightQuant(8, "int", True, "channel", None), ActivationQuant(), "int-quantized"),
    "FP8_DYNAMIC": Scheme("FP8_DYNAMIC", WeightQuant(8, "float", True, "channel", None),
                          ActivationQuant(type="float"), "float-quantized"),
    # DeepSeek-V3's own format (and llm-compressor's preset): float8 weights with a scale per 128x128
    # block, activations quantized on the fly per token and group of 128. Data-free: always rounded.
    "FP8_BLOCK": Scheme("FP8_BLOCK", WeightQuant(8, "float", True, "block", None, block=(128, 128)),
                        ActivationQuant(type="float", strategy="group", group_size=128), "float-quantized"),
}
# Lower-bit variants exist to show what a bad setting does (verify must catch them), not to ship.
PRESETS["W3A16"] = Scheme("W3A16", WeightQuant(3, "int", True, "group", 128))
PRESETS["W2A16"] = Scheme("W2A16", WeightQuant(2, "int", True, "group", 128))

GROUP_SIZES = (32, 64, 128)
DEFAULT_IGNORE = ("lm_head", "re:.*mlp\\.gate$")


def get_scheme(name: str, group_size: int | None = None) -> Scheme:
    key = name.upper().replace("-", "_")
    if key not in PRESETS:
        raise QuantshipError(f"unknown scheme {name!r}; choose one of {', '.join(PRESETS)}")
    scheme = PRESETS[key]
    if group_size is not None:
        if group_size not in GROUP_SIZES:
            raise QuantshipError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
        scheme = scheme.with_group_size(group_size)
    return scheme


def is_ignored(name: str, ignore: tuple[str, ...] | list[str]) -> bool:
    return any(matches_target(name, p) for p in ignore)
