#!/usr/bin/env python3
"""Builds the smp-partition wheel: the Python package `python/smp_partition` (the parameter
record included) and the two release binaries, built with a relative rpath into the installed
torch wheel (`$ORIGIN/../../torch/lib`). The wheel requires the torch release the binaries
were built against (this venv's) plus what export needs.

    python scripts/build_wheel.py --bin-dir target/wheel/release --out dist

Writes dist/smp_partition-<version>-py3-none-<platform>.whl (stdlib only: the wheel format is
a zip with a dist-info directory)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "python" / "smp_partition"
BINARIES = ("smp-partition", "smp-runner")
#: Export needs onnx and onnxscript (the optimiser), load_trained safetensors.
REQUIRES = ("onnx>=1.23", "onnxscript>=0.7", "safetensors>=0.4", "numpy")


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _torch_release() -> str:
    """This venv's torch without its local label (`2.13.0+cu130` → `2.13.0`)."""
    return importlib.metadata.version("torch").split("+", 1)[0]


def _check_rpath(binary: Path) -> None:
    """The runner must find libtorch beside the installed package, not in this build's venv."""
    out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, check=True).stdout
    paths = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "RUNPATH" in line or "RPATH" in line]
    if paths != ["$ORIGIN/../../torch/lib"]:
        sys.exit(f"{binary}: rpath {paths}, expected $ORIGIN/../../torch/lib (build with SMP_TORCH_RPATH)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", type=Path, required=True, help="where the release binaries are")
    ap.add_argument("--out", type=Path, default=REPO / "dist")
    args = ap.parse_args()

    project = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())["project"]
    name, version = "smp_partition", project["version"]
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    tag = f"py3-none-{platform}"
    dist_info = f"{name}-{version}.dist-info"
    files: list[tuple[str, bytes, int]] = []
    for f in sorted(PACKAGE.iterdir()):
        if f.suffix == ".py" or f.name == "py.typed":
            files.append((f"{name}/{f.name}", f.read_bytes(), 0o644))
    for b in BINARIES:
        path = args.bin_dir / b
        if not path.is_file():
            sys.exit(f"{path} not found: build it first (make wheel)")
        _check_rpath(path)
        files.append((f"{name}/bin/{b}", path.read_bytes(), 0o755))
    requires = [f"torch=={_torch_release()}", *REQUIRES]
    metadata = "\n".join([
        "Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {version}",
        f"Summary: {project['description']}", f"Requires-Python: {project['requires-python']}",
        "License: Apache-2.0", *(f"Requires-Dist: {r}" for r in requires), "", ""])
    wheel = "\n".join(["Wheel-Version: 1.0", "Generator: smp-partition scripts/build_wheel.py",
                       "Root-Is-Purelib: false", f"Tag: {tag}", "", ""])
    entry_points = ("[console_scripts]\nsmp-partition = smp_partition._binaries:smp_partition_main\n"
                    "smp-runner = smp_partition._binaries:smp_runner_main\n")
    files += [(f"{dist_info}/METADATA", metadata.encode(), 0o644), (f"{dist_info}/WHEEL", wheel.encode(), 0o644),
              (f"{dist_info}/entry_points.txt", entry_points.encode(), 0o644)]
    record = "".join(f"{p},{_digest(d)},{len(d)}\n" for p, d, _ in files) + f"{dist_info}/RECORD,,\n"
    files.append((f"{dist_info}/RECORD", record.encode(), 0o644))

    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data, mode in files:
            info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    print(f"wrote {target} ({target.stat().st_size / 1e6:.1f} MB; requires {', '.join(requires)})")


if __name__ == "__main__":
    main()
