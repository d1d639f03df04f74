#!/usr/bin/env bash
# Check flashhopper on an H100/H200 machine that has no package index.
#
#   source .device/setup.sh      # puts the bundled CuTe DSL (and FA4 as a peer) on PYTHONPATH
#   bash scripts/gpu_check.sh    # from anywhere in the checkout; installs nothing
#
# Runs the GPU tests and the quick benchmark, keeps their logs in ${OUT:-/tmp/fh_out}, and ends
# with a short summary. Exits non-zero when the GPU tests fail (or the benchmark cannot run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT_DIR="${OUT:-/tmp/fh_out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
gpu="${gpu:-none found (nvidia-smi failed)}"
echo "GPU: $gpu"
cutlass_version="$(python3 -c 'import cutlass; print(cutlass.__version__)' 2>&1 | tail -n 1)"
echo "cutlass: $cutlass_version"

echo "== GPU tests =="
python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT_DIR/pytest_gpu.log"
test_rc=${PIPESTATUS[0]}

echo "== Quick benchmark =="
python3 -m flashhopper.cli bench --quick --json "$OUT_DIR/bench_quick.json" 2>&1 | tee "$OUT_DIR/bench_quick.log"
bench_rc=${PIPESTATUS[0]}

echo "== Quick backward benchmark =="
python3 -m flashhopper.cli bench --bwd --quick --json "$OUT_DIR/bench_bwd_quick.json" 2>&1 | tee "$OUT_DIR/bench_bwd_quick.log"
bwd_rc=${PIPESTATUS[0]}

echo
echo "== Summary =="
printf '%-10s %s\n' "GPU" "$gpu" "cutlass" "$cutlass_version"
printf '%-10s %s (exit %s)\n' "tests" "$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT_DIR/pytest_gpu.log" | tail -n 1)" "$test_rc"
printf '%-10s exit %s\n' "bench" "$bench_rc"
printf '%-10s exit %s (backward table: %s)\n' "bench bwd" "$bwd_rc" "$OUT_DIR/bench_bwd_quick.log"
python3 - "$OUT_DIR/bench_quick.json" <<'PY'
import json
import sys

try:
    report = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    print(f"           no benchmark results ({exc})")
    sys.exit(0)
print(f"           bf16 matmul ceiling {report['matmul_tflops']:.0f} TFLOP/s; forward TFLOP/s below")
print(f"{'hdim':>4} {'causal':>6} {'seqlen':>6} {'flashhopper':>11}   {'best peer':<14} {'ratio':>6}")
for r in report["results"]:
    t = r["tflops"]
    peers = {k: v for k, v in t.items() if k in ("cudnn", "fa4") and v}
    best = max(peers, key=peers.get) if peers else None
    fh = f"{t['flashhopper']:.1f}" if t.get("flashhopper") else "-"
    peer = f"{peers[best]:6.1f} ({best})" if best else "-"
    ratio = f"{r['ratio']:.2f}" if r.get("ratio") else "-"
    print(f"{r['hdim']:>4} {'yes' if r['causal'] else 'no':>6} {r['seqlen']:>6} {fh:>11}   {peer:<14} {ratio:>6}")
PY
echo "logs: $OUT_DIR"

if [ "$test_rc" -ne 0 ]; then
  exit "$test_rc"
fi
exit "$bench_rc"
