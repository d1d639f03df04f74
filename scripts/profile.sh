#!/usr/bin/env bash
# Nsight Compute of one kernel (scripts/run_one.py's arguments after --): tensor-pipe activity,
# stall reasons per issued instruction, L2 / DRAM throughput and reduce traffic, smem bank conflicts.
# On the GPU machine after `source .device/setup.sh`; never changes clocks. CSV under $OUT.
#
#   bash scripts/profile.sh -- --hdim 128 --seqlen 8192 --set pingpong=false
#   bash scripts/profile.sh -- --bwd --hdim 192 --seqlen 8192 --fa4
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,7p' "${BASH_SOURCE[0]}" | cut -c3-
  exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
[ "${1:-}" = "--" ] && shift
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
M+=',regex:sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active'
M+=',sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active'
M+=',sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active'
M+=',lts__t_sectors_op_red.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed'
M+=',dram__throughput.avg.pct_of_peak_sustained_elapsed'
M+=',l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,gpu__time_duration.sum'
tag="$(echo "$*" | tr -c 'a-zA-Z0-9=_' '_' | sed 's/__*/_/g')"
KERNELS='regex:FlashFwdSm90|FlashBwdWideSm90|FlashBwdSm90|FlashAttentionForwardSm90|FlashAttentionBackwardSm90'
timeout -s KILL 300 ncu --clock-control none -k "$KERNELS" -c 1 --launch-skip 1 --metrics "$M" --csv \
  python3 scripts/run_one.py "$@" > "$OUT_DIR/ncu_$tag.csv" 2> "$OUT_DIR/ncu_$tag.err"
grep -E "issue_stalled|pipe|lts__|dram__|bank_conflicts|inst_executed|gpu__time" "$OUT_DIR/ncu_$tag.csv" \
  | awk -F'","' '{gsub(/"/, "", $NF); print $(NF-2) ": " $NF}' | sort -t: -k2 -gr | head -24
echo "csv: $OUT_DIR/ncu_$tag.csv"
