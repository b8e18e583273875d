"""`quantship serve --engine vllm`: the `vllm serve` command for the same checkpoint, for GPUs at scale.

vLLM reads a compressed-tensors checkpoint's scheme from config.json (no --quantization flag), so
the launcher's job is to check that vLLM has kernels for it, say what it found, and hand over the
process (exec: signals and exit codes then belong to vLLM, as a container runtime expects).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from quantship.errors import QuantshipError

log = logging.getLogger("quantship.server")

# vLLM's weight-only integer kernels (Marlin and its fallbacks) take 4 and 8 bits, groups of 32,
# 64 or 128 input columns, or one scale per output channel.
VLLM_WEIGHT_ONLY_BITS = (4, 8)
VLLM_GROUP_SIZES = (32, 64, 128)


@dataclass
class VllmCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # secrets go here, not into argv where `ps` shows them
    notes: list[str] = field(default_factory=list)  # what the launcher found, for the log


def describe_quantization(config: dict) -> str:
    """One line on the checkpoint's weights; QuantshipError when vLLM has no kernel for them."""
    qc = config.get("quantization_config")
    if not qc:
        return f"none (dense {config.get('torch_dtype', 'unknown dtype')} weights)"
    method = qc.get("quant_method", "unknown")
    if method != "compressed-tensors":
        return f"{method} (vLLM detects it from config.json)"
    parts = []
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        acts = group.get("input_activations")
        if kind == "int" and not acts:
            if bits not in VLLM_WEIGHT_ONLY_BITS:
                raise QuantshipError(f"{name} stores {bits}-bit weights; vLLM's weight-only kernels take "
                                     f"{' or '.join(map(str, VLLM_WEIGHT_ONLY_BITS))} bits: serve it with "
                                     "--engine native")
            if strategy == "group" and w.get("group_size") not in VLLM_GROUP_SIZES:
                raise QuantshipError(f"{name} uses groups of {w.get('group_size')}; vLLM's kernels take "
                                     f"{', '.join(map(str, VLLM_GROUP_SIZES))}: serve it with --engine native")
        detail = f"group {w.get('group_size')}" if strategy == "group" else f"per {strategy}"
        sym = "symmetric" if w.get("symmetric", True) else "asymmetric"
        act = f", {acts.get('type')}{acts.get('num_bits')} activations" if acts else ""
        parts.append(f"{kind}{bits} {detail} {sym}{act}")
    ignore = ", ".join(qc.get("ignore") or []) or "nothing"
    return (f"compressed-tensors {qc.get('format')}: {'; '.join(parts)} (ignore: {ignore}); "
            "vLLM detects it from config.json")


def vllm_command(model_dir: Path, served_model_name: str, host: str, port: int, executable: str = "vllm",
                 max_model_len: int | None = None, api_key: str | None = None, max_num_seqs: int | None = None,
                 block_size: int | None = None, prefix_caching: bool = True,
                 max_queue: int | None = None) -> VllmCommand:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise QuantshipError("no config.json: not a Hugging Face-layout model directory", model_dir)
    config = json.loads(config_path.read_text())
    notes = [f"quantization: {describe_quantization(config)}"]
    max_model_len = max_model_len or config.get("max_position_embeddings")
    argv = [executable, "serve", str(model_dir.resolve()), "--served-model-name", served_model_name,
            "--host", host, "--port", str(port)]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if max_num_seqs:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if block_size:
        argv += ["--block-size", str(block_size)]
    if not prefix_caching:
        argv.append("--no-enable-prefix-caching")
    env = {"VLLM_API_KEY": api_key} if api_key else {}  # vLLM reads it like --api-key
    if max_queue is not None:
        notes.append("note: vLLM has no bound on its waiting queue; --max-queue applies to the native engine only")
    return VllmCommand(argv, env, notes)


def find_vllm() -> str | None:
    """The `vllm` executable: on PATH, or beside this Python (a virtualenv that is not activated)."""
    found = shutil.which("vllm")
    if found:
        return found
    beside = Path(sys.executable).parent / "vllm"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def exec_vllm(command: VllmCommand) -> None:
    """Replace this process with vLLM (never returns)."""
    for note in command.notes:
        log.info(note)
    log.info("exec: %s", " ".join(command.argv))
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command.argv[0], command.argv, {**os.environ, **command.env})
