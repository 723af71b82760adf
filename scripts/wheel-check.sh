#!/usr/bin/env bash
# Installs the wheel (`make wheel`) into a fresh venv outside the checkout, with only what the
# wheel requires (from PyPI; uv's cache where it has them), and runs a pp 2 front-door job from
# a temporary directory with a clean environment (no SMP_BIN_DIR, no checkout on any path):
# export a small PyTorch module, plan it on cpu:2, launch 5 steps on 2 ranks, load the trained
# weights back, and compare with PyTorch's own training. Not part of `make test` or CI.
#
#   scripts/wheel-check.sh [WHEEL]     # default: the newest dist/smp_partition-*.whl
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEEL=${1:-$(ls -t "$REPO"/dist/smp_partition-*.whl 2>/dev/null | head -1)}
[ -f "$WHEEL" ] || { echo "wheel-check: no wheel; run make wheel" >&2; exit 1; }
UV="$REPO/.venv/bin/uv"
command -v "$UV" >/dev/null || UV=uv
WORK=$(mktemp -d /tmp/smp-wheel-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
echo "wheel-check: $(basename "$WHEEL") into a fresh venv in $WORK"
"$UV" venv --quiet --python 3.11 "$WORK/venv"
"$UV" pip install --quiet --python "$WORK/venv/bin/python" "$WHEEL"
"$UV" pip list --python "$WORK/venv/bin/python" 2>/dev/null | grep -Ei "^(smp|torch |onnx|safetensors|numpy)" | sed 's/^/wheel-check:   /'
mkdir "$WORK/job"
cat > "$WORK/job/job.py" <<'PY'
import copy
import sysconfig
from pathlib import Path

import torch
import smp_partition as smp

VOCAB, SEQ, BATCH, H = 64, 8, 4, 32


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.up = torch.nn.Linear(H, 4 * H)
        self.down = torch.nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, H)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.norm = torch.nn.LayerNorm(H)
        self.head = torch.nn.Linear(H, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


site = Path(sysconfig.get_paths()["purelib"])
for b in ("smp-partition", "smp-runner"):
    path = smp.find_binary(b)
    assert site in path.parents, f"{b} found at {path}, not in the installed wheel"
    print(f"wheel-check: {b} from {path.relative_to(site)}")
torch.manual_seed(0)
model = TinyLM()
batch = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
plan = smp.plan(model, batch, cluster="cpu:2", global_batch=BATCH,
                config={"pipeline_parallel_degree": 2, "microbatches": 2}, workdir="job")
print(f"wheel-check: plan {plan.parallel}, stages {[s['layers'] for s in plan.stages]}")
run = smp.launch(plan, data=batch, steps=5, threads=1, progress=False)

reference = copy.deepcopy(model)
opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
losses = []
for _ in range(5):
    opt.zero_grad()
    logits = reference(batch)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())
rel = max(abs(a - b) / b for a, b in zip(run.losses, losses))
trained = smp.load_trained(copy.deepcopy(model), run)
worst = max(float((p - reference.state_dict()[n]).norm() / reference.state_dict()[n].norm())
            for n, p in trained.state_dict().items())
print(f"wheel-check: losses {['%.6f' % x for x in run.losses]}, PyTorch {['%.6f' % x for x in losses]}")
print(f"wheel-check: losses within {rel:.1e} relative, trained weights within {worst:.1e} norm-relative")
assert rel <= 1e-5 and worst <= 1e-4
print("wheel-check: OK")
PY
cd "$WORK/job"
env -i HOME="$HOME" PATH="$WORK/venv/bin:/usr/local/bin:/usr/bin:/bin" "$WORK/venv/bin/python" job.py
