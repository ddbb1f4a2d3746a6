#!/bin/bash
# Session 9, GPU run 5 (binary of de337ab): bench-serve Qwen at 16 req/s, 8-bit pinned vs planner,
# with room for the model load (run 4 cut them at 70 s).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
for p in planner pinned; do
  s=$(date +%s)
  timeout 110 /tmp/pw bench-serve --model qwen1.5-moe-a2.7b --policies $p --rate 16 --requests 512 --max-seconds 30 \
    --out $R/serve-$p-qwen-r16.json > $R/serve-$p-qwen-r16.log 2>&1
  echo "serve qwen r16 $p rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
