#!/usr/bin/env python3
"""Prints, as one JSON object keyed by file name, what the onnx package reports for each
ONNX model given: floating-point initializer elements, initializer/node/input/output counts.
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
    stats[os.path.basename(path)] = {
        "float_initializer_elems": float_elems,
        "initializers": len(g.initializer),
        "nodes": len(g.node),
        "inputs": len([i for i in g.input if i.name not in inits]),
        "outputs": len(g.output),
    }
print(json.dumps(stats, sort_keys=True))
