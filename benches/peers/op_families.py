"""Per-step CPU time by op family, from two `perf record` profiles of one program.

One profile is of LONG steps and one of SHORT steps (their difference drops start-up and the
first step):

    op_families.py LONG.perf SHORT.perf STEPS_DIFFERENCE [FREQUENCY]

Each sample's symbol (perf report's flat self-time view) is put in the family of the libtorch
kernel, library or interpreter it belongs to; prints one JSON object per family with its CPU
ms per step (samples / frequency / steps difference). Samples ∝ CPU time, so the rows of two
programs compare even on a loaded machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

# first match wins; the order puts specific kernels before the catch-alls
FAMILIES = [
    ("matmul (GEMM)", r"gemm|mkl_blas|dnnl|brgemm|mkl_"),
    ("attention (SDPA kernel)", r"flash_attention"),
    ("pow", r"powf|pow_tensor|pow_"),
    ("mul", r"mul_kernel|mul_kernel_|\bmul\b"),
    ("add / sub", r"add_kernel|sub_kernel|add_clamp"),
    ("div / reciprocal", r"div_true|div_trunc|div_floor|reciprocal"),
    ("sqrt / rsqrt", r"sqrt"),
    ("sigmoid / silu", r"sigmoid|silu"),
    ("(log-)softmax, cross-entropy", r"softmax|nll_loss"),
    ("exp (Sleef)", r"Sleef_.*exp"),
    ("sin / cos", r"Sleef_.*(sin|cos)|sin_kernel|cos_kernel"),
    ("neg", r"neg_kernel"),
    ("optimizer (Adam)", r"adam|lerp|addcdiv|addcmul"),
    ("reductions (sum, mean, norm)", r"reduce|sum_kernel|mean_kernel|norm_kernel|Reduction"),
    ("fill / zero", r"fill_kernel|memset"),
    ("copy (contiguous, cat, cast)", r"copy_kernel|copy_|memmove|memcpy|cat_serial|cat_|index_select|_to_copy"),
    ("index / gather / embedding", r"index|gather|embedding|scatter|take"),
    ("where / compare / mask", r"where|compare|eq_kernel|lt_kernel|le_kernel|gt_kernel|ge_kernel|masked"),
    ("allocation, page faults (kernel)", r"malloc|free|_int_|mmap|page|\[k\]|alloc"),
    ("Python interpreter", r"^_?Py|python|_PyEval|pymalloc"),
    ("dispatch, autograd, TensorIterator", r"c10::|at::|torch::|caffe2|std::"),
]


def samples(path: str) -> Counter:
    out = subprocess.run(
        ["perf", "report", "-i", path, "--no-children", "--sort", "dso,sym", "--stdio", "-F", "sample,dso,sym", "-g", "none"],
        capture_output=True, text=True, check=True,
    ).stdout
    fam: Counter = Counter()
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+)\s+(\[.\])\s+(.*)", line)
        if not m:
            continue
        n, dso, kind, sym = int(m[1]), m[2], m[3], m[4]
        if dso == "smp-runner":
            name = "runner interpreter (Rust)"
        elif "python" in dso and not sym.startswith(("at::", "c10::", "torch::")):
            name = "Python interpreter"
        else:
            text = f"{kind} {sym}" if kind == "[k]" else sym
            name = next((f for f, rx in FAMILIES if re.search(rx, text)), "other")
        fam[name] += n
    return fam


def main() -> None:
    long_, short, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hz = float(sys.argv[4]) if len(sys.argv) > 4 else 999.0
    a, b = samples(long_), samples(short)
    rows = {f: (a[f] - b[f]) / hz / steps * 1e3 for f in set(a) | set(b)}
    for f, ms in sorted(rows.items(), key=lambda r: -r[1]):
        print(json.dumps({"family": f, "ms_per_step": round(ms, 2)}))


if __name__ == "__main__":
    main()
