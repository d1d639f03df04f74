#!/usr/bin/env bash
# Nsight Compute: tensor-pipe and MUFU/ALU activity of the forward kernel, ping-pong on and off
# (hdim 128, seqlen 8k). On the GPU machine after `source .device/setup.sh`; never changes clocks.
# OVERLAP="true false" profiles each with the intra-warpgroup overlap on, then off (default: on only).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
METRICS=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,\
sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,\
sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
for ov in ${OVERLAP:-true}; do
  for causal in "" "--causal"; do
    for pp in true false; do
      name="hdim128_8k${causal:+_causal}_overlap_${ov}_pingpong_${pp}"
      echo "== $name"
      ncu --clock-control none -k regex:FlashFwdSm90 -c 1 --launch-skip 1 --metrics "$METRICS" \
        --csv python3 scripts/run_one_fwd.py --hdim 128 --seqlen 8192 $causal --set pingpong=$pp \
        --set intra_wg_overlap=$ov > "$OUT_DIR/ncu_$name.csv" 2> "$OUT_DIR/ncu_$name.err"
      grep -E "pct|duration" "$OUT_DIR/ncu_$name.csv" | awk -F'","' '{print $(NF-2), $NF}' | tr -d '"'
    done
  done
done
