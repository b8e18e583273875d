"""From model facts to a pod's shape: CPU and memory, and how long it may take to start (how many
GPUs, and the batch they hold, come from the capacity planner: serving.py).

Startup budget (the startupProbe's failureThreshold × periodSeconds):

    load_estimate_s = size_bytes / load_bandwidth + warmup_s[engine]
    budget_s        = SAFETY × load_estimate_s
    failureThreshold = ceil(budget_s / PERIOD_S)

load_bandwidth is the stated read rate of the model cache volume (default 250 MB/s, what a network
volume sustains; a local NVMe reads several GB/s). warmup_s covers what happens after the weights
are in: vLLM profiles memory and captures CUDA graphs (minutes on large models), the native engine
only allocates its KV cache. SAFETY (1.5) absorbs a slower volume or a busy node: a pod that is still
loading must never be killed by its liveness probe, since it would start over from zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantship.errors import QuantshipError

GIB = 2**30
DEFAULT_GPU = "NVIDIA-H100-80GB-HBM3"  # a product label of deploy/gpus.yaml, where the GPUs' numbers live
DEFAULT_LOAD_MBPS = 250.0
WARMUP_S = {"vllm": 300, "native": 30}
SAFETY = 1.5
PERIOD_S = 10
INT32_MAX = 2**31 - 1  # replica counts are int32 in the Kubernetes API


@dataclass(frozen=True)
class Startup:
    load_estimate_s: int  # size / bandwidth + warmup: the expected cold start
    budget_s: int  # failureThreshold × periodSeconds
    failure_threshold: int
    period_s: int = PERIOD_S


def startup(size_bytes: int, load_mbps: float, engine: str) -> Startup:
    if not 0 < load_mbps < math.inf:  # also refuses NaN
        raise QuantshipError(f"--load-bandwidth must be a positive number of MB/s, got {load_mbps}")
    estimate = math.ceil(size_bytes / (load_mbps * 1e6) + WARMUP_S[engine])
    threshold = math.ceil(SAFETY * estimate / PERIOD_S)
    return Startup(load_estimate_s=estimate, budget_s=threshold * PERIOD_S, failure_threshold=threshold)


def load_estimate_s(size_bytes: int, load_bytes_per_s: float, warmup_s: float) -> float:
    """The same estimate from the numbers recorded in a workload's annotations (used by validate)."""
    return size_bytes / load_bytes_per_s + warmup_s


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
