#!/bin/bash
# Session 10, GPU run 3 (binary of 7f6ec9b): the step at this session's code (activation in the
# gate_up GEMV's epilogue at one token per routed item), 3/4/8 bits, b1/b8/b32, ctx 512, all
# three shapes; raisings on Mixtral-8x7B pages (8 layers) through the CUDA mover; bench-serve
# Qwen at 16 req/s (planner, pinned) and Mixtral at 4 req/s (planner).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
D="/tmp/pw bench-decode --device cuda --bits 4,3,8 --ctx 512 --steps 16 --warmup 2 --batches 1,8,32"
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 90 $D --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 90 /tmp/pw bench-raise --device cuda --model mixtral-8x7b --layers 8 --batch 1 --ctx 512 \
  --out $R/raise-mixtral.json > $R/raise-mixtral.log 2>&1
echo "raise mixtral rc=$? $(( $(date +%s) - s )) s"
for p in planner pinned; do
  s=$(date +%s)
  timeout 100 /tmp/pw bench-serve --model qwen1.5-moe-a2.7b --policies $p --rate 16 --requests 512 --max-seconds 30 \
    --out $R/serve-$p-qwen-r16.json > $R/serve-$p-qwen-r16.log 2>&1
  echo "serve qwen r16 $p rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
