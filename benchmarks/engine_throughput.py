"""Serving engine throughput against transformers' generate on the same weights, and KV bytes per token.

Here (CPU, bundled model):
    .venv/bin/python benchmarks/engine_throughput.py run --where cpu
On the GPU machine (DeepSeek-Coder-6.7B shape, random bf16 weights, plus the bandwidth roofline):
    PYTHONPATH=src python3 benchmarks/engine_throughput.py run --where gpu --out $OUT
DeepSeek-V2-Lite shape, 8 of its 27 layers (MLA + 64 routed experts through the fused MoE kernels):
    PYTHONPATH=src python3 benchmarks/engine_throughput.py run --where gpu --shape v2-lite --layers 8 --out $OUT
Greedy agreement of the W4A16 kernels with the dequantize reference on the bundled trained model:
    PYTHONPATH=src python3 benchmarks/engine_throughput.py agreement --out $OUT
Then here: .venv/bin/python benchmarks/engine_throughput.py render

Both sides generate the same number of tokens per request (EOS ignored) for a batch of equal-length
prompts that arrive together; throughput = generated tokens / wall time after a warm-up run, the
median of REPEATS runs that alternate between the two sides.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _report import RESULTS, table, update_section  # noqa: E402

REPEATS = 3  # timed runs per side and batch size; the median is reported

# Attention dims of deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite (config.json), for the cache table.
MLA_MODELS = {
    "DeepSeek-V3 (671B)": dict(layers=61, heads=128, kv_lora_rank=512, rope=64, nope=128, v=128),
    "DeepSeek-V2-Lite": dict(layers=27, heads=16, kv_lora_rank=512, rope=64, nope=128, v=128),
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_ENGINES: dict = {}


def ready_engine(model, config):
    """One engine per (model, config), its decode graphs captured and its kernels compiled before any
    timed run: a timed run pays for decoding only, as a server's requests do after start-up."""
    from quantship.engine.engine import LLMEngine

    key = (id(model), repr(config), os.environ.get("QUANTSHIP_PDL"))  # graphs are captured with PDL on or off
    if key not in _ENGINES:
        if len(_ENGINES) >= 4:  # each holds a whole KV cache: let the oldest go
            _ENGINES.pop(next(iter(_ENGINES)))
            torch.cuda.empty_cache()
        engine = LLMEngine(model, config)
        engine.runner.capture_graphs(config.max_num_seqs, engine.max_model_len)
        engine.warm_up()
        _ENGINES[key] = engine
    return _ENGINES[key]


def release_engines() -> None:
    """Let every cached engine go, and the GPU memory their KV caches and graphs held (before the parts of a run
    that need room of their own: the agreement's reference path dequantizes each weight whole)."""
    import gc

    _ENGINES.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_engine(model, prompts: list[list[int]], new_tokens: int, config) -> float:
    from quantship.engine.sampling_params import SamplingParams

    engine = ready_engine(model, config)
    device = str(next(model.parameters()).device.type)
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    sync(device)
    assert produced == len(prompts) * new_tokens
    engine.blocks.reset_prefix_cache()  # the next run's identical prompts must be computed again
    return time.perf_counter() - start


def time_transformers(hf, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device=hf.device)
    sync(hf.device.type)
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=0)
    sync(hf.device.type)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the roofline's denominator."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - start)


def quantized_copy(model):
    """The same model with every decoder Linear RTN-quantized to W4A16 (symmetric, group 128, or the
    fallback `quantship quantize` takes where 128 does not divide the input: V2-Lite's dense MLP) into
    PackedLinear, but MLA's kv_b_proj, which the loader holds dequantized (the absorbed decode reads it
    whole every step); embeddings, norms and lm_head shared with the original (no copy)."""
    from quantship.models.causal_lm import CausalLM
    from quantship.models.loader import ABSORBED
    from quantship.models.merged import merge_projections
    from quantship.models.quantized import quant_linear
    from quantship.quant.rtn import rtn_quantize
    from quantship.quant.scheme import get_scheme

    with torch.device("meta"):
        copy = CausalLM(model.config)
        if any(getattr(m, "merged", None) is not None for m in model.modules()):
            merge_projections(copy)  # an engine already merged the source's projections: same structure
    with torch.inference_mode():  # an engine's stacked experts are inference tensors
        copy.load_state_dict(model.state_dict(), assign=True)
    scheme = get_scheme("W4A16")
    for layer in copy.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, torch.nn.Linear):
                q = rtn_quantize(module.weight.data, scheme.fitted_to(module.in_features).weights)
                new = quant_linear(q.values, q.scale.to(module.weight.dtype), q.zero_point, bits=4)
                if name == ABSORBED:
                    dense = torch.nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
                    weight = new.dequantized_weight(module.weight.dtype).contiguous()
                    dense.weight = torch.nn.Parameter(weight, requires_grad=False)
                    new = dense
                owner, attr = name.rsplit(".", 1)
                setattr(layer.get_submodule(owner), attr, new)
    return copy.eval()


def routed_bytes(model) -> int:
    """Bytes of the routed experts' weights (packed or not): a decode step reads only the experts its
    tokens picked."""
    from quantship.models.quantized import weight_bytes

    return sum(weight_bytes(m) for name, m in model.named_modules() if name.endswith(".experts"))


def read_bytes(total: int, routed: int, config, batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens reads: everything but the routed experts, plus the
    expected share of experts at least one token picks (uniform routing: 1 - (1 - k/E)^batch)."""
    experts = getattr(config, "n_routed_experts", None)
    if not routed or not experts:
        return total
    touched = 1 - (1 - config.num_experts_per_tok / experts) ** batch
    return total - routed + routed * touched


REFERENCE = "every packed Linear dequantized + F.linear, routed experts looped one at a time"
EARLIER_REFERENCE = ("In this run the reference took the fused MoE kernels too, so it compared the dense Linears' "
                     "kernels only; the routed experts' kernels against the expert loop are the next run's.")


def greedy_agreement(fast, reference_path_model, vocab: int, prompts: int = 8, steps: int = 512,
                     ids: list[list[int]] | None = None, at_once: int | None = None) -> dict:
    """W4A16 through the kernels against the same weights through dequantize + F.linear, greedy: on
    the reference side every packed Linear dequantizes and MoE layers loop over their experts (no fused
    MoE kernels, no CUDA graphs).

    Generations are compared token by token up to the first divergence; then every step is checked
    teacher-forced: the kernel path's top-1 at each position of the reference generation. `ids`: the
    prompts (default: `prompts` random ones of 16 tokens). `at_once`: requests the engine runs together (default:
    all; 1 decodes one row a step, the GEMV classes' kernels)."""
    from quantship.engine.config import EngineConfig
    from quantship.engine.engine import LLMEngine
    from quantship.engine.sampling_params import SamplingParams
    from quantship.models.deepseek import MoE
    from quantship.models.quantized import PackedLinear

    ids = ids or torch.randint(3, vocab, (prompts, 16)).tolist()
    prompts = len(ids)
    longest = max(len(p) for p in ids)
    config = EngineConfig(max_num_seqs=at_once or prompts, max_num_batched_tokens=prompts * longest,
                          max_model_len=longest + steps + 16, kv_cache_bytes=8 << 30)

    def generate(model, use_kernel: bool) -> list[list[int]]:
        # the reference runs routed experts one at a time, dequantized (graphs cannot capture that loop's
        # host reads); shared experts folded into the stacks are experts of that loop too
        PackedLinear.use_kernel = MoE.use_kernels = use_kernel
        engine = LLMEngine(model, config if use_kernel else replace(config, cuda_graphs=False))
        for i, prompt in enumerate(ids):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
        out = {str(i): [] for i in range(prompts)}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return [out[str(i)] for i in range(prompts)]

    reference = generate(reference_path_model, False)
    kernel = generate(fast, True)
    prefix = [next((j for j, (a, b) in enumerate(zip(r, k)) if a != b), steps) for r, k in zip(reference, kernel)]
    agree = total = 0
    with torch.inference_mode():
        for prompt, gen in zip(ids, reference):
            seq = torch.tensor([prompt + gen], device=next(fast.parameters()).device)
            top1 = fast(seq)[0, len(prompt) - 1:-1].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(top1, gen))
            total += len(gen)
    return {"prompts": prompts, "steps": steps, "identical_prefix_tokens": prefix,
            "teacher_forced_top1_agreement": agree / total, "reference": REFERENCE}


def agreement_on_bundled(out: Path, steps: int = 512, device: str = "cuda") -> dict:
    """The greedy agreement of the W4A16 kernels with the dequantize reference on the bundled *trained*
    model in bf16 (next-token distributions as peaked as a real model's, where random weights give near
    ties), 8 prompts of 16 tokens from its held-out text. The bundled model is DeepSeek-V3-structured, so
    this runs tinygemm / the Triton tiles, the fused MoE kernels and MLA's paged decode."""
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model
    from quantship.models.tokenizer import load_tokenizer

    model = load_model(TINY_DIR, torch.bfloat16, device)
    w4 = quantized_copy(model)
    text = load_tokenizer(TINY_DIR)((TINY_DIR / "eval.txt").read_text())["input_ids"]
    stride = (len(text) - 16) // 8
    ids = [text[i * stride:i * stride + 16] for i in range(8)]
    with torch.inference_mode():
        result = {"model": "bundled tiny DeepSeek-V3 (trained)",
                  "device": torch.cuda.get_device_name() if device == "cuda" else device,
                  "pdl": os.environ.get("QUANTSHIP_PDL", "default"),
                  **greedy_agreement(w4, w4, model.config.vocab_size, steps=steps, ids=ids),
                  # the same requests one at a time: decode steps of one row, the GEMV's (the batch runs 8)
                  "one_at_a_time": greedy_agreement(w4, w4, model.config.vocab_size, steps=steps, ids=ids,
                                                    at_once=1)}
    print(result, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agreement_bundled_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def profile_decode(model, vocab: int) -> None:
    """Where one eager batch-1 decode step of the W4A16 model spends GPU time (top kernels), for the notes."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache()
    model(torch.randint(3, vocab, (1, 64), device="cuda"), cache=cache)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            model(torch.randint(3, vocab, (1, 1), device="cuda"), cache=cache)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)


def time_ttft(model, hf, prompt_len: int, config) -> dict:
    """Batch-1 time to the first token of a long prompt: the engine's prefill against transformers."""
    prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len)).tolist()
    long = replace(config, max_num_batched_tokens=prompt_len, max_model_len=prompt_len + 8)
    ours = statistics.median(time_engine(model, prompt, 1, long) for _ in range(REPEATS + 1))
    theirs = statistics.median(time_transformers(hf, prompt, 1) for _ in range(REPEATS + 1)) if hf else None
    return {"prompt_len": prompt_len, "ours_s": ours, "transformers_s": theirs}


def load_pair(where: str, shape: str = "coder-6.7b", layers: int | None = None):
    """(transformers model, our model sharing its weights, prompt source, dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantship.models.causal_lm import CausalLM
    from quantship.models.config import config_from_dict
    from quantship.models.loader import split_fused_experts

    if where == "cpu":
        from quantship.models.bundled import TINY_DIR
        from quantship.models.loader import load_model

        hf = AutoModelForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32).eval()
        return hf, load_model(TINY_DIR, torch.float32), "tiny", torch.float32
    from quantize_speed import SHAPES

    raw = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    config = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.device("meta"):
        ours = CausalLM(config_from_dict(raw))
    ours.load_state_dict(split_fused_experts(hf.state_dict()), assign=True)  # same tensors, no second copy
    return hf, ours.eval(), shape, torch.bfloat16


def run(where: str, out: Path, shape: str = "coder-6.7b", layers: int | None = None,
        batches: list[int] | None = None, agreement: bool = True) -> None:
    from quantship.engine.config import EngineConfig
    from quantship.models.paged import kv_bytes_per_token

    torch.manual_seed(0)
    hf, ours, name, dtype = load_pair(where, shape, layers)
    w4, w4_allocated = allocated_quantized_copy(ours) if where == "gpu" else (None, 0)
    default, prompt_len, new_tokens = ([1, 8, 32], 32, 64) if where == "cpu" else ([1, 16, 64], 128, 128)
    batches = batches or default
    vocab = ours.config.vocab_size
    config = EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * prompt_len,
                          max_model_len=prompt_len + new_tokens + 16, kv_cache_bytes=16 << 30)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            prompts = torch.randint(3, vocab, (batch, prompt_len)).tolist()
            time_engine(ours, prompts, 4, config)  # warm-up: allocator, kernels
            time_transformers(hf, prompts, 4)
            # Alternate the two sides and keep each one's median: these machines are shared and noisy.
            runs = [(time_engine(ours, prompts, new_tokens, config), time_transformers(hf, prompts, new_tokens))
                    for _ in range(REPEATS)]
            t_ours = statistics.median(r[0] for r in runs)
            t_hf = statistics.median(r[1] for r in runs)
            rows.append({"batch": batch, "ours_tok_s": batch * new_tokens / t_ours,
                         "transformers_tok_s": batch * new_tokens / t_hf, "ratio": t_hf / t_ours})
            if where == "gpu":  # what CUDA graphs are worth: the same engine, every step eager
                eager = replace(config, cuda_graphs=False)
                time_engine(ours, prompts, 4, eager)
                t_eager = statistics.median(time_engine(ours, prompts, new_tokens, eager) for _ in range(REPEATS))
                rows[-1]["eager_tok_s"] = batch * new_tokens / t_eager
            print(rows[-1], flush=True)
    result = {"where": where, "model": name, "dtype": str(dtype), "prompt_len": prompt_len, "warmed": True,
              "layers": layers,
              "new_tokens": new_tokens, "repeats": REPEATS, "rows": rows, "torch": torch.__version__,
              "kv_bytes_per_token": kv_bytes_per_token(ours.config, dtype)}
    if where == "gpu":
        from quantship.models.quantized import weight_bytes as module_bytes

        weight_bytes = module_bytes(ours)
        bandwidth = copy_bandwidth()
        result["routed_bytes"] = routed_bytes(ours)
        result |= {"device": torch.cuda.get_device_name(), "weight_bytes": weight_bytes, "copy_bandwidth": bandwidth}
        for row in rows:
            row["roofline_tok_s"] = row["batch"] * bandwidth / read_bytes(weight_bytes, result["routed_bytes"],
                                                                          ours.config, row["batch"])
            row["of_roofline"] = row["ours_tok_s"] / row["roofline_tok_s"]
        result["w4a16"] = run_w4a16(hf, ours, w4, w4_allocated, config, batches, prompt_len, new_tokens, bandwidth,
                                    agreement)
    else:
        import os

        result["cpu_threads"] = torch.get_num_threads()
        result["cpu_count"] = os.cpu_count()
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if where == "cpu" or shape == "coder-6.7b" else f"_{shape}"
    (out / f"engine_throughput_{where}{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")


def allocated_quantized_copy(model) -> tuple:
    """(quantized_copy(model), the GPU memory it allocated): made before an engine runs the source model,
    which merges its projections and folds MoE layers' shared experts into the routed stacks in place."""
    before = torch.cuda.memory_allocated()
    w4 = quantized_copy(model)
    torch.cuda.synchronize()
    return w4, torch.cuda.memory_allocated() - before


def run_w4a16(hf, ours, w4, allocated: int, config, batches, prompt_len, new_tokens, bandwidth,
              agreement: bool = True) -> dict:
    """The same model RTN-quantized to W4A16 g128 (packed, Triton kernels; allocated_quantized_copy) beside
    bf16, same run."""
    from quantship.models.quantized import PackedLinear, weight_bytes

    packed = sum(weight_bytes(m) for m in w4.modules() if isinstance(m, PackedLinear))
    total = weight_bytes(w4)
    routed = routed_bytes(w4)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            prompts = torch.randint(3, ours.config.vocab_size, (batch, prompt_len)).tolist()
            time_engine(w4, prompts, 4, config)
            time_engine(ours, prompts, 4, config)
            runs = [(time_engine(w4, prompts, new_tokens, config), time_engine(ours, prompts, new_tokens, config))
                    for _ in range(REPEATS)]
            t_w4, t_bf16 = (statistics.median(r[i] for r in runs) for i in (0, 1))
            rows.append({"batch": batch, "w4a16_tok_s": batch * new_tokens / t_w4,
                         "bf16_tok_s": batch * new_tokens / t_bf16, "speedup": t_bf16 / t_w4,
                         "roofline_tok_s": batch * bandwidth / read_bytes(total, routed, ours.config, batch)})
            rows[-1]["of_roofline"] = rows[-1]["w4a16_tok_s"] / rows[-1]["roofline_tok_s"]
            print(rows[-1], flush=True)
        ttft = {"w4a16": time_ttft(w4, None, 2048, config), "bf16": time_ttft(ours, hf, 2048, config)}
        print(ttft, flush=True)
        release_engines()  # up to four whole KV caches: the profile and the agreement's reference need the room
        profile_decode(w4, ours.config.vocab_size)
        if agreement:
            agreement = greedy_agreement(w4, w4, ours.config.vocab_size)
            PackedLinear.use_kernel = True
            print(agreement, flush=True)
        else:
            agreement = None
    from quantship.kernels import wna16

    return {"rows": rows, "weight_bytes": total, "routed_bytes": routed, "packed_linear_bytes": packed,
            "allocated_bytes": allocated, "ttft": ttft, "agreement": agreement,
            "tinygemm_max_m": wna16.TINYGEMM_MAX_M, "kernel_table": repr(wna16.table_for(torch.cuda.get_device_name()))}


def kernels_text(w: dict) -> str:
    """Which int4 kernels a run's W4A16 Linears took, from the kernel table it recorded (runs before the record:
    the table of their time, tinygemm up to 8 rows)."""
    tinygemm = w.get("tinygemm_max_m", 8)
    spans = []  # [first row, last row (None: no end), kind], neighbouring classes of one kind merged
    for limit, kind in re.findall(r"\((\d+|None), Blocks\(kind='(\w+)'", w.get("kernel_table", "")):
        last = None if limit == "None" else int(limit)
        below = spans[-1][1] if spans else 0
        if last is not None and last <= below:  # a second entry for the same rows (the float32 GEMV)
            continue
        if spans and spans[-1][2] == kind:
            spans[-1][1] = last
        else:
            spans.append([below + 1, last, kind])
    table = "; ".join(
        f"{'one row' if last == 1 else f'past {first - 1} rows' if last is None else f'{first}-{last} rows'}: "
        f"{'dequantize + cuBLAS' if kind == 'dequantize' else kind}" for first, last, kind in spans
    ) or "one row: a GEMV; up to 64: the swap tile; beyond: dequantize + cuBLAS"
    return ((f"ran PyTorch's tinygemm up to {tinygemm} rows, then " if tinygemm else "ran ")
            + f"the Triton kernel table of the run ({table}; kernels.wna16, see the kernel section below)")


def print_host_functions(title: str, work) -> None:
    """Run work() under cProfile and print the 30 functions with the most time of their own."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    work()
    profiler.disable()
    print(title, flush=True)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def step_anatomy(model, config, batch: int, steps: int = 32, profile: bool = False) -> dict:
    """Where a decode step's time goes: the whole engine step (schedule, stage inputs, graph replay,
    sample, bookkeeping) against replaying its CUDA graph alone. The difference is host time the GPU
    waits through. `profile` prints the host's functions over the steps (cProfile) and the kernels of 8
    replays by GPU time."""
    from quantship.engine.sampling_params import SamplingParams

    engine = ready_engine(model, config)
    for i in range(batch):
        engine.add_request(f"a{i}", [3 + i] * 64, SamplingParams(max_tokens=4 * steps, ignore_eos=True))
    for _ in range(4):  # prefill, then decode-only steps
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    if profile:  # the host's share of a step: what it runs while the GPU waits for the next replay
        def run_steps():
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()

        print_host_functions(f"batch {batch}: host functions of {steps} engine steps", run_steps)
    graphs = engine.runner.graphs
    replay_s = None
    if graphs is not None and graphs.graphs:
        size = next(b for b in graphs.seq_buckets if b >= batch)
        graph = next(g for (n, _), g in graphs.graphs.items() if n == size)[0]
        start = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
        replay_s = (time.perf_counter() - start) / steps
        if profile:
            from torch.profiler import ProfilerActivity, profile as profiler

            with profiler(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(8):
                    graph.replay()
                torch.cuda.synchronize()
            print(f"batch {batch}: kernels of 8 graph replays", flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70),
                  flush=True)
    for i in range(batch):
        engine.abort(f"a{i}")
    engine.step()
    return {"batch": batch, "step_ms": step_s * 1e3, "replay_ms": None if replay_s is None else replay_s * 1e3}


def prefill_kernels(model, config, prompt_len: int, label: str) -> None:
    """Print the host's functions (cProfile) and the kernels by GPU time of one batch-1 prefill of
    `prompt_len` tokens, and its wall time: a wall time well above the kernels' sum is host time the GPU
    waited through."""
    from torch.profiler import ProfilerActivity, profile as profiler

    prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len)).tolist()
    if prompt_len > config.max_num_batched_tokens or prompt_len >= config.max_model_len:
        config = replace(config, max_num_batched_tokens=max(prompt_len, config.max_num_batched_tokens),
                         max_model_len=max(prompt_len + 8, config.max_model_len))
    time_engine(model, prompt, 1, config)
    wall = time_engine(model, prompt, 1, config)
    print_host_functions(f"{label}: host functions of a {prompt_len}-token prefill",
                         lambda: time_engine(model, prompt, 1, config))
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time_engine(model, prompt, 1, config)
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    launches = sum(e.count for e in events if "LaunchKernel" in e.key)
    print(f"{label}: kernels of a {prompt_len}-token prefill (wall {wall * 1e3:.1f} ms, kernels {gpu:.1f} ms, "
          f"{launches} kernel launches)", flush=True)
    print(events.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70), flush=True)
    # What the host spends the wall time on: the ops it runs most often, with their own CPU time.
    print(events.table(sort_by="count", row_limit=30, max_name_column_width=70), flush=True)


# What each of the engine's host-time levers is worth at batch 1 (quick --ablate): every step of the
# step loop eager but decode, then graphs of prompt chunks, then decode steps run ahead (the default).
ABLATION = {"decode graphs only": dict(prefill_graphs=False, run_ahead=False),
            "+ graphs of prompt chunks": dict(prefill_graphs=True, run_ahead=False),
            "+ decode steps run ahead": dict(prefill_graphs=True, run_ahead=True)}


def ablation(models: dict, config, prompt_len: int = 128, new_tokens: int = 64) -> list[dict]:
    """Batch-1 tok/s (prefill included) and first-token ms of each model under each ABLATION setting,
    alternating the settings within each repeat."""
    prompts = torch.randint(3, next(iter(models.values())).config.vocab_size, (1, prompt_len)).tolist()
    rows = []
    for name, model in models.items():
        configs = {label: replace(config, **change) for label, change in ABLATION.items()}
        for c in configs.values():
            time_engine(model, prompts, 4, c)
        runs = [{label: time_engine(model, prompts, new_tokens, c) for label, c in configs.items()} for _ in range(3)]
        for label, c in configs.items():
            first = statistics.median(time_engine(model, prompts, 1, c) for _ in range(3))
            rows.append({"model": name, "setting": label, "tok_s": new_tokens / statistics.median(r[label] for r in runs),
                         "first_token_ms": first * 1e3})
            print(rows[-1], flush=True)
    return rows


@contextlib.contextmanager
def pdl_setting(on: bool | str | None):
    """Programmatic dependent launch for the kernels launched, and graphs captured, inside: off (False),
    on for every kernel (True), the default ("default": every kernel but the tiles, kernels.dependent_launch),
    or as the environment has it (None)."""
    before = os.environ.get("QUANTSHIP_PDL")
    if on == "default":
        os.environ.pop("QUANTSHIP_PDL", None)
    elif on is not None:
        os.environ["QUANTSHIP_PDL"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("QUANTSHIP_PDL", None)
        else:
            os.environ["QUANTSHIP_PDL"] = before


@contextlib.contextmanager
def words_along_k(along_k: bool | None):
    """The packed words' layout (kernels.wna16.WORDS_ALONG_K) for the models quantized inside: along K (True),
    along N (False), or the default (None). The engines' merged projections keep their parts' layout."""
    from quantship.kernels import wna16

    before = wna16.WORDS_ALONG_K
    wna16.WORDS_ALONG_K = before if along_k is None else along_k
    try:
        yield
    finally:
        wna16.WORDS_ALONG_K = before


@contextlib.contextmanager
def table_variant(variant: str | None, prefetch: int = 0, quads: bool = False, gemv=None):
    """The kernel table's tiles (kernels.wna16.BLOCKS_BY_M, DEVICE_TILES) as a `quick` side runs them, for the
    engines built and run inside: "no_tma", every tile loading without TMA (Blocks.tma False); "no_stream", its
    stream-K tiles splitting K in equal parts instead (Blocks.stream 0, each tile's split_k as adopted);
    "shared_table", the table every GPU shares, without this GPU's own tiles (DEVICE_TILES empty: what
    `adopt --device` gained, alternating, where --table-only runs a whole quick run so); None, the table as it
    is. `prefetch`: K tiles the stream-K tiles prefetch under PDL (kernels.wna16.STREAM_PREFETCH; 0: as it is).
    `quads`: the GEMV adds its sums four per vector reduction (kernels.wna16.GEMV_QUADS; False: as it is). `gemv`:
    this GPU's one-row GEMV in these tiles (a Blocks; None: as it is), a gemv_mma one for the 16-row class too. The
    code's table is back after, errors included.
    """
    from quantship.kernels import wna16

    def varied(b):
        if variant == "no_tma":
            return replace(b, tma=False)
        if variant == "no_stream":
            return replace(b, stream=0)
        return b

    table, own, ahead, fours = wna16.BLOCKS_BY_M, wna16.DEVICE_TILES, wna16.STREAM_PREFETCH, wna16.GEMV_QUADS
    wna16.STREAM_PREFETCH, wna16.GEMV_QUADS = prefetch or ahead, quads or fours
    if variant == "shared_table":
        wna16.DEVICE_TILES = {}
    elif gemv is not None:
        device = torch.cuda.get_device_name()
        mine = {(1, "gemv_bf16x2"): gemv}
        if gemv.kind == "gemv_mma":  # tensor cores take the 16-row class too
            mine[(16, "swap_bf16x2")] = gemv
        wna16.DEVICE_TILES = {**own, device: {**own.get(device, {}), **mine}}
    elif variant:
        wna16.BLOCKS_BY_M = [(limit, varied(b)) for limit, b in table]
        wna16.DEVICE_TILES = {name: {key: varied(b) for key, b in tiles.items()} for name, tiles in own.items()}
    try:
        yield
    finally:
        wna16.BLOCKS_BY_M, wna16.DEVICE_TILES, wna16.STREAM_PREFETCH, wna16.GEMV_QUADS = table, own, ahead, fours


def quick(out: Path, shape: str = "coder-6.7b", layers: int | None = None, batches: tuple[int, ...] = (1, 16),
          profile: bool = False, tag: str = "", ablate: bool = False, pdl: bool = False, words: bool = False,
          no_tma: bool = False, no_stream: bool = False, shared_table: bool = False, prefetch: int = 0,
          quads: bool = False, gemv_tile: tuple[int, int, int] | None = None, gemv_words: str = "n",
          gemv_kind: str = "gemv_bf16x2", gemv_stages: int = 1) -> None:
    """W4A16 against bf16 in the engine only (batch 1 and 16 unless asked, 64 tokens; the TTFT of 2,048
    tokens): a short check between full runs, with programmatic dependent launch as the environment has
    it (by default on for every kernel but the swap tiles past 16 rows). `pdl`: each side with it off, on for every
    kernel (the *_pdl entries) and W4A16 by default (w4a16_pdl_no_tiles, a name from when the default left out every
    tile; bf16 has no tiles), alternating. `words`:
    W4A16 also with its packed words held along K (w4a16_words_k), alternating with the default (along N). `no_tma`:
    W4A16 also with the table's tiles loading without TMA (w4a16_no_tma: a second copy of the weights, so an
    engine and graphs of its own), alternating. `no_stream`: the same with the table's stream-K tiles splitting K
    instead (w4a16_no_stream, table_variant). `shared_table`: the same through the table every GPU shares,
    without this GPU's own tiles (w4a16_shared_table). `prefetch`: W4A16 also with PDL on for every kernel and the
    stream-K tiles prefetching that many K tiles before their wait (w4a16_pdl_prefetch), alternating. `quads`: W4A16
    also with the GEMV adding its sums four per vector reduction (w4a16_quads), alternating. `gemv_tile` (outputs,
    inputs, warps): W4A16 also with the one-row GEMV in those tiles, its words held along `gemv_words` (w4a16_gemv_tile),
    alternating; `gemv_kind` "gemv_mma": that side's one-row product on tensor cores (kernels.wna16_mma) instead,
    its words in `gemv_stages` stages (2: each group's loaded while the group before computes)."""
    torch.manual_seed(0)
    hf, ours, _, _ = load_pair("gpu", shape, layers)
    with torch.inference_mode():  # the prefill reference, before the engines take the memory
        long = torch.randint(3, ours.config.vocab_size, (1, 2048)).tolist()
        time_transformers(hf, long, 1)
        theirs = statistics.median(time_transformers(hf, long, 1) for _ in range(REPEATS))
    del hf
    w4 = quantized_copy(ours)
    if words:
        with words_along_k(True):
            w4_k = quantized_copy(ours)
    variants = {f"w4a16_{v}": quantized_copy(ours) for v, asked in (("no_tma", no_tma), ("no_stream", no_stream),
                                                                   ("shared_table", shared_table),
                                                                   ("pdl_prefetch", prefetch),
                                                                   ("quads", quads)) if asked}
    if gemv_tile:
        with words_along_k(gemv_words == "k"):
            variants["w4a16_gemv_tile"] = quantized_copy(ours)
    from quantship.engine.config import EngineConfig

    most = max(batches)
    # four engines at once with pdl: a smaller cache each where the batches leave room (16 x 256 tokens
    # of the 6.7B shape are 2 GB)
    config = EngineConfig(max_num_seqs=most, max_num_batched_tokens=most * 128, max_model_len=256,
                          kv_cache_bytes=(4 if pdl and most <= 32 else 8) << 30)
    # with `pdl` the plain sides run with it off, whatever the default
    sides = {"w4a16": (w4, False if pdl else None), "bf16": (ours, False if pdl else None)}
    if pdl:  # bf16 has no swap tiles: its side with PDL on but them is bf16_pdl
        sides |= {"w4a16_pdl": (w4, True), "bf16_pdl": (ours, True), "w4a16_pdl_no_tiles": (w4, "default")}
    if words:
        sides["w4a16_words_k"] = (w4_k, None)
    sides |= {name: (model, True if name == "w4a16_pdl_prefetch" else None) for name, model in variants.items()}

    from quantship.kernels.wna16 import Blocks

    knobs = {"w4a16_pdl_prefetch": {"prefetch": prefetch}, "w4a16_quads": {"quads": True},  # sides of one setting
             "w4a16_gemv_tile": {"gemv": gemv_tile and Blocks(gemv_kind, 16 if gemv_kind == "gemv_mma" else 1,
                                                              *gemv_tile[:2], -1, gemv_tile[2], gemv_stages)}}

    def kernels(name):  # the kernel table a side runs
        if name in knobs:
            return table_variant(None, **knobs[name])
        return table_variant(name.removeprefix("w4a16_") if name in variants else None)

    def timed(name, *args):
        model, on = sides[name]
        with pdl_setting(on), kernels(name):
            return time_engine(model, *args)

    def anatomy(name, batch, **kw):
        model, on = sides[name]
        with pdl_setting(on), kernels(name):
            return step_anatomy(model, config, batch, **kw)

    rows = []
    with torch.inference_mode():
        for batch in batches:
            prompts = torch.randint(3, ours.config.vocab_size, (batch, 128)).tolist()
            for name in sides:
                timed(name, prompts, 4, config)
            runs = [{name: timed(name, prompts, 64, config) for name in sides} for _ in range(2)]
            row = {"batch": batch}
            for name in sides:
                row[f"{name}_tok_s"] = batch * 64 / statistics.median(r[name] for r in runs)
            # The prompts' prefill and first token alone: what of the timed run is not decode steps.
            row["first_token_ms"] = {name: statistics.median(timed(name, prompts, 1, config) for _ in range(3)) * 1e3
                                     for name in sides}
            for name in sides:
                row[f"anatomy_{name}"] = anatomy(name, batch, profile=profile and name == "w4a16")
            rows.append(row)
            print(rows[-1], flush=True)
        ttft = {}
        for name, (model, on) in sides.items():
            with pdl_setting(on), kernels(name):
                ttft[name] = time_ttft(model, None, 2048, config) | {"transformers_s": theirs}
        print(ttft, flush=True)
        levers = ablation({"w4a16": w4, "bf16": ours}, config) if ablate else None
        if profile:
            for prompt_len in (128, 2048):
                for label, model in (("w4a16", w4), ("bf16", ours)):
                    prefill_kernels(model, config, prompt_len, label)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if shape == "coder-6.7b" else f"_{shape}"
    extra = [{"ablation": levers}] if levers else []
    (out / f"engine_quick_gpu{suffix}{tag}.json").write_text(json.dumps(rows + [{"ttft": ttft}] + extra, indent=2) + "\n")


def kv_table() -> str:
    from quantship.models.bundled import TINY_DIR
    from quantship.models.config import load_config
    from quantship.models.paged import cache_width, full_kv_width

    rows = []
    tiny = load_config(TINY_DIR)
    specs = {"bundled tiny DeepSeek-V3": (cache_width(tiny), full_kv_width(tiny), tiny.num_hidden_layers)}
    for label, d in MLA_MODELS.items():
        specs[label] = (d["kv_lora_rank"] + d["rope"], d["heads"] * (d["nope"] + d["rope"] + d["v"]), d["layers"])
    for label, (latent, full, layers) in specs.items():
        rows.append([label, f"{latent * layers * 2:,}", f"{full * layers * 2:,}", f"{full / latent:.1f}x"])
    return table(["model (bf16 cache)", "MLA latent bytes/token", "full K/V bytes/token", "smaller by"], rows)


def w4a16_section(r: dict, label: str) -> list[str]:
    w = r["w4a16"]
    rows = [[row["batch"], f"{row['w4a16_tok_s']:.1f}", f"{row['bf16_tok_s']:.1f}", f"{row['speedup']:.2f}x",
             f"{row['roofline_tok_s']:.0f}", f"{row['of_roofline']:.0%}"] for row in w["rows"]]
    ttft = w["ttft"]
    theirs = ttft["bf16"]["transformers_s"]
    chip = next((name for name in ("H100", "H200") if name in r.get("device", "")), r.get("device", "GPU"))
    parts = [f"### W4A16 in the engine ({chip}, {label})", "",
             "The same random weights RTN-quantized to W4A16 g128 (symmetric; V2-Lite's dense MLP, whose input "
             "128 does not divide, takes the group fallback `quantize` takes), packed on the GPU, against bf16 in "
             "the same run, both with CUDA graphs captured before timing, median of alternating runs. int4 Linears "
             + kernels_text(w) + "; routed experts run the fused MoE kernels.", "",
             table(["batch", "W4A16 tok/s", "bf16 tok/s", "W4A16 / bf16", "W4 roofline tok/s", "of roofline"], rows),
             "", *([w["note"], ""] if w.get("note") else []),
             f"TTFT of a {ttft['bf16']['prompt_len']}-token prompt at batch 1: W4A16 "
             f"{ttft['w4a16']['ours_s'] * 1e3:.1f} ms, bf16 {ttft['bf16']['ours_s'] * 1e3:.1f} ms"
             + (f", transformers bf16 {theirs * 1e3:.1f} ms" if theirs else "") + ".", "",
             f"GPU memory of the W4A16 weights: {w['allocated_bytes'] / 1e9:.2f} GB allocated for the quantized "
             f"model against {w['packed_linear_bytes'] / 1e9:.2f} GB of packed values + scales (the same Linears in "
             f"bf16: {(r['weight_bytes'] - (w['weight_bytes'] - w['packed_linear_bytes'])) / 1e9:.1f} GB)."
             + (" The tinygemm decode layout, made on first use, added a second copy of the int4 values of dense "
                "Linears." if w.get("tinygemm_max_m", 8) else ""), "",
             agreement_text(r), ""]
    return parts


def agreement_text(r: dict) -> str:
    a = r["w4a16"]["agreement"]
    if a is None:
        return ("Greedy agreement was not checked in this run (`--no-agreement`); the bundled trained model's "
                "check is below.")
    return (f"Greedy agreement, kernels against the dequantize + F.linear reference on the same W4A16 weights, 8 "
            f"prompts x 512 steps: teacher-forced top-1 agreement {a['teacher_forced_top1_agreement']:.1%}, "
            f"identical prefixes {a['identical_prefix_tokens']} tokens. Random weights give nearly flat "
            "next-token distributions, so bf16 rounding differences flip near-ties; the 99% goal needs a trained "
            "model of this size, which this machine cannot fetch. On the CPU the engine stays token-identical to "
            "the plain loop (tests)." + (f" {EARLIER_REFERENCE}" if r.get("routed_bytes") and "reference" not in a else ""))


ANATOMY_RUN = "engine_quick_gpu_stop39_kv_write.json"  # the quick run whose step anatomy the 6.7B section quotes


STEP_PROFILE = (  # from benchmarks/results/profiles/engine_quick_h200_s49_no_pdl.txt (engine_quick_gpu_s49_profile_no_pdl)
    "The same on an H200 with stop 49's code (`QUANTSHIP_PDL=0 quick --batches 1 16 --profile`: with PDL on, a "
    "kernel's time in the profile includes its wait for the kernel before, so the durations come from a run with it "
    "off; the W4A16 step was 1.96 ms at batch 1 and 2.84 ms at 16 there, 1.89 and 2.66-2.72 with it). At batch 1 the "
    "GEMVs take 76% of the graph's GPU time, 11.3 µs a call and 45 µs a layer for its 101 MB (2.2 TB/s, about half "
    "the H200's copy bandwidth); paged decode attention 6.0 µs a layer (10%); the two norms 1.9 µs each (6.5%); the "
    "bf16 lm_head 65 µs a step (3.4%); the K/V write 1.3 µs a layer; about 20 one-off kernels a step (rotary "
    "tables, sampling, the inputs) 1-2 µs each. At batch 16 the stream-K tiles take 69%, 15.4 µs a call and 62 µs "
    "a layer (1.6 TB/s), paged decode attention 16.2 µs a layer (18%: its 16 sequences of 128-192 keys read about "
    "40 MB of K/V a layer, about 2.6 TB/s, as the kernel benchmark's 60-72% of the copy bandwidth at 128-256 keys), "
    "norms 2.1 µs each, SwiGLU's product 1.4 µs and the K/V write 1.8 µs a layer, lm_head 66 µs "
    "and the embedding's index_select 20 µs a step. What keeps the W4A16 calls from the bandwidth on an H200 is a "
    "per-call cost of about 6 µs at batch 1 and 10 µs at batch 16 beyond their bytes' time, more of the call than "
    "on an H100, whose bandwidth is lower.")


def anatomy_note() -> list[str]:
    quick = RESULTS / ANATOMY_RUN
    if not quick.exists() or "anatomy_bf16" not in json.loads(quick.read_text())[0]:
        return []
    q = json.loads(quick.read_text())
    cells = [f"batch {x['batch']} {kind}: {x[f'anatomy_{kind}']['step_ms']:.2f} ms per engine step against "
             f"{x[f'anatomy_{kind}']['replay_ms']:.2f} ms replaying its graph alone"
             for x in q if "batch" in x for kind in ("bf16", "w4a16")]
    return [f"Where a decode step goes (`engine_throughput.py quick --profile`, 6.7B shape, H100, stop 39's code: "
            f"{ANATOMY_RUN}): " + "; ".join(cells) + ". Scheduling, staging the inputs and sampling add "
            "a few percent: the rest is inside the graph. Inside the W4A16 graph the int4 Linears take 77% of the "
            "GPU time at batch 1 (the GEMV, 14.6 µs per call on average, 58 µs a layer for 104 MB: 1.8 TB/s), 72% "
            "at 16 (the swap tile, 85 µs a layer) and 62% at 64 (the swap tile, with 5% more for permuting x); "
            "paged decode attention 10%, 17% and 27% (at 16 and 64 sequences near the bandwidth of the K/V it "
            "reads); bf16's lm_head 4%; norms about 5% at batch 1; the K/V cache write 1.8% (1.3 µs a layer, 7 µs "
            "when one program walked every head).", "", STEP_PROFILE, ""]


QUICK_RUNS = {  # the quick re-runs each shape's section shows, newest first: label → file suffix
    "": {"H100, stop 55 (`quick --batches 1 16 --shared-table`, alternating, after a gemv_mma sweep whose `adopt "
         "--device` kept the H100's tiles): its table (gemv_mma 512x256 at one row) against the table every GPU "
         "shares (the bf16x2 GEMV 256x128); both run the stream-K swap tile at 16 rows": "_s55_stages_h100",
         "H100, stop 54 (`quick --batches 1 16 --gemv-tile 512 256 4 --gemv-kind gemv_mma`, alternating): the H100's "
         "table then (its own one-row GEMV, bf16x2 512x128), and with the GEMV on tensor cores (kernels.wna16_mma) "
         "in 512x256 tiles at 1 and at 16 rows (adopted after this run for one row only)": "_s54_mma_h100",
         "H100, stop 52 (`quick --batches 1 --quads --no-norm-fold --gemv-tile 64 256 2`, alternating): W4A16 with "
         "each decode step's norms made in the packed GEMV after them (commit 8ef2a10, reverted after this run; the "
         "quads and 64x256 lines have them too), with every norm a launch of its own (the code since), with the "
         "GEMV adding its sums four at once, and with the one-row GEMV in 64x256 tiles": "_s52_h100",
         "H100, stop 51 (`quick --batches 1 --shared-table --quads`, alternating): the one-row GEMV in 512x64 "
         "tiles capped at 128 registers (that machine's sweep winner, adopted there only), the same adding its K "
         "split's sums four at once (a 1.3% shorter step, level tok/s: GEMV_QUADS stays off), and the table's "
         "256x128": "_s51_quads",
         "H200, stop 49, after the full run above: profiled, PDL off (`QUANTSHIP_PDL=0 quick --batches 1 16 "
         "--profile`; both sides without it)": "_s49_profile_no_pdl",
         "H200, stop 49, the same machine: profiled, PDL by default (the stream-K tile up to 16 rows with it)":
         "_s49_profile_b",
         "H200, stop 49, the same machine, a run before": "_s49_profile",
         "H100, stop 49: programmatic dependent launch off, on for every kernel, by default (then every kernel but "
         "the swap tiles), and on with the stream-K tiles prefetching 4 K tiles (`quick --pdl --prefetch 4`), "
         "alternating; since this run the default takes it for the stream-K tile up to 16 rows too": "_pdl_s49",
         "H100, stop 48, another machine: the one-row GEMV over 512 outputs a program (`quick --wide-gemv`, since "
         "adopted as the H100's own; `--shared-table` times such tiles against the table now) and the "
         "stream-K tiles splitting K (`--no-stream`) beside the table, "
         "alternating (the 32-row tile unpaired, splitting K)": "_stop48_second",
         "H100, stop 48: the stream-K tiles adopted from 16 to 256 rows (32 rows then paired in stream form; "
         "the unpaired split-K tile that replaced it came after this run), beside the same table splitting K "
         "(`quick --no-stream`, alternating)": "_stop48_adopted",
         "H100, stop 48, the same machine: profiled (`quick --batches 1 16 --profile`)": "_stop48_profile",
         "H100, stop 48, the same machine, before adopting: the TMA tiles in stream form by registers (4 programs a "
         "multiprocessor at 16 rows, 2 at 32, 1 elsewhere; `quick --stream`, gone) beside the K split; the sweep "
         "later found 4 a multiprocessor the slowest at 16 rows": "_stop48_stream",
         "H100, stop 46: swap_bf16x2 loading through TMA from 16 to 128 rows, beside the same tiles without TMA "
         "(`quick --no-tma`, alternating; at 64 rows the adopted TMA tile has two warp groups, so the one without "
         "TMA is not stop 45's tile)": "_stop46_no_tma",
         "H100, stop 46: swap_bf16x2 loading through TMA, a run before the one above": "_stop46_tma",
         "H100, stop 45: each K tile's scales loaded a tile ahead in swap_bf16x2, x still permuted per tile (the "
         "adopt meant to take x_paired dropped the field; fixed after)": "_stop45_scale_ahead",
         "H200, stop 44: the one-row GEMV in the H200's own 512x64 tiles (`adopt --device`; `quick --batches 1` "
         "now, then a wrapper setting the table's one-row entry), batch 1, run before and after the next line (this "
         "file is the later run; the earlier: 471.3 against 228.5 tok/s, 2.06x)": "_stop44_h200_own_gemv",
         "H200, stop 44, the same machine: the one-row GEMV in the table's 256x128 tiles (`quick --batches 1 "
         "--table-only` now)": "_stop44_h200_table_gemv",
         "H100, stop 44: the one-row GEMV in 512x128 tiles, its sweep's fastest, adopted for the run only (not "
         "kept)": "_stop44_h100_own_gemv",
         "H100, stop 44, the same machine: the one-row GEMV in the table's 256x128 tiles (`--table-only`)":
         "_stop44_h100_table_gemv",
         "H200, stop 44, the same machine: the table as the H100 sweeps left it, decode attention before "
         "decode_tiles (the first H200 since stop 39)": "_stop44_h200",
         "H200, stop 44, the same machine: a CUDA-core decode attention path for one query head per K/V head "
         "(not kept)": "_stop44_h200_one_head",
         "H100, stop 44: programmatic dependent launch off (`QUANTSHIP_PDL=0`), profiled": "_stop44_no_pdl",
         "H100, stop 44: the 16-row tiles' register cap swept (not adopted), the table as stop 43 left it":
         "_stop44_registers",
         "H100, stop 43: the packed words held along N (the table's layout) and along K (`quick --words`), "
         "alternating": "_words",
         "H100, stop 42, a second machine: batch 64": "_bf16x2_b64",
         "H100, stop 42: swap_bf16x2 from 2 to 128 rows (one product per K tile, values two per bf16x2 "
         "instruction), PDL by default": "_bf16x2",
         "H100, stop 41, later: the rotations without FP contraction; under PDL the swap tiles released "
         "after their K loop (reverted since)": "_stop41_pdl_late",
         "H100, stop 41: prefill attention says causal to SDPA, the MLP's residual step in the next norm (swap "
         "tiles under PDL release at their start)": "_stop41_pdl",
         "H100, stop 39: the K/V cache write a program per head": "_stop39_kv_write",
         "H100, stop 39 before it: GEMVs load x's tile once, SwiGLU's product made in the down GEMV": "_stop39",
         "H100: swap_x from 2 to 16 rows": "_swap_x",
         "H100, the same machine: the swap tile at 16 rows (batch 16 only)": "_swap_dot_h100",
         "the same table; decode attention splits its keys where that pays (not at these contexts)":
         "_split_attention",
         "the table now (second sweep's winners)": "_final",
         "first sweep's table (bf16x2 GEMV 256 wide, split finished in the kernel)": "_finish",
         "earlier: tinygemm up to 8 rows, swap tile 9-64": ""},
    "_v2-lite": {"H100, 27 layers, stop 45: scales a tile ahead, x copied to the pair order from 32 rows (MLA's and "
                 "the dense int4 projections at batch 32)": "_stop45",
                 "H100, 27 layers, stop 44: the table as stop 43 left it": "_stop44",
                 "H100, 27 layers, stop 39: GEMVs load x's tile once, SwiGLU in the down GEMV, the MoE blocks' "
                 "gate and up in one K loop": "_stop39",
                 "H100, 27 layers, the same code, a second machine": "_stop39_b",
                 "H100, 27 layers, swap_x from 2 to 32 rows": "_swap_x",
                 "H100, 27 layers, graphs of prompt chunks, decode steps run ahead, rotations in the decode "
                 "kernels, before swap_x": "_run_ahead",
                 "27 layers, MLA's cache write in one kernel": "_latent_write",
                 "27 layers, MLA's decode attention split over the keys": "_split_attention",
                 "27 layers, shared experts folded into the routed stacks, slot GEMV in bf16 pairs chosen by all "
                 "slots": "_bf16x2",
                 "27 layers, routing in one kernel, slot GEMV to 0.75 slots per expert, packed experts "
                 "dequantized once in prefill": "_router2",
                 "27 layers, the same with the slot GEMV's down a program per token (twice that kernel's time)": "_router",
                 "27 layers, slot GEMV to 0.25 slots per expert": "_slot_gemv",
                 "27 layers, the same, its profiled run": "_prefill_profile",
                 "27 layers, before the slot GEMV (blocks only)": "_final",
                 "8 layers, fused MoE decode tile (earlier dense table)": "",
                 "8 layers, before it (old MoE tile)": "_old_moe_tile"},
}
QUICK_TEXT = {
    "": "Quick re-runs (`engine_throughput.py quick --batches ...`, one run per line, each on a fresh machine, W4A16 "
        "and bf16 alternating in each; 64 tokens per request after a 128-token prompt, graphs captured first; "
        "compare within a line: machines differ by up to 10%):",
    "_v2-lite": "Quick re-runs (`engine_throughput.py quick --shape v2-lite [--layers 8]`, one run per line, W4A16 "
                "and bf16 alternating in each):",
}


MOE_ANATOMY = (
    "Where a W4A16 decode step of the MoE model goes at batch 1 (`quick --shape v2-lite --profile`, all 27 "
    "layers, the slot GEMV run, kernels of the graph by GPU time, 3.0 ms per step): the dense int4 GEMVs 20% (four "
    "per layer, 5.5 µs each: MLA's projections and the shared experts, too small to leave the launch latency "
    "behind); the routed experts' slot GEMVs 24% (gate/up 18.7 µs and down 8.3 µs per layer, 0.9-1.0 TB/s; the "
    "16-row blocks took 60 µs for gate/up); MLA's paged decode 10%; the MLA absorption's small bf16 products 6%; "
    "routing about 12% (widening x and the router weight, top-k and its sort, gather, the normalization: one "
    "kernel now); the bf16 lm_head 3.5%; norms, rotary and copies the rest. In a 2,048-token prefill the routed "
    "experts take 58% of the W4A16 GPU time (gate/up 1.56 ms and down 0.80 ms per layer, against 0.49 and 0.30 ms "
    "in bf16), attention 25%: the in-kernel dequantization of packed expert tiles, repeated per 64-row block, "
    "is what kept W4A16 prefill of MoE models below bf16; they are dequantized once per prefill step now. "
    "The next run's profile (routing in one kernel): `route_kernel` 2.3 µs per layer, 2% of the step. A "
    "128-token prefill (eager, not a graph) took 42.6 ms of wall time for 15.5 ms of kernels in W4A16 and "
    "35.1 for 11.9 in bf16: the prompts' prefill in these runs is host-bound. A later profile (4 of the 27 "
    "layers, batch 1, shared experts folded into the stacks, before the key split; `quick --layers 4 --profile`), "
    "per MoE layer: the slot GEMVs 16.3 µs for gate/up and 10.5 µs for down, the shared experts' pieces included "
    "(no dense shared MLP left); MLA's int4 projections 7.3 µs per GEMV; MLA's paged decode 11.5 µs, one program "
    "for all 16 heads at batch 1, which the key split now spreads (7.4 µs at 128 keys, 22 µs instead of 247 at "
    "4,096 in the kernel benchmark); the absorption's two bf16 products 6.8 µs; the router's float32 product "
    "3.8 µs in two cuBLAS kernels and `route_kernel` 2.3 µs; the cache write and its concatenations about 6 µs; "
    "norms 1.5 µs each; the bf16 lm_head 109 µs per step. Its 128-token prefill made 136 kernel launches and 11 "
    "host synchronizations (the step's inputs uploaded from pageable memory) in 8.9 ms of wall time for 2.9 ms "
    "of kernels (bf16: 6.1 for 2.1).")


def quick_rerun_note(suffix: str) -> list[str]:
    """The quick re-runs of a shape's W4A16 / bf16 decode (engine_throughput.py quick), as a small table."""
    runs = {label: RESULTS / f"engine_quick_gpu{suffix}{tail}.json"
            for label, tail in QUICK_RUNS.get(suffix, {}).items()}
    rows, levers = [], []
    for label, path in runs.items():
        if not path.exists():
            continue
        for x in json.loads(path.read_text()):
            # a quick --pdl run has each side with programmatic dependent launch on too, and W4A16 with it by
            # default (against bf16 with it on)
            for side, bf16_name, note in (("", "bf16", ""), ("_pdl", "bf16_pdl", ", PDL on"),
                                          ("_pdl_no_tiles", "bf16_pdl", ", PDL by default"),
                                          ("_pdl_prefetch", "bf16_pdl", ", PDL on, the stream-K tiles prefetching "
                                                                        "`--prefetch` K tiles"),
                                          ("_quads", "bf16", ", the GEMV adding its sums four at once"),
                                          ("_gemv_tile", "bf16", ", the one-row GEMV in `--gemv-tile` tiles"),
                                          ("_no_norm_fold", "bf16", ", every norm a launch of its own (the code "
                                                                    "kept: the norms made in the GEMVs were reverted)"),
                                          ("_words_k", "bf16", ", packed words held along K"),
                                          ("_no_tma", "bf16", ", the tiles without TMA"),
                                          ("_stream", "bf16", ", the TMA tiles in equal runs of all K tiles"),
                                          ("_no_stream", "bf16", ", the stream-K tiles splitting K instead"),
                                          ("_wide_gemv", "bf16", ", the one-row GEMV over 512 outputs a program"),
                                          ("_shared_table", "bf16", ", the table every GPU shares (no own tiles)")):
                w4_name, named = f"w4a16{side}", label + note
                if "batch" in x and f"{w4_name}_tok_s" in x:
                    w4, bf16 = x.get(f"anatomy_{w4_name}") or {}, x.get(f"anatomy_{bf16_name}") or {}
                    first = x.get("first_token_ms")
                    ratios = [f"{bf16[k] / w4[k]:.2f}x" if w4.get(k) and bf16.get(k) else "-"
                              for k in ("step_ms", "replay_ms")]
                    rows.append([named, x["batch"], f"{x[f'{w4_name}_tok_s']:.1f}", f"{x[f'{bf16_name}_tok_s']:.1f}",
                                 f"{x[f'{w4_name}_tok_s'] / x[f'{bf16_name}_tok_s']:.2f}x", *ratios,
                                 f"{first[w4_name]:.1f} / {first[bf16_name]:.1f}" if first else "-"])
                elif "ttft" in x and w4_name in x["ttft"]:
                    w4_s, bf16_s = x["ttft"][w4_name]["ours_s"], x["ttft"][bf16_name]["ours_s"]
                    theirs = x["ttft"][bf16_name].get("transformers_s")
                    rows.append([named, "TTFT 2048", f"{w4_s * 1e3:.1f} ms", f"{bf16_s * 1e3:.1f} ms",
                                 f"{bf16_s / w4_s:.2f}x", "", "",
                                 f"transformers bf16 {theirs * 1e3:.1f} ms: W4A16 {theirs / w4_s:.2f}x, bf16 "
                                 f"{theirs / bf16_s:.2f}x of its speed" if theirs else ""])
            if "ablation" in x:
                levers += [[label, *row] for row in ablation_rows(x["ablation"])]
    if not rows:
        return []
    header = ["code", "batch", "W4A16 tok/s", "bf16 tok/s", "W4A16 / bf16", "decode step, bf16 / W4A16",
              "its graph replay alone, bf16 / W4A16", "prompts' prefill + first token, W4A16 / bf16 ms"]
    return [QUICK_TEXT[suffix], "", table(header, rows), "",
            "tok/s covers the whole run, the prompts' prefill included; the decode-step column is the engine's decode "
            "step alone (step_anatomy: 32 decode-only steps after a 64-token prompt), the last the run with one "
            "new token per request (median of 3), where recorded: the prefill ran eagerly, host-bound, in the runs "
            "before graphs of prompt chunks. Lines from stop 41 on add each MLP's residual step inside the next "
            "layer's norm (one launch fewer per layer, both sides alike); their \"PDL on\" rows launch every "
            "kernel with programmatic dependent launch (`QUANTSHIP_PDL=1`); \"PDL by default\" was every "
            "kernel but the swap tiles from stop 41 to 48, and since stop 49 it takes the stream-K tile up to 16 rows "
            "too (`quick` without `--pdl` times the default on both sides). Lines "
            "before stop 41 ran without it.", ""] + ([
            "Batch 1 under each of the engine's host-time levers (`quick --ablate`, the same run, settings alternating; "
            "tok/s with the 128-token prefill):", "",
            table(["code", "setting", "W4A16 tok/s", "bf16 tok/s", "W4A16 / bf16", "first token, W4A16 / bf16 ms"],
                  levers), ""] if levers else [])


def ablation_rows(entries: list[dict]) -> list[list]:
    """quick --ablate's entries as rows: one per setting, W4A16 beside bf16."""
    by = {(e["model"], e["setting"]): e for e in entries}
    out = []
    for setting in dict.fromkeys(e["setting"] for e in entries):
        w4, bf16 = by[("w4a16", setting)], by[("bf16", setting)]
        out.append([setting, f"{w4['tok_s']:.1f}", f"{bf16['tok_s']:.1f}", f"{w4['tok_s'] / bf16['tok_s']:.2f}x",
                    f"{w4['first_token_ms']:.1f} / {bf16['first_token_ms']:.1f}"])
    return out


def agreement_figures(a: dict) -> str:
    """A greedy_agreement result's figures, as the engine section words them."""
    return (f"teacher-forced top-1 agreement {a['teacher_forced_top1_agreement']:.2%}, identical prefixes "
            f"{a['identical_prefix_tokens']} tokens")


def render() -> None:
    parts = ["## Serving engine: throughput and cache size", "",
             "Output tokens per second for N requests arriving together (equal prompt lengths, EOS ignored), "
             "against transformers' `generate` on the same weights at the same batch size, measured in the same "
             "run (median of three alternating runs per side). "
             "`python benchmarks/engine_throughput.py run --where cpu|gpu`.", ""]
    # the H200's dense run, the H100's (a second GPU's figures for the same goals), the MoE shape's
    for where, suffix in (("cpu", ""), ("gpu", ""), ("gpu", "_h100"), ("gpu", "_v2-lite")):
        path = RESULTS / f"engine_throughput_{where}{suffix}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        gpu = where == "gpu"
        header = ["batch", "quantship tok/s", "transformers tok/s", "quantship / transformers"]
        header += ["quantship eager tok/s", "roofline tok/s", "of roofline"] if gpu else []
        rows = []
        for row in r["rows"]:
            cells = [row["batch"], f"{row['ours_tok_s']:.1f}", f"{row['transformers_tok_s']:.1f}",
                     f"{row['ratio']:.2f}x"]
            if gpu:
                cells += [f"{row['eager_tok_s']:.1f}" if "eager_tok_s" in row else "-",
                          f"{row['roofline_tok_s']:.0f}", f"{row['of_roofline']:.0%}"]
            rows.append(cells)
        layers = f" ({r['layers']} decoder layers)" if r.get("layers") else " (all decoder layers)" if gpu else ""
        moe = " (routed experts: the expected share its tokens pick, routing uniform)" if r.get("routed_bytes") else ""
        where_text = (f"{r.get('device')}, {r['model']} shape{layers}, random {r['dtype']} weights "
                      f"({r['weight_bytes'] / 1e9:.1f} GB); roofline = batch x copy bandwidth "
                      f"({r['copy_bandwidth'] / 1e12:.2f} TB/s) / weight bytes a decode step reads{moe}"
                      if gpu else f"CPU ({r['cpu_count']} cores), bundled model, {r['dtype']}")
        parts += [f"**{where_text}**; prompt {r['prompt_len']} tokens, {r['new_tokens']} generated per request.", "",
                  table(header, rows), ""]
        if gpu and not r.get("warmed"):
            parts += ["These figures predate a fix to this benchmark: each timed run built a new engine, so the "
                      "capture of its CUDA graphs (at the first decode step) was timed with it; the graph columns "
                      "understate the engine, as do both sides of the W4A16 tables below. Runs now capture and warm "
                      "up before timing.", ""]
        if gpu and not suffix:
            parts += ["Eager PyTorch is host-bound here: it launches every op separately. The engine replays "
                      "decode steps as CUDA graphs (one per batch-size and key-length bucket, MoE models included: "
                      "routing and the fused experts have static shapes); the eager column is the same engine with "
                      "graphs off. Fused RMSNorm, rotary and SwiGLU kernels and merged q/k/v and gate/up "
                      "projections keep the launches per layer low.", ""]
            parts += anatomy_note()
        if gpu and "w4a16" in r:
            parts += w4a16_section(r, f"{r['model']} shape{layers}")
            parts += quick_rerun_note(suffix)
            parts += [MOE_ANATOMY, ""] if suffix == "_v2-lite" else []
    agreement = RESULTS / "agreement_bundled_gpu.json"
    if agreement.exists():
        a = json.loads(agreement.read_text())
        parts += [f"Greedy agreement on a trained model ({a['model']}, bf16, {a['device']}; "
                  "`engine_throughput.py agreement`): W4A16 through the kernels against the same weights through "
                  f"dequantize + F.linear, {a['prompts']} prompts from its held-out text x {a['steps']} steps: "
                  + agreement_figures(a) + (f" (QUANTSHIP_PDL={a['pdl']})" if "pdl" in a else "")
                  + (f"; run one at a time (decode steps of one row): {agreement_figures(a['one_at_a_time'])}"
                     if "one_at_a_time" in a else "") + ". "
                  + (f"Reference: {a['reference']}." if "reference" in a else EARLIER_REFERENCE), ""]
    parts += ["KV cache per token (all layers, bf16): MLA keeps the latent c_kv plus the shared rope key instead of "
              "per-head keys and values.", "", kv_table()]
    update_section("engine_throughput", "\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--where", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--shape", default="coder-6.7b", help="gpu only: coder-6.7b, or v2-lite (MLA + MoE, fused experts)")
    p.add_argument("--layers", type=int, help="gpu only: fewer decoder layers than the shape has")
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default cpu 1 8 32, gpu 1 16 64)")
    p.add_argument("--no-agreement", action="store_true", help="gpu: skip the W4A16 greedy-agreement check")
    sub.add_parser("render")
    q = sub.add_parser("quick")
    q.add_argument("--out", type=Path, default=RESULTS)
    q.add_argument("--shape", default="coder-6.7b")
    q.add_argument("--layers", type=int)
    q.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    q.add_argument("--profile", action="store_true", help="print the W4A16 graph's kernels by GPU time per batch")
    q.add_argument("--moe-split-k", type=int, default=None,
                   help="K splits of the fused MoE's decode blocks (kernels.fused_moe.DECODE_SPLIT_K) for this run")
    q.add_argument("--slot-gemv-share", type=float, default=None,
                   help="packed experts run a GEMV row per slot up to this many slots per expert "
                        "(kernels.fused_moe.SLOT_GEMV_MAX_SHARE; 0: always the blocks)")
    q.add_argument("--no-fold-shared", action="store_true",
                   help="keep MoE layers' shared experts a dense MLP of their own (models.deepseek.MoE.fold_shared)")
    q.add_argument("--ablate", action="store_true",
                   help="also batch 1 with decode graphs only, + graphs of prompt chunks, + decode steps run ahead")
    q.add_argument("--pdl", action="store_true",
                   help="time each side with programmatic dependent launch off, on (*_pdl) and by default "
                        "(w4a16_pdl_no_tiles), alternating")
    q.add_argument("--words", action="store_true",
                   help="also time W4A16 with its packed words held along K (w4a16_words_k), alternating")
    q.add_argument("--no-tma", action="store_true",
                   help="also time W4A16 with the table's tiles loading without TMA (w4a16_no_tma), alternating")
    q.add_argument("--no-stream", action="store_true",
                   help="also time W4A16 with the table's stream-K tiles splitting K instead "
                        "(w4a16_no_stream), alternating")
    q.add_argument("--shared-table", action="store_true",
                   help="also time W4A16 through the table every GPU shares, without this GPU's own tiles "
                        "(kernels.wna16.DEVICE_TILES; w4a16_shared_table), alternating: what `adopt --device` gained")
    q.add_argument("--prefetch", type=int, default=0,
                   help="also time W4A16 with PDL on for every kernel and the stream-K tiles prefetching this many K "
                        "tiles into L2 before their wait (kernels.wna16.STREAM_PREFETCH; w4a16_pdl_prefetch), alternating")
    q.add_argument("--quads", action="store_true",
                   help="also time W4A16 with the one-row GEMV adding its K split's sums four per vector reduction "
                        "(kernels.wna16.GEMV_QUADS; w4a16_quads), alternating")
    q.add_argument("--gemv-tile", type=int, nargs=3, metavar=("OUTPUTS", "INPUTS", "WARPS"),
                   help="also time W4A16 with the one-row GEMV in these tiles (w4a16_gemv_tile), alternating")
    q.add_argument("--gemv-words", choices=("n", "k"), default="n",
                   help="the --gemv-tile side's packed words held along N (the default) or along K")
    q.add_argument("--gemv-kind", choices=("gemv_bf16x2", "gemv_mma"), default="gemv_bf16x2",
                   help="the --gemv-tile side's kernel: the CUDA-core GEMV, or tensor cores (kernels.wna16_mma)")
    q.add_argument("--gemv-stages", type=int, choices=(1, 2), default=1,
                   help="the --gemv-tile side's stages of words (gemv_mma; 2: each group's loaded while the group "
                        "before computes)")
    q.add_argument("--table-only", action="store_true",
                   help="W4A16 through the table every GPU shares, not this GPU's own tiles (kernels.wna16.DEVICE_TILES)")
    q.add_argument("--tag", default="", help="appended to the result file's name (engine_quick_gpu<shape><tag>.json)")
    a = sub.add_parser("agreement", help="gpu: W4A16 kernels against the dequantize reference, bundled trained model")
    a.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.cmd == "agreement":
        agreement_on_bundled(args.out)
    elif args.cmd == "quick":
        if args.gemv_stages > 1 and args.gemv_kind != "gemv_mma":  # the CUDA-core GEMV has no stages of words
            parser.error("--gemv-stages 2 takes --gemv-kind gemv_mma")
        from quantship.kernels import fused_moe, wna16

        if args.table_only:
            wna16.DEVICE_TILES = {}
        if args.moe_split_k is not None:
            fused_moe.DECODE_SPLIT_K = args.moe_split_k
        if args.slot_gemv_share is not None:
            fused_moe.SLOT_GEMV_MAX_SHARE = args.slot_gemv_share
        if args.no_fold_shared:
            from quantship.models.deepseek import MoE

            MoE.fold_shared = False
        quick(args.out, args.shape, args.layers, tuple(args.batches), args.profile, args.tag, args.ablate,
              args.pdl, args.words, args.no_tma, args.no_stream,
              args.shared_table, args.prefetch, args.quads, args.gemv_tile, args.gemv_words, args.gemv_kind,
              args.gemv_stages)
    elif args.cmd == "run":
        run(args.where, args.out, args.shape, args.layers, args.batches, not args.no_agreement)
        if args.out == RESULTS:
            render()
    else:
        render()


if __name__ == "__main__":
    main()
