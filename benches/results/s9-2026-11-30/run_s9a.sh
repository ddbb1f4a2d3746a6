#!/bin/bash
# Session 9, GPU run 1 (binary of 26b2e3c): SASS-level stall sampling (ncu SourceCounters) of the
# latency-bound small kernels of a decode step and of the GEMV, to see which instructions wait.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
$NCU --version > $R/ncu-version.txt 2>&1
SECS="--section SourceCounters --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section Occupancy --section LaunchStats"
prof() { # name regex skip count timeout -- app args
  local name=$1 rx=$2 skip=$3 cnt=$4 t=$5; shift 5
  local s=$(date +%s)
  timeout $t $NCU -o /tmp/rep-$name -f --kernel-name regex:$rx --launch-skip $skip --launch-count $cnt $SECS "$@" > $R/run-$name.log 2>&1
  echo "ncu $name rc=$? $(( $(date +%s) - s )) s"
  $NCU -i /tmp/rep-$name.ncu-rep --page details --print-details all > $R/details-$name.txt 2>&1
  $NCU -i /tmp/rep-$name.ncu-rep --page source --csv --print-source sass > $R/sass-$name.csv 2>&1 || \
    $NCU -i /tmp/rep-$name.ncu-rep --page source --csv > $R/sass-$name.csv 2>&1
  echo "  sass lines $(wc -l < $R/sass-$name.csv)"
}
DEC="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 1 --warmup 1 --out /tmp/d.json"
prof router route_gather_router 20 1 90 $DEC --models mixtral-8x7b --batches 1
prof routeq 'route_gather_kernel' 20 1 90 $DEC --models qwen1.5-moe-a2.7b --batches 8
prof attncomb paged_decode_combine 20 1 90 $DEC --models mixtral-8x7b --batches 1
prof dense dense_gemm 64 2 90 $DEC --models mixtral-8x7b --batches 1
prof gemvdec ap_gemv 20 2 90 $DEC --models mixtral-8x7b --batches 1
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
