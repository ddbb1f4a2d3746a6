#!/bin/bash
# Session 14, GPU run 3 (binary a92dfc8 + test-only changes): the expert GEMV's launch options on
# single Mixtral blocks (x staged f32 / f16, 24 / 32 warps per SM, plane words a step ahead) and
# in the decode step of the three models at b1 and b8 (all combinations, one process per model).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 80 /tmp/pw bench-kernels --device cuda --no-dense --models mixtral --tokens 1,2 --bits 3,4 --no-prefill --no-layers \
  --variants gemv,gemv_x_half,gemv_x_half_w32,gemv_prefetch,gemv_x_half_prefetch --launches 30 --out $R/gemv-var.json > $R/gemv-var.log 2>&1
echo "gemv variants rc=$? $(( $(date +%s) - s )) s"
grep "^gemv" $R/gemv-var.log
for m in mixtral-8x7b gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  s=$(date +%s)
  timeout 150 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 8 --warmup 2 --batches 1,8 --models $m \
    --gemv-x f32,f16 --gemv-warps-per-sm 24,32 --gemv-prefetch off,on --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
  grep -h tpot $R/decode-$m.log | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['model'][:8],r['batch'],r['gemv_x'],r['gemv_warps_per_sm'],'pf' if r['gemv_prefetch'] else '--',round(r['tpot_ms'],3),round(r['fraction_of_bound'],3))"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
