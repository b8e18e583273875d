"""Command line: parse, call one library function, print. Errors in the input exit 2 in one line."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from quantship import __version__
from quantship.errors import QuantshipError


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
    parts = []
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        kind = f"{w.get('type', 'int')}{w.get('num_bits')}"
        detail = f"group {w['group_size']}" if w.get("strategy") == "group" else w.get("strategy", "")
        sym = "symmetric" if w.get("symmetric", True) else "asymmetric"
        acts = group.get("input_activations")
        act = f", activations {acts.get('type')}{acts.get('num_bits')} per {acts.get('strategy')}" if acts else ""
        targets = ", ".join(group.get("targets", []))
        parts.append(f"{kind} {detail} {sym}{act} on {targets if len(targets) < 40 else str(len(group['targets'])) + ' modules'}")
    return f"{qc.get('quant_method')} {qc.get('format')}: " + "; ".join(parts) + f" (ignore: {', '.join(qc.get('ignore', []))})"


def cmd_info(args) -> int:
    from quantship.models.bundled import resolve_model
    from quantship.models.info import model_info

    info = model_info(resolve_model(args.model))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None, pad_edge=False)
    rows = [
        ("path", info["path"]),
        ("architecture", info["architecture"]),
        ("parameters", f"{_human_count(info['parameters'])} total, {_human_count(info['active_parameters'])} active per token"),
        ("layers", str(info["layers"])),
        ("attention", info["attention"] + (f" (kv_lora_rank {info['mla']['kv_lora_rank']}, q_lora_rank {info['mla']['q_lora_rank']})" if "mla" in info else "")),
    ]
    if "moe" in info:
        m = info["moe"]
        rows.append(("experts", f"{m['routed_experts']} routed (top-{m['experts_per_token']}, {m['scoring']}, {m['topk_method']}) + {m['shared_experts']} shared; {m['dense_layers']} dense layer(s) first"))
    rows += [
        ("dtype", info["dtype"]),
        ("context", f"{info['max_position_embeddings']} tokens (rope {info['rope']['type']}, factor {info['rope']['factor']:g})"),
        ("size on disk", f"{_human_bytes(info['size_bytes'])} in {info['shards']} shard(s)"),
        ("quantization", _describe_quantization(info["quantization_config"])),
    ]
    if "eval_text" in info:
        rows += [("eval_text", info["eval_text"]), ("calib_text", info["calib_text"])]
    for key, value in rows:
        table.add_row(f"[bold]{key}[/bold]", value)
    Console().print(table)
    return 0


def cmd_generate(args) -> int:
    import torch

    from quantship.models.bundled import resolve_model
    from quantship.models.generate import generate_tokens
    from quantship.models.loader import Checkpoint
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
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = ck.load_model(dtype=torch.float32 if device == "cpu" else torch.bfloat16, device=device)
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
                           overwrite=args.overwrite)
    if args.plan:
        from quantship.quant.plan import read_plan

        opts.plan = read_plan(args.plan)
    recipe = quantize(args.model, args.output, opts, progress=not args.quiet)
    if args.json:
        print(json.dumps(recipe, indent=2))
        return 0
    calib = recipe["calibration"]
    print(f"wrote {args.output}: {', '.join(recipe['schemes_used'])} via {recipe['method']}, "
          f"{recipe['quantized_linears']} Linear layers, {recipe['shards']} shard(s), {recipe['seconds']:.1f}s")
    print(f"calibration: {calib['samples']} x {calib['seq_len']} tokens from {calib['source']}")
    if calib["samples"] < calib["samples_requested"]:
        print(f"note: the calibration text holds only {calib['samples']} samples of {calib['seq_len']} tokens")
    if recipe["fallbacks"]:
        print(f"fallbacks (too few routed tokens; every-token statistics used): {len(recipe['fallbacks'])}, "
              "listed in quantship_recipe.json")
    return 0


def _progress_callback(console):
    """A rich progress bar driven by verify's step(name, total) / step() calls."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=console, transient=True)
    state = {}

    def step(name=None, total=None):
        if name is not None:
            state["task"] = bar.add_task(name, total=total)
        else:
            bar.advance(state["task"])

    return bar, step


def cmd_verify(args) -> int:
    from rich.console import Console

    from quantship.verify.report import write_report
    from quantship.verify.run import VerifyOptions, verify

    console = Console(stderr=True)
    opts = VerifyOptions(text=args.text, ctx=args.ctx, max_tokens=args.max_tokens, gates=args.gate,
                         sensitivity=not args.no_sensitivity, generations=not args.no_generations, device=args.device)
    bar, step = _progress_callback(console)
    with bar:
        report = verify(args.base, args.quant, opts, progress=step)
    paths = write_report(report, args.report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        h, f = report["headline"], report["noise_floor"]
        print(f"{report['tokens']} tokens, ctx {report['ctx']}: KL mean {h['kl_mean']:.4f} "
              f"[{h['kl_mean_ci95'][0]:.4f}, {h['kl_mean_ci95'][1]:.4f}] (noise floor {f['kl_mean']:.4f}), "
              f"p99 {h['kl_p99']:.3f}, top-1 {h['top1_agreement']:.1%}, ppl {h['ppl_base']:.3f} -> {h['ppl_quant']:.3f}, "
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


def cmd_plan(args) -> int:
    from quantship.verify.planning import make_plan, write_plan

    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    plan = make_plan(args.model, args.budget_bits, schemes, method=args.method, calib=args.calib, device=args.device)
    write_plan(plan, args.output)
    counts: dict[str, int] = {}
    for unit in plan["units"]:
        counts[unit["scheme"]] = counts.get(unit["scheme"], 0) + 1
    print(f"wrote {args.output}: {plan['predicted_avg_bits']:.3f} bits per weight (budget {args.budget_bits}), "
          f"predicted KL {plan['predicted_kl']:.4f}; units: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"next: quantship quantize {args.model} -o OUT --plan {args.output}")
    return 0


def cmd_demo(args) -> int:
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from quantship.quant.pipeline import QuantizeOptions, quantize
    from quantship.verify.compare import quick_fidelity

    console = Console()
    console.rule("[bold]quantship info tiny")
    cmd_info(argparse.Namespace(model="tiny", json=False))
    for prompt in ("def fibonacci(n):", "ROMEO:"):
        console.rule(f"[bold]quantship generate tiny --prompt {prompt!r} --max-tokens 48")
        cmd_generate(argparse.Namespace(model="tiny", prompt=prompt, max_tokens=48, temperature=0.0,
                                        top_p=1.0, seed=None, chat=False, device="cpu"))
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="quantship-demo-"))
    table = Table(title="W4A16 g128 and W8A16 on the bundled model, held-out text (8K tokens)")
    for column in ("checkpoint", "KL mean", "top-1 agreement", "ppl base", "ppl quant", "seconds"):
        table.add_column(column, justify="right" if column != "checkpoint" else "left")
    for scheme, method in (("W4A16", "rtn"), ("W4A16", "gptq"), ("W4A16", "awq"), ("W8A16", "rtn")):
        out = work / f"tiny-{scheme.lower()}-{method}"
        console.rule(f"[bold]quantship quantize tiny -o {out} --scheme {scheme} --method {method}")
        recipe = quantize("tiny", out, QuantizeOptions(scheme=scheme, method=method, samples=64, seq_len=256,
                                                       overwrite=True))
        r = quick_fidelity("tiny", out, max_tokens=8192)
        table.add_row(out.name, f"{r['kl_mean']:.4f}", f"{r['top1_agreement']:.1%}", f"{r['ppl_base']:.2f}",
                      f"{r['ppl_quant']:.2f}", f"{recipe['seconds']:.0f}")
    console.print(table)
    console.print(f"checkpoints in {work}; llama.cpp's scale on Llama-3-8B: q8_0 KL 0.0014, q4_K_M 0.028, q4_0 0.072")
    gptq = work / "tiny-w4a16-gptq"
    report = work / "report-w4a16-gptq"
    console.rule(f"[bold]quantship verify tiny {gptq} --report {report} --gate default")
    code = cmd_verify(argparse.Namespace(base="tiny", quant=str(gptq), report=report, text=None, ctx=1024,
                                         max_tokens=8192, gate="default", no_sensitivity=False,
                                         no_generations=False, device="cpu", json=False))
    console.print(f"open {report / 'report.html'} in a browser; gate verdict: {'PASS' if code == 0 else 'FAIL'}")
    return 0


EXAMPLES = {
    "info": """
        quantship info                       # the bundled tiny DeepSeek-V3
        quantship info /models/DeepSeek-V2-Lite --json
    """,
    "generate": """
        quantship generate --prompt 'def fibonacci(n):' --max-tokens 64
        quantship generate /models/deepseek-coder-6.7b --prompt 'import numpy' --temperature 0.7 --top-p 0.9 --seed 1
        quantship generate tiny --chat --prompt 'Write a haiku about tensors'
    """,
    "quantize": """
        quantship quantize tiny -o tiny-w4a16 --scheme W4A16 --method gptq
        quantship quantize /models/DeepSeek-V2-Lite -o v2lite-awq --method awq --device cuda --samples 128 --seq-len 2048
        quantship quantize tiny -o tiny-w8a8 --scheme W8A8 --ignore 're:.*kv_b_proj$'
        quantship quantize tiny -o tiny-g64 --scheme W4A16_ASYM --group-size 64 --calib my.jsonl
    """,
    "verify": """
        quantship verify tiny tiny-w4a16 --report reports/w4a16 --gate default
        quantship verify /models/DeepSeek-V2-Lite v2lite-awq --report r/ --text heldout.txt --ctx 8192 --device cuda
        quantship verify tiny tiny-w8a16 --report r/ --gate my-gates.yaml --no-sensitivity
    """,
    "plan": """
        quantship plan tiny --budget-bits 5 -o plan.json
        quantship quantize tiny -o tiny-mixed --plan plan.json
        quantship plan /models/DeepSeek-V2-Lite --budget-bits 4.5 -o plan.json --method awq --device cuda
    """,
    "demo": """
        quantship demo                       # offline, CPU, a few seconds
    """,
}


def _examples(name: str) -> str:
    return "examples:" + textwrap.indent(textwrap.dedent(EXAMPLES[name]).rstrip(), "  ")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantship",
        description="Quantize a DeepSeek-family model, verify it, serve it, benchmark it and ship it.",
        epilog="MODEL is a local Hugging Face-layout directory, or 'tiny' (the default) for the bundled model.",
    )
    parser.add_argument("--version", action="version", version=f"quantship {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_examples(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    p = add("info", "Describe a checkpoint: architecture, parameters, experts, size, quantization.", cmd_info)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")

    p = add("generate", "Generate text with quantship's model definition (simple loop, one request).", cmd_generate)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")

    p = add("quantize", "Quantize a model into a vLLM-loadable compressed-tensors checkpoint, one layer at a time.",
            cmd_quantize)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="OUT", help="output directory")
    p.add_argument("--scheme", default="W4A16",
                   help="W4A16 (default), W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC (W3A16/W2A16 only to test gates)")
    p.add_argument("--method", default="rtn", choices=["rtn", "awq", "gptq"])
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], help="for W4A16* (default 128)")
    p.add_argument("--actorder", choices=["static", "group"],
                   help="GPTQ activation order: static (group is refused: current readers dropped g_idx)")
    p.add_argument("--calib", type=Path, help="calibration .txt or .jsonl ({\"text\": ...} per line); "
                                              "default: the bundled calibration text")
    p.add_argument("--samples", type=int, default=128, help="calibration samples (default 128)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample (default 512)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ignore", nargs="+", metavar="PATTERN",
                   help="keep these modules unquantized: names or 're:' regexes (lm_head and routers always)")
    p.add_argument("--dampening", type=float, default=0.01, help="GPTQ dampening fraction (default 0.01)")
    p.add_argument("--plan", type=Path, help="mixed-precision plan from 'quantship plan' (overrides --scheme per module)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print the recipe as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = add("verify", "Compare a quantized model with its base: KL, top-k, flips, position curves, sensitivity, "
                      "coverage, generations; gates exit 1.", cmd_verify)
    p.add_argument("base", metavar="BASE", help="the original model ('tiny' for the bundled one)")
    p.add_argument("quant", metavar="QUANT", help="the quantized model")
    p.add_argument("--report", required=True, type=Path, metavar="DIR", help="writes report.json, .md and .html here")
    p.add_argument("--text", type=Path, help="held-out text (default: the bundled evaluation text)")
    p.add_argument("--ctx", type=int, help="tokens per window (default: the model's context, at most 4096)")
    p.add_argument("--max-tokens", type=int, default=32768, help="evaluate at most this many tokens (default 32768)")
    p.add_argument("--gate", metavar="GATES", help="YAML thresholds, or 'default' for the scheme's shipped gates")
    p.add_argument("--no-sensitivity", action="store_true", help="skip per-layer sensitivity")
    p.add_argument("--no-generations", action="store_true", help="skip side-by-side generations")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", action="store_true", help="print report.json to stdout")

    p = add("plan", "Choose a scheme per module from measured sensitivity under an average-bits budget.", cmd_plan)
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL")
    p.add_argument("--budget-bits", type=float, required=True, help="average stored bits per Linear weight")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="PLAN", help="plan JSON to write")
    p.add_argument("--schemes", default="W4A16,W8A16", help="candidates besides the original dtype (default W4A16,W8A16)")
    p.add_argument("--method", default="rtn", choices=["rtn", "awq", "gptq"], help="how candidates are quantized")
    p.add_argument("--calib", type=Path, help="text to calibrate and measure on (default: bundled calibration text)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])

    p = add("demo", "Run every stage that exists on the bundled model, offline, on CPU.", cmd_demo)
    p.add_argument("--workdir", type=Path, help="where to write the demo's checkpoints (default: a temp dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except QuantshipError as exc:
        print(f"quantship {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
