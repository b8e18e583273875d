"""From model facts to a pod's shape: CPU and memory, and how long it may take to start (how many
GPUs, and the batch they hold, come from the capacity planner: serving.py).

Startup budget (the startupProbe's failureThreshold × periodSeconds):

    load_estimate_s  = size_bytes / load_bandwidth + size_bytes / load_rate + fixed_s
    budget_s         = SAFETY × load_estimate_s
    failureThreshold = ceil(budget_s / PERIOD_S)

load_bandwidth is the stated read rate of the model cache volume (default 250 MB/s: a network volume;
AWS EBS gp3 gives 125 to 1000 MiB/s, a local NVMe several GB/s). load_rate and fixed_s are the
server's own, measured by benchmarks/cold_start.py and kept in startup.yaml with their sources: the
rate at which the load_weights phase turns read bytes into loaded weights, and every phase that does
not grow with the checkpoint (imports, cache, CUDA graphs, warm-up). SAFETY (1.5) absorbs a slower
volume or a busy node: a pod that is still loading must never be killed by its liveness probe, since it
would start over from zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from quantship.errors import QuantshipError

GIB = 2**30
DEFAULT_GPU = "NVIDIA-H100-80GB-HBM3"  # a product label of deploy/gpus.yaml, where the GPUs' numbers live
DEFAULT_LOAD_MBPS = 250.0
ENGINES = ("native", "vllm")
PROFILES = Path(__file__).parent / "startup.yaml"
SAFETY = 1.5
PERIOD_S = 10
INT32_MAX = 2**31 - 1  # replica counts are int32 in the Kubernetes API


@dataclass(frozen=True)
class Startup:
    load_estimate_s: int  # size / bandwidth + size / load rate + fixed: the expected cold start
    budget_s: int  # failureThreshold × periodSeconds
    failure_threshold: int
    period_s: int = PERIOD_S
    load_rate_bytes_per_s: float | None = None  # the server's load_weights rate (None: not counted)
    fixed_s: float = 0.0  # the phases that do not grow with the checkpoint
    source: str = ""  # where load_rate and fixed_s come from


def cold_start_profile(engine: str, device: str) -> dict:
    """startup.yaml's entry for this engine on this device (vLLM: cuda)."""
    from quantship.files import read_yaml_file

    profiles = read_yaml_file(PROFILES, "cold-start profiles")
    entry = (profiles.get(engine) or {}).get(device) or (profiles.get(engine) or {}).get("cuda")
    if not entry:
        raise QuantshipError(f"no cold-start profile for {engine} on {device}", PROFILES)
    return entry


def startup(size_bytes: int, load_mbps: float, engine: str, device: str = "cuda",
            load_rate_mbps: float | None = None) -> Startup:
    if not 0 < load_mbps < math.inf:  # also refuses NaN
        raise QuantshipError(f"--load-bandwidth must be a positive number of MB/s, got {load_mbps}")
    if load_rate_mbps is not None and not 0 < load_rate_mbps < math.inf:
        raise QuantshipError(f"--engine-load-rate must be a positive number of MB/s, got {load_rate_mbps}")
    profile = cold_start_profile(engine, device)
    measured = profile.get("load_bytes_per_second")
    rate = load_rate_mbps * 1e6 if load_rate_mbps else (float(measured) if measured else None)
    source = "--engine-load-rate" if load_rate_mbps else str(profile.get("source", ""))
    fixed = float(profile["fixed_seconds"])
    estimate = math.ceil(load_estimate_s(size_bytes, load_mbps * 1e6, fixed, rate))
    threshold = math.ceil(SAFETY * estimate / PERIOD_S)
    return Startup(load_estimate_s=estimate, budget_s=threshold * PERIOD_S, failure_threshold=threshold,
                   load_rate_bytes_per_s=rate, fixed_s=fixed, source=source)


def load_estimate_s(size_bytes: float, load_bytes_per_s: float, warmup_s: float,
                    load_rate_bytes_per_s: float | None = None) -> float:
    """The estimate, also from the numbers recorded in a workload's annotations (used by validate)."""
    return size_bytes / load_bytes_per_s + (size_bytes / load_rate_bytes_per_s if load_rate_bytes_per_s else 0) \
        + warmup_s


def pod_resources(size_bytes: int, gpus: int, cpu: str | None, memory: str | None) -> dict[str, str]:
    """CPU and memory requests (= limits). On GPU the host holds tokenizer, server and pinned
    buffers; on CPU the native engine holds the weights upcast to float32 plus its KV cache."""
    if gpus:
        default_cpu, default_mem = str(min(8 * gpus, 64)), f"{32 * gpus}Gi"
    else:
        default_cpu, default_mem = "4", f"{math.ceil((3 * size_bytes + 2 * GIB) / GIB)}Gi"
    out = {"cpu": cpu or default_cpu, "memory": memory or default_mem}
    if gpus:
        out["nvidia.com/gpu"] = str(gpus)
    return out


def parse_replicas(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":")) if ":" in text else (int(text), int(text))
    except ValueError:
        raise QuantshipError(f"--replicas wants MIN:MAX, got {text!r}") from None
    if low < 1 or high < low or high > INT32_MAX:
        raise QuantshipError(f"--replicas {text}: need 1 <= MIN <= MAX <= {INT32_MAX} (a model that takes minutes "
                             "to load is not scaled to zero)")
    return low, high
