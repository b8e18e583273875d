"""Loading a packed W4A16 checkpoint's decoder layers: the stored words taken as they are (transposed
into the kernel layout) against unpacking them to int8 and packing again, the path before.

On the H200, `serve` loaded the 6.7B W4A16 model at 83 MB/s against 730 MB/s for bf16 (cold_start.py;
that run's result file was not kept), and the repack was the difference. This measures both paths in
one run, alternating, on the CPU: DeepSeek-Coder-6.7B layers (random weights, RTN W4A16 g128), page
cache warm, median of rounds.

    .venv/bin/python benchmarks/load_packed.py [--layers 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _report import table, update_section, write_result  # noqa: E402


def load_layers(path: Path, keep_packed: bool) -> tuple[float, int]:
    """Seconds to load every decoder layer in bf16, and the bytes of their stored tensors."""
    from quantship.formats.compressed_tensors import CompressedTensorsReader
    from quantship.models.loader import Checkpoint

    read_linear = CompressedTensorsReader.read_linear
    if not keep_packed:  # the reference: the reader unpacks, the runtime packs again
        CompressedTensorsReader.read_linear = lambda self, name, tensors, keep_packed=False, where=None: read_linear(
            self, name, tensors, where=where)
    try:
        ck = Checkpoint(path)
        stored = sum(t.numel() * t.element_size() for i in ck.layer_tensors for t in ck.read(ck.layer_tensors[i]).values())
        started = time.perf_counter()
        for i in range(ck.config.num_hidden_layers):
            ck.layer(i, torch.bfloat16)
        return time.perf_counter() - started, stored
    finally:
        CompressedTensorsReader.read_linear = read_linear


def run(layers: int, rounds: int, workdir: Path) -> dict:
    from quantize_speed import write_checkpoint

    from quantship.quant.pipeline import QuantizeOptions, quantize

    dense, packed = workdir / f"coder-6.7b-{layers}-layers", workdir / f"coder-6.7b-{layers}-layers-w4a16"
    if not (dense / "config.json").exists():
        write_checkpoint("coder-6.7b", layers, dense)
    if not (packed / "config.json").exists():
        quantize(dense, packed, QuantizeOptions(scheme="W4A16", method="rtn", samples=4, seq_len=64), progress=False)
    seconds = {"stored words": [], "unpack and repack": []}
    for _ in range(rounds):
        for label, keep in (("stored words", True), ("unpack and repack", False)):
            s, stored = load_layers(packed, keep)
            seconds[label].append(s)
            print(f"{label}: {s:.2f} s, {stored / s / 1e6:.0f} MB/s", flush=True)
    return {"layers": layers, "rounds": rounds, "stored_bytes": stored, "seconds": seconds,
            "torch": torch.__version__, "cpus": os.cpu_count(), "load_average": os.getloadavg()}


def render(result: dict) -> None:
    write_result("load_packed_cpu", result)
    median = {k: statistics.median(v) for k, v in result["seconds"].items()}
    rows = [[label, f"{s:.2f}", f"{result['stored_bytes'] / s / 1e6:.0f}", f"{median['unpack and repack'] / s:.1f}x"]
            for label, s in median.items()]
    update_section("load_packed", "## Loading packed W4A16 layers\n\n"
        f"`benchmarks/load_packed.py`: {result['layers']} DeepSeek-Coder-6.7B decoder layers (RTN W4A16 g128, "
        f"{result['stored_bytes'] / 1e6:.0f} MB stored) loaded in bf16 on this host's CPU ({result['cpus']} cores, "
        f"load average {result['load_average'][0]:.1f} at the end), median of {result['rounds']} alternating rounds, "
        "page cache warm. compressed-tensors stores a W4A16 "
        "weight as int32 words, eight values each along the input; the kernels hold the same words transposed, "
        "so the loader now transposes them instead of unpacking to int8 and packing again.\n\n"
        + table(["path", "seconds", "MB/s", "speed-up"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/qs-load-packed")
    args = ap.parse_args()
    render(run(args.layers, args.rounds, Path(args.workdir)))


if __name__ == "__main__":
    main()
