#!/bin/bash
# Session 8, GPU run 5: GEMV words-per-lane / warps sweep on Mixtral's blocks and layers (4 bits, 1 and
# 2 tokens), decode Mixtral b1/b8 at the default and at 4 words per lane; ncu details of the dense GEMM
# at batch 8 and of the fused router at batch 1.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
for w in 1 2 4; do for wp in 8 4; do
  s=$(date +%s)
  timeout 25 /tmp/pw bench-kernels --device cuda --models mixtral --bits 4 --tokens 1,2 --no-prefill --launches 20 \
    --gemv-words $w --warps $wp --out $R/kernels-w$w-p$wp.json > $R/kernels-w$w-p$wp.log 2>&1
  echo "kernels words $w warps $wp rc=$? $(( $(date +%s) - s )) s"
done; done
for w in 2 4; do
  s=$(date +%s)
  timeout 30 /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 1,8 --ctx 512 \
    --steps 4 --warmup 1 --gemv-words $w --append --out $OUT/decode-words.json > $R/decode-w$w.log 2>&1
  echo "decode words $w rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 30 $NCU --kernel-name regex:dense_gemm --launch-skip 40 --launch-count 2 --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis --print-details all \
  /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 8 --ctx 512 --steps 1 --warmup 1 \
  --out /tmp/d2.json > $R/ncu-dense-b8.txt 2>&1
echo "ncu dense rc=$? $(( $(date +%s) - s )) s"
s=$(date +%s)
timeout 30 $NCU --kernel-name regex:route_gather_router --launch-skip 20 --launch-count 1 --section SpeedOfLight \
  --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --print-details all \
  /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 1 --ctx 512 --steps 1 --warmup 1 \
  --out /tmp/d3.json > $R/ncu-router-b1.txt 2>&1
echo "ncu router rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
