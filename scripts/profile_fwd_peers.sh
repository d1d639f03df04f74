#!/usr/bin/env bash
# Nsight Compute of the forward kernel at one point: ours (dispatch, and the 2x1 cluster with K/V
# multicast) against FA4's SM90 forward, which ran 5% faster per MHz at hdim 128 non-causal 8k / 16k in
# session 12 (scripts/clock_study.py) with the same tile, stages, register split and step SASS
# (docs/notes/fa4-schedule.md). Tensor pipe, stall reasons per issued instruction, L2 / DRAM traffic.
# On the GPU machine after `source .device/setup.sh`; never changes clocks. ~1 min per variant.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
HDIM="${HDIM:-128}"
SEQLEN="${SEQLEN:-8192}"
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
M+=',sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'
M+=',lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed'
M+=',lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex.sum,dram__bytes_read.sum'
M+=',smsp__inst_executed.sum,gpu__time_duration.sum,sm__cycles_active.avg'
# L2 mode: where the L2 sectors come from (SMs, the fabric between the two L2 partitions) and go
if [ "${L2:-0}" = 1 ]; then
  M='lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum'
  M+=',lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_requests_srcunit_tex.sum'
  M+=',lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum'
  M+=',lts__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,dram__bytes_read.sum'
fi
declare -A VARIANTS=(
  [dispatch]=""
  [cluster]="--set cluster_m=2 --set persistent=false --set dynamic_sched=false"
  [fa4]="--fa4"
  [oq3]="--set o_in_q=true --set num_stages=3"
  [single]="--set persistent=false --set dynamic_sched=false"
  [fa4like]="--set persistent=false --set dynamic_sched=false --set o_in_q=true --set wg_epilogue=false"
  [early_k]="--set late_k_release=false"
  [fa4step]="--set late_k_release=false --set row_sum_scaled_first=true"
)
for name in ${NAMES:-dispatch cluster fa4}; do
  tag="fwd_hdim${HDIM}_${SEQLEN}_${name}"
  echo "== $tag"
  # shellcheck disable=SC2086
  # shellcheck disable=SC2046
  timeout -s KILL 150 ncu --clock-control none -k 'regex:Fwd|Forward' -c 1 --launch-skip 1 \
    $([ "${L2:-0}" = 1 ] || echo --section WarpStateStats) --metrics "$M" --csv \
    python3 scripts/run_one_fwd.py --hdim "$HDIM" --seqlen "$SEQLEN" ${VARIANTS[$name]} \
    > "$OUT_DIR/ncu_$tag.csv" 2> "$OUT_DIR/ncu_$tag.err"
  grep -E "issue_stalled|hmma|lts__|dram__|inst_executed|gpu__time|cycles_active" "$OUT_DIR/ncu_$tag.csv" \
    | awk -F'","' '{gsub(/"/, "", $NF); print $(NF-2) ": " $NF}' | sort -t: -k2 -gr | head -24
done
