#!/bin/bash
# Session 9, GPU run 4 (binary of de337ab, as run 3): decode at ctx 4096 (4 bits, b1/b8) for the three
# models; bench-serve Qwen at 16 req/s and Mixtral at 4 req/s, 8-bit pinned vs planner.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 60 /tmp/pw bench-decode --device cuda --ctx 4096 --steps 16 --warmup 2 --models $m --bits 4 --batches 1,8 \
    --out $R/decode-ctx4096-$m.json > $R/decode-ctx4096-$m.log 2>&1
  echo "$m ctx4096 rc=$? $(( $(date +%s) - s )) s"
done
for p in pinned planner; do
  s=$(date +%s)
  timeout 70 /tmp/pw bench-serve --model qwen1.5-moe-a2.7b --policies $p --rate 16 --requests 512 --max-seconds 30 \
    --out $R/serve-$p-qwen-r16.json > $R/serve-$p-qwen-r16.log 2>&1
  echo "serve qwen r16 $p rc=$? $(( $(date +%s) - s )) s"
done
for p in pinned planner; do
  s=$(date +%s)
  timeout 120 /tmp/pw bench-serve --model mixtral-8x7b --policies $p --rate 4 --requests 256 --max-seconds 40 \
    --out $R/serve-$p-mixtral-r4.json > $R/serve-$p-mixtral-r4.log 2>&1
  echo "serve mixtral r4 $p rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
