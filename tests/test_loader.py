"""The streaming loader: sharded checkpoints, fused experts, and every kind of bad input."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantship.cli import main
from quantship.errors import QuantshipError
from quantship.models.loader import Checkpoint

from reference_models import build_reference


@pytest.fixture()
def v3_dir(reference_dirs, tmp_path):
    source, _ = reference_dirs["deepseek_v3"]
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    model = build_reference("deepseek_v3")
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ck = Checkpoint(tmp_path)
    assert len(set(ck.files.values())) > 3
    ids = torch.arange(50)[None]
    with torch.no_grad():
        torch.testing.assert_close(ck.load_model()(ids), model(ids).logits, atol=2e-5, rtol=1e-4)


def test_layer_state_maps_per_expert_names(v3_dir):
    state = Checkpoint(v3_dir).layer_state(1)
    assert "mlp.experts.7.down_proj.weight" in state
    assert "mlp.gate.e_score_correction_bias" in state
    assert not any(k.startswith("model.") for k in state)


def test_fused_expert_tensors_are_split(v3_dir):
    """transformers 5 keeps experts fused in memory; a checkpoint written that way must load too."""
    path = v3_dir / "model.safetensors"
    state = load_file(path)
    before = Checkpoint(v3_dir).load_model()
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack([torch.cat([state.pop(f"{p}.{e}.gate_proj.weight"), state.pop(f"{p}.{e}.up_proj.weight")])
                               for e in range(8)])
        down = torch.stack([state.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
        state[f"{p}.gate_up_proj"], state[f"{p}.down_proj"] = gate_up, down
    save_file(state, path, metadata={"format": "pt"})
    after = Checkpoint(v3_dir).load_model()
    ids = torch.arange(30)[None]
    with torch.no_grad():
        torch.testing.assert_close(after(ids), before(ids))


def _error(path) -> str:
    with pytest.raises(QuantshipError) as info:
        Checkpoint(path).load_model()
    return str(info.value)


def test_missing_config(tmp_path):
    assert "no config.json" in _error(tmp_path)


def test_malformed_config(v3_dir):
    (v3_dir / "config.json").write_text("{not json")
    msg = _error(v3_dir)
    assert "config.json" in msg and "malformed JSON" in msg


def test_unsupported_architecture(v3_dir):
    cfg = json.loads((v3_dir / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (v3_dir / "config.json").write_text(json.dumps(cfg))
    assert "unsupported architecture (MixtralForCausalLM)" in _error(v3_dir)


def test_missing_shard(tmp_path):
    build_reference("llama").save_pretrained(tmp_path, max_shard_size="200KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    msg = _error(tmp_path)
    assert shard.name in msg and "missing" in msg


def test_wrong_shape(v3_dir):
    cfg = json.loads((v3_dir / "config.json").read_text())
    cfg["moe_intermediate_size"] = 96
    (v3_dir / "config.json").write_text(json.dumps(cfg))
    msg = _error(v3_dir)
    assert "model.layers.1.mlp" in msg and "shape" in msg and "model.safetensors" in msg


def test_nan_weights(v3_dir):
    path = v3_dir / "model.safetensors"
    state = load_file(path)
    state["model.layers.2.self_attn.kv_b_proj.weight"][3, 5] = float("nan")
    save_file(state, path, metadata={"format": "pt"})
    msg = _error(v3_dir)
    assert "kv_b_proj" in msg and "NaN" in msg


def test_integer_weights_are_refused(v3_dir):
    """A float weight stored as integers (a damaged header, a mix-up) would load as garbage values."""
    path = v3_dir / "model.safetensors"
    original = load_file(path)
    for name, dtype in (("model.layers.2.self_attn.kv_b_proj.weight", torch.int16), ("model.norm.weight", torch.int32)):
        save_file({**original, name: original[name].to(dtype)}, path, metadata={"format": "pt"})
        msg = _error(v3_dir)
        assert f"{name} is stored as {dtype}" in msg and "model.safetensors" in msg, msg


def test_pickle_checkpoint_is_refused_unopened(v3_dir):
    (v3_dir / "model.safetensors").unlink()
    # Not a valid pickle at all: a loader that tried to unpickle would fail differently.
    (v3_dir / "pytorch_model.bin").write_bytes(b"\x80\x04 this would run code if unpickled")
    msg = _error(v3_dir)
    assert "pytorch_model.bin" in msg and "refused" in msg


def test_cli_reports_bad_input_in_one_line_with_exit_2(v3_dir, capsys):
    (v3_dir / "model.safetensors").unlink()
    assert main(["info", str(v3_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and str(v3_dir) in err


def test_cli_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "quantship.cli", "info", str(tmp_path / "absent")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("model directory not found") and "Traceback" not in proc.stderr
