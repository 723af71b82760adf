#!/usr/bin/env python3
"""Writes the ONNX operator conformance cases of the installed onnx wheel into
tests/data/onnx-cases/ (gitignored), in the layout of onnx's own backend test data:

    node/<case>/model.onnx
    node/<case>/test_data_set_<i>/input_<j>.pb, output_<j>.pb   (TensorProto etc.)
    index.json   {case: {op_type (single-node cases), domain, nodes, ops, rtol, atol,
                 data_sets}}

Idempotent: a stamp file holding the onnx version (and this script's hash) skips the work when it matches.

    .venv/bin/python scripts/gen_onnx_cases.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import warnings
from pathlib import Path

import onnx
from onnx import TensorProto, numpy_helper
from onnx.backend.test.case import node as node_cases

REPO = Path(__file__).resolve().parent.parent


def serialize(value, value_info: onnx.ValueInfoProto) -> bytes:
    kind = value_info.type.WhichOneof("value")
    if kind == "map_type":
        return numpy_helper.from_dict(value, value_info.name).SerializeToString()
    if kind == "sequence_type":
        return numpy_helper.from_list(value, value_info.name).SerializeToString()
    if kind == "optional_type":
        return numpy_helper.from_optional(value, value_info.name).SerializeToString()
    if isinstance(value, TensorProto):
        return value.SerializeToString()
    return numpy_helper.from_array(value, value_info.name).SerializeToString()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "onnx-cases")
    ap.add_argument("--force", action="store_true", help="regenerate even if the stamp matches")
    args = ap.parse_args()
    stamp = args.out / ".stamp"
    # The generator's own hash is in the stamp too: editing it regenerates.
    script_sha = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    want = f"onnx {onnx.__version__}, generator {script_sha}\n"
    if not args.force and stamp.exists() and stamp.read_text() == want:
        print(f"{args.out}: up to date ({want.strip()})")
        return 0

    tmp = args.out.with_name(args.out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    index = {}
    warnings.simplefilter("ignore")  # the case generators divide by zero on purpose
    for case in node_cases.collect_testcases():
        model = case.model
        case_dir = tmp / "node" / case.name
        case_dir.mkdir(parents=True)
        (case_dir / "model.onnx").write_bytes(model.SerializeToString())
        for i, (inputs, outputs) in enumerate(case.data_sets):
            data_dir = case_dir / f"test_data_set_{i}"
            data_dir.mkdir()
            for j, value in enumerate(inputs):
                (data_dir / f"input_{j}.pb").write_bytes(serialize(value, model.graph.input[j]))
            for j, value in enumerate(outputs):
                (data_dir / f"output_{j}.pb").write_bytes(
                    serialize(value, model.graph.output[j]))
        node = model.graph.node[0] if len(model.graph.node) == 1 else None
        index[case.name] = {
            "op_type": node.op_type if node else None,
            "domain": node.domain if node else None,
            "nodes": len(model.graph.node),
            "ops": sorted({n.op_type for n in model.graph.node}),
            "rtol": case.rtol, "atol": case.atol, "data_sets": len(case.data_sets),
        }
    (tmp / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    (tmp / ".stamp").write_text(want)
    if args.out.exists():
        shutil.rmtree(args.out)
    tmp.rename(args.out)
    print(f"{args.out}: wrote {len(index)} cases ({want.strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
