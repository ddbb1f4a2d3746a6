#!/bin/bash
# Session 13, GPU run 4 (binary 7109acd): the dense GEMMs' launch shapes at 8 tokens (x loaded with
# the weights or just before each step's MMAs, unroll 4 / 8, pipelined), checked first;
# registers and occupancy of the MMA kernels (ncu, Qwen's QKV); the decode step at batch 8 and
# 32 with auto / auto-j / auto-pj (4 bits, ctx 512).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 200 /tmp/pw bench-kernels --device cuda --dense-only --check --launches 30 --out $R/dense.json > $R/dense.log 2>&1
echo "dense rc=$? $(( $(date +%s) - s )) s"
python3 - $R/dense.json <<'PY'
import json,sys
rows={}
for r in json.load(open(sys.argv[1])):
    if 'check' in r: print('check',r['n'],r['k'],r['tokens'],'%.1e %.1e'%(r['rel_err_plain'],r['rel_err_mma'])); continue
    if r.get('kernel','').startswith('dense') and r['tokens']==8:
        rows.setdefault((r['model'],r['shape'],r['tokens']),[]).append('%s %.1f'%(r['variant'],r['time_us']))
for k,v in rows.items(): print(*k,' | '.join(v))
PY
s=$(date +%s)
timeout 60 /usr/local/cuda/bin/ncu -k regex:dense_mma --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,dram__throughput.avg.pct_of_peak_sustained_elapsed \
  --clock-control none --cache-control none --print-summary per-kernel /tmp/pw bench-kernels --device cuda --dense-only --quick --launches 2 --out /tmp/q.json > $R/ncu-dense-quick.txt 2>&1
echo "ncu rc=$? $(( $(date +%s) - s )) s"
grep -E "dense_mma|registers|warps_active|occupancy_limit|dram__|duration" $R/ncu-dense-quick.txt | head -40
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 150 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 12 --warmup 3 --batches 8,32 \
    --dense-mma auto,auto-j,auto-pj,auto --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
grep -h tpot $R/decode-*.log | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['model'],r['batch'],r['dense_mma'],round(r['tpot_ms'],3),round(r['fraction_of_bound'],3),r['launches'])"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
