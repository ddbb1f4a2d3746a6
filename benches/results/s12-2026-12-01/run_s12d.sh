#!/bin/bash
# Session 12, GPU run 4 (binary of the coalesced work-item writes + the multi-plane attention
# combine): decode steps at 4 bits b1 / b8 ctx 512, every kernel's time of Gemma-4 and Qwen
# batch-1 steps, SASS stall sampling of Gemma-4's expert GEMV at batch 1, and Gemma-4 / Qwen
# batch 1 with 1 and 3 plane words per lane in the expert GEMV (default 2), and with the dense
# MLP's activation fused into its down GEMM's loads (2, the default) or a launch of its own (0).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
D="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2 --batches 1,8"
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b mixtral-8x7b; do
  s=$(date +%s)
  timeout 100 $D --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  s=$(date +%s)
  timeout 100 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread --clock-control none \
    --cache-control none --print-summary per-kernel /tmp/pw bench-decode --device cuda --models $m --bits 4 \
    --batches 1 --ctx 512 --steps 2 --warmup 1 --out /tmp/d.json > $R/ncu-decode-$m-b1.txt 2>&1
  echo "ncu $m b1 rc=$? $(( $(date +%s) - s )) s"
done
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  for w in 1 3; do
    s=$(date +%s)
    timeout 60 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2 --batches 1 --models $m \
      --gemv-words $w --out $R/decode-$m-words$w.json > $R/decode-$m-words$w.log 2>&1
    echo "$m words $w rc=$? $(( $(date +%s) - s )) s"
  done
done
for m in gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  s=$(date +%s)
  timeout 80 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2 --batches 1 --models $m \
    --mlp-act-fused-max 2,0,2,0 --out $R/decode-$m-mlpact.json > $R/decode-$m-mlpact.log 2>&1
  echo "$m mlp act rc=$? $(( $(date +%s) - s )) s"
done
SECS="--section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats --section Occupancy --warp-sampling-interval 0 --cache-control none --clock-control none"
s=$(date +%s)
timeout 100 $NCU -o /tmp/rep-gemv -f --kernel-name regex:ap_gemv --launch-skip 20 --launch-count 2 $SECS \
  /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 1 --warmup 1 --out /tmp/d.json --models gemma-4-26b-a4b --batches 1 > $R/run-gemv.log 2>&1
echo "ncu gemv rc=$? $(( $(date +%s) - s )) s"
$NCU -i /tmp/rep-gemv.ncu-rep --page details --print-details all > $R/details-gemv.txt 2>&1
$NCU -i /tmp/rep-gemv.ncu-rep --page source --csv --print-source sass > $R/sass-gemv.csv 2>&1
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
