#!/bin/bash
# Session 13, GPU run 2 (binary 6f7c4ea): the dense GEMMs at 1..16 tokens, plain vs the matrix
# units (launch shapes compared at 8 tokens), checked first; the decode step of the three
# models with the dense GEMMs off / auto at batch 1, 8, 32; registers of the MMA kernels.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 200 /tmp/pw bench-kernels --device cuda --dense-only --check --launches 30 --out $R/dense.json > $R/dense.log 2>&1
echo "dense rc=$? $(( $(date +%s) - s )) s"
python3 - $R/dense.json <<'PY'
import json,sys
for r in json.load(open(sys.argv[1])):
    if 'check' in r: print('check',r['n'],r['k'],r['tokens'],'%.1e %.1e'%(r['rel_err_plain'],r['rel_err_mma'])); continue
    if r.get('kernel','').startswith('dense'): print(r['model'],r['shape'],r['tokens'],r['variant'],round(r['time_us'],1),round(r['effective_gbps']))
PY
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 200 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 12 --warmup 3 --batches 1,8,32 \
    --dense-mma off,auto,off,auto --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
grep -h tpot $R/decode-*.log | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['model'],r['batch'],r['dense_mma'],round(r['tpot_ms'],3),round(r['fraction_of_bound'],3),r['launches'])"
s=$(date +%s)
timeout 80 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
  --clock-control none --cache-control none --print-summary per-kernel /tmp/pw bench-decode --device cuda --models gemma-4-26b-a4b --bits 4 \
  --batches 8 --ctx 512 --steps 2 --warmup 1 --out /tmp/d.json > $R/ncu-decode-gemma-b8.txt 2>&1
echo "ncu gemma b8 rc=$? $(( $(date +%s) - s )) s"
grep -A12 "dense_mma" $R/ncu-decode-gemma-b8.txt | grep -E "dense_mma|registers|warps_active|duration" | head -20
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
