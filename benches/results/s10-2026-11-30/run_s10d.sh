#!/bin/bash
# Session 10, GPU run 4 (binary of 8ebf4a0): Mixtral at 8 bits after the 3-bit records (the
# recommit that stalled in run 3), and bench-serve Qwen at 16 req/s with the planner (synthetic
# LUT copies back on CubeCL's queue).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 90 /tmp/pw bench-decode --device cuda --bits 3,8 --ctx 512 --steps 16 --warmup 2 --batches 1,8,32 \
  --models mixtral-8x7b --out $R/decode-mixtral-8x7b.json > $R/decode-mixtral-8x7b.log 2>&1
echo "mixtral rc=$? $(( $(date +%s) - s )) s"
s=$(date +%s)
timeout 100 /tmp/pw bench-serve --model qwen1.5-moe-a2.7b --policies planner --rate 16 --requests 512 --max-seconds 30 \
  --out $R/serve-planner-qwen-r16.json > $R/serve-planner-qwen-r16.log 2>&1
echo "serve qwen r16 planner rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
