#!/bin/bash
# Session 11, GPU run 4 (binary of the session's last kernel change, the shared rope_store):
# bench-raise (exactness of the fused decode path on CUDA: the shipped model raised 3 -> 8 bits
# equals it loaded at 8) and bench-decode of the three shapes at 4 / 3 bits, b1 / b8, ctx 512.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 150 /tmp/pw bench-raise --device cuda --model qwen1.5-moe-a2.7b --layers 24 --batch 8 --ctx 512 \
  --out $R/raise-qwen.json > $R/raise-qwen.log 2>&1
echo "raise rc=$? $(( $(date +%s) - s )) s"
D="/tmp/pw bench-decode --device cuda --bits 4,3 --ctx 512 --steps 16 --warmup 2 --batches 1,8"
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 100 $D --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
