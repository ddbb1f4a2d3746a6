#!/bin/bash
# Session 10, GPU run 2 (binary of f8ee5c6): Qwen b8 epilogue vs launch again (alternating, one
# process) with the GEMV's registers per thread (ncu), then bench-serve Qwen at 16 req/s,
# planner vs 8-bit pinned (page moves now through the CUDA mover).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
s=$(date +%s)
timeout 80 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 32 --warmup 2 --batches 8,1 \
  --models qwen1.5-moe-a2.7b --expert-act launch,epilogue,launch,epilogue \
  --out $R/decode-qwen-alt.json > $R/decode-qwen-alt.log 2>&1
echo "qwen alt rc=$? $(( $(date +%s) - s )) s"
for m in epilogue launch; do
  s=$(date +%s)
  timeout 60 $NCU --metrics launch__registers_per_thread,launch__occupancy_limit_registers,gpu__time_duration.sum \
    --clock-control none --cache-control none --print-summary per-kernel -k regex:ap_gemv \
    /tmp/pw bench-decode --device cuda --models qwen1.5-moe-a2.7b --bits 4 --batches 8 --ctx 512 --steps 2 --warmup 1 \
    --expert-act $m --out /tmp/d.json > $R/ncu-qwen-b8-$m.txt 2>&1
  echo "ncu qwen b8 $m rc=$? $(( $(date +%s) - s )) s"
done
for p in planner pinned; do
  s=$(date +%s)
  timeout 110 /tmp/pw bench-serve --model qwen1.5-moe-a2.7b --policies $p --rate 16 --requests 512 --max-seconds 30 \
    --out $R/serve-$p-qwen-r16.json > $R/serve-$p-qwen-r16.log 2>&1
  echo "serve qwen r16 $p rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
