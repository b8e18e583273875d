"""Peak host memory of quantize does not grow with the number of layers (the streaming promise).

Two DeepSeek-V3-shaped checkpoints (MLA, routed experts with groups, a shared expert, a leading
dense layer) that differ only in depth, 3 and 6 layers, are quantized W4A16 in fresh processes;
the peak RSS above the post-import baseline is compared. Both have at least two MoE layers: the
allocator's high-water mark settles after the second (freed blocks reused from then on). Holding
every layer, or every layer's calibration activations, would add three layers' worth; streaming
adds allocator noise only.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from quantship.models.bundled import TINY_DIR
from quantship.models.causal_lm import CausalLM
from quantship.models.config import config_from_dict

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 8192, "hidden_size": 512,
    "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 256, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 32, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
}

PROBE = r"""
import json, sys
from quantship.models.tokenizer import load_tokenizer
from quantship.formats.compressed_tensors import SHARD_BYTES, ShardWriter
from quantship.quant.pipeline import QuantizeOptions, quantize
# The writer keeps up to FLUSH_BYTES of finished layers before writing them (bounded by design, not by
# depth): flush at every layer, so that only what grows with depth shows.
ShardWriter.__init__.__defaults__ = (SHARD_BYTES, 0)
def kb(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1])
from pathlib import Path
load_tokenizer(Path(sys.argv[1]))
base = kb('VmRSS')
quantize(sys.argv[1], sys.argv[2], QuantizeOptions(method=sys.argv[3], samples=4, seq_len=64))
print(json.dumps({"grown_kb": kb('VmHWM') - base}))
"""


def write_v3_shaped(directory, layers: int) -> int:
    """One shard per layer, random bf16; returns the bytes of the largest MoE layer in float32."""
    raw = dict(CONFIG, num_hidden_layers=layers)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(config_from_dict(raw)).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    by_layer: dict[str, list[str]] = {}
    for name in shapes:
        by_layer.setdefault(name.split(".")[2] if name.startswith("model.layers.") else "outer", []).append(name)
    directory.mkdir()
    weight_map, layer_bytes = {}, 0
    for i, (key, names) in enumerate(by_layer.items()):
        shard = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16) for n in names}
        fname = f"model-{i:05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        if key != "outer":
            layer_bytes = max(layer_bytes, sum(t.numel() * 4 for t in shard.values()))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(raw))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_DIR / f, directory / f)
    return layer_bytes


def grown_bytes(*runs: tuple) -> list[int]:
    """Peak RSS above the post-import baseline of quantizing each (model, out, method) in a fresh process,
    the processes side by side (each runs on one thread, and its peak is its own)."""
    # One malloc arena and one thread: glibc's per-thread arenas otherwise keep tens of MB of freed
    # memory in a pattern that varies from run to run, which is noise to this comparison. A fixed mmap
    # threshold: glibc raises it as large blocks are freed, after which tensors land in the heap,
    # whose fragmentation varied the peak by +-85 MB between identical runs (+-6 MB with it fixed).
    env = dict(os.environ, MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, str(model), str(out), method], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for model, out, method in runs]
    grown = []
    try:
        for proc, (_, out, _) in zip(procs, runs):
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, stderr[-2000:]
            assert len(json.loads((out / "quantship_recipe.json").read_text())) > 0
            grown.append(json.loads(stdout.strip().splitlines()[-1])["grown_kb"] * 1024)
    finally:  # a failed or timed-out run leaves no other process behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return grown


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_peak_host_memory_does_not_grow_with_depth(tmp_path, method):
    layer_bytes = max(write_v3_shaped(tmp_path / f"v3-{layers}", layers) for layers in (3, 6))
    grown = dict(zip((3, 6), grown_bytes(*((tmp_path / f"v3-{n}", tmp_path / f"out-{n}", method) for n in (3, 6)))))
    # Three more layers of ~60 MB each in float32: holding them (or their activations) would add ~180 MB.
    assert grown[6] - grown[3] < layer_bytes, (grown, layer_bytes)


def test_awq_searches_without_a_float32_copy_of_the_experts(tmp_path):
    """AWQ's search over a MoE layer (scales for every expert's gate/up at once, then each expert's down)
    costs little more host memory than RTN: the experts stay as stored, are fake-quantized per use and
    their scales are folded at widening. Before, the experts were held in float32 and copied whole for
    the search (about 56 MB more than now on this model: a float32 copy of its experts is 50 MB)."""
    model = tmp_path / "v3"
    write_v3_shaped(model, 3)
    c = CONFIG
    experts_float32 = c["n_routed_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"] * 4
    rtn, awq = grown_bytes(*((model, tmp_path / f"out-{m}", m) for m in ("rtn", "awq")))
    assert awq - rtn < 0.6 * experts_float32, (rtn, awq, experts_float32)


def test_calibration_activations_move_to_the_host_when_large_for_the_gpu(monkeypatch):
    """DeepSeek-V3's width at 512 x 2048 tokens is 30 GB of float32 activations per copy: on an 80 GB
    GPU they live in host memory (batches go to the GPU as layers run); small sets stay on the GPU."""
    from types import SimpleNamespace

    from quantship.quant.pipeline import _activation_store

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    cuda = torch.device("cuda")
    assert _activation_store(cuda, 512 * 2048, 7168).type == "cpu"
    assert _activation_store(cuda, 128 * 2048, 4096).type == "cuda"
    assert _activation_store(torch.device("cpu"), 512 * 2048, 7168).type == "cpu"


def test_gptq_in_expert_groups_writes_what_one_pass_writes(tmp_path, monkeypatch):
    """With more routed experts than their Hessians' budget, GPTQ gathers and solves them a group at a
    time (one calibration pass per group): every tensor written is the one a single pass writes."""
    from safetensors.torch import load_file

    from quantship.models.config import load_config
    from quantship.quant import pipeline
    from quantship.quant.pipeline import QuantizeOptions, quantize

    config = load_config(TINY_DIR)
    per_expert = 4 * (config.hidden_size ** 2 + config.moe_intermediate_size ** 2)
    passes = []
    original = pipeline.collect_stats
    monkeypatch.setattr(pipeline, "collect_stats", lambda *a, **k: passes.append(k["experts"]) or original(*a, **k))
    options = QuantizeOptions(scheme="W4A16", method="gptq", samples=8, seq_len=64)
    quantize("tiny", tmp_path / "one", options, progress=False)
    assert set(passes) == {None}
    passes.clear()
    options.expert_hessian_gb = 3 * per_expert / 2**30  # --expert-hessian-gb: three experts' Hessians a pass
    from quantship.cli import build_parser

    quantize_cli = build_parser()._subparsers._group_actions[0].choices["quantize"]
    flag = next(a for a in quantize_cli._actions if "--expert-hessian-gb" in a.option_strings)
    assert f"default {pipeline.EXPERT_HESSIAN_GB:g}:" in flag.help  # the help states the library's default
    quantize("tiny", tmp_path / "groups", options, progress=False)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    assert passes.count(range(0, 3)) == passes.count(range(6, 8)) == moe_layers  # 8 experts: 3 + 3 + 2

    def tensors(out):
        merged = {}
        for shard in sorted(out.glob("*.safetensors")):
            merged.update(load_file(shard))
        return merged

    recipes = [json.loads((tmp_path / d / "quantship_recipe.json").read_text()) for d in ("one", "groups")]
    assert recipes[0]["tokens_per_expert"] == recipes[1]["tokens_per_expert"]
    assert recipes[0]["fallbacks"] == recipes[1]["fallbacks"]
    assert [r["memory"]["expert_groups"] for r in recipes] == [1, 3]  # what the recipe and the CLI report
    assert recipes[1]["memory"]["activations"] == "device"
    one, groups = tensors(tmp_path / "one"), tensors(tmp_path / "groups")
    assert one.keys() == groups.keys()
    for name in one:
        assert torch.equal(one[name], groups[name]), name


@pytest.mark.parametrize("source,method", [("bf16", "rtn"), ("bf16", "gptq"), ("fp8", "gptq"), ("bf16", "awq"),
                                           ("fp8", "awq")])
def test_routed_experts_stay_as_stored_and_the_output_does_not_change(tmp_path, monkeypatch, source, method):
    """The routed experts a run quantizes are held on the device as the checkpoint stores them (bf16, or
    FP8 blocks with their scales) and widened per use: a MoE layer loads at a half (bf16) or a quarter
    (FP8) of its float32 size, and every tensor written equals what loading them in float32 writes."""
    from safetensors.torch import load_file

    from quantship.models.held import HeldLinear
    from quantship.models.loader import Checkpoint
    from quantship.quant import pipeline
    from quantship.quant.pipeline import QuantizeOptions, quantize

    from fp8_models import convert_to_fp8

    model = TINY_DIR if source == "bf16" else convert_to_fp8(TINY_DIR, tmp_path / "fp8", mtp=False)
    loaded = []
    original = Checkpoint.layer

    def spy(self, index, dtype=torch.float32, device="cpu", held=None):
        layer = original(self, index, dtype, device, held)
        experts = [m for n, m in layer.named_modules() if n.startswith("mlp.experts.") and isinstance(m, nn.Linear)]
        loaded.append({"experts": len(experts), "held": sum(isinstance(m, HeldLinear) for m in experts),
                       "bytes": sum(t.numel() * t.element_size() for m in experts for t in m.state_dict().values()),
                       "float32": sum(4 * m.weight.numel() for m in experts)})
        return layer

    monkeypatch.setattr(Checkpoint, "layer", spy)
    options = QuantizeOptions(scheme="W4A16", method=method, samples=4, seq_len=64)
    quantize(str(model), tmp_path / "held", options, progress=False)
    moe = [x for x in loaded if x["experts"]]
    assert moe and all(x["held"] == x["experts"] for x in moe)
    share = 0.5 if source == "bf16" else 0.25
    assert all(share <= x["bytes"] / x["float32"] < share * 1.01 for x in moe)  # FP8: + one scale per block
    loaded.clear()
    monkeypatch.setattr(pipeline, "_held_experts", lambda *args: None)
    quantize(str(model), tmp_path / "float32", options, progress=False)
    assert all(x["held"] == 0 and x["bytes"] == x["float32"] for x in loaded if x["experts"])

    def tensors(out):
        merged = {}
        for shard in sorted(out.glob("*.safetensors")):
            merged.update(load_file(shard))
        return merged

    recipes = [json.loads((tmp_path / d / "quantship_recipe.json").read_text()) for d in ("held", "float32")]
    assert [r["memory"]["routed_experts"] for r in recipes] == ["as stored" if source == "bf16" else "fp8 blocks",
                                                               "float32"]
    held, float32 = tensors(tmp_path / "held"), tensors(tmp_path / "float32")
    assert held.keys() == float32.keys()
    for name in held:
        assert torch.equal(held[name], float32[name]), name


def test_quantize_prints_where_the_activations_are_and_the_expert_groups(tmp_path, capsys):
    """The `memory:` line names the memory the calibration activations sit in (here the CPU's: the model
    runs there) and how many groups of routed-expert Hessians GPTQ solved under --expert-hessian-gb."""
    from quantship.cli import main

    assert main(["quantize", "tiny", "-o", str(tmp_path / "q"), "--method", "gptq", "--samples", "4",
                 "--seq-len", "64", "--expert-hessian-gb", "0.002", "--quiet"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory: "))
    assert "activations in the CPU's memory, beside the model" in line
    groups = int(line.split("routed experts solved in ")[1].split(" group")[0])
    assert groups > 1
