#!/bin/bash
# Session 13, GPU run 5 (binary d60f6b1): the dense GEMMs checked and timed (launch shapes at 8
# tokens: 16 or 32 warps per SM); the decode matrix of the three models at 4 bits, ctx 512 and
# 4096, batch 1, 8, 32, dense GEMMs auto-w / auto / off.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 150 /tmp/pw bench-kernels --device cuda --dense-only --check --launches 30 --out $R/dense.json > $R/dense.log 2>&1
echo "dense rc=$? $(( $(date +%s) - s )) s"
python3 - $R/dense.json <<'PY'
import json,sys
rows={}
for r in json.load(open(sys.argv[1])):
    if 'check' in r: print('check',r['n'],r['k'],r['tokens'],'%.1e %.1e'%(r['rel_err_plain'],r['rel_err_mma'])); continue
    if r.get('kernel','').startswith('dense') and r['tokens'] in (4,8,16):
        rows.setdefault((r['model'],r['shape'],r['tokens']),[]).append('%s %.1f'%(r['variant'],r['time_us']))
for k,v in rows.items(): print(*k,' | '.join(v))
PY
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 150 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512,4096 --steps 10 --warmup 3 --batches 1,8,32 \
    --dense-mma auto-w,auto,off --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
grep -h tpot $R/decode-*.log | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['model'],r['ctx'],r['batch'],r['dense_mma'],round(r['tpot_ms'],3),round(r['fraction_of_bound'],3),r['launches'])"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
