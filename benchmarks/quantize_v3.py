"""DeepSeek-V3 at its real shape: quantize a few of its layers on one GPU, project all 671B from them.

The checkpoint is DeepSeek-V3's exact config (61 layers, the first 3 dense, 256 routed experts top-8
in 8 groups, MLA, vocab 129280, one MTP layer) written in the published FP8 block layout with random
weights, but only the first --layers decoder layers (and the MTP layer) on disk: the config says how
many there are, the run stops where the weights stop. Each layer is generated on the device, written,
and freed, so writing needs one layer of memory. Each method runs in a child process that reports its
own peak host memory (ru_maxrss), its peak GPU memory and the time of every layer; the projection
adds up per-layer times of dense and MoE layers over the full model, and says what it assumes.

On the GPU machine (about 35 GB of disk with --layers 5 and the MTP layer):
    PYTHONPATH=src python3 benchmarks/quantize_v3.py run --layers 5 --methods rtn gptq awq --samples 128 512 \
        --out $OUT
Here, to render the fetched JSON into BENCHMARKS.md:
    .venv/bin/python benchmarks/quantize_v3.py render benchmarks/results/quantize_v3*.json
512 samples of 2048 tokens, one MoE layer alone, one method per command (a 10-minute device slot holds
one; a first try with a dense layer and two methods ran out of it; keep the output in a file with
`| tee $OUT/log`, not a pipe through a buffering filter). GPTQ with the Hessians of all 256 experts in one
calibration pass (141 GB card; the default 8 GiB takes 7 passes), then AWQ and RTN:
    PYTHONPATH=src python3 benchmarks/quantize_v3.py run --layers 1 --dense-layers 0 --no-mtp --methods gptq \
        --samples 512 --expert-hessian-gb 60 --suffix _512_onepass --out $OUT 2>&1 | tee $OUT/log
    PYTHONPATH=src python3 benchmarks/quantize_v3.py run --layers 1 --dense-layers 0 --no-mtp --methods awq \
        --samples 512 --suffix _512_awq --out $OUT 2>&1 | tee $OUT/log
A run without a dense layer projects with the dense-layer time of the same method's run with one.
The same script on a CPU, on a V3-structured model of a few MB (checks the script, measures nothing):
    .venv/bin/python benchmarks/quantize_v3.py run --shape v3-smoke --device cpu --samples 8 --seq-len 64 \
        --methods rtn gptq --out /tmp/v3-smoke
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

# deepseek-ai/DeepSeek-V3 config.json (quantization_config is added when the checkpoint is written)
V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
      "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
      "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
      "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
      "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
      "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
      "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
      "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
      "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
      "eos_token_id": 1}
# The same structure a few MB large: for running this script where there is no GPU.
SHAPES = {"v3": V3, "v3-smoke": dict(V3, vocab_size=8192, hidden_size=256, intermediate_size=512,
                                     moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                                     n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                     kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16, v_head_dim=32,
                                     qk_nope_head_dim=32)}
# Characters of calibration text written per token asked for: the 3M characters once written held 831,488
# tokens (3.6 per token), so a "512-sample" run calibrated on 406 samples.
CHARS_PER_TOKEN = 5
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _fp8_target(name: str) -> bool:
    """DeepSeek's FP8 layout: every decoder Linear's weight (attention, experts, MTP's eh_proj), not the router."""
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def _random_tensors(module: torch.nn.Module, prefix: str, device: str, gen: torch.Generator) -> dict:
    """Weights of `module` (built on the meta device) as the checkpoint stores them, made on `device`."""
    from quantship.quant.fp8_block import block_quantize

    out = {}
    for name, meta in module.state_dict().items():
        key = prefix + name
        if name.endswith("norm.weight"):
            out[key] = torch.ones(meta.shape, dtype=torch.bfloat16)
            continue
        t = torch.randn(meta.shape, generator=gen, device=device) / meta.shape[-1] ** 0.5
        if _fp8_target(name) and t.dim() == 2:
            values, scale = block_quantize(t)
            out[key], out[key + "_scale_inv"] = values.cpu(), scale.cpu()
        else:  # V3 keeps the router's correction bias in float32, the rest in bf16
            out[key] = (t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)).cpu()
    return out


def write_checkpoint(shape: str, layers: int, directory: Path, device: str, mtp: bool,
                     dense_layers: int | None = None) -> dict:
    """One shard per decoder layer (and one for the outer weights), generated and written one at a time.
    `dense_layers` (default: the shape's 3) sets first_k_dense_replace in the written config: a layer's
    time does not depend on its index, so 1 dense layer + 1 MoE layer measures both kinds in less time."""
    from quantship.models.causal_lm import CausalLM, build_layer
    from quantship.models.config import config_from_dict
    from quantship.models.mtp import MTPLayer

    raw = dict(SHAPES[shape], num_hidden_layers=layers, num_nextn_predict_layers=1 if mtp else 0,
               quantization_config=dict(FP8_CONFIG))
    if dense_layers is not None:
        raw["first_k_dense_replace"] = dense_layers
    config = config_from_dict(raw)
    gen = torch.Generator(device).manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[str, object]] = [("outer", None)] + [(f"layer {i}", i) for i in range(layers)]
    if mtp:
        parts.append(("mtp", layers))
    weight_map, total = {}, 0
    for number, (label, index) in enumerate(parts):
        with torch.device("meta"):
            if index is None:
                module, prefix = CausalLM(config, layers=[]), ""
            elif label == "mtp":
                module, prefix = MTPLayer(config, index), f"model.layers.{index}."
            else:
                module, prefix = build_layer(config, index), f"model.layers.{index}."
        shard = _random_tensors(module, prefix, device, gen)
        fname = f"model-{number + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update({n: fname for n in shard})
        del shard
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    from quantship.models.bundled import TINY_DIR

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_DIR / name, directory / name)  # any tokenizer will do for speed: its ids are < vocab
    return {"bytes": total, "layers": layers, "dense_layers": min(layers, raw["first_k_dense_replace"])}


def _quantize_child(model: str, out: str, method: str, samples: int, seq_len: int, calib: str, device: str,
                    result: str, expert_hessian_gb: float | None = None) -> None:
    """Runs in its own process: its ru_maxrss is this method's peak host memory alone."""
    from quantship.quant.pipeline import EXPERT_HESSIAN_GB, QuantizeOptions, quantize

    marks: list[float] = []

    def mark(*args) -> None:  # printed as it goes: a run stopped by its time limit still shows its layers
        marks.append(time.time())
        if len(marks) > 1:
            peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            print(f"{method} x {samples}: layer {len(marks) - 2} took {marks[-1] - marks[-2]:.0f} s "
                  f"(peak GPU {peak:.1f} GiB, host {rss:.1f} GiB)", flush=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.time()
    recipe = quantize(model, out, QuantizeOptions(scheme="W4A16", method=method, calib=Path(calib), samples=samples,
                                                  seq_len=seq_len, device=device, mtp="quantize",
                                                  expert_hessian_gb=expert_hessian_gb or EXPERT_HESSIAN_GB),
                      progress=mark)
    seconds = time.time() - start
    written = sum(p.stat().st_size for p in Path(out).glob("*.safetensors"))
    first_moe = str(min((int(k) for k in recipe["tokens_per_expert"]), default=-1))
    Path(result).write_text(json.dumps({
        "seconds": seconds, "layer_seconds": [b - a for a, b in zip(marks, marks[1:])],
        "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "written_bytes": written, "fallbacks": len(recipe["fallbacks"]),
        "samples_used": recipe.get("calibration", {}).get("samples"),  # fewer than asked where the text ran out
        "tokens_per_expert_first_moe_layer": recipe["tokens_per_expert"].get(first_moe)}))


def run(args) -> None:
    from quantize_speed import stdlib_calibration

    work = Path(args.workdir)
    model = work / f"model-{args.shape}"
    shutil.rmtree(model, ignore_errors=True)
    start = time.time()
    info = write_checkpoint(args.shape, args.layers, model, args.device, mtp=not args.no_mtp,
                            dense_layers=args.dense_layers)
    calib = work / "calib.txt"
    stdlib_calibration(calib, chars=max(args.samples) * args.seq_len * CHARS_PER_TOKEN)
    results = {"shape": args.shape, "config": SHAPES[args.shape], "layers": info["layers"],
               "dense_layers": info["dense_layers"], "mtp": not args.no_mtp, "checkpoint_bytes": info["bytes"],
               "write_seconds": time.time() - start, "seq_len": args.seq_len, "device": args.device,
               "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "runs": []}
    spawn = multiprocessing.get_context("spawn")  # a fresh process: no CUDA context or memory inherited
    for samples in args.samples:
        for method in args.methods:
            out, result = work / f"out-{method}", work / "result.json"
            shutil.rmtree(out, ignore_errors=True)
            child = spawn.Process(target=_quantize_child, args=(str(model), str(out), method, samples, args.seq_len,
                                                                 str(calib), args.device, str(result),
                                                                 args.expert_hessian_gb))
            child.start()
            child.join()
            if child.exitcode != 0:
                print(f"{method} x {samples} samples failed (exit {child.exitcode})", flush=True)
                continue
            row = {"method": method, "samples": samples, "expert_hessian_gb": args.expert_hessian_gb,
                   **json.loads(result.read_text())}
            results["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens_per_expert_first_moe_layer"}), flush=True)
            shutil.rmtree(out, ignore_errors=True)
            Path(args.out).mkdir(parents=True, exist_ok=True)  # after every run: a cut-short run keeps what finished
            name = f"quantize_{args.shape.replace('-', '_')}{args.suffix}.json"
            (Path(args.out) / name).write_text(json.dumps(results, indent=2))


def _samples(run_: dict) -> int:
    return run_.get("samples_used") or run_["samples"]


def _dense_donor(r: dict, run_: dict, pairs: list[tuple[dict, dict]]) -> tuple[dict, dict] | None:
    """For a run of MoE layers alone: the same method's run with a dense layer and the nearest number of
    calibration samples, whose dense-layer time stands in for this run's (a dense layer is the same work
    whatever the expert settings)."""
    if r["dense_layers"]:
        return None
    donors = [(d, dr) for d, dr in pairs if d["dense_layers"] and dr["method"] == run_["method"]]
    return min(donors, key=lambda pair: abs(_samples(pair[1]) - _samples(run_)), default=None)


def projection(r: dict, run_: dict, donor: tuple[dict, dict] | None = None) -> dict:
    """Minutes for all of V3 from this run's per-layer times: the median dense and MoE layer times the
    full model's counts (61 layers, 3 dense; the MTP layer like a MoE layer). A run without a dense
    layer takes the dense time of `donor` (a result and its run)."""
    import statistics

    config = r["config"]
    times = run_["layer_seconds"]
    dense = times[:r["dense_layers"]]
    moe = times[r["dense_layers"]:r["layers"]]
    full_dense = config["first_k_dense_replace"]
    full_moe = config["num_hidden_layers"] - full_dense + config.get("num_nextn_predict_layers", 0)
    per_dense = statistics.median(dense) if dense else (projection(*donor)["dense_s"] if donor else 0.0)
    per_moe = statistics.median(moe) if moe else 0.0
    return {"dense_s": per_dense, "moe_s": per_moe, "hours": (per_dense * full_dense + per_moe * full_moe) / 3600}


def _layers_label(r: dict) -> str:
    moe = r["layers"] - r["dense_layers"]
    return f"{r['dense_layers']} dense + {moe} MoE" + (" + MTP" if r["mtp"] else "")


def render(paths: list[str]) -> None:
    from _report import table, update_section, write_result

    results = [json.loads(Path(path).read_text()) for path in paths]
    rows, read_rates = [], []
    pairs = [(r, run_) for r in results for run_ in r["runs"]]
    for path, r in zip(paths, results):
        write_result(Path(path).stem, r)
        for run_ in r["runs"]:
            donor = _dense_donor(r, run_, pairs)
            p = projection(r, run_, donor)
            gpu = run_["peak_gpu_bytes"]
            used = _samples(run_)
            samples = str(used) if used == run_["samples"] else f"{used} ({run_['samples']} asked: the text ran out)"
            budget = run_.get("expert_hessian_gb")
            method = run_["method"].upper() + (f" (--expert-hessian-gb {budget:g})" if budget else "")
            dense = f"{p['dense_s'] / 60:.1f}" + (f" (the {_samples(donor[1])}-sample run's)" if donor else "")
            rows.append([method, samples, _layers_label(r), dense,
                         f"{p['moe_s'] / 60:.1f}", f"{p['hours']:.1f}", "" if gpu is None else f"{gpu / 2**30:.1f}",
                         f"{run_['peak_host_bytes'] / 2**30:.1f}", str(run_["fallbacks"])])
        if r["runs"]:
            read_rates.append(r["checkpoint_bytes"] / max(run_["seconds"] for run_ in r["runs"]) / 1e6)
    first = results[0]
    notes = " ".join(r["note"] for r in results if r.get("note"))
    update_section("quantize_v3", "## DeepSeek-V3 shape: per-layer quantization and the 671B projection\n\n"
        f"`benchmarks/quantize_v3.py` on {first['device_name']} (torch {first['torch']}): DeepSeek-V3's exact config "
        "in its FP8 block layout with random weights, a few of its 61 layers on disk (column \"layers\"; the "
        "checkpoint of a row with fewer than 3 dense layers sets first_k_dense_replace to its count: a layer's "
        f"time does not depend on its index); W4A16 g128, {first['seq_len']}-token calibration samples. Minutes "
        "per layer are medians over the layers of each kind; the projection multiplies them by 3 dense and 58 MoE "
        "layers + MTP, and assumes the disk reads the full 671 GB at least as fast as these runs read their shards "
        f"(slowest method: {min(read_rates, default=0):.0f} MB/s including compute). Peak host memory is each "
        "method's own process (ru_maxrss)." + (f" {notes}" if notes else "") + " Fallbacks: the recipe's count of "
        "expert Linears (GPTQ) or expert balance groups (AWQ) that saw fewer than --min-expert-tokens and borrowed "
        "the statistics of every token the MoE saw.\n\n"
        + table(["method", "samples", "layers", "min / dense layer", "min / MoE layer", "hours, all of V3 (projected)",
                 "peak GPU GiB", "peak host GiB", "fallbacks (recipe)"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--shape", choices=list(SHAPES), default="v3")
    r.add_argument("--layers", type=int, default=5, help="decoder layers written (the first 3 are dense)")
    r.add_argument("--dense-layers", type=int, help="first_k_dense_replace of the written config (default: 3)")
    r.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out")
    r.add_argument("--methods", nargs="+", default=["rtn", "gptq", "awq"])
    r.add_argument("--samples", nargs="+", type=int, default=[128, 512])
    r.add_argument("--seq-len", type=int, default=2048)
    r.add_argument("--device", default="cuda")
    r.add_argument("--workdir", default="/tmp/qv3-bench")
    r.add_argument("--out", default="benchmarks/results")
    r.add_argument("--suffix", default="", help="added to the result's file name (quantize_v3SUFFIX.json)")
    r.add_argument("--expert-hessian-gb", type=float, help="quantize's --expert-hessian-gb (default: quantize's)")
    g = sub.add_parser("render")
    g.add_argument("paths", nargs="+", help="result files; the first one's checkpoint describes the section")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else render(args.paths)


if __name__ == "__main__":
    main()
