import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU, the Triton kernels' tests run on the CPU under Triton's interpreter (read when a
# kernel is first decorated, so before any test imports one). The model's own layers dispatch to
# Triton only for CUDA tensors, so the rest of the suite is unaffected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from quantship.models.bundled import TINY_DIR  # noqa: E402

from reference_models import CONFIGS, save_reference  # noqa: E402


@pytest.fixture(scope="session")
def reference_dirs(tmp_path_factory):
    """Every reference architecture saved once per session: name -> (directory, transformers model)."""
    out = {}
    for name in CONFIGS:
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, save_reference(name, d))
    return out


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A DeepSeek-Coder-shaped (Llama) model with the bundled tokenizer, dims multiple of 128."""
    d = tmp_path_factory.mktemp("llama")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=8192, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, rope_scaling={"type": "linear", "factor": 2.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_DIR / name, d / name)
    return d


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """`quantship demo` run once, offline, as `make demo` runs it: (the finished process, its work directory).
    The quality test reads the checkpoints and fidelity table it wrote rather than quantize them again."""
    work = tmp_path_factory.mktemp("demo")
    proc = subprocess.run([sys.executable, "-m", "quantship.cli", "demo", "--workdir", str(work)],
                          capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return proc, work
