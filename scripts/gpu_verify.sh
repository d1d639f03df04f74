#!/usr/bin/env bash
# The GPU evidence at a commit, in two device calls of under 10 minutes each on the same warm machine
# (after `source .device/setup.sh`; the kernel cache under .fhcache lives between the calls, and `sweep`
# builds it again where the machine is a fresh one):
#
#   bash scripts/gpu_verify.sh suite   # make gpu-test: precompile every dispatched kernel, the GPU suite
#   bash scripts/gpu_verify.sh sweep   # fuzz (every stratum) beside the three sanitizers over the covering subset
#
# Details go under $OUT (or ./out); each phase ends with a few summary lines. SEED and CASES pick the fuzz.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export FLASHHOPPER_CACHE_DIR=${FLASHHOPPER_CACHE_DIR:-$PWD/.fhcache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
case "${1:-}" in
  suite)
    start=$(date +%s)
    python3 -m flashhopper.cli precompile --bwd --paged --decode --jobs "$(nproc)" > "$OUT/precompile.log" 2>&1
    echo "precompile rc=$? $(( $(date +%s) - start )) s: $(tail -1 "$OUT/precompile.log")"
    start=$(date +%s)
    FLASHHOPPER_JIT=0 FH_REQUIRE_GPU=1 timeout 220 python3 -m pytest -q -m gpu -n 8 tests -p no:cacheprovider \
      > "$OUT/gpu_test.log" 2>&1
    echo "GPU suite rc=$? $(( $(date +%s) - start )) s"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_test.log" | head -30
    tail -1 "$OUT/gpu_test.log"
    ;;
  sweep)
    # a no-op on the kernel cache `suite` left; on a fresh machine it builds what the suite's call built
    start=$(date +%s)
    python3 -m flashhopper.cli precompile --bwd --paged --decode --jobs "$(nproc)" > "$OUT/precompile_sweep.log" 2>&1
    echo "precompile rc=$? $(( $(date +%s) - start )) s: $(tail -1 "$OUT/precompile_sweep.log")"
    export FLASHHOPPER_JIT=0
    start=$(date +%s)
    timeout 480 python3 -m flashhopper.cli fuzz --cases "${CASES:-5000}" --seed "${SEED:-0}" --jobs 8 \
      --json "$OUT/fuzz.json" > "$OUT/fuzz.log" 2>&1 &
    fuzz=$!
    for tool in memcheck synccheck racecheck; do
      timeout 150 compute-sanitizer --tool "$tool" --report-api-errors no python3 scripts/sanitize.py \
        > "$OUT/san_$tool.log" 2>&1
      echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san_$tool.log" | tail -1)"
    done
    wait $fuzz
    echo "fuzz rc=$? $(( $(date +%s) - start )) s: $(tail -1 "$OUT/fuzz.log")"
    ;;
  *)
    echo "usage: bash scripts/gpu_verify.sh suite|sweep" >&2
    exit 2
    ;;
esac
