#!/usr/bin/env bash
# Which SASS instructions of the backward main kernel cause shared-memory bank conflicts: ncu's
# SourceCounters section (excess shared wavefronts per instruction), imported back as the source
# page in CSV. Session 10's ncu of the hdim 192 backward counted 85M bank conflicts in ours
# against 4.6M in FA4's (docs/benchmarks.md). On the GPU machine after `source .device/setup.sh`;
# never changes clocks. Usage: HDIMS="192 128" SEQLEN=2048 bash scripts/profile_conflicts.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
for hdim in ${HDIMS:-192 128}; do
  tag="conflicts_hdim${hdim}_${SEQLEN:-2048}"
  timeout -s KILL 150 ncu --clock-control none -k 'regex:FlashBwdWideSm90|FlashBwdSm90' -c 1 --launch-skip 1 \
    --section SourceCounters -f -o "$OUT_DIR/$tag" \
    python3 scripts/run_one_bwd.py --hdim "$hdim" --seqlen "${SEQLEN:-2048}" > "$OUT_DIR/$tag.log" 2>&1
  ncu -i "$OUT_DIR/$tag.ncu-rep" --page source --print-source sass --csv > "$OUT_DIR/$tag.csv" 2>> "$OUT_DIR/$tag.log"
  echo "== $tag: $(wc -l < "$OUT_DIR/$tag.csv") source rows"
  python3 scripts/top_conflicts.py "$OUT_DIR/$tag.csv" | tee "$OUT_DIR/$tag.top.txt"
done
