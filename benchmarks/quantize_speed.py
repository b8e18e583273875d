"""Quantization speed and peak memory on full-size shapes (random bf16 weights; speed, not quality).

On the GPU machine:
    PYTHONPATH=src python3 benchmarks/quantize_speed.py run --shape coder-6.7b --methods rtn gptq --out $OUT
    PYTHONPATH=src python3 benchmarks/quantize_speed.py run --shape v2-lite --layers 4 --methods gptq awq --out $OUT
Here, to render the fetched JSON into BENCHMARKS.md:
    .venv/bin/python benchmarks/quantize_speed.py render benchmarks/results/quantize_speed_*.json

Each run writes a random checkpoint of the shape (one shard per layer), a calibration file from this
machine's Python standard library source, then quantizes W4A16 g128 with 128 samples x 2048 tokens.
RTN through the same streaming pipeline (same calibration forward passes, no GPTQ/AWQ search) is the
in-run reference: "x RTN" says what the method's search costs on top of streaming and forwarding.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = {
    # deepseek-ai/deepseek-coder-6.7b-base config.json
    "coder-6.7b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32256,
                   "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "max_position_embeddings": 16384, "rms_norm_eps": 1e-6,
                   "rope_theta": 100000, "rope_scaling": {"type": "linear", "factor": 4.0},
                   "torch_dtype": "bfloat16", "bos_token_id": 32013, "eos_token_id": 32014},
    # deepseek-ai/DeepSeek-V2-Lite config.json
    "v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
                "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
                "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                "moe_layer_freq": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                "topk_method": "greedy", "scoring_func": "softmax", "max_position_embeddings": 163840,
                "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32,
                "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096}, "torch_dtype": "bfloat16",
                "bos_token_id": 100000, "eos_token_id": 100001},
}


# V2-Lite's dense intermediate size (10944) is not a multiple of 128: the one layer it affects stays in
# bf16, which is what quantship's error message tells a user to do.
IGNORE = {"v2-lite": ["re:.*layers\\.0\\.mlp\\.down_proj$"]}


def random_model(shape: str, device: str, dtype: torch.dtype = torch.bfloat16, layers: int | None = None):
    """A model of a shape's real config (or its first `layers` decoder layers) with random weights, built on
    `device`, routers spread over their experts (default init sends most tokens to a few)."""
    from quantship.models.causal_lm import CausalLM
    from quantship.models.config import config_from_dict

    config = config_from_dict({**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(config).to(dtype).eval().requires_grad_(False)
    for m in model.modules():
        if type(m).__name__ == "Router":
            torch.nn.init.normal_(m.weight, std=0.02)
    return model


def write_checkpoint(shape: str, layers: int | None, directory: Path) -> dict:
    from quantship.models.causal_lm import CausalLM
    from quantship.models.config import config_from_dict

    raw = dict(SHAPES[shape])
    if layers:
        raw["num_hidden_layers"] = layers
    config = config_from_dict(raw)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(config).state_dict().items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        groups.setdefault(name.split(".")[2] if name.startswith("model.layers.") else "outer", []).append(name)
    weight_map, total = {}, 0
    directory.mkdir(parents=True, exist_ok=True)
    for i, (key, names) in enumerate(groups.items()):
        shard = {}
        for n in names:
            fan_in = shapes[n][-1]
            t = torch.randn(shapes[n], generator=gen, device=device) / fan_in**0.5
            if n.endswith("norm.weight"):
                t = torch.ones(shapes[n], device=device)
            shard[n] = t.to(torch.bfloat16).cpu()
            total += shard[n].numel() * 2
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(raw))
    from quantship.models.bundled import TINY_DIR

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_DIR / name, directory / name)  # any tokenizer will do for speed: ids < vocab
    return {"bytes": total, "layers": config.num_hidden_layers}


def stdlib_calibration(path: Path, chars: int = 3_000_000) -> None:
    """At least `chars` characters of Python's standard library as calibration text (fails if it is smaller)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for f in sorted(root.rglob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        size += len(text)
        if size > chars:
            break
    if size <= chars:
        raise SystemExit(f"the standard library under {root} holds {size} characters of Python, not {chars}")
    path.write_text("\n\n".join(parts))


def run(args) -> None:
    from quantship.quant.pipeline import QuantizeOptions, quantize

    work = Path(args.workdir)
    model = work / f"model-{args.shape}"
    t0 = time.time()
    info = write_checkpoint(args.shape, args.layers, model)
    gen_seconds = time.time() - t0
    calib = work / "calib.txt"
    stdlib_calibration(calib)
    results = {"shape": args.shape, "layers": info["layers"], "full_layers": SHAPES[args.shape]["num_hidden_layers"],
               "checkpoint_bytes": info["bytes"], "write_seconds": gen_seconds,
               "samples": args.samples, "seq_len": args.seq_len, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "runs": {}}
    for method in args.methods:
        out = work / f"out-{method}"
        shutil.rmtree(out, ignore_errors=True)
        torch.cuda.reset_peak_memory_stats()
        start = time.time()
        recipe = quantize(model, out, QuantizeOptions(scheme="W4A16", method=method, calib=calib,
                                                      samples=args.samples, seq_len=args.seq_len, device="cuda",
                                                      ignore=IGNORE.get(args.shape, [])))
        seconds = time.time() - start
        results["runs"][method] = {"seconds": seconds, "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
                                   "samples": recipe["calibration"]["samples"],
                                   "fallbacks": len(recipe["fallbacks"]),
                                   "tokens_per_expert_layer1": recipe["tokens_per_expert"].get("1")}
        print(method, json.dumps(results["runs"][method]), flush=True)
        shutil.rmtree(out, ignore_errors=True)
        # Written after every method, so a run cut short still reports what finished.
        results["largest_shard_bytes"] = max(p.stat().st_size for p in model.glob("model-*.safetensors"))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"quantize_speed_{args.shape}.json").write_text(json.dumps(results, indent=2))


def render(paths: list[str]) -> None:
    from quantship.models.causal_lm import build_layer
    from quantship.models.config import config_from_dict

    from _report import table, update_section, write_result

    rows = []
    for p in paths:
        r = json.loads(Path(p).read_text())
        write_result(Path(p).stem, r)
        rtn = r["runs"].get("rtn", {}).get("seconds")
        scale = r["full_layers"] / r["layers"]
        config = config_from_dict(SHAPES[r["shape"]])
        with torch.device("meta"):
            layer_params = max(sum(t.numel() for t in build_layer(config, i).parameters()) for i in range(2))
        activations = r["samples"] * r["seq_len"] * config.hidden_size * 4
        floor = layer_params * 4 + activations
        for method, run_ in r["runs"].items():
            rows.append([r["shape"] + ("" if scale == 1 else f" ({r['layers']} of {r['full_layers']} layers)"),
                         method.upper(), f"{run_['seconds'] / 60:.1f}",
                         "" if scale == 1 else f"{run_['seconds'] * scale / 60:.1f}",
                         f"{run_['seconds'] / rtn:.1f}" if rtn else "",
                         f"{run_['peak_gpu_bytes'] / 2**30:.1f}",
                         f"{run_['peak_gpu_bytes'] / floor:.2f}"])
    update_section("quantize_speed", "## Quantization speed on one GPU\n\n"
        f"`benchmarks/quantize_speed.py` on one {r['device']} (torch {r['torch']}): random bf16 weights of the real "
        f"configs, W4A16 g128, {r['samples']} samples x {r['seq_len']} tokens of calibration. RTN runs the same "
        "streaming pipeline and calibration forward passes without the search, measured in the same run. The last "
        "column is peak GPU memory over (the largest decoder layer in float32 + the calibration activations in "
        "float32). For scale, llm-compressor's guide quotes about 30 minutes for GPTQ or AWQ on an 8B model on an "
        "A100 (not measured here).\n\n"
        + table(["checkpoint", "method", "minutes", "minutes, all layers (extrapolated)", "x RTN", "peak GPU GiB",
                 "peak / (layer + activations)"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--shape", choices=list(SHAPES), required=True)
    r.add_argument("--layers", type=int, help="only the first N layers (a partial model)")
    r.add_argument("--methods", nargs="+", default=["rtn", "gptq", "awq"])
    r.add_argument("--samples", type=int, default=128)
    r.add_argument("--seq-len", type=int, default=2048)
    r.add_argument("--workdir", default="/tmp/qs-bench")
    r.add_argument("--out", default="benchmarks/results")
    g = sub.add_parser("render")
    g.add_argument("paths", nargs="+")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else render(args.paths)


if __name__ == "__main__":
    main()
