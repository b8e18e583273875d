"""Which quantship can serve which checkpoint: a small matrix of semantic-version ranges.

A checkpoint quantship wrote records the writer's version in quantship_recipe.json. The packed
layout, the recipe and the config fields a reader relies on can change between minor releases
while the major version is 0, so a row says which writer versions a range of code versions reads.
Checkpoints from other tools (no recipe) are judged by their format alone.
"""

from __future__ import annotations

import re

from quantship.errors import QuantshipError

# (code versions, checkpoint writer versions that code reads)
COMPATIBILITY = (
    (">=0.1.0 <0.2.0", ">=0.1.0 <0.2.0"),
)
# Formats our model loader reads, whoever wrote them.
READABLE_FORMATS = ("safetensors", "compressed-tensors/pack-quantized", "compressed-tensors/int-quantized",
                    "compressed-tensors/float-quantized", "compressed-tensors/naive-quantized",
                    "compressed-tensors/mixed-precision",
                    # our ONNX exports: verify and the ONNX Runtime runner read them (Triton serves them)
                    "onnx/fp32", "onnx/fp16", "onnx/int4", "onnx/int8-dynamic", "onnx/int8-static")

_SEMVER = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?$")
_COMPARATOR = re.compile(r"^(>=|<=|>|<|==|=)?(.+)$")


def parse(version: str) -> tuple:
    """Sortable key of a semantic version; a pre-release sorts before its release."""
    m = _SEMVER.match(str(version).strip())
    if not m:
        raise QuantshipError(f"{version!r} is not a semantic version (MAJOR.MINOR.PATCH)")
    major, minor, patch, pre = m.groups()
    pre_key = tuple(int(p) if p.isdigit() else p for p in pre.split(".")) if pre else ()
    # Release (1) after pre-release (0); numeric identifiers before alphanumeric ones.
    return int(major), int(minor), int(patch), 0 if pre else 1, tuple((isinstance(p, str), p) for p in pre_key)


def satisfies(version: str, spec: str) -> bool:
    """`spec` is space-separated comparators, all of which must hold: ">=0.1.0 <0.2.0"."""
    key = parse(version)
    for part in spec.split():
        op, bound = _COMPARATOR.match(part).groups()
        other = parse(bound)
        ok = {">=": key >= other, "<=": key <= other, ">": key > other, "<": key < other}.get(op or "==", key == other)
        if not ok:
            return False
    return True


def compatible(code_version: str, writer_version: str | None, checkpoint_format: str) -> tuple[bool, str]:
    """(verdict, one-line reason) for serving a checkpoint with this code."""
    if checkpoint_format not in READABLE_FORMATS:
        return False, f"format {checkpoint_format} is not one quantship {code_version} reads"
    if writer_version is None:
        return True, (f"{checkpoint_format} checkpoint without a quantship recipe; "
                      f"quantship {code_version} reads the format")
    for code_range, writer_range in COMPATIBILITY:
        if satisfies(code_version, code_range):
            if satisfies(writer_version, writer_range):
                return True, f"written by quantship {writer_version}, which quantship {code_version} reads"
            newer = parse(writer_version) > parse(code_version)
            hint = "upgrade quantship" if newer else "re-quantize with this quantship"
            return False, (f"written by quantship {writer_version}; quantship {code_version} reads checkpoints "
                           f"written by {writer_range} ({hint})")
    return False, f"quantship {code_version} has no row in the compatibility matrix"
