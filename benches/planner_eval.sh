#!/usr/bin/env bash
# Reproduces benches/results/planner-eval.{json,md,png} (issues 7, 29): held-out perplexity of
# the shipped tiny-mixtral under expert budgets of 25/30/40/50 % of its FP16 expert bytes, for
# fp16, uniform, the planner (residual head per prompt), the head on the text's mean features
# (a per-block constant), no head, the absolute routing multiplier, no sensitivity, and uniform /
# planner on a second checkpoint quantized with layer-streamed importance. CPU only; release build.
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
# 1. Quantize (3..8 bits, importance from MODEL/calib.txt: Fisher, and layer-streamed input
# moments), 2. train the residual head beside each checkpoint.
Q=$WORK/$(basename "$MODEL")-pw
QS=$WORK/$(basename "$MODEL")-pw-streamed
for IMP in fisher streamed; do
  DIR=$Q; [ "$IMP" = streamed ] && DIR=$QS
  if [ ! -f "$DIR/pagedweight.json" ]; then
    "$PW" quantize --model "$MODEL" --out "$DIR" --importance "$IMP" > "$WORK/quantize-$IMP.json"
  fi
  if [ ! -f "$DIR/residual_head.json" ]; then
    "$TARGET/release/examples/train_residual_head" --model "$MODEL" --out "$DIR" --prompts 240 > "$WORK/head-$IMP.json"
  fi
done

ROWS=$WORK/$NAME.jsonl
: > "$ROWS"
ev() { "$PW" eval-ppl --text "$TEXT" --max-tokens "$MAX_TOKENS" "$@" 2> "$WORK/err.txt"; }
# FP16: the reference and the unit of the budgets.
FP16=$(ev --model "$MODEL" --expert-budget-bytes 1)
echo "$FP16" | tee -a "$ROWS"
FP16_BYTES=$(echo "$FP16" | sed 's/.*"expert_bytes":\([0-9]*\).*/\1/')
for PCT in 25 30 40 50; do
  BUDGET=$((FP16_BYTES * PCT / 100))
  for POLICY in uniform planner planner,text-residual planner,no-residual planner,absolute-routing \
      planner,no-sensitivity streamed:uniform streamed:planner; do
    DIR=$Q; NAME_PREFIX=""
    case "$POLICY" in streamed:*) DIR=$QS; NAME_PREFIX="streamed:"; POLICY=${POLICY#streamed:};; esac
    if LINE=$(ev --model "$DIR" --expert-budget-bytes "$BUDGET" --policy "$POLICY"); then
      LINE=${LINE/\"policy\":\"/\"policy\":\"$NAME_PREFIX}
      echo "{\"budget_pct\":$PCT,${LINE#\{}" | tee -a "$ROWS"
    else
      # Infeasible budgets (below every block at 3 bits) are rows too, with the error.
      ERR=$(grep -v '^ *[0-9]*:\|^ *at \|^Stack backtrace\|^$' "$WORK/err.txt" | head -1 | sed 's/\\/\\\\/g; s/"/\\"/g')
      echo "{\"budget_pct\":$PCT,\"policy\":\"$NAME_PREFIX$POLICY\",\"budget_bytes\":$BUDGET,\"infeasible\":true,\"error\":\"$ERR\"}" | tee -a "$ROWS"
    fi
  done
done
# At 25 % the hot experts' 5-bit floor does not fit: the planner rows again with every floor at
# 3 bits (`--routing-config`), named `floor3:…`.
FLOOR3=$WORK/routing-floor3.json
echo '{"half_life_steps":64.0,"hot_share":2.0,"cold_share":0.5,"hot_floor_bits":3,"warm_floor_bits":3,"cold_floor_bits":3,"hot_multiplier":2.0,"warm_multiplier":1.0,"cold_multiplier":0.5}' > "$FLOOR3"
PCT=25
BUDGET=$((FP16_BYTES * PCT / 100))
for POLICY in planner planner,text-residual planner,no-residual planner,absolute-routing streamed:planner; do
  DIR=$Q; NAME_PREFIX="floor3:"
  case "$POLICY" in streamed:*) DIR=$QS; NAME_PREFIX="floor3:streamed:"; POLICY=${POLICY#streamed:};; esac
  LINE=$(ev --model "$DIR" --expert-budget-bytes "$BUDGET" --policy "$POLICY" --routing-config "$FLOOR3")
  LINE=${LINE/\"policy\":\"/\"policy\":\"$NAME_PREFIX}
  echo "{\"budget_pct\":$PCT,${LINE#\{}" | tee -a "$ROWS"
done
"$TARGET/release/examples/planner_eval_plot" --rows "$ROWS" --png "$OUT/$NAME.png" --json "$OUT/$NAME.json" \
  --md "$OUT/$NAME.table.md" --title "$(basename "$MODEL"): held-out ppl vs expert bytes ($MAX_TOKENS tokens)"
