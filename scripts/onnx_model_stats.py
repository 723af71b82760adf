#!/usr/bin/env python3
"""Prints, as one JSON object keyed by file name, what the onnx package reports for each
ONNX model given: floating-point initializer elements, initializer/node/input/output counts,
and the elements of weights built by constant subgraphs (float values made by nodes that read
no graph input, used as a Conv/Gemm weight or bias or a MatMul's second operand; their shapes
from onnx's shape inference).
The frontend tests use it as an oracle. Usage: onnx_model_stats.py MODEL.onnx..."""
import json
import os
import sys

import onnx

FLOAT_TYPES = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16,
}

stats = {}
for path in sys.argv[1:]:
    model = onnx.load(path, load_external_data=False)
    g = model.graph
    inits = {t.name for t in g.initializer}
    float_elems = 0
    for t in g.initializer:
        if t.data_type in FLOAT_TYPES:
            n = 1
            for d in t.dims:
                n *= d
            float_elems += n
    inferred = onnx.shape_inference.infer_shapes(model).graph
    shapes = {v.name: v.type.tensor_type for v in list(inferred.value_info) + list(inferred.output)}
    data = {i.name for i in g.input if i.name not in inits}
    made = set()
    for node in g.node:
        if any(i in data for i in node.input if i):
            data.update(node.output)
        made.update(node.output)
    built = set()
    for node in g.node:
        slots = {"Conv": (1, 2), "Gemm": (1, 2)}.get(node.op_type, ())
        if node.op_type == "MatMul" and node.input[0] in data:
            slots = (1,)
        for k in slots:
            if k < len(node.input) and node.input[k] in made and node.input[k] not in data:
                built.add(node.input[k])
    built_elems = 0
    for name in built:
        t = shapes[name]
        if t.elem_type in FLOAT_TYPES:
            n = 1
            for d in t.shape.dim:
                n *= d.dim_value
            built_elems += n
    stats[os.path.basename(path)] = {
        "built_weight_elems": built_elems,
        "float_initializer_elems": float_elems,
        "initializers": len(g.initializer),
        "nodes": len(g.node),
        "inputs": len([i for i in g.input if i.name not in inits]),
        "outputs": len(g.output),
    }
print(json.dumps(stats, sort_keys=True))
