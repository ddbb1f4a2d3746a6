#!/bin/bash
# Session 12, GPU run 5 (binary of the session's last kernel change): the decode matrix of the
# three models (4 and 3 bits at ctx 512, 4 bits at ctx 4096; b1 / b8), Gemma-4 / Qwen batch 1
# with 4 rows per GEMV unit, and every kernel's time of the three batch-1 steps.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b mixtral-8x7b; do
  s=$(date +%s)
  timeout 120 /tmp/pw bench-decode --device cuda --bits 4,3 --ctx 512 --steps 16 --warmup 2 --batches 1,8 \
    --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
  s=$(date +%s)
  timeout 90 /tmp/pw bench-decode --device cuda --bits 4 --ctx 4096 --steps 16 --warmup 2 --batches 1,8 \
    --models $m --out $R/decode-$m-ctx4096.json > $R/decode-$m-ctx4096.log 2>&1
  echo "$m ctx 4096 rc=$? $(( $(date +%s) - s )) s"
done
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  s=$(date +%s)
  timeout 60 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2 --batches 1 --models $m \
    --gemv-rows 4 --out $R/decode-$m-rows4.json > $R/decode-$m-rows4.log 2>&1
  echo "$m rows 4 rc=$? $(( $(date +%s) - s )) s"
done
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b mixtral-8x7b; do
  s=$(date +%s)
  timeout 100 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread --clock-control none \
    --cache-control none --print-summary per-kernel /tmp/pw bench-decode --device cuda --models $m --bits 4 \
    --batches 1 --ctx 512 --steps 2 --warmup 1 --out /tmp/d.json > $R/ncu-decode-$m-b1.txt 2>&1
  echo "ncu $m b1 rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
