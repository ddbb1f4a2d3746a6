#!/bin/bash
# Session 8, GPU run 1 (binary of b4cf179): per-kernel GPU time of decode steps (ncu, one metric, clocks
# free) for Mixtral b1/b8, Qwen b8, Gemma b1; stall reasons of the GEMV at one token.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
s=$(date +%s)
timeout 60 $NCU --kernel-name regex:ap_gemv --launch-skip 6 --launch-count 1 --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters --print-details all \
  /tmp/pw bench-kernels --device cuda --models mixtral --bits 4 --tokens 1 --no-prefill --launches 5 \
  --out /tmp/k.json > $R/ncu-gemv-stalls.txt 2>&1
echo "ncu gemv rc=$? $(( $(date +%s) - s )) s"
for spec in mixtral-8x7b:1:100 mixtral-8x7b:8:100 qwen1.5-moe-a2.7b:8:80 gemma-4-26b-a4b:1:100; do
  IFS=: read m b t <<< "$spec"
  s=$(date +%s)
  timeout $t $NCU --metrics gpu__time_duration.sum --clock-control none --print-summary per-kernel \
    /tmp/pw bench-decode --device cuda --models $m --bits 4 --batches $b --ctx 512 --steps 2 --warmup 1 \
    --out /tmp/d.json > $R/ncu-decode-$m-b$b.txt 2>&1
  echo "ncu decode $m b$b rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
