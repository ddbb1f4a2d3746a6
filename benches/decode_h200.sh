#!/bin/bash
# GPU run of the fast decode path: the three families' shapes at 4 bits and a planner mix,
# batch 1/8/32, ctx 512/4096 (one process per model, records appended to one JSON), then ncu
# over one Mixtral batch-1 step (per-kernel GPU time; the window of 430 launches after the
# first 900 covers one step of 420 + the attention combine passes).
# Usage: benches/decode_h200.sh [path to a `--features cuda` release binary]; writes to $OUT.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
PW=${1:-target/release/pagedweight}
OUT=${OUT:-/tmp}
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  timeout ${T_DECODE:-120} $PW bench-decode --device cuda --models $m --bits ${BITS:-4,mix} --batches 1,8,32 \
    --ctx 512,4096 --steps 4 --warmup 1 --append --out $OUT/h200-decode.json > $OUT/decode-$m.log 2>&1
  echo "$m rc=$?"
done
timeout ${T_NCU:-60} /usr/local/cuda/bin/ncu --cache-control none --clock-control none \
  --metrics gpu__time_duration.sum --launch-skip 900 --launch-count 430 --csv \
  $PW bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 1 --ctx 512 \
  --steps 1 --warmup 1 --out /tmp/ncu-decode.json > $OUT/ncu-decode.csv 2> $OUT/ncu-decode.err
echo "ncu rc=$?"
