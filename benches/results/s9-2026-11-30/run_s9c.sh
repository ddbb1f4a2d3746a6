#!/bin/bash
# Session 9, GPU run 3: CUDA check of the kernels (bench-kernels --check); the decode matrix of the
# three models at the defaults (experts' activation in a launch of its own), the same at 4 bits with
# the activation inside the down GEMV (--expert-act-in-down); per-kernel ncu of Mixtral b1.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
s=$(date +%s)
timeout 90 /tmp/pw bench-kernels --device cuda --check --models mixtral --bits 3,4,8 --tokens 1,2 --no-prefill \
  --out $R/kernels-check.json > $R/kernels-check.log 2>&1
echo "kernels check rc=$? $(( $(date +%s) - s )) s"
D="/tmp/pw bench-decode --device cuda --ctx 512 --steps 16 --warmup 2"
for spec in mixtral-8x7b:3,4,8:150 qwen1.5-moe-a2.7b:3,4:90 gemma-4-26b-a4b:3,4:110; do
  IFS=: read m bits t <<< "$spec"
  s=$(date +%s)
  timeout $t $D --models $m --bits $bits --batches 1,8,32 --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
  s=$(date +%s)
  timeout 60 $D --models $m --bits 4 --batches 1,8 --expert-act-in-down --out $R/decode-$m-actdown.json > $R/decode-$m-actdown.log 2>&1
  echo "$m act-in-down rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 100 $NCU --metrics gpu__time_duration.sum --clock-control none --cache-control none --print-summary per-kernel \
  /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 1 --ctx 512 --steps 2 --warmup 1 \
  --out /tmp/d.json > $R/ncu-decode-mixtral-b1.txt 2>&1
echo "ncu mixtral b1 rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
