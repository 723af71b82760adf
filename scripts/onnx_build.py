"""Small helpers shared by the model scripts: an ONNX graph builder that writes weights as
external data (or only its metadata), and the manifest file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
ELEM_SIZE = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2,
             TensorProto.DOUBLE: 8, TensorProto.INT64: 8, TensorProto.BOOL: 1}
REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "models" / "manifest.json"


def float_initializer_elements(model: onnx.ModelProto) -> int:
    """Elements of floating-point initializers, each counted once (main graph)."""
    seen = set()
    total = 0
    for t in model.graph.initializer:
        if t.data_type in FLOAT_TYPES and t.name not in seen:
            seen.add(t.name)
            total += int(np.prod(t.dims, dtype=np.int64))
    return total


def untied_float_elements(model: onnx.ModelProto) -> int:
    """Elements of floating-point initializers once the parameter record unties them: an
    initializer standing for N module tensors (the exporter merged equal values) counts N
    times, one without a record (constants) once."""
    total = 0
    for t in model.graph.initializer:
        if t.data_type not in FLOAT_TYPES:
            continue
        groups = next((json.loads(p.value) for p in t.metadata_props if p.key == "smp.params"), [])
        total += int(np.prod(t.dims, dtype=np.int64)) * max(1, len(groups))
    return total


def update_manifest(entries: dict) -> None:
    """Merge `entries` (name -> record) into models/manifest.json, keys sorted."""
    data = {}
    if MANIFEST.exists():
        data = json.loads(MANIFEST.read_text())
    data.update(entries)
    MANIFEST.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")


class GraphBuilder:
    """Builds one ONNX graph. Weights are external data in `weights_location`; with
    `weights_file` None only the metadata is written (a graph-only model), else random
    values are written there (used to check the graph on onnxruntime)."""

    def __init__(self, root: str, dtype: int, weights_location: str, weights_file=None, seed=0):
        self.root = root  # namespace root, e.g. ": GPT"
        self.dtype = dtype
        self.np_dtype = {TensorProto.FLOAT: np.float32, TensorProto.BFLOAT16: None}[dtype]
        self.location = weights_location
        self.weights_file = weights_file
        self.rng = np.random.default_rng(seed)
        self.offset = 0
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.init_names: set[str] = set()
        self.counter = 0

    # -- initializers ------------------------------------------------------------------
    def weight(self, name, shape, fill="normal", values=None, doc=""):
        """A floating-point weight stored as external data (never inline)."""
        assert name not in self.init_names, name
        self.init_names.add(name)
        numel = int(np.prod(shape, dtype=np.int64))
        nbytes = numel * ELEM_SIZE[self.dtype]
        t = TensorProto()
        t.name = name
        t.data_type = self.dtype
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        if doc:
            t.doc_string = doc
        self.offset = (self.offset + 63) // 64 * 64
        for k, v in (("location", self.location), ("offset", str(self.offset)),
                     ("length", str(nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        if self.weights_file is not None:
            if values is None:
                if fill == "ones":
                    values = np.ones(shape, np.float32)
                elif fill == "zeros":
                    values = np.zeros(shape, np.float32)
                else:
                    values = self.rng.normal(0.0, 0.02, size=shape).astype(np.float32)
            assert self.dtype == TensorProto.FLOAT, "real weights only in float32"
            self.weights_file.seek(self.offset)
            self.weights_file.write(np.asarray(values, np.float32).tobytes())
        self.offset += nbytes
        self.inits.append(t)
        return name

    def const(self, name, array):
        """A small constant stored inline (scalars, shapes, positions)."""
        assert name not in self.init_names, name
        self.init_names.add(name)
        array = np.asarray(array)
        if array.dtype.kind == "f":
            if self.dtype == TensorProto.BFLOAT16:
                t = helper.make_tensor(name, TensorProto.BFLOAT16, array.shape,
                                       array.astype(np.float32).flatten().tolist())
            else:
                t = numpy_helper.from_array(array.astype(np.float32), name)
        else:
            t = numpy_helper.from_array(array, name)
        self.inits.append(t)
        return name

    # -- nodes -------------------------------------------------------------------------
    def node(self, op, inputs, scope, module="", n_out=1, **attrs):
        """Appends a node; `scope` is the module path chain [(path, class), ...] below the
        root, written as torch.onnx writes `namespace`. Returns the output name(s)."""
        self.counter += 1
        path = scope[-1][0] if scope else ""
        name = f"{path}/{op}_{self.counter}" if path else f"{op}_{self.counter}"
        outs = [f"{name}:{i}" if n_out > 1 else name for i in range(n_out)]
        n = helper.make_node(op, inputs, outs, name=name, **attrs)
        ns = self.root + "".join(f"/{p}: {c}" for p, c in scope)
        ns += f"/{op.lower()}_{self.counter}: onnx.{op}"
        e = n.metadata_props.add()
        e.key, e.value = "namespace", ns
        self.nodes.append(n)
        return outs if n_out > 1 else outs[0]

    def model(self, name, inputs, outputs, opset=20):
        graph = helper.make_graph(self.nodes, name, inputs, outputs, initializer=self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="smp-partition/scripts/make_graph_only.py")
        m.ir_version = 10
        return m


def write_model(model: onnx.ModelProto, path: Path) -> None:
    """Writes the model as one protobuf file (external data is metadata only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(model.SerializeToString(deterministic=True))


def io_record(model: onnx.ModelProto) -> dict:
    """Graph inputs/outputs as {name, shape, dtype} (symbolic dims by name)."""
    def one(v):
        tt = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in tt.shape.dim]
        return {"name": v.name, "shape": dims,
                "dtype": helper.tensor_dtype_to_np_dtype(tt.elem_type).name
                if tt.elem_type != TensorProto.BFLOAT16 else "bfloat16"}
    return {"inputs": [one(v) for v in model.graph.input],
            "outputs": [one(v) for v in model.graph.output]}

