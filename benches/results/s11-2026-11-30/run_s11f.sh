#!/bin/bash
# Session 11, GPU run 7: gemma_ffn_out with the routing's plane top-k (binary of that commit):
# Gemma-4 and Qwen1.5-MoE decode at 4 bits, b1 / b8, and ncu of Gemma b1's small kernels.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
D="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2 --batches 1,8"
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  s=$(date +%s)
  timeout 100 $D --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 110 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread --clock-control none \
  --cache-control none -k regex:"gemma_ffn_out|route_gather" --print-summary per-kernel /tmp/pw bench-decode \
  --device cuda --models gemma-4-26b-a4b --bits 4 --batches 1 --ctx 512 --steps 2 --warmup 1 --out /tmp/d.json \
  > $R/ncu-gemma-b1.txt 2>&1
echo "ncu gemma b1 rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
