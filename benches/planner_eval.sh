#!/usr/bin/env bash
# Reproduces benches/results/planner-eval.{json,md,png} (issue 7): held-out perplexity of the
# shipped tiny-mixtral under expert budgets of 30/40/50/60 % of its FP16 expert bytes, for
# fp16, uniform, the planner and its four ablations. CPU only; release build.
#
#   bash benches/planner_eval.sh [MAX_TOKENS]      # default 32768 (the committed table)
#
# SKIP_BUILD=1 uses the binaries already in CARGO_TARGET_DIR.
# Env: MODEL (default assets/tiny-mixtral), WORK (default /tmp/planner-eval), OUT (default
# benches/results), CARGO_TARGET_DIR (default target).
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_TOKENS=${1:-32768}
MODEL=${MODEL:-assets/tiny-mixtral}
WORK=${WORK:-/tmp/planner-eval}
OUT=${OUT:-benches/results}
NAME=${NAME:-planner-eval}
TARGET=${CARGO_TARGET_DIR:-target}
PW=$TARGET/release/pagedweight
TEXT=$MODEL/heldout.txt
mkdir -p "$WORK" "$OUT"

[ -n "${SKIP_BUILD:-}" ] || cargo build --release --bin pagedweight --example planner_eval_plot --example train_residual_head
# 1. Quantize (3..8 bits, Fisher importance from MODEL/calib.txt), 2. train the residual head
# beside the checkpoint.
Q=$WORK/$(basename "$MODEL")-pw
if [ ! -f "$Q/pagedweight.json" ]; then
  "$PW" quantize --model "$MODEL" --out "$Q" > "$WORK/quantize.json"
fi
if [ ! -f "$Q/residual_head.json" ]; then
  "$TARGET/release/examples/train_residual_head" --model "$MODEL" --out "$Q" > "$WORK/head.json"
fi

ROWS=$WORK/$NAME.jsonl
: > "$ROWS"
ev() { "$PW" eval-ppl --text "$TEXT" --max-tokens "$MAX_TOKENS" "$@" 2> "$WORK/err.txt"; }
# FP16: the reference and the unit of the budgets.
FP16=$(ev --model "$MODEL" --expert-budget-bytes 1)
echo "$FP16" | tee -a "$ROWS"
FP16_BYTES=$(echo "$FP16" | sed 's/.*"expert_bytes":\([0-9]*\).*/\1/')
for PCT in 30 40 50 60; do
  BUDGET=$((FP16_BYTES * PCT / 100))
  for POLICY in uniform planner planner,no-routing planner,no-residual planner,no-sensitivity \
      planner,no-routing,no-residual,no-sensitivity; do
    if LINE=$(ev --model "$Q" --expert-budget-bytes "$BUDGET" --policy "$POLICY"); then
      echo "{\"budget_pct\":$PCT,${LINE#\{}" | tee -a "$ROWS"
    else
      # Infeasible budgets (below every block at 3 bits) are rows too, with the error.
      ERR=$(grep -v '^ *[0-9]*:\|^ *at \|^Stack backtrace\|^$' "$WORK/err.txt" | head -1 | sed 's/\\/\\\\/g; s/"/\\"/g')
      echo "{\"budget_pct\":$PCT,\"policy\":\"$POLICY\",\"budget_bytes\":$BUDGET,\"infeasible\":true,\"error\":\"$ERR\"}" | tee -a "$ROWS"
    fi
  done
done
"$TARGET/release/examples/planner_eval_plot" --rows "$ROWS" --png "$OUT/$NAME.png" --json "$OUT/$NAME.json" \
  --md "$OUT/$NAME.table.md" --title "$(basename "$MODEL"): held-out ppl vs expert bytes ($MAX_TOKENS tokens)"
