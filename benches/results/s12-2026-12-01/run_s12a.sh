#!/bin/bash
# Session 12, GPU run 1 (binary of 6b74e23's kernels, built for 5b224f0): SASS-level stall
# sampling of Gemma-4's one-cube / few-cube kernels at batch 1, and every kernel's time of a
# Mixtral batch-8 step (where the 700 µs per layer go).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
SECS="--section SourceCounters --section WarpStateStats --section InstructionStats --section SpeedOfLight --section Occupancy --section LaunchStats"
prof() { # name regex skip count timeout -- app args
  local name=$1 rx=$2 skip=$3 cnt=$4 t=$5; shift 5
  local s=$(date +%s)
  timeout $t $NCU -o /tmp/rep-$name -f --kernel-name regex:$rx --launch-skip $skip --launch-count $cnt $SECS "$@" > $R/run-$name.log 2>&1
  echo "ncu $name rc=$? $(( $(date +%s) - s )) s"
  $NCU -i /tmp/rep-$name.ncu-rep --page details --print-details all > $R/details-$name.txt 2>&1
  $NCU -i /tmp/rep-$name.ncu-rep --page source --csv --print-source sass > $R/sass-$name.csv 2>&1
  echo "  sass lines $(wc -l < $R/sass-$name.csv)"
}
DEC="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 1 --warmup 1 --out /tmp/d.json"
prof ffnout gemma_ffn_out 20 1 90 $DEC --models gemma-4-26b-a4b --batches 1
prof routeg 'route_gather_kernel' 20 1 90 $DEC --models gemma-4-26b-a4b --batches 1
prof hnrope head_norm_rope 20 1 90 $DEC --models gemma-4-26b-a4b --batches 1
prof addrms add_rms_norm 20 1 90 $DEC --models gemma-4-26b-a4b --batches 1
s=$(date +%s)
timeout 150 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size --clock-control none \
  --cache-control none --print-summary per-kernel /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 \
  --batches 8 --ctx 512 --steps 2 --warmup 1 --out /tmp/d.json > $R/ncu-decode-mixtral-b8.txt 2>&1
echo "ncu mixtral b8 rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
