"""Checkpoint formats that external readers load: compressed-tensors (vLLM)."""
