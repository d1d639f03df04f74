#!/usr/bin/env bash
# Nsight Compute of the forward kernel at one point (HDIM, SEQLEN; causal with CAUSAL=1): pipe activity
# (tensor, MUFU / XU, FMA, ALU), issue activity and stall reasons per issued instruction, for each variant
# in NAMES (FwdConfig overrides by name, below; default: dispatch and chains4). Session 21: which unit
# limits the hdim 64 softmax (poly8 / poly4 / rowsum need commit c5982a2's switches).
# On the GPU machine after `source .device/setup.sh`; never changes clocks. ~1 min per variant.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
HDIM="${HDIM:-64}"
SEQLEN="${SEQLEN:-8192}"
M='sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'
M+=',sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active'
M+=',sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active'
M+=',sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active'
M+=',smsp__issue_active.avg.pct_of_peak_sustained_active'
M+=',smsp__inst_executed.sum,gpu__time_duration.sum'
M+=',regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
declare -A VARIANTS=(
  [dispatch]=""
  [poly8]="--set exp2_poly_every=8"
  [poly4]="--set exp2_poly_every=4"
  [rowsum]="--set rowsum_mma=true"
  [chains4]="--set row_max_chains=4"
)
for name in ${NAMES:-dispatch chains4}; do
  tag="fwd_hdim${HDIM}_${SEQLEN}${CAUSAL:+_causal}_${name}"
  echo "== $tag"
  # shellcheck disable=SC2086
  timeout -s KILL 120 ncu --clock-control none -k 'regex:Fwd' -c 1 --launch-skip 1 --metrics "$M" --csv \
    python3 scripts/run_one_fwd.py --hdim "$HDIM" --seqlen "$SEQLEN" ${CAUSAL:+--causal} ${VARIANTS[$name]} \
    > "$OUT_DIR/ncu_$tag.csv" 2> "$OUT_DIR/ncu_$tag.err"
  grep -E "pct|ratio|inst_executed|duration" "$OUT_DIR/ncu_$tag.csv" \
    | awk -F'","' '{gsub(/"/, "", $NF); print $(NF-2) ": " $NF}' \
    | awk -F': ' '$0 !~ /ratio/ || $2 + 0 >= 0.05' | sed 's/smsp__average_warps_issue_stalled_//'
done
