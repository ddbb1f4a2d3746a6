#!/bin/bash
# Session 9, GPU run 2: split-K routed GEMV (--gemv-split-words), GEMV rows per warp unit
# (--gemv-rows), vectorised fused router, batched attention combine. Mixtral b1/b8 at 4 bits
# under four GEMV settings in one call, Qwen/Gemma at the defaults, per-kernel ncu of Mixtral b1.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
D="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2"
for spec in "default:" "nosplit:--gemv-split-words 0" "rows4:--gemv-rows 4" "split64:--gemv-split-words 64"; do
  name=${spec%%:*}; flags=${spec#*:}
  s=$(date +%s)
  timeout 75 $D --models mixtral-8x7b --batches 1,8 $flags --out $R/decode-mixtral-$name.json > $R/decode-mixtral-$name.log 2>&1
  echo "mixtral $name rc=$? $(( $(date +%s) - s )) s"
done
for m in qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 60 $D --models $m --batches 1,8 --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 100 $NCU --metrics gpu__time_duration.sum --clock-control none --cache-control none --print-summary per-kernel \
  /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 1 --ctx 512 --steps 2 --warmup 1 \
  --out /tmp/d.json > $R/ncu-decode-mixtral-b1.txt 2>&1
echo "ncu mixtral b1 rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
