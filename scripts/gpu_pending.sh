#!/usr/bin/env bash
# The GPU work waiting at the end of session 5, in four device calls of <= 10 minutes each:
#
#   source .device/setup.sh && bash scripts/gpu_pending.sh tests         # correctness, parallel
#   source .device/setup.sh && bash scripts/gpu_pending.sh fwd_timings   # forward switch A/B, serial
#   source .device/setup.sh && bash scripts/gpu_pending.sh bwd_timings   # backward switch A/B, serial
#   source .device/setup.sh && bash scripts/gpu_pending.sh grids         # forward + backward grids
#
# Most of a timing step is compiling each variant once (~5 s each on the GPU machine); the
# modes interleave variants over rounds so that clock drift shows as spread.
#
# Each step has its own time limit and the whole call a deadline (DEADLINE seconds, default 570),
# so a hang costs one step, not the call. Logs and JSON go to $OUT (or /tmp/fh_out); a short
# summary is printed last. Never changes clocks or GPU settings.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
O="${OUT:-/tmp/fh_out}"
mkdir -p "$O"
T0=$(date +%s)
DEADLINE="${DEADLINE:-570}"
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
bg() {  # name limit cmd...: run in the background with a hard limit
  local name=$1 lim=$2
  shift 2
  (timeout -s KILL "$lim" "$@" >"$O/$name.log" 2>&1; echo "rc=$?" >>"$O/$name.log") &
}
run() {  # name cmd...: run now, within what is left of the deadline
  local name=$1 t
  shift
  t=$(left)
  if [ "$t" -lt 40 ]; then echo "SKIP $name ($t s left)"; return; fi
  echo "== $name ($t s left)"
  timeout -s KILL $((t - 5)) "$@" >"$O/$name.log" 2>&1
  echo "rc=$?" >>"$O/$name.log"
}
quiet() { grep -vE "UserWarning|exe_args|_warn_once" "$@"; }

case "${1:-}" in
tests)
  bg fwd_tests 480 python3 -m pytest -q tests/test_fwd_gpu.py
  bg bwd_tests 480 python3 -m pytest -q tests/test_bwd_gpu.py
  bg bwd80_cases 300 python3 scripts/bwd_check.py --no-bench --case-hdims 128 --bwd-config tile_m=80 \
    --bwd-config tile_m=80,dk_rs=True
  bg bwd80_fp16 300 python3 scripts/bwd_check.py --no-bench --case-hdims 128 --fp16 --bwd-config tile_m=80
  bg bwd64_cases 300 python3 scripts/bwd_check.py --no-bench --case-hdims 64 --bwd-config ds_then_dv=True
  bg mask_runs_cases 300 python3 scripts/bwd_check.py --no-bench --case-hdims 64,96,128 --bwd-config mask_runs=True
  wait
  for f in fwd_tests bwd_tests bwd80_cases bwd80_fp16 bwd64_cases mask_runs_cases; do
    echo "--- $f: $(grep -E 'passed|failed|cases failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    grep -E "^FAILED|^FAIL " "$O/$f.log" | head -8
  done
  ;;
fwd_timings)
  run wg_epilogue python3 scripts/tune_fwd.py wg_epilogue
  run cluster python3 scripts/tune_fwd.py cluster
  run persistent_wide python3 scripts/tune_fwd.py persistent_wide
  echo "== end at $(($(date +%s) - T0)) s"
  for f in wg_epilogue cluster persistent_wide; do
    [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -40; }
  done
  ;;
bwd_timings)
  run bwd80 python3 scripts/bwd_check.py --no-cases --hdims 128 --seqlens 1024,8192 --bwd-config default \
    --bwd-config tile_m=80 --bwd-config tile_m=80,dk_rs=True --bwd-config tile_m=80,ds_stages=2
  run bwd64 python3 scripts/bwd_check.py --no-cases --hdims 64 --seqlens 1024,8192 --bwd-config default \
    --bwd-config ds_then_dv=True --bwd-config ds_then_dv=True,dk_rs=False
  run mask_runs python3 scripts/bwd_check.py --no-cases --hdims 64,128 --seqlens 1024,8192 --bwd-config default \
    --bwd-config mask_runs=True
  run bwd_parts python3 scripts/bwd_parts.py 64,128,256 512,8192
  echo "== end at $(($(date +%s) - T0)) s"
  for f in bwd80 bwd64 mask_runs bwd_parts; do
    [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -16; }
  done
  ;;
grids)
  run bwd_grid python3 -m flashhopper.cli bench --bwd --json "$O/bwd_grid.json"
  run fwd_grid python3 -m flashhopper.cli bench --json "$O/fwd_grid.json"
  run stalls bash scripts/profile_stalls.sh
  echo "== end at $(($(date +%s) - T0)) s"
  for f in bwd_grid fwd_grid; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -5; }; done
  [ -f "$O/stalls.log" ] && quiet "$O/stalls.log" | tail -50
  ;;
*)
  echo "usage: bash scripts/gpu_pending.sh tests|fwd_timings|bwd_timings|grids" >&2
  exit 2
  ;;
esac
