#!/bin/bash
# Runner start-up, old binaries against new, alternated in one run: a one-step cp 2 run of the
# bundled Llama (seq 16, batch 8, 2 ranks x 1 thread), which start-up dominates.
#   scripts/startup_bench.sh OLD_BIN_DIR NEW_BIN_DIR [ROUNDS]
# Prints "old|new round wall_s user+sys_s" per run (CPU time of the launcher and its ranks).
set -eu
OLD=$1; NEW=$2; ROUNDS=${3:-11}
OUT=$(mktemp -d)
for b in old new; do
  dir=$([ $b = old ] && echo "$OLD" || echo "$NEW")
  "$dir/smp-partition" models/llama.onnx --cluster cpu:2 --seq-len 16 --global-batch 8 --cp 2 --tp 1 --pp 1 --dp 1 \
    -o "$OUT/$b.json" > "$OUT/$b.plan.log" 2>&1 || { echo "planning with the $b binaries failed"; cat "$OUT/$b.plan.log"; exit 1; }
done
for r in $(seq "$ROUNDS"); do
  for b in old new; do
    dir=$([ $b = old ] && echo "$OLD" || echo "$NEW")
    /usr/bin/time -f "$b $r %e %U %S" -o "$OUT/t" "$dir/smp-runner" launch --nproc 2 "$OUT/$b.json" --steps 1 --threads 1 \
      > "$OUT/$b.run.log" 2>&1 || { echo "the $b run failed"; tail -5 "$OUT/$b.run.log"; exit 1; }
    awk '{printf "%s %s %s %.2f\n", $1, $2, $3, $4 + $5}' "$OUT/t"
  done
done
