#!/bin/bash
# Session 12, GPU run 6 (binary of the session's final kernels): the decode matrix of the three
# models, 4 and 3 bits at ctx 512 and 4 bits at ctx 4096, batches 1 and 8.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
for m in mixtral-8x7b gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  s=$(date +%s)
  timeout 100 /tmp/pw bench-decode --device cuda --bits 4,3 --ctx 512 --steps 16 --warmup 3 --batches 1,8 \
    --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
  s=$(date +%s)
  timeout 70 /tmp/pw bench-decode --device cuda --bits 4 --ctx 4096 --steps 16 --warmup 3 --batches 1,8 \
    --models $m --out $R/decode-$m-ctx4096.json > $R/decode-$m-ctx4096.log 2>&1
  echo "$m ctx 4096 rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
