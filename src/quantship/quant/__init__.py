"""Quantization: schemes (plain data), RTN/AWQ/GPTQ, calibration and the layer-streaming pipeline."""
