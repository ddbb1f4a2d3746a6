#!/bin/bash
# Session 13, GPU run 6 (binary d60f6b1, the kernels of the session's head): end to end with the
# dense GEMMs on the matrix units: the shipped tiny Mixtral through the fast path on CUDA (its
# 31-token prompt prefilled in steps of 16 and 15 tokens, so the projections and the LM head run
# on the matrix units), greedy, experts at 8 bits (no planner moves), against the same command
# on wgpu/lavapipe here (plain kernels): `serve-once-wgpu-8bit.txt`.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/pagedweight.xz'),open('/tmp/pw','wb'))" && chmod +x /tmp/pw
R=$OUT/r; mkdir -p $R
timeout 200 /tmp/pw serve --fast --device cuda --bits 8 --max-tokens 48 --once "KING HENRY.
Now, lords, if God doth give successful end
To this debate that bleedeth at our doors," > $R/serve-once-cuda-8bit.txt 2>&1
echo "serve rc=$?"
tail -12 $R/serve-once-cuda-8bit.txt
cd $OUT && tar -cJf r.tar.xz r && rm -rf r
