"""Fidelity of a quantized model against its base: metrics, reports, gates."""
