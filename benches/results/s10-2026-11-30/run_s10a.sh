#!/bin/bash
# Session 10, GPU run 1: page raisings in the decode path through the CUDA mover (bench-raise:
# exactness on the shipped model, GB/s and step times on Qwen1.5-MoE while raising), and the
# routed experts' activation in the gate_up GEMV's epilogue vs its own launch (bench-decode,
# 4 bits, ctx 512, b1/b8, all three shapes), with per-kernel ncu of Mixtral b1.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
NCU=/usr/local/cuda/bin/ncu
s=$(date +%s)
timeout 150 /tmp/pw bench-raise --device cuda --model qwen1.5-moe-a2.7b --layers 24 --batch 8 --ctx 512 \
  --out $R/raise-qwen.json > $R/raise-qwen.log 2>&1
echo "raise rc=$? $(( $(date +%s) - s )) s"
free -g | head -2
D="/tmp/pw bench-decode --device cuda --bits 4 --ctx 512 --steps 16 --warmup 2 --batches 1,8 --expert-act epilogue,launch"
for m in mixtral-8x7b qwen1.5-moe-a2.7b gemma-4-26b-a4b; do
  s=$(date +%s)
  timeout 80 $D --models $m --out $R/decode-$m.json > $R/decode-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s )) s"
done
s=$(date +%s)
timeout 100 $NCU --metrics gpu__time_duration.sum --clock-control none --cache-control none --print-summary per-kernel \
  /tmp/pw bench-decode --device cuda --models mixtral-8x7b --bits 4 --batches 1 --ctx 512 --steps 2 --warmup 1 \
  --out /tmp/d.json > $R/ncu-decode-mixtral-b1.txt 2>&1
echo "ncu mixtral b1 rc=$? $(( $(date +%s) - s )) s"
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
