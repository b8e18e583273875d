"""`quantship export --format X`: one request shape, one exporter per format, chosen by name.

A format registers a function taking an ExportRequest and returning the summary lines to print;
its module is imported only when that format is asked for (gguf-py, onnx, ... load nothing
otherwise). Options a format does not use are refused by it, in one line.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from quantship.errors import QuantshipError
from quantship.files import check_output_location

# format name → "module:function"
EXPORT_FORMATS = {"gguf": "quantship.formats.export:export_gguf_request",
                  "onnx": "quantship.formats.export:export_onnx_request"}


@dataclass
class ExportRequest:
    source: str | None
    output: Path
    type: str | None = None
    method: str = "rtn"
    calib: Path | None = None
    samples: int = 128
    seq_len: int = 512
    overwrite: bool = False
    pre_tokenizer: str | None = None
    imatrix: bool = False


def export(fmt: str, request: ExportRequest) -> list[str]:
    if fmt not in EXPORT_FORMATS:
        raise QuantshipError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    check_output_location(Path(request.output), "output")  # in one line now, not a traceback after the work
    module, function = EXPORT_FORMATS[fmt].split(":")
    return getattr(importlib.import_module(module), function)(request)


def export_gguf_request(request: ExportRequest) -> list[str]:
    from quantship.formats.gguf import GGUFOptions, export_gguf, summary_lines

    opts = GGUFOptions(type=request.type, method=request.method, calib=request.calib, samples=request.samples,
                       seq_len=request.seq_len, overwrite=request.overwrite, pre_tokenizer=request.pre_tokenizer,
                       imatrix=request.imatrix)
    return summary_lines(export_gguf(request.source, request.output, opts))


def export_onnx_request(request: ExportRequest) -> list[str]:
    from quantship.formats.onnx import OnnxOptions, export_onnx, summary_lines

    if request.method != "rtn":
        raise QuantshipError("--method applies to GGUF; ONNX int4/int8 take a checkpoint's integers "
                             "(quantize with --method gptq/awq first) or round full precision with RTN")
    if request.imatrix:
        raise QuantshipError("--imatrix weighs llama.cpp's block rounding in a GGUF export; ONNX int4/int8 take a "
                             "checkpoint's integers (quantize with --method awq/gptq for activation-aware weights)")
    if request.pre_tokenizer is not None:
        raise QuantshipError("--pre-tokenizer names llama.cpp's pre-tokenizer in a GGUF file; ONNX exports carry "
                             "tokenizer.json itself")
    opts = OnnxOptions(type=request.type or "fp32", calib=request.calib, samples=request.samples,
                       seq_len=request.seq_len, overwrite=request.overwrite)
    return summary_lines(export_onnx(request.source, request.output, opts))
