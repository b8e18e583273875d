"""Running an exported directory with ONNX Runtime (CPU): logits of a window, and greedy generation
through the graph's own KV cache. What verify, the benchmark and the tests drive."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from quantship.errors import QuantshipError
from quantship.formats.onnx import INFO_FILE, MODEL_FILE
from quantship.formats.onnx_decoder import empty_cache
from quantship.models.config import load_config


class OnnxModel:
    def __init__(self, directory: str | Path, threads: int | None = None):
        import onnxruntime as ort

        self.path = Path(directory)
        if not (self.path / MODEL_FILE).is_file():
            raise QuantshipError(f"no {MODEL_FILE} (is this a quantship ONNX export?)", self.path)
        self.config = load_config(self.path)
        try:
            self.info = json.loads((self.path / INFO_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise QuantshipError(f"unreadable {INFO_FILE} ({exc})", self.path) from None
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(self.path / MODEL_FILE), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types; one line for the user
            raise QuantshipError(f"ONNX Runtime cannot load the model ({' '.join(str(exc).split())[:300]})",
                                 self.path) from None
        past = next(i for i in self.session.get_inputs() if i.name.startswith("past_key_values."))
        self.cache_dtype = np.float16 if past.type == "tensor(float16)" else np.float32

    def step(self, ids: np.ndarray, cache: dict[str, np.ndarray], past: int,
             mask: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """ids [B, S] after `past` cached tokens → (logits [B, S, vocab], the cache for the next step)."""
        batch, new = ids.shape
        if mask is None:
            mask = np.ones((batch, past + new), dtype=np.int64)
        positions = np.broadcast_to(np.arange(past, past + new, dtype=np.int64), (batch, new))
        feeds = {"input_ids": ids.astype(np.int64), "attention_mask": mask,
                 "position_ids": np.ascontiguousarray(positions), **cache}
        outputs = self.session.run(None, feeds)
        names = [o.name for o in self.session.get_outputs()]
        result = dict(zip(names, outputs))
        present = {n.replace("present.", "past_key_values.", 1): v for n, v in result.items()
                   if n.startswith("present.")}
        return result["logits"], present

    def empty_cache(self, batch: int = 1) -> dict[str, np.ndarray]:
        return empty_cache(self.config, batch, self.cache_dtype)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Teacher-forced logits of token windows [B, S], no cache."""
        out, _ = self.step(np.asarray(ids), self.empty_cache(len(ids)), 0)
        return out

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        """Prefill the prompt, then feed one token at a time with the returned cache."""
        cache, past, ids, out = self.empty_cache(1), 0, np.array([prompt], dtype=np.int64), []
        for _ in range(steps):
            logits, cache = self.step(ids, cache, past)
            past += ids.shape[1]
            token = int(logits[0, -1].argmax())
            out.append(token)
            ids = np.array([[token]], dtype=np.int64)
        return out


class OnnxCache:
    """The graph's present tensors, fed back as the next call's past."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays, self.length = arrays, 0


class OnnxCausalLM:
    """An exported directory behind our CausalLM's calling convention (model(ids, cache=...) → logits),
    so verify's comparisons and the plain generation loop run ONNX Runtime unchanged."""

    def __init__(self, directory: str | Path):
        self.runner = OnnxModel(directory)
        self.config = self.runner.config

    def __call__(self, input_ids, positions=None, cache: OnnxCache | None = None):
        import torch

        ids = input_ids.cpu().numpy()
        if cache is None:
            logits, _ = self.runner.step(ids, self.runner.empty_cache(len(ids)), 0)
        else:
            logits, cache.arrays = self.runner.step(ids, cache.arrays, cache.length)
            cache.length += ids.shape[1]
        return torch.from_numpy(logits)

    def new_cache(self) -> OnnxCache:
        return OnnxCache(self.runner.empty_cache(1))

    def parameters(self):
        import torch

        yield torch.zeros(())  # the generation loop takes its device from here: the CPU

    def eval(self):
        return self


class OnnxCheckpoint:
    """An ONNX export opened as verify's QUANT: its config, its type, and the runner as the model."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory)
        self.config = load_config(self.path)
        try:
            self.info = json.loads((self.path / INFO_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise QuantshipError(f"unreadable {INFO_FILE} ({exc})", self.path) from None

    @property
    def type(self) -> str:
        return str(self.info.get("type", "fp32"))

    def load_model(self, dtype=None, device="cpu") -> OnnxCausalLM:
        if str(device) != "cpu":
            raise QuantshipError("an ONNX export is verified on the CPU (ONNX Runtime's CPU provider)", self.path)
        return OnnxCausalLM(self.path)

    # verify's per-layer sensitivity swaps modules of our model; an ONNX graph only runs whole
    swappable_layers = False

    def recipe(self) -> dict:
        """What verify reports as the scheme, and whose default gates apply (int4 is held to W4A16's)."""
        recipe = {"scheme": f"ONNX {self.type}", "gates_scheme": "W4A16" if self.type == "int4" else "W8A16"}
        if "calibration" in self.info:
            recipe["calibration"] = self.info["calibration"]
        return recipe
