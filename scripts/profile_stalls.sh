#!/usr/bin/env bash
# Nsight Compute warp-state breakdown of the forward's steady state: where the consumer warps wait
# (tensor pipe, MUFU, barriers, mbarriers), our step schedule against FA4's (docs/notes/
# fa4-schedule.md: its schedule measured 2-10% slower at hdim 128; this is to find out why), and
# FA4's own kernel.
# On the GPU machine after `source .device/setup.sh`; never changes clocks. ~1 min per variant.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
HDIM="${HDIM:-128}"
SEQLEN="${SEQLEN:-16384}"
# the sections alone print only summaries (issue rate, cycles per issued instruction); the stall
# reasons are these per-reason ratios (warps stalled per issued instruction), plus the tensor pipe
STALL_METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
STALL_METRICS+=',sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'
declare -A VARIANTS=(
  [default]=""
  [fa4_pair]="--set late_k_release=false --set row_sum_scaled_first=true"
  [fa4_kernel]="--fa4"
)
for name in default fa4_pair fa4_kernel; do
  tag="hdim${HDIM}_${SEQLEN}_${name}"
  echo "== $tag"
  # shellcheck disable=SC2086
  ncu --clock-control none -k 'regex:FlashFwdSm90|FlashAttentionForwardSm90' -c 1 --launch-skip 1 \
    --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --metrics "$STALL_METRICS" --csv \
    python3 scripts/run_one_fwd.py --hdim "$HDIM" --seqlen "$SEQLEN" ${VARIANTS[$name]} \
    > "$OUT_DIR/stalls_$tag.csv" 2> "$OUT_DIR/stalls_$tag.err"
  # the largest stall reasons (cycles per issued instruction) and the issue rate
  grep -E "issue_stalled|hmma|Issued Warp|No Eligible|Active Warps" "$OUT_DIR/stalls_$tag.csv" \
    | awk -F'","' '{gsub(/"/, "", $NF); print $(NF-2) ": " $NF}' | sort -t: -k2 -gr | head -16
done
