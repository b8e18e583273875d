"""What `quantship deploy` takes from the capacity planner: how many GPUs to request, the batch
(--max-num-seqs) and the memory fraction the server gets, recorded in the workload's annotations.

The planner is asked at two contexts: PLAN_CONTEXT (or the served context when shorter), where the
batch is chosen (the roofline's throughput-optimal batch, at most what the cache holds there), and
the served context (max_model_len), which must fit at least one sequence on the GPUs requested.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from quantship.deploy import capacity
from quantship.deploy.gpus import find_gpu
from quantship.errors import QuantshipError

PLAN_CONTEXT = 4096
CPU_BATCH_CAP = 64  # the engine's default max_num_seqs: a CPU has no roofline to choose by
MAX_GPUS = 8  # one node; multi-node tensor parallelism is out of scope


@dataclass
class ServingPlan:
    gpus: int
    max_num_seqs: int | None = None
    kv_cache_fraction: float | None = None  # native engine
    gpu_memory_utilization: float | None = None  # vLLM
    plan_context: int | None = None
    seqs_at: dict[int, int] = field(default_factory=dict)  # context -> sequences the cache holds at once
    command: str | None = None  # the `quantship capacity` command that shows the plan
    note: str = ""

    def to_dict(self) -> dict:
        return {k: ({str(c): n for c, n in v.items()} if k == "seqs_at" else v) for k, v in asdict(self).items()}


def _contexts(max_model_len: int) -> tuple[int, ...]:
    return tuple(sorted({min(PLAN_CONTEXT, max_model_len), max_model_len}))


def _command(model: str, gpu: str | None, gpus: int, contexts: tuple[int, ...]) -> str:
    where = f"--gpu {gpu}" if gpu else "(CPU)"
    return f"quantship capacity {model} {where} --context {','.join(map(str, contexts))}" + \
        (f"  (per GPU of {gpus}, tensor parallel)" if gpus > 1 else "")


def serving_plan(model: str, gpu_type: str, gpus: int | None, engine: str, max_model_len: int,
                 num_heads: int) -> ServingPlan:
    contexts = _contexts(max_model_len)
    if gpus == 0:
        p = capacity.plan(capacity.Request(model=model, device="cpu", contexts=contexts, batch_cap=CPU_BATCH_CAP,
                                           compare_schemes=False))
        out = _from(p, 0, engine, contexts, model, None, "CPU engine: a fixed 2 GiB KV cache, batch at most the "
                    f"engine's default {CPU_BATCH_CAP}")
        out.command = None  # `quantship capacity` plans GPUs
        return out
    try:
        gpu = find_gpu(gpu_type, "--gpu-type")
    except QuantshipError:
        if gpus is None:
            raise QuantshipError(f"--gpu-type {gpu_type!r} is not in the GPU table (deploy/gpus.yaml); give --gpus N "
                                 "or add the GPU to the table") from None
        return ServingPlan(gpus=gpus, note=f"{gpu_type} is not in the GPU table: batch and memory left to the engine")
    if engine == "native" and (gpus or 1) > 1:
        raise QuantshipError("the native engine runs on one GPU; --gpus above 1 needs --engine vllm (tensor parallel)")
    candidates = [gpus] if gpus else [g for g in (1, 2, 4, 8) if g == 1 or engine == "vllm"]
    last = None
    for g in candidates:
        if num_heads % g:
            continue
        try:
            p = capacity.plan(capacity.Request(model=model, gpu=gpu.name, contexts=contexts, gpus=g,
                                               compare_schemes=False))
        except QuantshipError as exc:
            last = exc
            continue
        if p.row(max_model_len).seqs_engine >= 1:
            return _from(p, g, engine, contexts, model, gpu.name, "")
        last = QuantshipError(f"not one sequence of {max_model_len} tokens fits next to the weights on {g} x {gpu.name}")
    tried = f"{candidates[-1]} x {gpu.product}"
    hint = "; --engine vllm spreads it over up to 8 GPUs" if engine == "native" else ""
    reason = str(last).split("; quantize")[0]  # the planner's own advice is the same as below
    raise QuantshipError(f"the model does not fit {tried}: {reason}; quantize the model (quantship quantize), "
                         f"lower --max-model-len or pick a larger --gpu-type{hint}")


def _from(p: capacity.Plan, gpus: int, engine: str, contexts: tuple[int, ...], model: str, gpu: str | None,
          note: str) -> ServingPlan:
    rec = p.recommended
    out = ServingPlan(gpus=gpus, max_num_seqs=rec["max_num_seqs"], plan_context=rec["context"],
                      seqs_at={r.context: r.seqs_engine for r in p.rows}, command=_command(model, gpu, gpus, contexts),
                      note=note or f"{rec['batch_from']} at {rec['context']} tokens")
    if gpus:
        if engine == "native":
            out.kv_cache_fraction = rec["kv_cache_fraction"]
        else:  # vLLM's knob is a share of all the memory CUDA shows: context, weights, this cache, overheads
            m, row = p.memory, p.row(rec["context"])
            need = m["context_bytes"] + m["weight_bytes"] + m["kv_budget_bytes"] + row.overhead_bytes
            out.gpu_memory_utilization = min(0.95, math.ceil(100 * need / (m["total_bytes"] - m["driver_reserved_bytes"])) / 100)
    return out
