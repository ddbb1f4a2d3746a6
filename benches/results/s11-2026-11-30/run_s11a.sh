#!/bin/bash
# Session 11, GPU run 1: the one-token expert GEMV with x in registers (gemv_xr) against the
# staged-x GEMV: CUDA check + single-block times (bench-kernels), the decode step of the three
# shapes in both modes (bench-decode --gemv-x regs,shared), registers and time per GEMV (ncu).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
s=$(date +%s)
timeout 100 /tmp/pw bench-kernels --device cuda --check --compare-v1 --models mixtral --bits 3,4,8 --tokens 1 \
  --no-prefill --out $R/kernels-mixtral.json > $R/kernels-mixtral.log 2>&1
echo "kernels mixtral rc=$? $(( $(date +%s) - s )) s"
s=$(date +%s)
timeout 60 /tmp/pw bench-kernels --device cuda --check --compare-v1 --models mixtral --bits 4 --tokens 1 --gemv-rows 4 \
  --no-prefill --out $R/kernels-mixtral-rows4.json > $R/kernels-mixtral-rows4.log 2>&1
echo "kernels mixtral rows4 rc=$? $(( $(date +%s) - s )) s"
D="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2 --batches 1,8 --gemv-x regs,shared,regs"
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 90 $D --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 100 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread --clock-control none --cache-control none \
  --print-summary per-kernel /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 1 --ctx 512 \
  --steps 2 --warmup 1 --out /tmp/d.json > $R/ncu-decode-mixtral-b1.txt 2>&1
echo "ncu mixtral b1 rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
