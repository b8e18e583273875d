"""Command line: parse, call one library function, print. Errors in the input exit 2 in one line."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path

from quantship import __version__
from quantship.argtypes import (
    PORT,
    POSITIVE,
    POSITIVE_FLOAT,
    SEED,
    OneLineParser,
    integer,
    module_pattern,
    number,
    token_counts,
)
from quantship.errors import QuantshipError, Terminated, as_stop, clear_stop, stop_on_signal
from quantship.files import check_output_location


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _describe_quantization(qc: dict | None) -> str:
    if not qc:
        return "none"
    if qc.get("quant_method") == "fp8":
        block = "x".join(str(b) for b in qc.get("weight_block_size") or [])
        return (f"FP8 block source ({qc.get('fmt', 'e4m3')} weights, {block} block scales, "
                f"{qc.get('activation_scheme', 'dynamic')} activations), dequantized layer by layer when read")
    parts = []
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        kind = f"{w.get('type', 'int')}{w.get('num_bits')}"
        detail = f"group {w['group_size']}" if w.get("strategy") == "group" else w.get("strategy", "")
        sym = "symmetric" if w.get("symmetric", True) else "asymmetric"
        acts = group.get("input_activations")
        act = f", activations {acts.get('type')}{acts.get('num_bits')} per {acts.get('strategy')}" if acts else ""
        targets = ", ".join(group.get("targets", []))
        on = targets if len(targets) < 40 else f"{len(group['targets'])} modules"
        parts.append(f"{kind} {detail} {sym}{act} on {on}")
    ignore = ", ".join(qc.get("ignore", []))
    return f"{qc.get('quant_method')} {qc.get('format')}: " + "; ".join(parts) + f" (ignore: {ignore})"


def _serving_memory(path) -> dict:
    """What the engine holds for the weights when it serves this checkpoint on a GPU (bf16, quantized
    Linears kept packed): the figure `serve` logs at start-up, known here without loading anything."""
    import torch

    from quantship.deploy.weights import weight_memory
    from quantship.models.config import load_config

    memory = weight_memory(load_config(path), None, torch.bfloat16, path)
    return {"dtype": "bfloat16", "weight_bytes": memory.weight_bytes, "decode_copy_bytes": memory.decode_copy_bytes}


def _print_rows(rows: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None, pad_edge=False)
    for key, value in rows:
        table.add_row(f"[bold]{key}[/bold]", value)
    Console().print(table)


def _gguf_info(path: str, as_json: bool) -> int:
    from quantship.formats.gguf_read import gguf_info

    info = gguf_info(path)
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    tokenizer = info["tokenizer"]
    _print_rows([
        ("path", info["path"]),
        ("format", f"GGUF, file type {info['file_type']} ({info['bits_per_weight']:.2f} bits per weight)"),
        ("architecture", f"{info['gguf_architecture']} in llama.cpp, {info['architecture']} in quantship"),
        ("parameters", _human_count(info["parameters"])),
        ("layers", str(info["layers"])),
        ("context", f"{info['max_position_embeddings']} tokens"),
        ("size on disk", _human_bytes(info["size_bytes"])),
        ("tensor types", ", ".join(f"{n} {t}" for t, n in info["tensor_types"].items())),
        ("tokenizer", f"{tokenizer['model']}, pre-tokenizer {tokenizer['pre']}"
                      + (", chat template" if tokenizer["chat_template"] else "")),
    ])
    return 0


def _onnx_info(path: str, as_json: bool) -> int:
    from quantship.formats.onnx import onnx_info

    info = onnx_info(path)
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    linears = ", ".join(f"{n} {kind}" for kind, n in (info["linears"] or {}).items())
    _print_rows([
        ("path", info["path"]),
        ("format", f"ONNX export, type {info['type']} (written by {info['writer']} from {info['source']})"),
        ("architecture", info["architecture"]),
        ("layers", str(info["layers"])),
        ("context", f"{info['max_position_embeddings']} tokens"),
        ("size on disk", _human_bytes(info["size_bytes"])),
        ("graph", f"{info['nodes']} nodes, {info['inputs']} inputs, {info['outputs']} outputs (KV cache: "
                  f"{', '.join(info['cache'] or [])})"),
        ("linears", linears),
        ("operators", ", ".join(f"{n} {op}" for op, n in list(info["operators"].items())[:6])),
    ])
    return 0


def cmd_info(args) -> int:
    from quantship.formats.gguf_read import is_gguf
    from quantship.formats.onnx import is_onnx_export
    from quantship.models.bundled import resolve_model
    from quantship.models.info import model_info
    from quantship.models.tokenizer import tokenizer_summary

    if args.model is not None and is_gguf(args.model):  # a file llama.cpp serves: described from its metadata
        return _gguf_info(args.model, args.json)
    if args.model is not None and is_onnx_export(args.model):  # an export directory ONNX Runtime runs
        return _onnx_info(args.model, args.json)
    path = resolve_model(args.model)
    info = model_info(path)
    info["serving"] = _serving_memory(path)
    info["tokenizer"] = tokenizer_summary(path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [
        ("path", info["path"]),
        ("architecture", info["architecture"]),
        ("parameters", f"{_human_count(info['parameters'])} total, "
                       f"{_human_count(info['active_parameters'])} active per token"),
        ("layers", str(info["layers"])),
        ("attention", info["attention"] + (f" (kv_lora_rank {info['mla']['kv_lora_rank']}, "
                                           f"q_lora_rank {info['mla']['q_lora_rank']})" if "mla" in info else "")),
    ]
    if "moe" in info:
        m = info["moe"]
        rows.append(("experts", f"{m['routed_experts']} routed (top-{m['experts_per_token']}, {m['scoring']}, "
                                f"{m['topk_method']}) + {m['shared_experts']} shared; "
                                f"{m['dense_layers']} dense layer(s) first"))
    if "mtp" in info:
        m = info["mtp"]
        found = (f"layer {', '.join(map(str, m['layers']))}, {_human_count(m['parameters'])} parameters"
                 if m["layers"] else "declared but not stored")
        rows.append(("MTP", f"{m['declared']} multi-token-prediction layer(s): {found} (not run by verify/serve)"))
    rows += [
        ("dtype", info["dtype"]),
        ("context", f"{info['max_position_embeddings']} tokens "
                    f"(rope {info['rope']['type']}, factor {info['rope']['factor']:g})"),
        ("size on disk", f"{_human_bytes(info['size_bytes'])} in {info['shards']} shard(s)"),
        ("KV cache", f"{_human_bytes(info['kv_cache_bytes_per_token'])} per token in bf16"
                     + (f" (MLA latent; full K/V would be {_human_bytes(info['full_kv_bytes_per_token'])})"
                        if "mla" in info else "")),
        ("quantization", _describe_quantization(info["quantization_config"])),
        ("served weights", f"{_human_bytes(info['serving']['weight_bytes'])} of GPU memory in bf16"
                           + (f" (+{_human_bytes(info['serving']['decode_copy_bytes'])} int4 decode copies)"
                              if info["serving"]["decode_copy_bytes"] else "")),
        ("tokenizer", _describe_tokenizer(info["tokenizer"])),
    ]
    if "eval_text" in info:
        rows += [("eval_text", info["eval_text"]), ("calib_text", info["calib_text"])]
    _print_rows(rows)
    return 0


def _describe_tokenizer(t: dict) -> str:
    if "error" in t:
        return f"does not load: {t['error']}"
    return (f"{t['vocab']:,} tokens, eos {t['eos_token']!r}, "
            + ("chat template" if t["chat_template"] else "no chat template (/v1/chat/completions answers 400)"))


def cmd_generate(args) -> int:
    import torch

    from quantship.models.bundled import resolve_model
    from quantship.models.loader import Checkpoint
    from quantship.models.quantized import use_cpu_kernels
    from quantship.models.reference_loop import generate_tokens
    from quantship.models.tokenizer import eos_ids, load_tokenizer

    if args.max_tokens < 1:
        raise QuantshipError("--max-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise QuantshipError("--temperature must be >= 0 and --top-p in (0, 1]")
    path = resolve_model(args.model)
    ck = Checkpoint(path)
    tokenizer = load_tokenizer(path)
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise QuantshipError("--chat needs a chat_template in tokenizer_config.json", path)
        # The template writes BOS itself, so tokenize its text without adding specials again.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(args.prompt)["input_ids"]
    context = ck.config.max_position_embeddings
    if len(prompt_ids) + args.max_tokens > context:
        raise QuantshipError(f"--max-tokens {args.max_tokens} and the {len(prompt_ids)}-token prompt exceed the "
                             f"model's context of {context} tokens (at most {max(context - len(prompt_ids), 0)})")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = ck.load_model(dtype=torch.float32 if device == "cpu" else torch.bfloat16, device=device)
    if device == "cpu":
        use_cpu_kernels(model)  # as `serve` runs it: the same tokens
    tokens = generate_tokens(
        model, list(prompt_ids), args.max_tokens, args.temperature, args.top_p, args.seed,
        stop_ids=eos_ids(tokenizer, ck.config.eos_token_id),
    )
    out: list[int] = []
    printed = ""
    sys.stdout.write(args.prompt)
    for token in tokens:
        out.append(token)
        text = tokenizer.decode(out, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    return 0


def cmd_quantize(args) -> int:
    from quantship.quant.pipeline import QuantizeOptions, quantize

    opts = QuantizeOptions(scheme=args.scheme, method=args.method, calib=args.calib, samples=args.samples,
                           seq_len=args.seq_len, device=args.device, ignore=args.ignore or [],
                           group_size=args.group_size, actorder=args.actorder, dampening=args.dampening,
                           overwrite=args.overwrite, mtp=args.mtp, strict_groups=args.strict_groups,
                           resume=args.resume)
    if args.expert_hessian_gb is not None:
        opts.expert_hessian_gb = args.expert_hessian_gb
    if args.plan:
        from quantship.quant.plan import read_plan

        opts.plan = read_plan(args.plan)
    if args.quiet:
        recipe = quantize(args.model, args.output, opts)
    else:
        from quantship.progress import layer_bar

        bar, step = layer_bar()
        with bar:
            recipe = quantize(args.model, args.output, opts, progress=step)
    if not recipe:  # a helper process of a torchrun group: rank 0 writes and reports
        return 0
    if args.json:
        print(json.dumps(recipe, indent=2))
        return 0
    calib = recipe["calibration"]
    resumed = f", resumed at layer {recipe['resumed_from_layer']}" if "resumed_from_layer" in recipe else ""
    print(f"wrote {args.output}: {', '.join(recipe['schemes_used'])} via {recipe['method']}, "
          f"{recipe['quantized_linears']} Linear layers, {recipe['shards']} shard(s), "
          f"{recipe['seconds']:.1f}s{resumed}")
    if not calib:
        print("calibration: none run (RTN rounds each weight on its own)")
    else:
        print(f"calibration: {calib['samples']} x {calib['seq_len']} tokens from {calib['source']}")
    memory = recipe.get("memory") or {}
    if memory.get("activations") == "host" or memory.get("expert_groups", 1) > 1:
        on_gpu = str(recipe.get("device", "cpu")).startswith("cuda")
        where = ("host memory" if memory["activations"] == "host" else
                 "GPU memory, beside the model" if on_gpu else "the CPU's memory, beside the model")
        held = memory.get("routed_experts", "float32")
        held = f", held {held} and widened per use" if held != "float32" else ""
        print(f"memory: calibration activations in {where} ({memory['activation_bytes'] / 2**30:.1f} GiB a copy); "
              f"routed experts solved in {memory['expert_groups']} group(s) of Hessians{held}")
    if calib and calib["samples"] < calib["samples_requested"]:
        print(f"note: the calibration text holds only {calib['samples']} samples of {calib['seq_len']} tokens")
    if recipe["fallbacks"]:
        print(f"fallbacks (too few routed tokens; every-token statistics used): {len(recipe['fallbacks'])}, "
              "listed in quantship_recipe.json")
    for module, got in recipe["group_fallbacks"].items():
        print(f"group fallback: {module} -> {got} (the group size does not divide its input)")
    if "mtp" in recipe:
        m = recipe["mtp"]
        where = f"layer {', '.join(map(str, m['layers']))}" if m["layers"] else "none written"
        print(f"MTP ({m['mode']}): {where}, {m['stored_as']}")
    return 0


def cmd_verify(args) -> int:
    from rich.console import Console

    from quantship.progress import progress_bar
    from quantship.verify.report import write_report
    from quantship.verify.run import VerifyOptions, verify

    console = Console(stderr=True)
    opts = VerifyOptions(text=args.text, ctx=args.ctx, max_tokens=args.max_tokens, gates=args.gate,
                         sensitivity=not args.no_sensitivity, generations=not args.no_generations, device=args.device)
    check_output_location(args.report / "report.json", "report")
    bar, step = progress_bar(console)
    with bar:
        report = verify(args.base, args.quant, opts, progress=step)
    paths = write_report(report, args.report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        h, f = report["headline"], report["noise_floor"]
        print(f"{report['tokens']} tokens, ctx {report['ctx']}: KL mean {h['kl_mean']:.4f} "
              f"[{h['kl_mean_ci95'][0]:.4f}, {h['kl_mean_ci95'][1]:.4f}] (noise floor {f['kl_mean']:.4f}), "
              f"p99 {h['kl_p99']:.3f}, top-1 {h['top1_agreement']:.1%}, "
              f"ppl {h['ppl_base']:.3f} -> {h['ppl_quant']:.3f}, "
              f"flips {h['flips_right_to_wrong']} right->wrong / {h['flips_wrong_to_right']} wrong->right")
        print("report: " + ", ".join(str(p) for p in paths.values()))
    gates = report.get("gates")
    if gates:
        failed = [r for r in gates["results"] if not r["passed"]]
        for r in failed:
            where = f" at {r['where']}" if r.get("where") else ""
            print(f"FAIL {r['metric']} = {r['value']:.4g}{where}, needs {r['op']} {r['threshold']:g}", file=sys.stderr)
        verdict = "PASS" if not failed else f"{len(failed)} of {len(gates['results'])} FAILED"
        print(f"gates ({gates['file']}): {verdict}",
              file=sys.stderr)
        return 1 if failed else 0
    return 0


def cmd_export(args) -> int:
    from quantship.formats.export import ExportRequest, export

    request = ExportRequest(source=args.model, output=args.output, type=args.type, method=args.method,
                            calib=args.calib, samples=args.samples, seq_len=args.seq_len, overwrite=args.overwrite,
                            pre_tokenizer=args.pre_tokenizer, imatrix=args.imatrix)
    print("\n".join(export(args.format, request)))
    return 0


def cmd_plan(args) -> int:
    from quantship.verify.mixed_precision import make_plan, write_plan

    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    plan = make_plan(args.model, args.budget_bits, schemes, out=args.output, method=args.method, calib=args.calib,
                     device=args.device)
    write_plan(plan, args.output)
    counts: dict[str, int] = {}
    for unit in plan["units"]:
        counts[unit["scheme"]] = counts.get(unit["scheme"], 0) + 1
    print(f"wrote {args.output}: {plan['predicted_avg_bits']:.3f} bits per weight (budget {args.budget_bits}), "
          f"predicted KL {plan['predicted_kl']:.4f}; units: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"next: quantship quantize {args.model} -o OUT --plan {args.output}")
    return 0


def cmd_bench(args) -> int:
    from quantship.bench.run import BenchOptions, run_bench

    return run_bench(BenchOptions(
        url=args.url, model=args.model, profile=args.profile, rates=args.rate or [], concurrency=args.concurrency,
        burstiness=args.burstiness, steps=args.steps, requests=args.requests, duration=args.duration,
        input_len=args.input_len, output_len=args.output_len, prompts=args.prompts, tokenizer=args.tokenizer,
        slo=args.slo, output=args.output, baseline=args.baseline, tolerance=args.tolerance, gate_file=args.gate_file,
        timeout=args.timeout, allow_remote=args.allow_remote, details=args.details, seed=args.seed,
        otlp_endpoint=args.otlp_endpoint))


def cmd_serve(args) -> int:
    from quantship.server.serve import ServeOptions, serve

    return serve(args.model, ServeOptions(
        host=args.host, port=args.port, engine=args.engine, device=args.device,
        served_model_name=args.served_model_name,
        api_key=args.api_key, api_key_file=args.api_key_file, max_queue=args.max_queue,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, block_size=args.block_size,
        kv_cache_fraction=args.kv_cache_fraction, prefix_caching=not args.no_prefix_caching,
        inject_latency_ms=args.inject_latency_ms, inject_error_rate=args.inject_error_rate,
        request_timeout_s=args.request_timeout, otlp_endpoint=args.otlp_endpoint, expert_stats=args.expert_stats))


def cmd_capacity(args) -> int:
    from quantship.deploy.capacity import Request, plan
    from quantship.deploy.capacity_report import lines

    result = plan(Request(model=args.model, scheme=args.scheme, gpu=args.gpu, gpu_memory_gb=args.gpu_memory,
                          contexts=args.context, batch_cap=args.max_num_seqs_cap, block_size=args.block_size,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_fraction=args.kv_cache_fraction))
    print(json.dumps(result.to_dict(), indent=2) if args.json else "\n".join(lines(result)))
    return 0


def cmd_deploy_generate(args) -> int:
    from quantship.deploy.generate import DeployOptions, generate, summary_lines

    opts = DeployOptions(engine=args.engine, gpu_type=args.gpu_type, gpus=args.gpus, replicas=args.replicas,
                         canary=args.canary, autoscaler=args.autoscaler, image=args.image,
                         max_model_len=args.max_model_len, load_mbps=args.load_bandwidth,
                         engine_load_mbps=args.engine_load_rate,
                         storage_class=args.storage_class, prometheus_url=args.prometheus_url,
                         queue_target=args.queue_target, cpu=args.cpu, memory=args.memory, size_gb=args.size_gb,
                         name=args.name, rules=args.rules, ttft_slo_s=args.ttft_slo, overwrite=args.overwrite)
    result = generate(args.model, args.output, opts)
    print("\n".join(summary_lines(result)))
    return 0


def cmd_deploy_validate(args) -> int:
    from quantship.deploy.validate import K8S_VERSION, validate_dir

    report = validate_dir(args.path)
    for problem in report.problems:
        print(problem)
    for note in report.notes:
        print(f"note: {note}")
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(report.kinds.items()))
    verdict = f"{len(report.problems)} problem(s)" if report.problems else "valid"
    print(f"{args.path}: {report.objects} objects in {report.files} files ({kinds}); {len(report.builds)} "
          f"kustomize build(s); Kubernetes {K8S_VERSION} strict + custom schemas: {verdict}")
    return 1 if report.problems else 0


def cmd_deploy_verify(args) -> int:
    from quantship.deploy.checksums import verify

    verdict = verify(args.model, args.sums, strict=args.strict)
    print("\n".join(verdict.lines))
    print(f"verdict: {'PASS' if verdict.ok else 'FAIL'}")
    return 0 if verdict.ok else 1


def cmd_gate(args) -> int:
    from quantship.deploy.canary import VERDICTS, clean_selector, load_rules, run_gate

    rules = load_rules(args.rules)
    canary = clean_selector(args.canary_selector or rules.canary_selector, "canary")
    baseline = clean_selector(args.baseline_selector or rules.baseline_selector, "baseline")
    result = run_gate(args.prometheus, rules, canary, baseline, interval=args.interval, count=args.count,
                      failure_limit=args.failure_limit, window=args.window,
                      report=lambda line: print(line, file=sys.stderr if args.json else sys.stdout, flush=True))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"verdict: {VERDICTS[result.verdict]} ({result.reason})")
    return result.verdict


def cmd_demo(args) -> int:
    from quantship.demo import run_demo

    return run_demo(args.workdir, run=main)


EXAMPLES = {
    "info": """
        quantship info                       # the bundled tiny DeepSeek-V3
        quantship info /models/DeepSeek-V2-Lite --json
        quantship info tiny-q4km.gguf                        # a GGUF file: file type, tensor types, tokenizer
        quantship info tiny-onnx-int4                        # an ONNX export: type, graph, operators
    """,
    "generate": """
        quantship generate --prompt 'def fibonacci(n):' --max-tokens 64
        quantship generate /models/deepseek-coder-6.7b --prompt 'import numpy' --temperature 0.7 --top-p 0.9 --seed 1
        quantship generate tiny --chat --prompt 'Write a haiku about tensors'
    """,
    "quantize": """
        quantship quantize tiny -o tiny-w4a16 --scheme W4A16 --method gptq
        quantship quantize /models/DeepSeek-V2-Lite -o v2lite-awq --method awq --device cuda --seq-len 2048
        quantship quantize tiny -o tiny-w8a8 --scheme W8A8 --ignore 're:.*kv_b_proj$'
        quantship quantize tiny -o tiny-g64 --scheme W4A16_ASYM --group-size 64 --calib my.jsonl
    """,
    "verify": """
        quantship verify tiny tiny-w4a16 --report reports/w4a16 --gate default
        quantship verify /models/DeepSeek-V2-Lite v2lite-awq --report r/ --text heldout.txt --ctx 8192 --device cuda
        quantship verify tiny tiny-w8a16 --report r/ --gate my-gates.yaml --no-sensitivity
    """,
    "export": """
        quantship export tiny --format gguf -o tiny-q4km.gguf                 # Q4_K_M, llama.cpp's mix of types
        quantship export tiny-w4a16-g32 --format gguf -o tiny-q4_0.gguf        # lossless from W4A16 group 32
        quantship export tiny --format gguf -o tiny-q4km-gptq.gguf --type Q4_K_M --method gptq
        quantship verify tiny tiny-q4km.gguf --report reports/q4km            # the file measured like any checkpoint
        quantship export tiny --format onnx -o tiny-onnx                      # fp32 with a KV cache, for ONNX Runtime
        quantship export tiny-w4a16 --format onnx -o tiny-onnx-int4 --type int4   # MatMulNBits from its integers
    """,
    "plan": """
        quantship plan tiny --budget-bits 5 -o plan.json
        quantship quantize tiny -o tiny-mixed --plan plan.json
        quantship plan /models/DeepSeek-V2-Lite --budget-bits 4.5 -o plan.json --method awq --device cuda
    """,
    "bench": """
        quantship bench http://127.0.0.1:8000                      # sweep: max throughput, then 5 Poisson rates
        quantship bench http://127.0.0.1:8000 --profile poisson --rate 1 2 4 --requests 200 --slo ttft=500ms,tpot=50ms
        quantship bench http://127.0.0.1:8000 --profile concurrent --concurrency 8 --duration 60 -o runs/new
        quantship bench http://127.0.0.1:8000 --profile constant --rate 2 --prompts prompts.jsonl --output-len 64
        quantship bench http://127.0.0.1:8000 --baseline runs/old/bench.json --tolerance 5%   # exit 1 on regression
    """,
    "serve": """
        quantship serve                      # the bundled model on http://127.0.0.1:8000/v1
        quantship serve tiny-w4a16 --port 8001 --max-queue 64 --api-key "$KEY"
        quantship serve /models/deepseek-coder-6.7b-w4a16 --engine vllm --host 0.0.0.0
    """,
    "capacity": """
        quantship capacity /models/deepseek-coder-6.7b --gpu H200                 # 4K, 8K (and 32K where the model has it)
        quantship capacity /models/deepseek-coder-6.7b --gpu H200 --scheme W4A16 --context 4096,16384
        quantship capacity v2-lite-config/ --gpu-memory 80 --json                # a config.json-only directory works
    GPUs in the table (deploy/gpus.yaml, with sources): H200, H100-80G, A100-80G, A100-40G, L40S, L4, A10G
    """,
    "deploy": """
        quantship deploy tiny -o k8s/ --gpus 0                   # CPU-only manifests for the bundled model
        quantship deploy /models/v3-w4a16 -o k8s/ --engine vllm --gpu-type NVIDIA-H200 --replicas 2:8 --canary
        quantship deploy v3-config-only/ -o k8s/ --engine vllm --autoscaler keda --size-gb 360   # config.json only
        quantship deploy generate validate -o k8s/                # `deploy MODEL` for a MODEL named validate
        quantship deploy validate k8s/                            # exit 1 with file: object: field: problem
        quantship deploy verify /models/v3-w4a16 --sums k8s/      # SHA256SUMS + version check, exit 1 on mismatch
        quantship deploy verify /models/v3-w4a16 --sums k8s/ --strict   # unlisted extra files fail too
    """,
    "gate": """
        quantship gate canary --prometheus http://127.0.0.1:9090 --canary-selector 'job="canary"' \\
            --baseline-selector 'job="baseline"' --interval 30 --count 10 --failure-limit 2
        quantship gate canary --prometheus http://prom:9090 --rules my-rules.yaml --json   # as JSON
        # exit 0 promote, 1 roll back, 2 inconclusive (no data)
    """,
    "demo": """
        quantship demo                       # offline, CPU: a few minutes (about four on two idle cores)
    """,
}


def _examples(name: str) -> str:
    return "examples:" + textwrap.indent(textwrap.dedent(EXAMPLES[name]).rstrip(), "  ")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="quantship",
        description="Quantize a DeepSeek-family model, verify it, serve it, benchmark it and ship it.",
        epilog="MODEL is a local Hugging Face-layout directory, or 'tiny' (the default) for the bundled model.",
    )
    parser.add_argument("--version", action="version", version=f"quantship {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_examples(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if func is not None:
            p.set_defaults(func=func)
        return p

    p = add("info", "Describe a checkpoint: architecture, parameters, experts, size, quantization (or a GGUF "
                    "file or an ONNX export: its type, tensors or graph, tokenizer).", cmd_info)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")

    p = add("generate", "Generate text with quantship's model definition (simple loop, one request).", cmd_generate)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=POSITIVE, default=64,
                   help="tokens to generate, within the context (default 64)")
    p.add_argument("--temperature", type=number(0), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=number(0, 1, lo_open=True), default=1.0)
    p.add_argument("--seed", type=SEED, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")

    p = add("quantize", "Quantize a model into a vLLM-loadable compressed-tensors checkpoint, one layer at a time.",
            cmd_quantize)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="OUT", help="output directory")
    p.add_argument("--scheme", default="W4A16",
                   help="W4A16 (default), W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, FP8_BLOCK "
                        "(W3A16/W2A16 only to test gates)")
    p.add_argument("--method", default="rtn", choices=["rtn", "awq", "gptq"])
    p.add_argument("--group-size", type=int, choices=[32, 64, 128],
                   help="for W4A16* (default 128) and W8A16 (default per channel; 32 = llama.cpp's Q8_0 grid)")
    p.add_argument("--actorder", choices=["static"],
                   help="GPTQ activation order: static, the most-activated columns first (act-order 'group' is not "
                        "offered: compressed-tensors >= 0.20 and the readers built on it dropped weight_g_idx)")
    p.add_argument("--calib", type=Path, help="calibration .txt or .jsonl ({\"text\": ...} per line); "
                                              "default: the bundled calibration text")
    p.add_argument("--samples", type=POSITIVE, default=128, help="calibration samples (default 128)")
    p.add_argument("--seq-len", type=integer(2), default=512, help="tokens per sample (default 512)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ignore", nargs="+", metavar="PATTERN", type=module_pattern,
                   help="keep these modules unquantized: names or 're:' regexes (lm_head and routers always)")
    p.add_argument("--dampening", type=number(0, 1, lo_open=True), default=0.01,
                   help="GPTQ dampening fraction (default 0.01)")
    p.add_argument("--expert-hessian-gb", type=number(0, lo_open=True), metavar="GB",
                   help="GPTQ: GiB of routed experts' Hessians gathered per calibration pass of a MoE layer "
                        "(default 8: DeepSeek-V3 in 7 passes, within an 80 GB GPU; 60 takes its 256 experts in "
                        "one pass on a 141 GB H200); the output is the same")
    p.add_argument("--plan", type=Path,
                   help="mixed-precision plan from 'quantship plan' (overrides --scheme per module)")
    p.add_argument("--mtp", default="keep", choices=["keep", "quantize", "drop"],
                   help="DeepSeek-V3's multi-token-prediction layer: copy in the source precision (default), "
                        "quantize it too, or drop it (num_nextn_predict_layers becomes 0)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run into the same OUT from its first unfinished layer "
                        "(the settings must be the same; the output is identical to an uninterrupted run)")
    p.add_argument("--strict-groups", action="store_true",
                   help="refuse a layer the group size does not divide (default: fall back to group 64/32, "
                        "else per channel, listed in the recipe)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print the recipe as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = add("verify", "Compare a quantized model with its base: KL, top-k, flips, position curves, sensitivity, "
                      "coverage, generations; gates exit 1.", cmd_verify)
    p.add_argument("base", metavar="BASE", help="the original model ('tiny' for the bundled one)")
    p.add_argument("quant", metavar="QUANT", help="the quantized model")
    p.add_argument("--report", required=True, type=Path, metavar="DIR", help="writes report.json, .md and .html here")
    p.add_argument("--text", type=Path, help="held-out text (default: the bundled evaluation text)")
    p.add_argument("--ctx", type=integer(2), help="tokens per window (default: the model's context, at most 4096)")
    p.add_argument("--max-tokens", type=integer(2), default=32768,
                   help="evaluate at most this many tokens (default 32768)")
    p.add_argument("--gate", metavar="GATES", help="YAML thresholds, or 'default' for the scheme's shipped gates")
    p.add_argument("--no-sensitivity", action="store_true", help="skip per-layer sensitivity")
    p.add_argument("--no-generations", action="store_true", help="skip side-by-side generations")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", action="store_true", help="print report.json to stdout")

    from quantship.formats.export import EXPORT_FORMATS

    p = add("export", "Write a model (full precision, or quantized by quantship) in another runtime's format: GGUF "
                      "for llama.cpp, ONNX (a KV-cache decoder directory) for ONNX Runtime.", cmd_export)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL_OR_QUANT")
    p.add_argument("--format", required=True, choices=sorted(EXPORT_FORMATS))
    p.add_argument("-o", "--output", required=True, type=Path, metavar="OUT",
                   help="the file to write (.gguf), or the directory (onnx)")
    p.add_argument("--type", help="gguf: Q4_0, Q4_1, Q8_0, Q4_K_M, Q5_K_M, Q6_K, BF16, F16 (default: the lossless type "
                                  "of a quantized checkpoint, Q4_K_M from full precision); onnx: fp32 (default), fp16, "
                                  "int4, int8-dynamic, int8-static")
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq"],
                   help="how full-precision weights are rounded onto the type's grid (default rtn)")
    p.add_argument("--calib", type=Path, help="calibration text for --method gptq, --imatrix and onnx int8-static "
                                              "(default: the bundled one)")
    p.add_argument("--samples", type=POSITIVE, default=128, help="calibration samples (default 128)")
    p.add_argument("--seq-len", type=integer(2), default=512, help="tokens per calibration sample (default 512)")
    p.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    p.add_argument("--imatrix", action="store_true",
                   help="gguf: weigh round-to-nearest by an importance matrix (mean squared activations per input "
                        "column, from a calibration pass over --calib), as llama-quantize --imatrix does")
    p.add_argument("--pre-tokenizer", metavar="NAME",
                   help="gguf: llama.cpp's pre-tokenizer name (tokenizer.ggml.pre) for a tokenizer quantship cannot "
                        "identify, e.g. deepseek-v3, deepseek-coder, llama-bpe, qwen2 (default: identified)")

    p = add("plan", "Choose a scheme per module from measured sensitivity under an average-bits budget.", cmd_plan)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("--budget-bits", type=POSITIVE_FLOAT, required=True, help="average stored bits per Linear weight")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="PLAN", help="plan JSON to write")
    p.add_argument("--schemes", default="W4A16,W8A16",
                   help="candidates besides the original dtype (default W4A16,W8A16)")
    p.add_argument("--method", default="rtn", choices=["rtn", "awq", "gptq"], help="how candidates are quantized")
    p.add_argument("--calib", type=Path, help="text to calibrate and measure on (default: bundled calibration text)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])

    p = add("bench", "Load-test an OpenAI-compatible server (streaming /v1/completions): TTFT, TPOT, ITL, E2E "
                     "by load, goodput, plots; a baseline gate exits 1.", cmd_bench)
    p.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000 (loopback unless --allow-remote)")
    p.add_argument("--model", help="model name to request (default: the first of the server's /v1/models)")
    p.add_argument("--profile", default="sweep",
                   choices=["synchronous", "concurrent", "constant", "poisson", "sweep"],
                   help="sweep (default): saturate to find the max throughput, then a ladder of Poisson rates")
    p.add_argument("--rate", type=POSITIVE_FLOAT, nargs="+", metavar="R",
                   help="requests/s for constant and poisson; several run one after another")
    p.add_argument("--concurrency", type=POSITIVE, metavar="C", help="streams for concurrent and the sweep's "
                                                                     "saturation step (default 32); a cap on in-flight "
                                                                     "requests for rates")
    p.add_argument("--burstiness", type=POSITIVE_FLOAT, default=1.0,
                   help="gamma shape of arrival gaps: 1 Poisson (default), <1 burstier")
    p.add_argument("--steps", type=POSITIVE, default=5, help="rungs of the sweep's rate ladder (default 5)")
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--requests", type=POSITIVE, metavar="N", help="requests per step (default 100)")
    bound.add_argument("--duration", type=POSITIVE_FLOAT, metavar="S", help="seconds of sending per step instead")
    p.add_argument("--input-len", type=POSITIVE, metavar="I", help="synthetic prompt tokens (default 256)")
    p.add_argument("--output-len", type=POSITIVE, default=128, metavar="O",
                   help="max_tokens, with ignore_eos (default 128)")
    p.add_argument("--prompts", type=Path, metavar="FILE", help='JSONL of {"prompt": ...} instead of synthetic prompts')
    p.add_argument("--tokenizer", type=Path, metavar="DIR", help="model directory whose tokenizer counts prompt "
                                                                 "tokens (default: the bundled model's)")
    p.add_argument("--slo", metavar="ttft=..,tpot=..", help="goodput SLOs in ms (or s): ttft, tpot, e2el")
    p.add_argument("-o", "--output", type=Path, default=Path("quantship-bench"), metavar="OUT",
                   help="writes bench.json, bench.csv, *.png and bench.html here (default quantship-bench)")
    p.add_argument("--baseline", type=Path, metavar="OLD.json",
                   help="an earlier bench.json (or vLLM result) to gate on")
    p.add_argument("--tolerance", default="5%", help="how much worse a gated metric may get (default 5%%)")
    p.add_argument("--gate-file", type=Path, metavar="F", help="YAML choosing gated metrics and their tolerances")
    p.add_argument("--timeout", type=POSITIVE_FLOAT, default=120.0,
                   help="seconds per request, end to end (default 120)")
    p.add_argument("--allow-remote", action="store_true", help="allow a host that is not this machine")
    p.add_argument("--details", action="store_true", help="per-request arrays in bench.json (ttfts, itls, ...)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the arrival times (default 0)")
    p.add_argument("--otlp-endpoint", metavar="URL",
                   help="trace every request with OpenTelemetry (OTLP/HTTP, e.g. http://127.0.0.1:4318) and send "
                        "its traceparent, so a traced server's spans join the same trace")

    p = add("serve", "Serve a model over an OpenAI-compatible HTTP API with vLLM's Prometheus metrics.", cmd_serve)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=PORT, default=8000, help="default 8000")
    p.add_argument("--engine", choices=["native", "vllm"], default="native",
                   help="native: quantship's engine (default); vllm: exec `vllm serve` on the same checkpoint")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--served-model-name", metavar="NAME", help="the API's model id (default: the directory name)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("QUANTSHIP_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $QUANTSHIP_API_KEY); visible in the "
                        "process list: prefer the variable or --api-key-file")
    p.add_argument("--api-key-file", type=Path, metavar="FILE", help="read the API key from FILE (one line)")
    p.add_argument("--max-queue", type=POSITIVE, metavar="N", help="waiting requests beyond N get 429 (default 256)")
    p.add_argument("--max-num-seqs", type=POSITIVE, metavar="N", help="sequences in the running batch (default 64)")
    p.add_argument("--max-model-len", type=POSITIVE, metavar="N",
                   help="context length, at most the model's (default: the model's)")
    p.add_argument("--block-size", type=integer(1, 1024), metavar="N", help="tokens per KV-cache block (default 16)")
    p.add_argument("--kv-cache-fraction", type=number(0, 1, lo_open=True), metavar="F",
                   help="share of the memory left after the weights that the KV cache takes (default 0.85; on "
                        "CPU the cache is 2 GiB); `quantship capacity` recommends one")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn off prefix caching")
    p.add_argument("--request-timeout", type=POSITIVE_FLOAT, metavar="S",
                   help="stop a request S seconds after it arrived (finish_reason 'timeout'); default: none")
    p.add_argument("--inject-latency-ms", type=number(0), default=0.0, metavar="MS",
                   help="canary drills only: delay every /v1 request by MS (counted in TTFT and E2E)")
    p.add_argument("--inject-error-rate", type=number(0, 1), default=0.0, metavar="P",
                   help="canary drills only: answer this share of /v1 requests with 500")
    p.add_argument("--otlp-endpoint", metavar="URL",
                   help="OpenTelemetry request traces over OTLP/HTTP, e.g. http://127.0.0.1:4318 (default off; "
                        "OTEL_EXPORTER_OTLP_ENDPOINT and the other OTEL_* variables work too)")
    p.add_argument("--expert-stats", action="store_true",
                   help="MoE models: count tokens routed to each expert (metric quantship:moe_expert_tokens_total); "
                        "decode steps then run without CUDA graphs")

    p = add("deploy", "Kubernetes manifests for a served model (GPU scheduling, Guaranteed QoS, startup budget, "
                      "queue autoscaling, canary), validated offline; `deploy validate DIR` checks them, "
                      "`deploy verify MODEL` the model against its checksums. `quantship deploy MODEL -o DIR` is "
                      "`deploy generate MODEL -o DIR`.", None)
    deploy = p.add_subparsers(dest="deploy_command", metavar="SUBCOMMAND", required=True)

    def add_deploy(name: str, help_text: str, func) -> argparse.ArgumentParser:
        d = deploy.add_parser(name, help=help_text, description=help_text, epilog=_examples("deploy"),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        d.set_defaults(func=func)
        return d

    p = add_deploy("generate", "Write the manifests for MODEL into DIR (the default subcommand: "
                               "`quantship deploy MODEL -o DIR`).", cmd_deploy_generate)
    p.add_argument("model", metavar="MODEL",
                   help="a model directory (or config.json-only description), or 'tiny'")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="DIR",
                   help="directory to write (must not exist)")
    p.add_argument("--engine", choices=["native", "vllm"], default="native",
                   help="our image (default) or vllm/vllm-openai")
    p.add_argument("--gpu-type", default="NVIDIA-H100-80GB-HBM3", metavar="T",
                   help="nvidia.com/gpu.product label value")
    p.add_argument("--gpus", type=integer(0, 8), metavar="N",
                   help="GPUs per replica (default: what the weights need; 0: CPU)")
    p.add_argument("--replicas", default="1:4", metavar="MIN:MAX", help="autoscaling range (default 1:4)")
    p.add_argument("--canary", action="store_true",
                   help="also write the canary overlay: Argo Rollout + AnalysisTemplate")
    p.add_argument("--autoscaler", choices=["hpa", "keda"], default="hpa",
                   help="hpa: autoscaling/v2 + prometheus-adapter rule (default); keda: ScaledObject")
    p.add_argument("--image", help="server image (default quantship-server:VERSION, or vLLM's with --engine vllm)")
    p.add_argument("--max-model-len", type=POSITIVE, metavar="N",
                   help="context to serve (default: the model's, at most 32768)")
    p.add_argument("--load-bandwidth", type=POSITIVE_FLOAT, default=250.0, metavar="MB/S",
                   help="read rate of the model volume, sizes the startup probe (default 250)")
    p.add_argument("--engine-load-rate", type=POSITIVE_FLOAT, metavar="MB/S",
                   help="bytes of checkpoint per second the server loads once read (default: measured, "
                        "deploy/startup.yaml; a server logs its own at start-up)")
    p.add_argument("--size-gb", type=POSITIVE_FLOAT, metavar="GB",
                   help="model size when MODEL has no weights (default: estimated)")
    p.add_argument("--storage-class", help="storageClassName of the model cache PVC (must allow ReadOnlyMany)")
    p.add_argument("--prometheus-url", default="http://prometheus-operated.monitoring.svc:9090",
                   help="Prometheus for KEDA and the canary analysis")
    p.add_argument("--queue-target", type=integer(1, 10**6), default=5, metavar="N",
                   help="waiting requests per replica to scale at")
    p.add_argument("--cpu", help="CPU per replica (default 8 per GPU, max 64; 4 on CPU)")
    p.add_argument("--memory", help="memory per replica, e.g. 64Gi (default 32Gi per GPU; on CPU 3 x model + 2Gi)")
    p.add_argument("--name", help="object and served-model name (default: the model directory's name)")
    p.add_argument("--rules", metavar="RULES", help="canary rules for the AnalysisTemplate (default: the shipped ones)")
    p.add_argument("--ttft-slo", type=POSITIVE_FLOAT, default=2.0, metavar="S",
                   help="p99 TTFT alert threshold (default 2 s)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")

    p = add_deploy("validate", "Check every YAML file of DIR offline and strictly: exit 0 valid, 1 with problems.",
                   cmd_deploy_validate)
    p.add_argument("path", metavar="DIR", help="the manifests (what `deploy generate` wrote)")

    p = add_deploy("verify", "Recheck MODEL against its SHA256SUMS and whether this quantship reads it: exit 0 PASS, "
                             "1 FAIL.", cmd_deploy_verify)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL", help="the model directory (default tiny)")
    p.add_argument("--sums", metavar="FILE|DIR", help="SHA256SUMS, or the deploy directory holding it "
                                                      "(default MODEL/SHA256SUMS)")
    p.add_argument("--strict", action="store_true",
                   help="a file present but not listed in SHA256SUMS fails (default: a warning)")

    p = add("capacity", "How many sequences of which length one GPU holds: weights per scheme, KV bytes per token, "
                        "the engine's overheads, the out-of-memory point, and a roofline's throughput-optimal batch.",
            cmd_capacity)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL",
                   help="a model directory (a config.json alone is enough) or 'tiny'")
    p.add_argument("--scheme", metavar="S", help="plan for the model quantized to S: BF16, W8A16, W8A8, FP8_DYNAMIC, "
                                                 "FP8_BLOCK, W4A16, W4A16_ASYM (default: the checkpoint as stored)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", metavar="NAME", help="a GPU of the table (see below), or its nvidia.com/gpu.product label")
    gpu.add_argument("--gpu-memory", type=POSITIVE_FLOAT, metavar="GB", help="a GPU known only by its memory (no roofline)")
    p.add_argument("--context", type=token_counts, metavar="L,L,..",
                   help="context lengths to plan for (default 4096,8192,32768, those the model takes)")
    p.add_argument("--max-num-seqs-cap", type=POSITIVE, default=256, metavar="N",
                   help="the largest batch to plan (default 256, vLLM's max_num_seqs)")
    p.add_argument("--kv-cache-fraction", type=number(0, 1, lo_open=True), metavar="F",
                   help="share of free memory for the KV cache (default: the largest whose reserve holds twice "
                        "the estimated overheads)")
    p.add_argument("--block-size", type=integer(1, 1024), default=16, metavar="N", help="tokens per KV block (16)")
    p.add_argument("--max-num-batched-tokens", type=POSITIVE, default=512, metavar="N",
                   help="the engine's token budget per step (512): sizes the prefill activations")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")

    p = add("gate", "Compare a canary with its baseline on Prometheus: exit 0 promote, 1 roll back, 2 inconclusive.",
            cmd_gate)
    p.add_argument("check", choices=["canary"], help="what to gate (canary)")
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--rules", default="default", metavar="RULES", help="YAML of PromQL comparisons (default: shipped)")
    p.add_argument("--canary-selector", metavar="LABELS", help='label matchers of the canary, e.g. \'job="canary"\'')
    p.add_argument("--baseline-selector", metavar="LABELS", help="label matchers of the baseline")
    p.add_argument("--interval", type=number(0), default=60.0, metavar="S", help="seconds between rounds (default 60)")
    p.add_argument("--count", type=POSITIVE, default=5, metavar="N", help="rounds (default 5)")
    p.add_argument("--failure-limit", type=integer(0), default=1, metavar="K",
                   help="failed rounds a rule may have (default 1)")
    p.add_argument("--window", metavar="W", help="rate window, e.g. 2m (default: the rules file's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (rounds go to stderr)")

    p = add("demo", "Run every stage that exists on the bundled model, offline, on CPU (a few minutes).", cmd_demo)
    p.add_argument("--workdir", type=Path, help="where to write the demo's checkpoints (default: a temp dir)")
    return parser


DEPLOY_SUBCOMMANDS = ("generate", "validate", "verify")


def _with_default_subcommand(argv: list[str]) -> list[str]:
    """`quantship deploy MODEL ...` (no subcommand) is `quantship deploy generate MODEL ...`, as documented."""
    if len(argv) >= 2 and argv[0] == "deploy" and argv[1] not in (*DEPLOY_SUBCOMMANDS, "-h", "--help"):
        return ["deploy", "generate", *argv[1:]]
    return argv


# What needs less memory, by command, when the device runs out of it (the output is never half-written:
# every command writes to a temporary path and renames).
LESS_MEMORY = {
    "quantize": "a run stopped here continues with --resume (same settings); fewer calibration tokens "
                "(--samples, --seq-len) or a smaller --expert-hessian-gb need less",
    "plan": "fewer calibration tokens (--samples, --seq-len) need less, or --device cpu",
    "verify": "a shorter --ctx or fewer --max-tokens need less, or --device cpu",
    "generate": "a shorter prompt or --max-tokens needs less, or --device cpu",
    "serve": "lower --kv-cache-fraction or --max-num-seqs",
}


# Errors of a disk that takes no more (full, over quota, a file too large, mounted read-only): the user's
# to fix, so one line; every other OSError is a bug with its traceback.
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
# A path that is missing, a directory where a file belongs, or not readable: the readers of user files
# say so in their own words; this is the net under the ones that do not, one line naming the path.
USER_PATH = {errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENAMETOOLONG}


def _out_of_memory_message(command: str, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else type(exc).__name__
    return (f"out of memory ({first}): "
            + LESS_MEMORY.get(command, "free memory others hold on the device, or run this on a larger one"))


def _check_device(device: str | None) -> None:
    """Every command's --device cuda fails here, in one line, where this machine has no CUDA device
    (rather than in the middle of loading the model, with torch's assertion)."""
    if not (isinstance(device, str) and device.startswith("cuda")):
        return
    import torch

    if not torch.cuda.is_available():
        build = "this PyTorch is a CPU build" if torch.version.cuda is None else "the driver finds no GPU"
        raise QuantshipError(f"--device {device} asked for, but no CUDA device is available ({build}); "
                             "use --device cpu")


def main(argv: list[str] | None = None) -> int:
    argv = _with_default_subcommand(list(sys.argv[1:] if argv is None else argv))
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed in one line
        return exc.code if isinstance(exc.code, int) else 2
    main_thread = threading.current_thread() is threading.main_thread()
    # `timeout`, a Kubernetes Job and systemd stop a process with SIGTERM, whose default action skips every
    # cleanup; unwinding instead removes partial outputs exactly as Ctrl-C does. serve replaces these
    # handlers with its own draining ones once it is listening.
    clear_stop()
    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        try:
            _check_device(getattr(args, "device", None))
            return args.func(args)
        except Exception as exc:
            stop = as_stop(exc)
            if stop is exc:
                raise
            raise stop from exc  # the signal came while native code ran, which replaced its exception
    except QuantshipError as exc:
        print(f"quantship {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno in USER_PATH and exc.filename:  # a path the user gave that a reader did not check
            print(f"quantship {args.command}: error: {exc.filename}: {os.strerror(exc.errno).lower()}",
                  file=sys.stderr)
            return 2
        if exc.errno not in DISK_FULL:
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        print(f"quantship {args.command}: error: {os.strerror(exc.errno).lower()}{where}: free space and run it "
              "again" + ("; --resume continues from the layers already written" if args.command == "quantize"
                         else ""), file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as exc:
        from quantship.engine.memory import out_of_memory

        if not (isinstance(exc, MemoryError) or out_of_memory(exc)):
            raise
        print(f"quantship {args.command}: error: {_out_of_memory_message(args.command, exc)}", file=sys.stderr)
        return 2
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        clear_stop()  # library calls made later in this process (tests, notebooks) start unstopped


if __name__ == "__main__":
    sys.exit(main())
