"""Integrity of a safetensors shard without reading its tensors: the header parses, the file is
exactly as long as the header says, and safetensors itself accepts the header (known dtypes, each
tensor's bytes matching its shape). A truncated download or a damaged header then fails `info` in one
line instead of a load minutes later."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from quantship.errors import QuantshipError

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def check_shard(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
        if length is None or length > min(size - 8, MAX_HEADER_BYTES):
            raise QuantshipError(f"truncated or not a safetensors file ({size} bytes, no complete header)", path)
        raw = f.read(length)
    try:
        header = json.loads(raw)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        data_bytes = max((int(end) for end in ends), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise QuantshipError(f"corrupt safetensors header ({exc})", path) from None
    if 8 + length + data_bytes != size:
        raise QuantshipError(f"truncated safetensors file: its header describes {8 + length + data_bytes} bytes, "
                             f"the file holds {size}", path)
    try:  # the rest of the header's rules are safetensors' own: let it judge (it reads only the header)
        with safe_open(str(path), framework="pt", device="cpu"):
            pass
    except (SafetensorError, OSError, ValueError) as exc:
        raise QuantshipError(f"corrupt safetensors header ({exc})", path) from None
