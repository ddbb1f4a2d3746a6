#!/bin/bash
# Session 8, GPU run 3: decode b1/b8 at 4 bits (three models) after the wider GEMV cubes and the
# plane-parallel top-k; per-kernel GPU time of a Mixtral b1 step; bench-serve Qwen pinned vs planner.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
for spec in mixtral-8x7b:50 qwen1.5-moe-a2.7b:45 gemma-4-26b-a4b:70; do
  IFS=: read m t <<< "$spec"
  s=$(date +%s)
  timeout $t /tmp/pw bench-decode --device cuda --models $m --bits 4 --batches 1,8 --ctx 512 \
    --steps 4 --warmup 1 --append --out $OUT/decode.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 45 $NCU --metrics gpu__time_duration.sum --clock-control none --cache-control none --print-summary per-kernel \
  /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 1 --ctx 512 --steps 2 --warmup 1 \
  --out /tmp/d.json > $R/ncu-decode-mixtral-b1.txt 2>&1
echo "ncu rc=$? $(( $(date +%s) - s )) s"
for p in pinned planner; do
  s=$(date +%s)
  timeout 85 /tmp/pw bench-serve --model qwen1.5-moe-a2.7b --policies $p --rate 4 --requests 256 --max-seconds 40 \
    --out $OUT/h200-serve-$p-qwen.json > $R/serve-$p-qwen.log 2>&1
  echo "serve qwen $p rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
