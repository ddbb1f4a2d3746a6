#!/bin/bash
# Session 14, GPU run 1: the plain dense kernel at one and two tokens with one or two rows per
# plane (PW_DENSE_ROWS), plain and normed input; the expert GEMV with `x` staged as f32 or f16
# (single Mixtral blocks, checked, and the decode step); Mixtral's GEMV with 4 rows, 1 word.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
s=$(date +%s)
timeout 90 /tmp/pw bench-kernels --device cuda --models mixtral --tokens 1,2 --bits 3,4,8 --no-prefill --no-layers \
  --variants gemv,gemv_x_half --check --launches 30 --out $R/gemv-xhalf.json > $R/gemv-xhalf.log 2>&1
echo "gemv x half rc=$? $(( $(date +%s) - s )) s"
grep -h "check\|\"gemv\"" $R/gemv-xhalf.log | python3 -c "
import sys,json
for l in sys.stdin:
    l=l.strip()
    if l.startswith('{'):
        r=json.loads(l)
        if r.get('kernel')=='gemv': print(r['variant'],r['block'],r['tokens'],r['bits'],round(r['time_us'],2),round(r['effective_gbps']))
    else: print(l)"
for rows in 1 2; do
  s=$(date +%s)
  PW_DENSE_ROWS=$rows timeout 80 /tmp/pw bench-kernels --device cuda --dense-only --launches 20 --out $R/dense-rows$rows.json > $R/dense-rows$rows.log 2>&1
  echo "dense rows $rows rc=$? $(( $(date +%s) - s )) s"
done
python3 - $R/dense-rows1.json $R/dense-rows2.json <<'PY'
import json,sys
t={}
for i,f in enumerate(sys.argv[1:]):
    try: recs=json.load(open(f))
    except Exception as e: print(f,e); continue
    for r in recs:
        if r.get('kernel')=='dense_f16' and r['tokens']<=2:
            t.setdefault((r['model'],r['shape'],r['tokens'],r['variant']),[0,0])[i]=r['time_us']
for k,v in t.items(): print(*k, 'rows1 %.1f rows2 %.1f'%tuple(v))
PY
run() { # name, env, args...
  local n=$1; shift; local e=$1; shift; s=$(date +%s)
  env $e timeout 110 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 10 --warmup 3 "$@" --out $R/decode-$n.json > $R/decode-$n.log 2>&1
  echo "$n rc=$? $(( $(date +%s) - s )) s"
  grep -h tpot $R/decode-$n.log | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print('$n',r['model'],r['ctx'],r['batch'],r['gemv_x'],round(r['tpot_ms'],3),round(r['host_ms'],3),round(r['fraction_of_bound'],3),r['launches'])"
}
run mixtral-rows1 PW_DENSE_ROWS=1 --models mixtral-8x7b --batches 1,8 --gemv-x f32,f16
run mixtral-rows2 PW_DENSE_ROWS=2 --models mixtral-8x7b --batches 1,8 --gemv-x f32,f16
run gemma-rows1 PW_DENSE_ROWS=1 --models gemma-4-26b-a4b --batches 1,8 --gemv-x f32,f16
run gemma-rows2 PW_DENSE_ROWS=2 --models gemma-4-26b-a4b --batches 1 --gemv-x f32
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
