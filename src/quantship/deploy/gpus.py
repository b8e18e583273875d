"""The GPU table (gpus.yaml: memory, bandwidth, BF16 throughput and where each number comes from)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from quantship.errors import QuantshipError
from quantship.files import read_yaml_file

TABLE = Path(__file__).parent / "gpus.yaml"
MIB = 2**20


@dataclass(frozen=True)
class Gpu:
    name: str
    product: str | None  # nvidia.com/gpu.product; None for a GPU given only by its memory
    memory_mib: float
    bandwidth_gbs: float | None = None
    bf16_tflops: float | None = None
    measured_bandwidth_gbs: float | None = None
    sources: dict = field(default_factory=dict, compare=False)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mib * MIB)

    @property
    def bandwidth(self) -> float | None:
        """Bytes/s for the roofline: the measured copy bandwidth where the table has one."""
        gbs = self.measured_bandwidth_gbs or self.bandwidth_gbs
        return gbs * 1e9 if gbs else None

    @property
    def bandwidth_label(self) -> str:
        return self.bandwidth_source.split(" (")[0]

    @property
    def bandwidth_source(self) -> str:
        if self.measured_bandwidth_gbs:
            return f"measured {self.measured_bandwidth_gbs:g} GB/s ({self.sources.get('measured', 'gpus.yaml')})"
        if self.bandwidth_gbs:
            return f"datasheet {self.bandwidth_gbs:g} GB/s ({self.sources.get('datasheet', 'gpus.yaml')})"
        return "unknown"


@dataclass(frozen=True)
class CudaOverhead:
    driver_reserved_bytes: int  # memory.total that never reaches the process
    context_bytes: int  # the process's CUDA context before its first tensor
    sources: dict = field(default_factory=dict, compare=False)


@functools.cache
def _table() -> tuple[tuple[Gpu, ...], CudaOverhead]:
    raw = read_yaml_file(TABLE, "GPU table")
    try:
        gpus = tuple(Gpu(**entry) for entry in raw["gpus"])
        o = raw["cuda_overhead"]
        overhead = CudaOverhead(int(o["driver_reserved_mib"] * MIB), int(o["context_mib"] * MIB), o.get("sources", {}))
    except (KeyError, TypeError) as exc:
        raise QuantshipError(f"malformed GPU table ({exc})", TABLE) from None
    return gpus, overhead


def gpus() -> tuple[Gpu, ...]:
    return _table()[0]


def cuda_overhead() -> CudaOverhead:
    return _table()[1]


def find_gpu(name: str, flag: str = "--gpu") -> Gpu:
    """A table entry by its short name (H200) or its node label (NVIDIA-H200), case-insensitive."""
    key = name.strip().lower()
    for gpu in gpus():
        if key in (gpu.name.lower(), (gpu.product or "").lower()):
            return gpu
    known = ", ".join(g.name for g in gpus())
    raise QuantshipError(f"{flag} {name!r} is not in the GPU table (known: {known}; or give --gpu-memory GB)")


def gpu_of_memory(gb: float) -> Gpu:
    """A GPU known only by its memory (decimal GB, as datasheets count): no roofline without bandwidth."""
    return Gpu(name=f"{gb:g} GB GPU", product=None, memory_mib=gb * 1e9 / MIB)
