#!/bin/bash
# Session 11, GPU run 5: where Gemma-4's and Qwen1.5-MoE's batch-1 steps go (ncu, every kernel's
# time, caches not flushed), binary 95e6139.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  s=$(date +%s)
  timeout 120 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread --clock-control none \
    --cache-control none --print-summary per-kernel /tmp/pw bench-decode --device cuda --models $m --bits 4 \
    --batches 1 --ctx 512 --steps 2 --warmup 1 --out /tmp/d.json > $R/ncu-decode-$m-b1.txt 2>&1
  echo "ncu $m b1 rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
