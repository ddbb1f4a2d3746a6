#!/bin/bash
# Session 11, GPU run 3: the staged-x expert GEMV's launch shape at Mixtral b1 (ncu per GEMV
# launch: rows per unit 2 / 1, plane words per lane 2 / 1 / 4, warps 8 / 4), binary d542b9a.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
for v in "2 2 8" "1 2 8" "2 1 8" "2 4 8" "2 2 4" "1 2 4"; do
  set -- $v
  s=$(date +%s)
  timeout 60 $NCU --metrics gpu__time_duration.sum,launch__registers_per_thread --clock-control none --cache-control none \
    -k regex:ap_gemv --print-summary per-kernel /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 \
    --batches 1 --ctx 512 --steps 2 --warmup 1 --gemv-x shared --gemv-rows $1 --gemv-words $2 --warps $3 \
    --out $R/d-r$1-j$2-w$3.json > $R/ncu-r$1-j$2-w$3.txt 2>&1
  echo "r$1 j$2 w$3 rc=$? $(( $(date +%s) - s )) s"
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
