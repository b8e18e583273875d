"""A small graph builder over the `onnx` helper API: named nodes, small constants inline, weights
streamed to one external data file as they are made (so a layer's arrays can be freed at once)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # ONNX Runtime, TensorRT and the QDQ tooling all take 17
MS_DOMAIN = "com.microsoft"  # MatMulNBits
ALIGN_LARGE = 4096  # page-aligned offsets let ONNX Runtime map large weights instead of copying them


class Graph:
    """Nodes, inputs, outputs and initializers of one model. `op` returns its output name(s)."""

    def __init__(self, data_path: Path):
        self.data_path = Path(data_path)
        self.data = open(self.data_path, "wb")
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.used: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self.weight_bytes = 0

    def unique(self, name: str) -> str:
        base, n = name, 1
        while name in self.used:
            n += 1
            name = f"{base}_{n}"
        self.used.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], name: str, outputs: int = 1, domain: str | None = None,
           **attrs) -> str | list[str]:
        """One node named `name` (Optimum-style paths like /model/layers.0/attn/q_proj/MatMul)."""
        name = self.unique(name)
        outs = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, value, dtype=np.int64) -> str:
        """A small constant (shapes, axes, scalars), stored inline once per distinct value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = self.unique(f"const_{len(self._consts)}")
            self.initializers.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def weight(self, name: str, array: np.ndarray) -> str:
        """A weight appended to the external data file now; the proto keeps only where it lies."""
        array = np.ascontiguousarray(array)
        name = self.unique(name)
        align = ALIGN_LARGE if array.nbytes >= 65536 else 16
        offset = -(-self.data.tell() // align) * align
        self.data.seek(offset)
        self.data.write(array.tobytes())
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                             dims=list(array.shape), data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.data_path.name), ("offset", str(offset)), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        self.weight_bytes += array.nbytes
        return name

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        self.used.add(name)
        return name

    def output(self, source: str, name: str, elem_type: int, shape: list) -> None:
        """Name a computed tensor as a graph output (through an Identity, so node names stay paths)."""
        self.nodes.append(helper.make_node("Identity", [source], [name], name=self.unique(f"/output/{name}")))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def finish(self, producer: str, version: str, metadata: dict[str, str]) -> onnx.ModelProto:
        self.data.close()
        graph = helper.make_graph(self.nodes, "decoder", self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", OPSET)]
        if any(n.domain == MS_DOMAIN for n in self.nodes):
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name=producer, producer_version=version,
                                  ir_version=8)
        helper.set_model_props(model, metadata)
        return model
