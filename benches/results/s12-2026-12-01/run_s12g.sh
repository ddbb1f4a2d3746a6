#!/bin/bash
# Session 12, GPU run 7 (binary of run 6): Qwen1.5-MoE batch 8 again (its step moved 7.14 ->
# 7.82 ms between runs 4 and 6) and every kernel's time of its batch-8 step.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 40 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 3 --batches 8,1,8 \
  --models qwen1.5-moe-a2.7b --out $R/decode-qwen-b8.json > $R/decode-qwen-b8.log 2>&1
echo "qwen b8 rc=$? $(( $(date +%s) - s )) s"
s=$(date +%s)
timeout 70 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum,launch__registers_per_thread --clock-control none \
  --cache-control none --print-summary per-kernel /tmp/pw bench-decode --device cuda --models qwen1.5-moe-a2.7b --bits 4 \
  --batches 8 --ctx 512 --steps 2 --warmup 1 --out /tmp/d.json > $R/ncu-decode-qwen-b8.txt 2>&1
echo "ncu qwen b8 rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
