#!/bin/bash
# Session 11, GPU run 2: gemv_xr after sizing its grid for its registers (one wave), keeping the
# item across units and summing a unit's rows together: single blocks (x in registers vs
# staged, rows per unit 2 / 4, resident warps per SM 21 / 16), the decode step at b1 in both
# modes, registers and time per GEMV launch (ncu).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
K="/tmp/pw bench-kernels --device cuda --models mixtral --tokens 1 --no-prefill --no-layers --compare-v1 --variants gemv,gemv_x_shared"
s=$(date +%s)
timeout 120 $K --check --bits 3,4,8 --out $R/k-r2-w21.json > $R/k-r2-w21.log 2>&1
echo "k r2 w21 rc=$? $(( $(date +%s) - s )) s"
for v in "2 16" "4 21" "4 16" "4 12"; do
  set -- $v
  s=$(date +%s)
  timeout 60 $K --bits 4 --gemv-rows $1 --xr-warps-per-sm $2 --out $R/k-r$1-w$2.json > $R/k-r$1-w$2.log 2>&1
  echo "k r$1 w$2 rc=$? $(( $(date +%s) - s )) s"
done
D="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2 --batches 1 --gemv-x regs,shared,regs"
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 90 $D --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 60 $D --models mixtral-8x7b --gemv-rows 4 --out $R/decode-mixtral-r4.json > $R/decode-mixtral-r4.log 2>&1
echo "mixtral r4 rc=$? $(( $(date +%s) - s )) s"
s=$(date +%s)
timeout 100 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers \
  --clock-control none --cache-control none -k regex:ap_gemv --print-summary per-kernel /tmp/pw bench-decode \
  --device cuda --models mixtral-8x7b --bits 4 --batches 1 --ctx 512 --steps 2 --warmup 1 --gemv-x regs,shared \
  --out /tmp/d.json > $R/ncu-gemv-mixtral-b1.txt 2>&1
echo "ncu mixtral b1 rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
