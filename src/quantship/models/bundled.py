"""The bundled tiny DeepSeek-V3 and how a MODEL argument is resolved to a directory."""

from __future__ import annotations

from pathlib import Path

from quantship.errors import QuantshipError

TINY_DIR = Path(__file__).parent / "assets" / "tiny"
TINY_NAMES = ("tiny", "")


def resolve_model(model: str | Path | None) -> Path:
    """`tiny` (or nothing) means the bundled model; anything else is a local directory, never a hub id."""
    if model is None or str(model) in TINY_NAMES:
        return TINY_DIR
    path = Path(model).expanduser()
    if not path.exists():
        hub_id = "/" in str(model) and not path.parent.exists()
        hint = " (quantship never downloads; give a local directory)" if hub_id else ""
        raise QuantshipError(f"model directory not found{hint}", path)
    if not path.is_dir():
        raise QuantshipError("expected a model directory (config.json, *.safetensors, tokenizer files)", path)
    return path


def bundled_texts() -> dict[str, Path]:
    """Held-out evaluation text and the disjoint calibration text shipped with the tiny model."""
    return {"eval_text": TINY_DIR / "eval.txt", "calib_text": TINY_DIR / "calib.txt"}
