"""quantship: DeepSeek-family checkpoints to a quantized service you can trust and ship."""

__version__ = "0.1.0"
