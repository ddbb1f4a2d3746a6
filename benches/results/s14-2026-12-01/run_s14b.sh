#!/bin/bash
# Session 14, GPU run 2 (binary of run 1; run twice, the first call lacked --out for bench-decode and timed out in --check): single Mixtral blocks, GEMV with x staged as f32 or
# f16 (checked); per-kernel device times of Mixtral's decode step at b1 and b8 (ncu), and
# the expert GEMV's pipe / stall metrics at b1 with x staged as f32 and as f16.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
[ -x /tmp/pw ] || { python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw; }
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 100 /tmp/pw bench-kernels --device cuda --no-dense --models mixtral --tokens 1,2 --bits 3,4,8 --no-prefill --no-layers \
  --variants gemv,gemv_x_half --launches 30 --out $R/gemv-xhalf.json > $R/gemv-xhalf.log 2>&1
echo "gemv x half rc=$? $(( $(date +%s) - s )) s"
grep -h "check\|\"gemv\"" $R/gemv-xhalf.log | python3 -c "
import sys,json
for l in sys.stdin:
    l=l.strip()
    if l.startswith('{'):
        r=json.loads(l)
        if r.get('kernel')=='gemv': print(r['variant'],r['block'],r['tokens'],r['bits'],round(r['time_us'],2),round(r['effective_gbps']))
    else: print(l[:160])"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
s=$(date +%s)
PW_DENSE_ROWS=2 timeout 200 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread --clock-control none --cache-control none \
  --print-summary per-kernel /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --ctx 512 --steps 2 --warmup 1 --batches 1,8 --out /tmp/n1.json \
  > $R/ncu-mixtral-b1b8.txt 2>&1
echo "ncu summary rc=$? $(( $(date +%s) - s )) s"
grep -A1 -E "^  [a-z_]+.*Invocations" $R/ncu-mixtral-b1b8.txt | grep -v "^--" | paste - - | awk '{print $1, $2, $3, $NF}' | head -60
M=gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,dram__throughput.avg.pct_of_peak_sustained_elapsed
for x in f32 f16; do
  s=$(date +%s)
  timeout 150 $NCU --metrics $M --clock-control none --cache-control none -k regex:ap_gemv --launch-skip 64 -c 4 \
    /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --ctx 512 --steps 2 --warmup 1 --batches 1 --gemv-x $x --out /tmp/n2.json \
    > $R/ncu-gemv-$x.txt 2>&1
  echo "ncu gemv $x rc=$? $(( $(date +%s) - s )) s"
  grep -E "ap_gemv|gpu__time|registers|warps_active|inst_executed|wavefronts|pipe_lsu|issue_active|stalled|dram__" $R/ncu-gemv-$x.txt | head -60
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
