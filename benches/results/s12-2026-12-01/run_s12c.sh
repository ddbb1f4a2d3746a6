#!/bin/bash
# Session 12, GPU run 3 (binary of run 2): SASS stall sampling at the finest interval of the
# route + gather launch (Gemma-4 and Qwen1.5-MoE, batch 1) and of gemma_ffn_out, caches not flushed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
SECS="--section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats --warp-sampling-interval 0 --cache-control none --clock-control none"
prof() { # name regex skip count timeout -- app args
  local name=$1 rx=$2 skip=$3 cnt=$4 t=$5; shift 5
  local s=$(date +%s)
  timeout $t $NCU -o /tmp/rep-$name -f --kernel-name regex:$rx --launch-skip $skip --launch-count $cnt $SECS "$@" > $R/run-$name.log 2>&1
  echo "ncu $name rc=$? $(( $(date +%s) - s )) s"
  $NCU -i /tmp/rep-$name.ncu-rep --page details --print-details all > $R/details-$name.txt 2>&1
  $NCU -i /tmp/rep-$name.ncu-rep --page source --csv --print-source sass > $R/sass-$name.csv 2>&1
}
DEC="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 1 --warmup 1 --out /tmp/d.json"
prof routeg 'route_gather_kernel' 20 3 90 $DEC --models gemma-4-26b-a4b --batches 1
prof routeq 'route_gather_kernel' 20 3 90 $DEC --models qwen1.5-moe-a2.7b --batches 1
prof ffnout gemma_ffn_out 20 3 90 $DEC --models gemma-4-26b-a4b --batches 1
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
