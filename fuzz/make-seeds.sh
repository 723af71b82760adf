#!/usr/bin/env bash
# Writes fuzzing seeds made by the tools themselves into target/fuzz/seeds/TARGET/ (see
# docs/fuzzing.md): plans the planner writes for several meshes and schedules, a token file
# from prepare-data, checkpoints that one process and plans of 2 ranks write, and gpt2's
# batch as .npy, .npz and .safetensors. Real files carry every field the current code writes,
# so the fields later issues add are fuzzed without anyone listing them.
#
#   fuzz/make-seeds.sh [BIN_DIR]     (default target/debug; needs smp-partition, smp-runner)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/debug}
P=$BIN/smp-partition
R=$BIN/smp-runner
OUT=target/fuzz/seeds
NEW=$OUT.new
WORK=$(mktemp -d)
trap 'rm -rf "$WORK" "$NEW"' EXIT
rm -rf "$NEW"
mkdir -p "$NEW"/{plan,tokens,checkpoint,batch}
C=tests/data/cpu.toml

plan() {
  local name=$1
  shift
  "$P" "$@" -o "$NEW/plan/$name.json" >/dev/null 2>"$WORK/err" || { echo "make-seeds: plan $name: $(tail -1 "$WORK/err")" >&2; return 0; }
}
G="models/gpt2.onnx --seq-len 16"
plan gpt2-one $G --cluster $C:1 --global-batch 2
plan gpt2-pp2-dp2 $G --cluster $C:4 --global-batch 8 --pp 2 --dp 2
plan gpt2-tp2 $G --cluster $C:2 --global-batch 4 --tp 2
plan gpt2-dp2-zero3 $G --cluster $C:2 --global-batch 4 --dp 2 --zero 3
plan gpt2-sharded-dp $G --cluster $C:4 --global-batch 8 --dp 4 --sharded-dp 2
plan gpt2-interleaved $G --cluster $C:2 --global-batch 8 --pp 2 --schedule interleaved:2 --microbatches 4
plan gpt2-zb-h1 $G --cluster $C:2 --global-batch 8 --pp 2 --schedule zb-h1 --microbatches 4
plan gpt2-gpipe-full $G --cluster $C:2 --global-batch 4 --pp 2 --schedule gpipe --checkpointing full
plan gpt2-megatron $G --cluster $C:4 --global-batch 8 --baseline megatron
plan llama-tp2-pp2 models/llama.onnx --seq-len 16 --cluster $C:4 --global-batch 4 --tp 2 --pp 2
plan bert-pp2 models/bert.onnx --seq-len 16 --cluster $C:2 --global-batch 4 --pp 2
plan gpt2-h100 $G --cluster h100-80gb:16 --global-batch 64

# a token file and its sidecar (byte-level ids of the docs)
mkdir -p "$NEW/tokens/docs"
"$R" prepare-data docs -o "$NEW/tokens/docs/data.bin" >/dev/null

# checkpoints: one process, and plans of 2 ranks (pipeline, tensor and ZeRO-3 cuts)
ckpt() {
  local name=$1
  shift
  "$@" --steps 1 --checkpoint-dir "$WORK/$name" --checkpoint-every 1 >/dev/null 2>"$WORK/err" || { echo "make-seeds: checkpoint $name: $(tail -1 "$WORK/err")" >&2; return 0; }
  cp -r "$WORK/$name"/step-* "$NEW/checkpoint/$name"
}
ckpt one "$R" train models/gpt2.onnx --batch 2 --seq-len 16
for p in gpt2-pp2-dp2 gpt2-tp2 gpt2-dp2-zero3; do
  [ -f "$NEW/plan/$p.json" ] || continue
  n=$(python3 -c "import json,sys; p=json.load(open(sys.argv[1]))['parallel']; print(p['pp']*p['tp']*p['dp'])" "$NEW/plan/$p.json")
  ckpt "$p" "$R" launch --nproc "$n" "$NEW/plan/$p.json"
done

# gpt2's batch in the three fixed-batch formats (each a case directory keeping its name)
.venv/bin/python - "$NEW/batch" <<'PY'
import os, sys
import numpy as np
from safetensors.numpy import save_file
out = sys.argv[1]
ids = np.load("models/gpt2.io.npz")["input_ids"]
for name, write in [("npy", lambda p: np.save(p, ids)),
                    ("npz", lambda p: np.savez(p, input_ids=ids)),
                    ("safetensors", lambda p: save_file({"input_ids": ids}, p))]:
    os.makedirs(f"{out}/{name}", exist_ok=True)
    write(f"{out}/{name}/batch.{name}")
PY

rm -rf "$OUT"
mv "$NEW" "$OUT"
echo "make-seeds: $(find "$OUT" -type f | wc -l) files in $OUT"
