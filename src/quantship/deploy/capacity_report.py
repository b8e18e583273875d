"""The capacity plan as text for `quantship capacity` (its --json is Plan.to_dict())."""

from __future__ import annotations

from quantship.deploy.capacity import Plan

GIB, MIB = 2**30, 2**20


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / MIB:.1f} MiB"


def _rate(x: float | None) -> str:
    return "-" if x is None else (f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}")


def lines(plan: Plan) -> list[str]:
    m, kv, s = plan.memory, plan.kv, plan.served
    where = f"1 x {plan.gpu}" if plan.gpus == 1 else f"{plan.gpus} x {plan.gpu} (tensor parallel, per GPU below)"
    if plan.device == "cpu":
        where = "CPU" + (f" with a {_gib(m['total_bytes'])} budget" if m["total_bytes"] else "")
    out = [f"model      {plan.model}: {plan.architecture}, served as {s.description} on {where} "
           f"({plan.dtype} activations and cache)"]
    out.append(f"weights    {'scheme':<44} {'in memory':>10}   (* served)")
    for w in plan.weights:
        mark = "*" if w.scheme == s.scheme else " "
        extra = f"   +{_gib(w.decode_copy_bytes)} int4 decode copies at the first decode" if w.decode_copy_bytes else ""
        out.append(f"         {mark} {w.description:<44} {_gib(w.weight_bytes):>10}{extra}")
    ratio = kv["full_kv_bytes_per_token"] / kv["bytes_per_token"]
    out.append(f"KV cache   {kv['layout']} = {kv['numbers_per_token_per_layer']} x {kv['layers']} layers x "
               f"{kv['dtype']}: {kv['bytes_per_token'] / 1024:.1f} KiB per token"
               + (f" (full K/V would be {kv['full_kv_bytes_per_token'] / 1024:.1f} KiB, {ratio:.1f}x)" if ratio > 1 else ""))
    if m["free_bytes"] is None:
        out.append(f"memory     CPU engine without a budget: a fixed {_gib(m['kv_budget_bytes'])} cache "
                   f"({m['num_blocks']} blocks)")
    else:
        lead = (f"{_gib(m['total_bytes'])} - driver {_gib(m['driver_reserved_bytes'])} - CUDA context "
                f"{_gib(m['context_bytes'])} - weights" if plan.device == "cuda" else f"{_gib(m['total_bytes'])} - weights")
        out.append(f"memory     {lead} {_gib(m['weight_bytes'])} = {_gib(m['free_bytes'])} free; KV cache "
                   f"{m['kv_cache_fraction']:.0%} of it = {_gib(m['cache_bytes'])} ({m['num_blocks']} blocks of "
                   f"{m['block_size']} tokens), the rest the reserve for the overheads")
    header = f"{'context':>8} {'seqs (engine)':>14} {'seqs (OOM)':>11} {'KV/seq':>11} {'overheads':>11}"
    if plan.roofline:
        header += f" {'optimal batch':>14} {'tok/s there':>12} {'best tok/s':>11} {'bound':>7}"
    out.append(header)
    for r in plan.rows:
        row = (f"{r.context:>8} {r.seqs_engine:>14} {'-' if r.seqs_oom is None else r.seqs_oom:>11} "
               f"{_gib(r.kv_bytes_per_sequence):>11} {_gib(r.overhead_bytes):>11}")
        if plan.roofline:
            row += (f" {'-' if r.optimal_batch is None else r.optimal_batch:>14} {_rate(r.optimal_tokens_per_s):>12} "
                    f"{_rate(r.best_tokens_per_s):>11} {r.bound or '-':>7}")
        out.append(row)
    out.append("seqs (engine): what the engine's cache holds at once (more wait or are preempted); seqs (OOM): "
               "where a cache taking all but the estimated overheads (activations at that batch, CUDA graphs, "
               "int4 decode copies where the kernel table uses tinygemm, a quantized Linear or a chunk of packed "
               "experts dequantized, allocator slack) runs out of memory")
    if plan.roofline:
        r = plan.roofline
        out.append(f"roofline   a model, not a measurement: decode step = max(weights and caches read / "
                   f"{r['bandwidth_label']}, 2 x {r['active_parameters'] / 1e9:.2f}B active parameters per "
                   f"token / {r['bf16_tflops']:g} TFLOPS BF16); optimal = smallest batch within 5% of the best")
    elif plan.device == "cuda":
        out.append("roofline   needs the GPU's bandwidth: give --gpu NAME from the table")
    rec = plan.recommended
    if rec["max_num_seqs"] is None:
        out.append(f"nothing to serve at {rec['context']} tokens: quantize the model, plan a shorter context or a "
                   "larger GPU")
    else:
        out.append(f"serve with --kv-cache-fraction {rec['kv_cache_fraction']:.2f} --max-num-seqs {rec['max_num_seqs']} "
                   f"({rec['batch_from']} at {rec['context']} tokens)")
    out += [f"warning: {w}" for w in plan.warnings]
    return out
