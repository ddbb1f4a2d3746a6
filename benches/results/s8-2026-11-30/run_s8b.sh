#!/bin/bash
# Session 8, GPU run 2: decode (three models, 4/3 bits, b1/8/32) after ROUTE_CHUNK 2, the staged-x
# rounds, finer attention splits, the column-parallel combine and the unfused activation above two
# tokens; per-kernel GPU time again (ncu, caches not flushed); ncu details of the dense GEMM at b8.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
for spec in mixtral-8x7b:4,3:90 qwen1.5-moe-a2.7b:4,3:80 gemma-4-26b-a4b:4,3:130; do
  IFS=: read m bits t <<< "$spec"
  s=$(date +%s)
  timeout $t /tmp/pw bench-decode --device cuda --models $m --bits $bits --batches 1,8,32 --ctx 512 \
    --steps 4 --warmup 1 --append --out $OUT/h200-decode.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
for spec in mixtral-8x7b:1:70 mixtral-8x7b:8:70 qwen1.5-moe-a2.7b:8:70; do
  IFS=: read m b t <<< "$spec"
  s=$(date +%s)
  timeout $t $NCU --metrics gpu__time_duration.sum --clock-control none --cache-control none --print-summary per-kernel \
    /tmp/pw bench-decode --device cuda --models $m --bits 4 --batches $b --ctx 512 --steps 2 --warmup 1 \
    --out /tmp/d.json > $R/ncu-decode-$m-b$b.txt 2>&1
  echo "ncu decode $m b$b rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 70 $NCU --kernel-name regex:dense_gemm --launch-skip 200 --launch-count 2 --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
  --section SourceCounters --print-details all \
  /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 8 --ctx 512 --steps 2 --warmup 1 \
  --out /tmp/d2.json > $R/ncu-dense-b8.txt 2>&1
echo "ncu dense rc=$? $(( $(date +%s) - s )) s"
s=$(date +%s)
timeout 60 /tmp/pw bench-kernels --device cuda --models mixtral --bits 3,4,8 --tokens 1,2 --no-prefill \
  --out $OUT/kernels.json > $R/kernels.log 2>&1
echo "kernels rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
