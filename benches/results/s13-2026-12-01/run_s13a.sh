#!/bin/bash
# Session 13, GPU run 1 (binary 208e272): the dense f16 GEMMs on the matrix units (TF32 mma)
# checked against the CPU reference and timed against the plain kernel; then the decode step
# of the three models with and without them (same process, alternating).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 150 /tmp/pw bench-kernels --device cuda --dense-only --check --launches 30 --out $R/dense.json > $R/dense.log 2>&1
echo "dense rc=$? $(( $(date +%s) - s )) s"
tail -3 $R/dense.log
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 150 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 3 --batches 1,8 \
    --dense-mma 0,1,0,1 --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
grep -h tpot $R/decode-*.log | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['model'],r['batch'],r['dense_mma'],round(r['tpot_ms'],3),round(r['fraction_of_bound'],3))"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
