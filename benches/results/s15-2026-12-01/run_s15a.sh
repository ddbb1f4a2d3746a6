#!/bin/bash
# Prepared in session 15 and NOT run: no device machine was lent that session. For the next
# session's first GPU call (binary built from the commit that adds this script, carried as
# `.carry/pagedweight.xz`; the tracked assets' two model.safetensors must stay behind so the
# tree + carry fit the 64 MiB a call may carry).
# What session 14 built but whose figures were lost with it: the expert GEMV's options on single
# Mixtral blocks (x staged f32 / f16, 24 / 32 warps per SM, plane words a step ahead; checked
# against the CPU reference), then per model the decode step at b1 and b8 with x f32 / f16 and
# prefetch off / on (all combinations, one process), and at b8 and b32 session 15's routed
# items of 2 / 4 tokens with grids for 16 / 24 warps per SM (x f32 / f16): the static SASS
# (`benches/results/sass-gemv.md`) gives Qwen's and Gemma's two-token GEMVs 110–116 registers,
# which leave room for 16 warps where the grid plans 24, and the four-token ones 112–146.
# (Mixtral's down input of 4 tokens fits in shared memory only as f16; in f32 it takes the
# tiled kernel.)
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu.txt 2>&1
s=$(date +%s)
timeout 110 /tmp/pw bench-kernels --device cuda --no-dense --models mixtral --tokens 1,2 --bits 3,4,8 --no-prefill --no-layers \
  --variants gemv,gemv_x_half,gemv_x_half_w32,gemv_prefetch,gemv_x_half_prefetch --check --launches 30 --out $R/gemv-var.json > $R/gemv-var.log 2>&1
echo "gemv variants rc=$? $(( $(date +%s) - s )) s"
grep -h "^check\|relative error" $R/gemv-var.log | awk '{print $2,$4,$5,$6,$NF}' | sort | uniq | head -40
python3 - $R/gemv-var.json <<'PY'
import json,sys
try: recs=json.load(open(sys.argv[1]))
except Exception as e: print(e); sys.exit()
for r in recs:
    if r.get('kernel')=='gemv': print(r['variant'],r['block'],r['tokens'],r['bits'],round(r['time_us'],2),round(r['effective_gbps']))
    elif 'hbm_read_gbps' in r: print('hbm',r['hbm_read_gbps'])
PY
show() { grep -h tpot $1 | python3 -c "
import sys,json
for l in sys.stdin:
    r=json.loads(l); print(r['model'][:8],r['batch'],r['gemv_x'],'pf' if r['gemv_prefetch'] else '--','c%d'%r['route_chunk'],'w%d'%r['gemv_warps_per_sm'],round(r['tpot_ms'],3),round(r['host_ms'],3),round(r['fraction_of_bound'],3))"; }
for m in mixtral-8x7b gemma-4-26b-a4b qwen1.5-moe-a2.7b; do
  s=$(date +%s)
  timeout 100 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 8 --warmup 2 --batches 1,8 --models $m \
    --gemv-x f32,f16 --gemv-prefetch off,on --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"; show $R/decode-$m.log
  s=$(date +%s)
  timeout 110 /tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 8 --warmup 2 --batches 8,32 --models $m \
    --gemv-x f32,f16 --gemv-warps-per-sm 16,24 --route-chunk 2,4 --out $R/chunk-$m.json > $R/chunk-$m.log 2>&1
  echo "$m chunks rc=$? $(( $(date +%s) - s )) s"; show $R/chunk-$m.log
done
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
