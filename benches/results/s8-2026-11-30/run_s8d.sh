#!/bin/bash
# Session 8, GPU run 4 (last): the decode table (Mixtral 8/4/3 bits, Qwen and Gemma 4/3, b1/8/32,
# ctx 512), bench-serve Mixtral pinned vs planner at 4 req/s, Qwen pinned vs planner at 16 req/s.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
for spec in mixtral-8x7b:8,4,3:70 qwen1.5-moe-a2.7b:4,3:50 gemma-4-26b-a4b:4,3:65; do
  IFS=: read m bits t <<< "$spec"
  s=$(date +%s)
  timeout $t /tmp/pw bench-decode --device cuda --models $m --bits $bits --batches 1,8,32 --ctx 512 \
    --steps 4 --warmup 1 --append --out $OUT/h200-decode.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
for p in pinned planner; do
  s=$(date +%s)
  timeout 120 /tmp/pw bench-serve --model mixtral-8x7b --policies $p --rate 4 --requests 256 --max-seconds 40 \
    --out $OUT/serve-$p-mixtral.json > $R/serve-$p-mixtral.log 2>&1
  echo "serve mixtral $p rc=$? $(( $(date +%s) - s )) s"
done
for p in pinned planner; do
  s=$(date +%s)
  timeout 70 /tmp/pw bench-serve --model qwen1.5-moe-a2.7b --policies $p --rate 16 --requests 512 --max-seconds 30 \
    --out $OUT/serve-$p-qwen-r16.json > $R/serve-$p-qwen-r16.log 2>&1
  echo "serve qwen r16 $p rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
