"""Peak memory of walking a checkpoint one layer at a time, against loading it whole.

Builds a synthetic DeepSeek-V3-shaped checkpoint of a few hundred MB (random bf16, one shard per
layer, with an index), then in fresh processes measures peak RSS above the post-import baseline:
  stream: Checkpoint.iter_layers() over all layers, holding embeddings/norm/lm_head throughout
  whole:  Checkpoint.load_model(), the reference
and reports each as a ratio to (largest layer + embeddings + lm_head) bytes.

    .venv/bin/python benchmarks/loader_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from quantship.models.causal_lm import CausalLM  # noqa: E402
from quantship.models.config import config_from_dict  # noqa: E402

from _report import table, update_section, write_result  # noqa: E402

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 2816, "moe_intermediate_size": 384, "num_hidden_layers": 8,
    "num_attention_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 16, "n_shared_experts": 1,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

PROBE = r"""
import json, sys, torch
from quantship.models.loader import Checkpoint
# /proc's VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so it would include the parent's peak.
def status_kb(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1])
def rss_kb():
    return status_kb('VmRSS')
ck = Checkpoint(sys.argv[1]); base = rss_kb()
if sys.argv[2] == 'stream':
    outer = ck.outer_state()
    for _, layer in ck.iter_layers(dtype=torch.bfloat16):
        del layer
else:
    model = ck.load_model(dtype=torch.bfloat16)
peak = status_kb('VmHWM')
print(json.dumps({"baseline_kb": base, "peak_kb": peak}))
"""


def write_checkpoint(directory: Path, layers: int | None = None) -> dict:
    raw = dict(CONFIG, num_hidden_layers=layers or CONFIG["num_hidden_layers"])
    config = config_from_dict(raw)
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in CausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    groups: dict[str, dict] = {}
    for name in shapes:
        key = name.split(".")[2] if name.startswith("model.layers.") else "outer"
        groups.setdefault(key, {})[name] = shapes[name]
    weight_map, sizes = {}, {}
    for i, (key, members) in enumerate(groups.items()):
        shard = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, (s, _) in members.items()}
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
        sizes[key] = sum(t.numel() * 2 for t in shard.values())
        del shard
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(raw))
    return sizes


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        sizes = write_checkpoint(directory)
        total = sum(sizes.values())
        largest_layer = max(v for k, v in sizes.items() if k != "outer")
        floor = largest_layer + sizes["outer"]
        runs = {}
        for mode in ("stream", "whole"):
            out = subprocess.run([sys.executable, "-c", PROBE, str(directory), mode], capture_output=True,
                                 text=True, check=True)
            r = json.loads(out.stdout)
            runs[mode] = (r["peak_kb"] - r["baseline_kb"]) * 1024
    mb = 2**20
    result = {
        "checkpoint_bytes": total, "shards": len(sizes), "largest_layer_bytes": largest_layer,
        "outer_bytes": sizes["outer"], "stream_peak_bytes": runs["stream"], "whole_peak_bytes": runs["whole"],
        "stream_ratio_to_one_layer_plus_embeddings": runs["stream"] / floor,
        "whole_ratio_to_one_layer_plus_embeddings": runs["whole"] / floor,
        "stream_ratio_to_whole": runs["stream"] / runs["whole"],
    }
    write_result("loader_memory", result)
    update_section("loader_memory", "## Streaming loader: peak memory\n\n"
        "`benchmarks/loader_memory.py`: a synthetic DeepSeek-V3-shaped checkpoint (random bf16), peak RSS above the "
        "post-import baseline, in fresh processes. The floor is the largest decoder layer plus embeddings and "
        "lm_head.\n\n"
        + table(["mode", "peak MB", "× floor", "checkpoint MB", "floor MB"], [
            ["stream (iter_layers)", f"{runs['stream'] / mb:.0f}",
             f"{result['stream_ratio_to_one_layer_plus_embeddings']:.2f}", f"{total / mb:.0f}", f"{floor / mb:.0f}"],
            ["whole (load_model)", f"{runs['whole'] / mb:.0f}",
             f"{result['whole_ratio_to_one_layer_plus_embeddings']:.2f}", f"{total / mb:.0f}", f"{floor / mb:.0f}"],
        ]))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
