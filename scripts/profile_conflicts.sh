#!/usr/bin/env bash
# Which SASS instructions of a kernel cause shared-memory bank conflicts, and where its warps stall:
# ncu's SourceCounters section (excess shared wavefronts and stall samples per instruction), imported
# back as the source page in CSV. Session 10: all 85M bank conflicts of the hdim 192 backward (FA4:
# 4.6M) were the dQ STS.64 (docs/benchmarks.md). Session 15: stall samples by barrier id.
# On the GPU machine after `source .device/setup.sh`; never changes clocks. Each entry of TARGETS is
# DIRECTION:HDIM[:fa4][:causal], e.g.
#   TARGETS="bwd:192 bwd:128" SEQLEN=2048 bash scripts/profile_conflicts.sh        (the default)
#   TARGETS="fwd:128 fwd:128:fa4 bwd:128:fa4 bwd:256" SEQLEN=8192 bash scripts/profile_conflicts.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
SEQLEN="${SEQLEN:-2048}"
for target in ${TARGETS:-bwd:192 bwd:128}; do
  IFS=: read -r direction hdim rest <<< "$target"
  args=(--hdim "$hdim" --seqlen "$SEQLEN")
  [[ ":$rest:" == *":fa4:"* ]] && args+=(--fa4)
  [[ ":$rest:" == *":causal:"* ]] && args+=(--causal)
  if [ "$direction" = fwd ]; then
    kernels='regex:FlashFwdSm90|FlashAttentionForwardSm90'
  else
    kernels='regex:FlashBwdWideSm90|FlashBwdSm90|FlashAttentionBackwardSm90'
  fi
  tag="conflicts_${target//:/_}_$SEQLEN"
  timeout -s KILL 150 ncu --clock-control none -k "$kernels" -c 1 --launch-skip 1 \
    --section SourceCounters -f -o "$OUT_DIR/$tag" \
    python3 "scripts/run_one_$direction.py" "${args[@]}" > "$OUT_DIR/$tag.log" 2>&1
  ncu -i "$OUT_DIR/$tag.ncu-rep" --page source --print-source sass --csv > "$OUT_DIR/$tag.csv" 2>> "$OUT_DIR/$tag.log"
  rm -f "$OUT_DIR/$tag.ncu-rep"  # large; the CSV has what is read here
  echo "== $tag: $(wc -l < "$OUT_DIR/$tag.csv") source rows"
  python3 scripts/top_conflicts.py "$OUT_DIR/$tag.csv" | tee "$OUT_DIR/$tag.top.txt"
  python3 scripts/top_stalls.py "$OUT_DIR/$tag.csv" | tee "$OUT_DIR/$tag.stalls.txt"
done
