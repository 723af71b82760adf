"""Writes the ONNX backend node test cases of the installed onnx wheel whose every node is a
default-domain op in the given list, as <out>/<case>/model.onnx, <out>/<case>/meta.json
(rtol, atol) and <out>/<case>/test_data_set_N/{input,output}_K.pb.

usage: gen_onnx_cases.py OUT_DIR OP [OP ...]
(The runner's conformance test calls this when OUT_DIR is missing.)
"""
import json
import os
import sys
import warnings

import numpy as np
from onnx import TensorProto, numpy_helper
import onnx.backend.test.case.node as node_cases


def main():
    out, ops = sys.argv[1], set(sys.argv[2:])
    warnings.simplefilter("ignore")
    np.seterr(all="ignore")
    cases = node_cases.collect_testcases()
    os.makedirs(out, exist_ok=True)
    n = 0
    for case in cases:
        graph = case.model.graph
        if not all(nd.domain in ("", "ai.onnx") and nd.op_type in ops for nd in graph.node):
            continue
        if not all(v.type.HasField("tensor_type") for v in list(graph.input) + list(graph.output)):
            continue
        d = os.path.join(out, case.name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "model.onnx"), "wb") as f:
            f.write(case.model.SerializeToString())
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump({"rtol": case.rtol, "atol": case.atol}, f)
        for i, (inputs, outputs) in enumerate(case.data_sets):
            ds = os.path.join(d, f"test_data_set_{i}")
            os.makedirs(ds, exist_ok=True)
            for kind, arrays, decl in (("input", inputs, graph.input), ("output", outputs, graph.output)):
                for j, arr in enumerate(arrays):
                    if isinstance(arr, TensorProto):
                        proto = arr
                    else:
                        proto = numpy_helper.from_array(np.asarray(arr), decl[j].name)
                    with open(os.path.join(ds, f"{kind}_{j}.pb"), "wb") as f:
                        f.write(proto.SerializeToString())
        n += 1
    print(f"wrote {n} cases to {out}")


if __name__ == "__main__":
    main()
