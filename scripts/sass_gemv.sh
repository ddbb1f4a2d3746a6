#!/usr/bin/env bash
# Static SASS of the expert GEMV on sm_90a without a GPU: `pw-bench sass-gemv` writes the
# CUDA C++ of the three models' routed launches, CUDA 13.0's nvcc (the GPU machine's toolkit
# and driver generation: register allocation differs between releases, 13.5 gave the gated
# GEMV 99 registers where 13.0 gives 78) compiles it, cuobjdump disassembles it and
# scripts/sass_gemv.py counts. The toolkit comes from PyPI wheels, installed into $TOOLS once.
# Usage: scripts/sass_gemv.sh OUT_DIR [--tokens 1,2,4]
set -euo pipefail
OUT=${1:?output folder}; shift
TOOLS=${TOOLS:-$HOME/.cache/pagedweight-cuda-13.0}
if [ ! -x "$TOOLS/nvidia/cu13/bin/nvdisasm" ]; then
  # --no-deps: the wheels' unpinned dependencies would pull a newer NVVM.
  python3 -m pip install -q --no-deps --target "$TOOLS" nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 \
    nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51
fi
export PATH="$TOOLS/nvidia/cu13/bin:$PATH"
BIN=${PW_BENCH:-${CARGO_TARGET_DIR:-target}/release/pw-bench}
"$BIN" sass-gemv --out "$OUT" "$@"
python3 "$(dirname "$0")/sass_gemv.py" "$OUT"
