#!/usr/bin/env bash
# Nsight Compute of the backward main kernel at one head dim: ours (dispatch: since session 10 FA4's
# split with dQ through one smem slot; FA4's tile with the whole dQ tile in smem; the slot with FA4's
# whole step) against FA4's SM90 backward, which ran 1.32-1.38x faster at hdim 192 in the same tile
# shape with an almost identical loop (docs/notes/bwd-hdim192.md), and still 1.05-1.16x after.
# Tensor-pipe activity, stall reasons per issued instruction, L2 reduce traffic, smem bank conflicts.
# On the GPU machine after `source .device/setup.sh`; never changes clocks. ~1 min per variant.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
HDIM="${HDIM:-192}"
SEQLEN="${SEQLEN:-8192}"
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
M+=',sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'
M+=',lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum,lts__t_requests_op_red.sum'
M+=',lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed'
M+=',l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,gpu__time_duration.sum'
FA4_TILE="--set num_consumer_wg=2 --set dkv_by_keys=true --set dq_tma=true --set dq_slots=0 --set do_stages=1
  --set ds_stages=1"
declare -A VARIANTS=(
  [dispatch]=""
  [fa4_tile_dq_tma]="$FA4_TILE"
  [fa4_step_slot]="--set num_consumer_wg=2 --set dkv_by_keys=true --set ds_stages=1 --set dq_tma=true
    --set dq_slots=1 --set pds_swizzle_per_wg=true --set dkv_early=true --set scale_in_ds=true"
  [fa4_kernel]="--fa4"
  # hdim 256: S / dP split by GEMM is the dispatch since session 14; the split by keys before it
  # (session 13's per_wg / roles variants were removed after commit 2cd3768)
  [by_keys]="--set sdp_by_gemm=false"
)
for name in ${NAMES:-dispatch fa4_tile_dq_tma fa4_step_slot fa4_kernel}; do
  tag="bwd_hdim${HDIM}_${SEQLEN}_${name}"
  echo "== $tag"
  # shellcheck disable=SC2086
  timeout -s KILL 150 ncu --clock-control none -k 'regex:FlashBwdWideSm90|FlashBwdSm90|FlashAttentionBackwardSm90' \
    -c 1 --launch-skip 1 --section SpeedOfLight --section WarpStateStats --metrics "$M" --csv \
    python3 scripts/run_one_bwd.py --hdim "$HDIM" --seqlen "$SEQLEN" ${VARIANTS[$name]} \
    > "$OUT_DIR/ncu_$tag.csv" 2> "$OUT_DIR/ncu_$tag.err"
  grep -E "issue_stalled|hmma|lts__|dram__|bank_conflicts|inst_executed|gpu__time" "$OUT_DIR/ncu_$tag.csv" \
    | awk -F'","' '{gsub(/"/, "", $NF); print $(NF-2) ": " $NF}' | sort -t: -k2 -gr | head -22
done
