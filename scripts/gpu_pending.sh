#!/usr/bin/env bash
# GPU work by mode, one device call of <= 10 minutes each. Session 20 ran s20_a (hdim 192 with O in V's
# stages, never timed before; ping-pong on / off at every hdim), s20_b (hdim 192 tests of the new dispatch;
# ping-pong at more lengths), s20_c (the final dispatch's hdim 192 and API tests, the fp16 grid), s20_d
# (fp16 and bf16 grids alternating) and s20_e (the forward suite on the final head); results in
# docs/benchmarks.md, "GPU runs of session 20". Session 21: s21_a (exp2 on the FMA pipe, timing and
# tests), s21_b (row sums by WGMMA), s21_c (ncu of both at hdim 64; s21_a..c need c5982a2's switches),
# s21_d (the row max in 4 chains: waiting, no machine could be started for it).
# Session 24: s24_a (hdim 64 lazy_max at 192 x 64, the ablation), s24_b (lazy64 again, ping-pong with the
# overlap off, the bf16 grid), s24_c (fp16 and bf16 grids, the 5-round ablation, ncu), s24_d (fp16 per MHz).
# Session 25: s25_qearly (hdim 256 backward, BwdConfig.sdp_q_early with one Q stage; the switch lives in
# 4b25238, removed after 32a3003), s25_persist (the wide backward on a persistent grid, de528b8), s25_bgrid
# (the backward grid), s25_diag (hdim 256 without the epilogue, f06fe71).
# Session 26: s26_dvearly (hdim 256 backward, BwdConfig.dv_early), s26_overlap / s26_overlap2 (the
# backward in chunks beside capped preprocess / cast grids, aef4924), s26_l2rev (preprocess and cast in
# reverse order, c5442b3); all three switches live in c5442b3 and were removed after it.
# Session 27: s27_host (the backward's host time, scripts/host_overhead.py --bwd), s27_verify, s27_counter.
# Prepared in session 27, run first in session 28: s27_plan (the dispatch caches' GPU tests).
# Session 28: s28_compile, s28_compile2 (torch.compile and CUDA graphs), s28_graph, s28_probe, s28_probe2, s28_probe3 (a captured step's host time;
# which captures fail).
# Session 29: s29_confirm (the API and compile suites after 0489d30; the hdim 256 backward grid, 3 rounds).
# Session 30: s30_tests (issue 5's GPU checks again at the head), s30_bgrid (the whole backward grid, 2 rounds).
#
#   source .device/setup.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash scripts/gpu_pending.sh MODE
# Both GPUs of nvidia-h200-x2 through `bash scripts/gpu_two.sh MODE0 MODE1` where two modes are ready.
#
# s10_slot256 / s10_slot192: the wide kernel's dQ by TMA reduce-adds through one smem part (dq_tma,
# dq_slots=1) in the dispatched tiles with one P / dS pair, against the dispatch and the same tiles with
# the atomics; cases first under their own limit (a new barrier protocol: a hang costs that step).
# If it wins at 256 (on the grid: 0.91-1.01 of the best peer, target 1.3x), dispatch and rerun s8c_bwd.
# s10_pdl: the backward main kernel launched under the preprocess's tail (BwdConfig.pdl): smoke, timing
# at 512-4k (predicted: a few us a call, +1-3% at 512, nothing at 4k), its tests; then hdim 64 backward
# at 512-2k with 64-row steps (FA4's causal tile; our hdim 64 causal 512 / 1k sit at 0.93 / 0.94).
# s10_accum: the dQ accumulator in (b, h, sq, d) memory order (BwdConfig.dq_accum_head_major; FA4's
# accumulator is per (b, h) too): smoke, timing at every hdim, tests.
# s10_ncu192: ncu of the hdim 192 backward main kernel, ours (3 variants) against FA4's: tensor pipe,
# stall reasons, L2 reduce sectors, smem bank conflicts (why FA4 is 1.32-1.38x faster in the same tile).
# s9_192: hdim 192 backward with FA4's split (BwdConfig.dkv_by_keys, 2 warpgroups), cases and timing
# (run it on GPU 1 after s9_short, or in place of s9_tests_b).
# s9_short: hdim 128 backward at 512-2k with 64-row steps (FA4 takes 64 rows under causal masks; we
# take 80 everywhere, measured better at 1k / 8k in session 6 but never at 512, our weakest point).
# s9_fused: the third fused dQ cast build (converters count the tiles): smoke under its own limit,
# all its tests (incl. the local windows that failed to build in session 8), timing in rounds.
# s9_tests: the backward test variants not rerun since the per-case seeds changed (session 7).
# s9_dqtma192, s9_dqtma256: the wide kernel's dQ by TMA reduce-adds (dq_tma) in FA4's tiles: cases,
# timing against the dispatch and the same tiles with atomics, its GPU tests.
# s9_ftests: the short-causal dispatch's tests, then the forward grid in bf16 and fp16.
# s8c_*: the grids of the final dispatch (backward 2 rounds; forward 2 rounds, then fp16).
# On one GPU: `bash scripts/gpu_pending.sh MODE`. The modes that produced recorded results stay below
# (docs/benchmarks.md names them); those never run were dropped.
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
tests_summary() {  # name...: each pytest log's pass / fail line, exit status and first failures
  local f
  for f in "$@"; do
    [ -f "$O/$f.log" ] || continue
    echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    grep -E "^FAILED" "$O/$f.log" | head -8
  done
}

tests256() {  # name overrides: hdim 256 backward GPU tests (the ones a wide-kernel switch can change,
  # softcap cases left out) with FH_TEST_BWD_OVERRIDES
  local B=tests/test_bwd_gpu.py
  FH_TEST_BWD_OVERRIDES=$2 run "$1" python3 -m pytest -q -rf --tb=short \
    -k "256 and not 128 and not 5.0 and not 3.0 and not 10.0" $B::test_backward $B::test_backward_fp16 \
    $B::test_backward_packed_qkv $B::test_deterministic_is_bitwise_reproducible \
    $B::test_gradient_matches_finite_differences $B::test_backward_pre_zero_dq
}
oinv_tests_then_tune() {  # limit mode: the o_in_v GPU tests under their own limit, then tune_fwd.py MODE
  bg oinv_tests "$1" python3 -m pytest -q -rf --tb=short -x tests/test_fwd_gpu.py -k o_in_v
  wait
  run "$2" python3 scripts/tune_fwd.py "$2"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary oinv_tests
  [ -f "$O/$2.log" ] && quiet "$O/$2.log" | grep -E "TFLOP|FAILED"
}
case "${1:-}" in
failed)  # the named test ids (arguments after the mode), verbose, one process
  shift
  run failed python3 -m pytest -q -rf --tb=short "$@"
  quiet "$O/failed.log" | grep -vE "^ *$" | tail -30
  ;;
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
combos)  # session 6: the backward winners combined, checked then timed; the rest of the bwd tests
  M128=tile_m=80,dk_rs=True,mask_runs=True
  M64=ds_then_dv=True,mask_runs=True
  bg c128 300 python3 scripts/bwd_check.py --no-bench --case-hdims 128 --bwd-config $M128
  bg c128_fp16 300 python3 scripts/bwd_check.py --no-bench --case-hdims 128 --fp16 --bwd-config $M128
  bg c64 300 python3 scripts/bwd_check.py --no-bench --case-hdims 64 --bwd-config $M64
  bg c64_fp16 300 python3 scripts/bwd_check.py --no-bench --case-hdims 64 --fp16 --bwd-config $M64
  [ -f rest_ids.txt ] && bg rest 300 python3 -m pytest -q -rf --tb=line $(cat rest_ids.txt)
  wait
  for f in c128 c128_fp16 c64 c64_fp16 rest; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed|cases failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^FAIL " "$O/$f.log" | head -8
  done
  run t128 python3 scripts/bwd_check.py --no-cases --hdims 128 --seqlens 1024,8192 --bwd-config default \
    --bwd-config tile_m=80,dk_rs=True --bwd-config $M128
  run t64 python3 scripts/bwd_check.py --no-cases --hdims 64 --seqlens 1024,8192 --bwd-config default \
    --bwd-config ds_then_dv=True --bwd-config $M64
  run t96 python3 scripts/bwd_check.py --no-cases --hdims 96 --seqlens 1024,8192 --bwd-config default \
    --bwd-config mask_runs=True
  run wg_epilogue python3 scripts/tune_fwd.py wg_epilogue
  echo "== end at $(($(date +%s) - T0)) s"
  for f in t128 t64 t96; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | grep -E "^ *(64|96|128) "; }; done
  [ -f "$O/wg_epilogue.log" ] && { echo "--- wg_epilogue"; quiet "$O/wg_epilogue.log" | tail -30; }
  ;;
verify)  # session 6: the GPU tests that cover the dispatched kernels, four processes
  B=tests/test_bwd_gpu.py
  bg fwd_a 420 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "not wg_epilogue and not rescale"
  bg fwd_b 420 python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py tests/test_fwd_gpu.py -k "wg_epilogue or rescale or api"
  bg bwd_a 420 python3 -m pytest -q -rf --tb=short $B::test_backward $B::test_backward_fp16 $B::test_backward_packed_qkv
  bg bwd_b 420 python3 -m pytest -q -rf --tb=short $B::test_deterministic_is_bitwise_reproducible \
    $B::test_gradient_matches_finite_differences $B::test_noncontiguous_grad_output \
    $B::test_grad_output_at_unaligned_offset $B::test_unwritten_gradients_show \
    $B::test_hopper_and_reference_backends_agree_through_autograd
  wait
  for f in fwd_a fwd_b bwd_a bwd_b; do
    echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    grep -E "^FAILED|^E  " "$O/$f.log" | head -10
  done
  ;;
fwd_timings)
  run short256 python3 scripts/tune_fwd.py short256
  run ablation_causal python3 -m flashhopper.cli bench --ablation --causal yes
  run ablation python3 -m flashhopper.cli bench --ablation --causal no
  run cluster python3 scripts/tune_fwd.py cluster
  echo "== end at $(($(date +%s) - T0)) s"
  for f in short256 ablation_causal ablation cluster; do
    [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -30; }
  done
  ;;
bwd_timings)
  run sid_cases python3 scripts/bwd_check.py --no-bench --case-hdims 64,96,128,192,256 --bwd-config scale_in_ds=True
  grep -E "cases failed" "$O/sid_cases.log"
  run sid python3 scripts/bwd_check.py --no-cases --hdims 64,128,256 --seqlens 1024,8192 \
    --bwd-config default --bwd-config scale_in_ds=True
  run wide_pds_cases python3 scripts/bwd_check.py --no-bench --case-hdims 192,256 --bwd-config ds_stages=2
  grep -E "cases failed" "$O/wide_pds_cases.log"
  run wide_pds python3 scripts/bwd_check.py --no-cases --hdims 192,256 --seqlens 1024,8192 \
    --bwd-config default --bwd-config ds_stages=2
  run wide_pds64 python3 scripts/bwd_check.py --no-cases --hdims 256 --seqlens 1024,8192 \
    --bwd-config default --bwd-config tile_n=64,do_stages=0,ds_stages=2
  run bwd96 python3 scripts/bwd_check.py --no-cases --hdims 96 --seqlens 1024,8192 --bwd-config default \
    --bwd-config dk_rs=True --bwd-config dk_rs=True,ds_stages=1
  run bwd64 python3 scripts/bwd_check.py --no-cases --hdims 64 --seqlens 1024,8192 \
    --bwd-config default --bwd-config ds_then_dv=True --bwd-config mask_runs=False
  [ -n "${WITH_PARTS:-}" ] && run bwd_parts python3 scripts/bwd_parts.py 64,128,256 512,8192
  echo "== end at $(($(date +%s) - T0)) s"
  for f in sid wide_pds wide_pds64 bwd96 bwd64 bwd_parts; do
    [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -16; }
  done
  ;;
s7_fwd)  # session 7, GPU 0: the causal forward grid with ping-pong off and on, the non-causal grid, tests
  run fwd_causal_pp python3 -m flashhopper.cli bench --causal yes --set pingpong=false --json "$O/fwd_causal_pp.json"
  run fwd_causal python3 -m flashhopper.cli bench --causal yes --json "$O/fwd_causal.json"
  run fwd_nc python3 -m flashhopper.cli bench --causal no --json "$O/fwd_nc.json"
  FH_TEST_FWD_OVERRIDES=pingpong=false run fwd_pp_tests python3 -m pytest -q -rf --tb=short \
    tests/test_fwd_gpu.py tests/test_api_gpu.py -k "not cluster"
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fwd_causal_pp fwd_causal fwd_nc; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -24; }; done
  [ -f "$O/fwd_pp_tests.log" ] && { echo "--- fwd_pp_tests"; grep -E "passed|failed|^FAILED|^rc" "$O/fwd_pp_tests.log" | tail -12; }
  ;;
s8b_fused)  # session 8, second call: the fused dQ cast (BwdConfig.fused_dq_cast), a first test, timing, all tests
  B=tests/test_bwd_gpu.py
  run fused_smoke python3 -m pytest -x -q -rf --tb=short $B -k "test_backward_fused_dq_cast and 4097 and not pre_zero"
  run fused_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,128 --seqlens 512,1024,2048,8192 \
    --bwd-config default --bwd-config fused_dq_cast=True --bwd-config fused_dq_cast=True,pre_zero_dq=True
  run fused_tests python3 -m pytest -q -rf --tb=short $B -k "fused_dq_cast"
  run fused_time96 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 96 --seqlens 512,2048 \
    --bwd-config default --bwd-config fused_dq_cast=True
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fused_smoke fused_tests; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^E  " "$O/$f.log" | head -10
  done
  for f in fused_time fused_time96; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -24; }; done
  ;;
s8b_tests)  # session 8, second call, GPU 1: the backward tests of the dispatch (pre_zero_dq on), two processes
  B=tests/test_bwd_gpu.py
  t=$(($(left) - 10))
  bg disp_a "$t" python3 -m pytest -q -rf --tb=short $B::test_backward $B::test_backward_fp16 $B::test_backward_packed_qkv \
    $B::test_noncontiguous_grad_output $B::test_grad_output_at_unaligned_offset $B::test_unwritten_gradients_show \
    $B::test_hopper_and_reference_backends_agree_through_autograd $B::test_gradient_matches_finite_differences
  bg disp_b "$t" python3 -m pytest -q -rf --tb=short $B::test_deterministic_is_bitwise_reproducible \
    $B::test_backward_pre_zero_dq $B::test_deterministic_wide_one_pds_buffer_is_bitwise_reproducible
  wait
  for f in disp_a disp_b; do
    echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    grep -E "^FAILED|^E  " "$O/$f.log" | head -10
  done
  ;;
s8c_bwd)  # session 8, last call, GPU 0: the backward grid of the final dispatch in 2 rounds
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | tail -42; }
  ;;
s8c_fwd)  # session 8, last call, GPU 1: the forward grid in 2 rounds, then fp16 in 1
  run fwd_grid python3 -m flashhopper.cli bench --rounds 2 --json "$O/fwd_grid.json"
  run fwd_grid_fp16 python3 -m flashhopper.cli bench --dtype fp16 --json "$O/fwd_grid_fp16.json"
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fwd_grid fwd_grid_fp16; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -6; }; done
  ;;
s9_fused)  # fused dQ cast, third build: smoke (own limit), every test, timing in rounds
  B=tests/test_bwd_gpu.py
  bg fused_smoke 150 python3 -m pytest -x -q -rf --tb=short $B -k "test_backward_fused_dq_cast and 4097 and not pre_zero"
  wait
  if grep -qE " passed" "$O/fused_smoke.log" && ! grep -qE "failed" "$O/fused_smoke.log"; then
    run fused_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,96,128 --seqlens 512,2048,8192 \
      --bwd-config default --bwd-config fused_dq_cast=True
    run fused_tests python3 -m pytest -q -rf --tb=short $B -k "fused_dq_cast"
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fused_smoke fused_tests; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^E  " "$O/$f.log" | head -8
  done
  [ -f "$O/fused_time.log" ] && { echo "--- fused_time"; quiet "$O/fused_time.log" | tail -22; }
  ;;
s9_short)  # hdim 128 backward on short sequences with 64-row steps (FA4's causal tile), then the test variants
  run short128 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 128 --seqlens 512,1024,2048 \
    --bwd-config default --bwd-config tile_m=64 --bwd-config tile_m=64,dk_rs=False
  run short128_cases python3 scripts/bwd_check.py --no-bench --case-hdims 128 --bwd-config tile_m=64 \
    --bwd-config tile_m=64,dk_rs=False
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/short128.log" ] && { echo "--- short128"; quiet "$O/short128.log" | tail -10; }
  [ -f "$O/short128_cases.log" ] && { echo "--- short128_cases"; grep -E "FAIL|fail|rc=" "$O/short128_cases.log" | tail -8; }
  ;;
s9_192)  # hdim 192 backward in FA4's shape (dkv_by_keys, 2 warpgroups): cases, then timing in rounds
  run cases192 python3 scripts/bwd_check.py --no-bench --case-hdims 192 --bwd-config num_consumer_wg=2,dkv_by_keys=True \
    --bwd-config num_consumer_wg=2,dkv_by_keys=True,dkv_early=True
  run time192 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 192 --seqlens 1024,4096,8192 \
    --bwd-config default --bwd-config num_consumer_wg=2,dkv_by_keys=True \
    --bwd-config num_consumer_wg=2,dkv_by_keys=True,dkv_early=True \
    --bwd-config num_consumer_wg=2,dkv_by_keys=True,ds_stages=1
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/cases192.log" ] && { echo "--- cases192"; grep -E "FAIL|fail|rc=" "$O/cases192.log" | tail -8; }
  [ -f "$O/time192.log" ] && { echo "--- time192"; quiet "$O/time192.log" | tail -10; }
  ;;
s9_tests|s9_tests_b)  # the backward test variants not rerun since the seeds changed, two processes per GPU
  B=tests/test_bwd_gpu.py
  t=$(($(left) - 10))
  if [ "$1" = s9_tests ]; then
    bg var_a "$t" python3 -m pytest -q -rf --tb=short $B -k "hdim64_variants or dk_rs or dq_per_wg"
    bg var_b "$t" python3 -m pytest -q -rf --tb=short $B -k "scale_in_ds or 80_rows or ds_then_dv or lpt"
  else
    bg var_a "$t" python3 -m pytest -q -rf --tb=short $B -k "mask_runs"
    bg var_b "$t" python3 -m pytest -q -rf --tb=short $B -k "wide"
  fi
  wait
  for f in var_a var_b; do
    echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    grep -E "^FAILED|^E  " "$O/$f.log" | head -10
  done
  ;;
s10_wide)  # session 10, second call: the wide kernel's new dispatch (dQ by TMA reduce-adds through one
  # smem part at hdim 192 / 256): every backward GPU test at those head dims except the atomics-based
  # candidates (unchanged kernels), then the API tests there
  run wide_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py \
    -k "(192 or 256) and not wide_variants and not dq_accum and not pdl"
  run wide_api python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py -k "192 or 256"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary wide_tests wide_api
  ;;
s10_idle)  # session 10: forward warpgroups with no rows below seqlen_q skip their work (FwdConfig.skip_idle_wg)
  run idle_tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k skip_idle_wg
  if grep -qE " passed" "$O/idle_tests.log" && ! grep -qE "failed" "$O/idle_tests.log"; then
    run idle_time python3 scripts/tune_fwd.py idle
    FH_TEST_FWD_OVERRIDES=skip_idle_wg=true run idle_all python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
      -k "not cluster and not wide_key and not skip_idle"
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- idle_tests: $(grep -E 'passed|failed' "$O/idle_tests.log" | tail -1) $(tail -1 "$O/idle_tests.log")"
  grep -E "^FAILED" "$O/idle_tests.log" | head -8
  [ -f "$O/idle_time.log" ] && { echo "--- idle_time"; grep TFLOP "$O/idle_time.log" | sed 's/TFLOP\/s//'; }
  [ -f "$O/idle_all.log" ] && echo "--- idle_all: $(grep -E 'passed|failed' "$O/idle_all.log" | tail -1) $(tail -1 "$O/idle_all.log")"
  ;;
s10_rows)  # session 10, last call (one GPU): dQ rows interleaved in smem (BwdConfig.dq_rows_interleaved)
  # at hdim 192 / 256: cases and the deterministic bit-equality tests (own limits), then timing
  bg rows_cases ${ROWS_CASE_LIM:-200} python3 scripts/bwd_check.py --no-bench --case-hdims ${ROWS_HDIMS:-192,256} \
    --bwd-config dq_rows_interleaved=True
  [ -n "${ROWS_DET:-}" ] && FH_TEST_BWD_OVERRIDES=dq_rows_interleaved=true bg rows_det ${ROWS_DET_LIM:-300} python3 -m pytest -q \
    -rf --tb=short tests/test_bwd_gpu.py -k "(deterministic_is_bitwise and (192 or 256)) or dq_rows_interleaved"
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/rows_cases.log"; then
    run rows_time python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims ${ROWS_HDIMS:-192,256} \
      --seqlens ${ROWS_SEQLENS:-2048,8192} \
      --bwd-config default --bwd-config dq_rows_interleaved=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- rows_cases"; grep -E "^FAIL|failed|rc=" "$O/rows_cases.log" | tail -6
  [ -f "$O/rows_det.log" ] && echo "--- rows_det: $(grep -E 'passed|failed' "$O/rows_det.log" | tail -1)"
  [ -f "$O/rows_time.log" ] && { echo "--- rows_time"; quiet "$O/rows_time.log" | tail -7; }
  ;;
s11_verify)  # session 11, GPU 0: dQ rows interleaved dispatched (hdim 64, 192, 256): every backward GPU
  # test at 192 / 256 except the atomics-based candidates, then the shape list and determinism at all hdims
  run wide_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py \
    -k "(192 or 256) and not wide_variants and not dq_accum and not pdl"
  run main_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py::test_backward
  run all_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py \
    -k "hdim64_variants or dk_rs or dq_per_wg or ds_then_dv or mask_runs or fp16 or packed \
    or finite or deterministic_is_bitwise or deterministic_dq_rows or unwritten"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary wide_tests main_tests all_tests
  ;;
s11_grid)  # session 11, GPU 1: the backward grid of that dispatch (2 rounds), the API tests, then ncu of
  # hdim 256 (ours against FA4's) and the smem conflicts left at 64 / 256
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json"
  run api python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  HDIM=256 NAMES="dispatch fa4_kernel" run ncu256 bash scripts/profile_bwd.sh
  TARGETS="bwd:256 bwd:64" SEQLEN=8192 run conflicts bash scripts/profile_conflicts.sh
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | tail -42; }
  [ -f "$O/api.log" ] && echo "--- api: $(grep -E 'passed|failed' "$O/api.log" | tail -1)"
  [ -f "$O/ncu256.log" ] && tail -48 "$O/ncu256.log"
  [ -f "$O/conflicts.log" ] && grep -E "^==|totals" "$O/conflicts.log"
  ;;
s12_rows128)  # session 12: hdim 128 causal at 64-row steps (bwd_per_call, <= 1k) with dQ rows interleaved
  bg rows128_cases 150 python3 scripts/bwd_check.py --no-bench --case-hdims 128 \
    --bwd-config tile_m=64,dq_rows_interleaved=True
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/rows128_cases.log"; then
    run rows128_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 128 --seqlens 512,1024 \
      --causal yes --bwd-config default --bwd-config dq_rows_interleaved=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- rows128_cases"; grep -E "^FAIL|failed|rc=" "$O/rows128_cases.log" | tail -6
  [ -f "$O/rows128_time.log" ] && { echo "--- rows128_time"; quiet "$O/rows128_time.log" | tail -7; }
  ;;
s12_cluster)  # session 12: the 2x1 cluster with K/V multicast (never timed in rounds) by rate per MHz
  V="--fh-config default --fh-config cluster_m=2,persistent=False,dynamic_sched=False"
  V="$V --fh-config cluster_m=2,persistent=True,dynamic_sched=False"
  run c128 python3 scripts/clock_study.py --rounds 3 --seconds 1.0 --no-matmul $V
  run c128_8k python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --seqlen 8192 $V
  run c128_2k python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --seqlen 2048 $V
  run c256 python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --hdim 256 $V
  run c64 python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --hdim 64 $V
  echo "== end at $(($(date +%s) - T0)) s"
  for f in c128 c128_8k c128_2k c256 c64; do echo "--- $f"; quiet "$O/$f.log" | grep -A5 "^forward"; done
  ;;
s12_l2b)  # session 12, with the last device minutes: s13_l2 trimmed (L2 sectors of fa4like; per MHz)
  L2=1 NAMES="fa4like" run l2 bash scripts/profile_fwd_peers.sh
  run rate python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --no-peers --fh-config default \
    --fh-config persistent=False,dynamic_sched=False,o_in_q=True,wg_epilogue=False
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/l2.log" | grep -E "==|srcunit|gpu__time"; quiet "$O/rate.log" | grep -A3 "^forward"
  ;;
s13_l2)  # session 13: does the hdim 128 forward's L2 sector count follow the K release time? ours with K released
  # right after the QK^T wait (alone, and with FA4's step order) against the dispatch and FA4 (ncu, 8k)
  L2=1 NAMES="dispatch early_k fa4step fa4" run l2 bash scripts/profile_fwd_peers.sh
  NAMES="early_k fa4step" run stalls bash scripts/profile_fwd_peers.sh
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/l2.log" | grep -E "==|srcunit|gpu__time"; quiet "$O/stalls.log" | grep -E "==|hmma|stalled_gmma"
  ;;
s13_ablation)  # issue 4's ablation (FA3 Table 2) by rate per MHz: hdim 128, 8k, each switch off, causal and not
  V="--fh-config default"
  for f in pingpong intra_wg_overlap persistent dynamic_sched reg_realloc wg_epilogue; do V="$V --fh-config $f=False"; done
  run abl_nc python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --no-peers --seqlen 8192 $V
  run abl_c python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --no-peers --seqlen 8192 --causal $V
  echo "== end at $(($(date +%s) - T0)) s"
  for f in abl_nc abl_c; do echo "--- $f"; quiet "$O/$f.log" | grep -A9 "^forward"; done
  ;;
s13_bwd256)  # (needs commit 2cd3768: dq_slot_per_wg and wg_roles were removed after it)
  # session 13: the three hdim 256 backward variants: cases side by side, then the clean ones timed
  # dq_slot_per_wg needs the slot's halves, which the dispatch drops under a local window unless asked
  declare -A CFG=([dq_slot_per_wg]="dq_slot_halves=True,dq_slot_per_wg=True" [sdp_by_gemm]="sdp_by_gemm=True"
                  [wg_roles]="wg_roles=True")
  for v in dq_slot_per_wg sdp_by_gemm wg_roles; do
    # sdp_by_gemm and wg_roles exclude softcap: every variant gets the same cases
    bg "cases_$v" 300 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap \
      --bwd-config "${CFG[$v]}"
  done
  wait
  V="--bwd-config default"; R="--fh-config default"
  for v in dq_slot_per_wg sdp_by_gemm wg_roles; do
    if grep -qE "^0 of [0-9]+ cases failed" "$O/cases_$v.log"; then
      V="$V --bwd-config ${CFG[$v]}"; R="$R --fh-config ${CFG[$v]}"
    fi
  done
  if [ "$V" != "--bwd-config default" ]; then
    run time256 python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 256 --seqlens 2048,8192,16384 $V
    run rate256 python3 scripts/clock_study.py --bwd --hdim 256 --seqlen 8192 --rounds 2 --seconds 1.0 \
      --no-matmul --no-peers $R
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  for v in dq_slot_per_wg sdp_by_gemm wg_roles; do
    echo "--- cases_$v"; grep -E "^FAIL|failed|rc=" "$O/cases_$v.log" | tail -4
  done
  [ -f "$O/time256.log" ] && { echo "--- time256"; quiet "$O/time256.log" | tail -14; }
  [ -f "$O/rate256.log" ] && { echo "--- rate256"; quiet "$O/rate256.log" | grep -A5 "^backward"; }
  ;;
s14_pick256)  # (needs commit 2cd3768: wg_roles was removed after it)
  # session 14: sdp_by_gemm and wg_roles against the dispatch on the whole hdim 256 grid, then their tests
  run pick256 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 \
    --seqlens 512,1024,2048,4096,8192,16384 --bwd-config default --bwd-config sdp_by_gemm=True \
    --bwd-config wg_roles=True
  FH_TEST_EXPERIMENTAL=1 run splits_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py \
    -k "hdim256 and not per_wg"
  B=tests/test_bwd_gpu.py
  for v in sdp_by_gemm wg_roles; do
    FH_TEST_BWD_OVERRIDES=$v=true run "tests_$v" python3 -m pytest -q -rf --tb=short \
      -k "256 and not 128 and not 5.0 and not 3.0 and not 10.0" $B::test_backward $B::test_backward_fp16 \
      $B::test_backward_packed_qkv $B::test_backward_lpt $B::test_deterministic_is_bitwise_reproducible \
      $B::test_gradient_matches_finite_differences $B::test_backward_pre_zero_dq
  done
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/pick256.log" ] && { echo "--- pick256"; quiet "$O/pick256.log" | tail -16; }
  tests_summary splits_tests tests_sdp_by_gemm tests_wg_roles
  ;;
s14_bgrid)  # session 14: the backward grid with sdp_by_gemm dispatched at hdim 256 (2 rounds)
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | tail -8; }
  ;;
s14_verify)  # session 14: every hdim 256 backward GPU test on the new dispatch (sdp_by_gemm), then the API tests
  run verify256 python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "256"
  run api python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary verify256 api
  ;;
s14_close)  # session 14, last: the hdim 256 split-by-keys tests (softcap's kernel, no longer dispatched
  # without softcap) after the variants' removal, then s13_l2 in what is left
  run bykeys python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "hdim256_split_by_keys or (256 and 10.0)"
  L2=1 NAMES="dispatch early_k fa4step fa4" run l2 bash scripts/profile_fwd_peers.sh
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary bykeys
  [ -f "$O/l2.log" ] && { echo "--- l2"; quiet "$O/l2.log" | grep -E "==|srcunit|gpu__time" | head -40; }
  ;;
s14_extra)  # session 14, last minutes: hdim 256 (sdp_by_gemm) with scale_in_ds, and the slot's halves under a
  # local window (they spilled there without sdp_by_gemm, not with it): cases, then scale_in_ds timed
  bg cases_sids 150 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap --bwd-config scale_in_ds=True
  bg cases_halves 150 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap \
    --bwd-config dq_slot_halves=True
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/cases_sids.log"; then
    run sids_time python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 256 --seqlens 2048,8192 \
      --bwd-config default --bwd-config scale_in_ds=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  for f in cases_sids cases_halves; do echo "--- $f"; grep -E "^FAIL|failed|rc=" "$O/$f.log" | tail -4; done
  [ -f "$O/sids_time.log" ] && { echo "--- sids_time"; quiet "$O/sids_time.log" | tail -7; }
  ;;
s17_frag)  # (needs 3ad69d4's dq_frag, measured and removed) hdim 256 backward with dQ by 16-byte
  # vector atomics into a fragment-order accumulator (dq_frag: no smem slot, no writer, no grants;
  # hopper/dq_frag.py), one and two P / dS pairs: cases, then timing against the dispatch and the
  # row-order atomics of the same step (3 rounds)
  AT=dq_tma=False,dq_slots=0,dq_rows_interleaved=False,dq_slot_halves=False,dq_slot_ring=0
  bg frag_cases 300 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap \
    --bwd-config $AT,dq_frag=True --bwd-config $AT,dq_frag=True,ds_stages=2
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/frag_cases.log"; then
    run frag_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 512,2048,8192,16384 \
      --bwd-config default --bwd-config $AT --bwd-config $AT,dq_frag=True --bwd-config $AT,dq_frag=True,ds_stages=2
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- frag_cases"; grep -E "^FAIL|cases failed|rc=" "$O/frag_cases.log" | tail -6
  [ -f "$O/frag_time.log" ] && { echo "--- frag_time"; quiet "$O/frag_time.log" | tail -11; }
  ;;
s17_n64)  # (the grants ahead need 3ad69d4) hdim 256 backward at 64 keys a CTA with sdp_by_gemm and the
  # ring (dq_chunks 2; 206,656 B of smem): room for a ring of 6 boxes (5 reduce-adds read while a
  # warpgroup stores), with and without the grants ahead; less of the diagonal block wasted on short
  # causal sequences. Cases, then timing (3 rounds)
  N64=tile_n=64,dq_chunks=2
  bg n64_cases 300 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap --bwd-config $N64 \
    --bwd-config $N64,dq_slot_ring=6 --bwd-config $N64,dq_slot_ring=6,dq_grant_ahead=True
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/n64_cases.log"; then
    run n64_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 512,1024,2048,8192 \
      --bwd-config default --bwd-config $N64 --bwd-config $N64,dq_slot_ring=6 \
      --bwd-config $N64,dq_slot_ring=6,dq_grant_ahead=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- n64_cases"; grep -E "^FAIL|cases failed|rc=" "$O/n64_cases.log" | tail -6
  [ -f "$O/n64_time.log" ] && { echo "--- n64_time"; quiet "$O/n64_time.log" | tail -11; }
  ;;
s17_ahead)  # (needs 3ad69d4's dq_grant_ahead, measured and removed) hdim 256 backward with the dQ
  # ring's grants ahead (dq_grant_ahead: the half-turns alternate warpgroups and each warpgroup's next
  # box is granted once its previous one is handed over): cases, timing against the dispatch (3 rounds,
  # 1k-16k), then the hdim 256 GPU tests with the override
  bg ahead_cases 200 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap \
    --bwd-config dq_grant_ahead=True
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/ahead_cases.log"; then
    run ahead_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 1024,2048,8192,16384 \
      --bwd-config default --bwd-config dq_grant_ahead=True
    tests256 ahead_tests dq_grant_ahead=true
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- ahead_cases"; grep -E "^FAIL|failed|rc=" "$O/ahead_cases.log" | tail -4
  [ -f "$O/ahead_time.log" ] && { echo "--- ahead_time"; quiet "$O/ahead_time.log" | tail -11; }
  tests_summary ahead_tests
  ;;
s17_dqrs)  # (needs 6852bf9's dq_rs, measured and removed) hdim 256 backward with dQ's A operand (dS)
  # from registers (dq_rs: RS WGMMA, dS read once by ldmatrix instead of once per dQ chunk by the SS
  # WGMMA): cases of dq_rs (2 chunks) and of dq_rs with 4 chunks (one 32-column ring box a part), then
  # timing against the dispatch (3 rounds)
  bg rs_cases 240 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap --bwd-config dq_rs=True
  wait
  bg rs4_cases 240 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap \
    --bwd-config dq_rs=True,dq_chunks=4
  wait
  cfgs=(--bwd-config default)
  grep -qE "^0 of [0-9]+ cases failed" "$O/rs_cases.log" && cfgs+=(--bwd-config dq_rs=True)
  grep -qE "^0 of [0-9]+ cases failed" "$O/rs4_cases.log" && cfgs+=(--bwd-config dq_rs=True,dq_chunks=4)
  [ ${#cfgs[@]} -gt 2 ] && run rs_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 \
    --seqlens 2048,8192,16384 "${cfgs[@]}"
  echo "== end at $(($(date +%s) - T0)) s"
  for f in rs_cases rs4_cases; do echo "--- $f"; grep -E "^FAIL|failed|rc=" "$O/$f.log" | tail -4; done
  [ -f "$O/rs_time.log" ] && { echo "--- rs_time"; quiet "$O/rs_time.log" | tail -9; }
  ;;
s16_lpt)  # causal backward launched longest first at 1k-16k (BwdConfig.lpt; dispatched only at hdim 128 2k-4k),
  # sections of the default 24 MiB and of 96 MiB (s16_order: +3.5% at hdim 256 causal 8k with 96 MiB)
  run lpt_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 1024,2048,4096,8192,16384 \
    --causal yes --bwd-config default --bwd-config lpt=True --bwd-config lpt=True,lpt_l2_kib=98304
  run lpt_time2 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,128 --seqlens 8192,16384 \
    --causal yes --bwd-config default --bwd-config lpt=True --bwd-config lpt=True,lpt_l2_kib=98304
  echo "== end at $(($(date +%s) - T0)) s"
  for f in lpt_time lpt_time2; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -8; }; done
  ;;
s16_verify)  # the new lpt dispatch (hdim 128 causal to 8k, 256 causal 1k-2k): its GPU tests, then the grid
  run lpt_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "lpt"
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary lpt_tests
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | grep -E "^ *(64|128|256) |geomean|matmul" | tail -40; }
  ;;
s16_lpt2)  # s16_lpt again, 5 rounds, where it gained: longest first at hdim 128 causal 8k (+5.4%), 256 causal
  # 1k / 2k (+2.5 / +1.9%), 64 causal 8k (+1.7%); hdim 128 causal 4k is a control (lpt is its dispatch)
  run lpt_a python3 scripts/bwd_check.py --no-cases --rounds 5 --hdims 128 --seqlens 4096,8192,16384 \
    --causal yes --bwd-config default --bwd-config lpt=True
  run lpt_b python3 scripts/bwd_check.py --no-cases --rounds 5 --hdims 64,256 --seqlens 1024,2048,8192 \
    --causal yes --bwd-config default --bwd-config lpt=True
  echo "== end at $(($(date +%s) - T0)) s"
  for f in lpt_a lpt_b; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -8; }; done
  ;;
s16_order)  # the backward's launch order at 8k / 16k: key block fastest (the dispatch: ~one head's CTAs
  # resident, all adding into the same dQ rows in lockstep) against lpt's sections of 4 and 16 (head,
  # batch) pairs with key block slowest (the resident CTAs spread over those heads): is dQ's reduce-add
  # contention or Q / dO sharing in L2 what hdim 128 loses at 16k (0.93 of FA4)?
  run order_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,128,256 --seqlens 8192,16384 \
    --bwd-config default --bwd-config lpt=True,lpt_l2_kib=98304 --bwd-config lpt=True,lpt_l2_kib=393216
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/order_time.log" ] && { echo "--- order_time"; quiet "$O/order_time.log" | tail -16; }
  ;;
s16_boxes192)  # (needs 01a3d80's dq_slot_boxes, measured and removed) hdim 192 backward with the dQ slot in
  # three 32-column boxes (dq_slot_boxes=3): cases,
  # timing against the dispatch (3 rounds, 2k / 8k / 16k, with the peers), then every hdim 192 GPU test
  bg boxes_cases 240 python3 scripts/bwd_check.py --no-bench --case-hdims 192 --bwd-config dq_slot_boxes=3
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/boxes_cases.log"; then
    run boxes_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 192 --seqlens 2048,8192,16384 \
      --bwd-config default --bwd-config dq_slot_boxes=3
    FH_TEST_BWD_OVERRIDES=dq_slot_boxes=3 run boxes_tests python3 -m pytest -q -rf --tb=short \
      tests/test_bwd_gpu.py -k 192
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- boxes_cases"; grep -E "^FAIL|failed|rc=" "$O/boxes_cases.log" | tail -4
  [ -f "$O/boxes_time.log" ] && { echo "--- boxes_time"; quiet "$O/boxes_time.log" | tail -9; }
  tests_summary boxes_tests
  ;;
s16_bulk)  # (needs 4fad727's diag_dq_bulk, not kept) DIAG (wrong dQ, timing only): the writer's dQ boxes as 1-D bulk reduce-adds (UBLKRED, FA4's
  # instruction at 192) into a permuted accumulator in place of the TMA tensor reduce-adds
  run bulk_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 192,256 --seqlens 2048,8192,16384 \
    --bwd-config default --bwd-config diag_dq_bulk=True
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bulk_time.log" ] && { echo "--- bulk_time"; quiet "$O/bulk_time.log" | tail -14; }
  ;;
s16_bgrid)  # the backward grid of session 15's dispatch (2 rounds); the ring against the halves per MHz
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json"
  run ring_rate python3 scripts/clock_study.py --bwd --hdim 256 --seqlen 8192 --rounds 2 --seconds 1.0 \
    --no-matmul --no-peers --fh-config dq_slot_ring=0 --fh-config default
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | grep -E "^ *(64|128|256) |geomean|matmul" | tail -40; }
  [ -f "$O/ring_rate.log" ] && { echo "--- ring_rate"; quiet "$O/ring_rate.log" | grep -E "^round|^fh"; }
  ;;
s15_ring)  # hdim 256 backward with the dQ slot as a ring of three half-size boxes (dq_slot_ring=3): cases,
  # timing against the dispatch (3 rounds), then the hdim 256 GPU tests with the override
  bg ring_cases 200 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap --bwd-config dq_slot_ring=3
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/ring_cases.log"; then
    run ring_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 2048,8192,16384 \
      --bwd-config default --bwd-config dq_slot_ring=3
    tests256 ring_tests dq_slot_ring=3
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- ring_cases"; grep -E "^FAIL|failed|rc=" "$O/ring_cases.log" | tail -4
  [ -f "$O/ring_time.log" ] && { echo "--- ring_time"; quiet "$O/ring_time.log" | tail -9; }
  tests_summary ring_tests
  ;;
s15_verify)  # the new hdim 256 dispatch (dq_slot_ring=3): every hdim 256 backward GPU test
  run verify256 python3 -m pytest -q -rf --tb=short -x tests/test_bwd_gpu.py -k 256
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary verify256
  ;;
s15_stalls)  # where the warps wait, per SASS instruction and named barrier id (ncu source counters, one
  # launch, 8k, non-causal): the hdim 256 backward (which of "P full" 8, "P / dS full" 3, "P / dS free" 2
  # and the dQ slot's grants 9-12 hold its barrier stalls), the hdim 128 one and FA4's hdim 128
  TARGETS="bwd:256 bwd:128 bwd:128:fa4" SEQLEN=8192 run stalls bash scripts/profile_conflicts.sh
  echo "== end at $(($(date +%s) - T0)) s"
  for f in "$O"/*.stalls.txt; do echo "--- $f"; head -24 "$f"; done
  ;;
s15_peers)  # a second sample of the backward grid (2 rounds) on this session's machine; then hdim 128 without
  # a mask, ours against the peers in sustained 1 s streams with the SM clock read (2k, 8k)
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json"
  run rate128_2k python3 scripts/clock_study.py --bwd --hdim 128 --seqlen 2048 --rounds 2 --seconds 1.0 --no-matmul
  run rate128_8k python3 scripts/clock_study.py --bwd --hdim 128 --seqlen 8192 --rounds 2 --seconds 1.0 --no-matmul
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | grep -E "^ *(64|128|256) |geomean|matmul" | tail -40; }
  for f in rate128_2k rate128_8k; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | grep -A6 "^backward"; }; done
  ;;
s15_stagger)  # backward without a mask, each key block's walk over query blocks staggered (stagger_m):
  # its GPU tests, then timing against the dispatch at every grid hdim (3 rounds) and per MHz at hdim 128 16k
  run stagger_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k stagger_m
  if grep -qE "[0-9]+ passed" "$O/stagger_tests.log" && ! grep -qE "[0-9]+ failed" "$O/stagger_tests.log"; then
    run stagger_time python3 scripts/bwd_check.py --no-cases --rounds 3 --causal no --hdims 64,128,256 \
      --seqlens 2048,8192,16384 --bwd-config default --bwd-config stagger_m=True
    run stagger_rate python3 scripts/clock_study.py --bwd --hdim 128 --seqlen 16384 --rounds 2 --seconds 1.0 \
      --no-matmul --no-peers --fh-config default --fh-config stagger_m=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary stagger_tests
  [ -f "$O/stagger_time.log" ] && { echo "--- stagger_time"; quiet "$O/stagger_time.log" | tail -12; }
  [ -f "$O/stagger_rate.log" ] && { echo "--- stagger_rate"; quiet "$O/stagger_rate.log" | grep -A3 "^backward"; }
  ;;
s15_sfirst)  # hdim 256 backward with S issued before dP (sdp_s_first): cases, tests, timing, rate per MHz
  bg sfirst_cases 200 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap \
    --bwd-config sdp_s_first=True
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/sfirst_cases.log"; then
    FH_TEST_EXPERIMENTAL=1 run sfirst_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k sdp_s_first
    run sfirst_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 2048,8192,16384 \
      --bwd-config default --bwd-config sdp_s_first=True
    run sfirst_rate python3 scripts/clock_study.py --bwd --hdim 256 --seqlen 8192 --rounds 2 --seconds 1.0 \
      --no-matmul --no-peers --fh-config default --fh-config sdp_s_first=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- sfirst_cases"; grep -E "^FAIL|failed|rc=" "$O/sfirst_cases.log" | tail -4
  tests_summary sfirst_tests
  [ -f "$O/sfirst_time.log" ] && { echo "--- sfirst_time"; quiet "$O/sfirst_time.log" | tail -9; }
  [ -f "$O/sfirst_rate.log" ] && { echo "--- sfirst_rate"; quiet "$O/sfirst_rate.log" | grep -A3 "^backward"; }
  ;;
s13_ncu256)  # (needs commit 2cd3768 for per_wg / roles: removed after it)
  # session 13: ncu of the hdim 256 backward variants against the dispatch and FA4 (8k, non-causal)
  HDIM=256 NAMES="dispatch per_wg by_gemm roles fa4_kernel" run ncu256 bash scripts/profile_bwd.sh
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/ncu256.log" | grep -E "==|hmma|barrier|long_score|mio|gmma|gpu__time|lts__throughput" | head -60
  ;;
s12_halves)  # session 12: hdim 256 backward with the dQ slot lent in column halves (dq_slot_halves)
  bg halves_cases 200 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --bwd-config dq_slot_halves=True
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/halves_cases.log"; then
    run halves_time python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 256 --seqlens 2048,8192 \
      --bwd-config default --bwd-config dq_slot_halves=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- halves_cases"; grep -E "^FAIL|failed|rc=" "$O/halves_cases.log" | tail -6
  [ -f "$O/halves_time.log" ] && { echo "--- halves_time"; quiet "$O/halves_time.log" | tail -7; }
  ;;
s12_halves_tests)  # session 12: the hdim 256 backward GPU tests with dq_slot_halves on
  B=tests/test_bwd_gpu.py
  FH_TEST_BWD_OVERRIDES=dq_slot_halves=true run halves_tests python3 -m pytest -q -rf --tb=short -k 256 \
    $B::test_backward $B::test_backward_fp16 $B::test_backward_packed_qkv $B::test_backward_lpt \
    $B::test_deterministic_is_bitwise_reproducible $B::test_gradient_matches_finite_differences \
    $B::test_backward_pre_zero_dq
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary halves_tests
  ;;
s12_verify)  # session 12, GPU 1: every hdim 256 backward GPU test on the final dispatch (dq_slot_halves),
  # then the short-causal hdim 128 ones (dq_rows_interleaved at 64-row steps)
  run verify256 python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "256"
  run api python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary verify256 api
  ;;
s12_close)  # session 12, last: dq_slot_halves at 256 by rate per MHz; forward fp16 against bf16 per MHz
  run h256 python3 scripts/clock_study.py --bwd --rounds 3 --seconds 1.0 --no-matmul --no-peers --hdim 256 \
    --seqlen 8192 --fh-config dq_slot_halves=False --fh-config default
  run f16 python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --dtype fp16
  run f16b python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --dtype bf16
  echo "== end at $(($(date +%s) - T0)) s"
  for f in h256 f16 f16b; do echo "--- $f"; quiet "$O/$f.log" | grep -A4 "^backward\|^forward"; done
  ;;
s12_bgrid)  # session 12, last call, GPU 0: the backward grid of the final dispatch (2 rounds)
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | tail -8; }
  ;;
s12_fgrid)  # session 12, last call, GPU 1: the forward grid (2 rounds), then fp16 (1 round)
  run fwd_grid python3 -m flashhopper.cli bench --rounds 2 --json "$O/fwd_grid.json"
  run fwd_grid_fp16 python3 -m flashhopper.cli bench --dtype fp16 --json "$O/fwd_grid_fp16.json"
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fwd_grid fwd_grid_fp16; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -6; }; done
  ;;
s12_oq)  # session 12: hdim 128 forward with O in Q's buffer (o_in_q) and then a third K / V stage, per MHz
  V="--fh-config default --fh-config o_in_q=True --fh-config o_in_q=True,num_stages=3"
  run q16k python3 scripts/clock_study.py --rounds 3 --seconds 1.0 --no-matmul $V
  run q8k python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --seqlen 8192 $V
  run q8kc python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --seqlen 8192 --causal $V
  run q2k python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --seqlen 2048 $V
  run s64 python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --hdim 64 \
    --fh-config default --fh-config num_stages=3
  echo "== end at $(($(date +%s) - T0)) s"
  for f in q16k q8k q8kc q2k s64; do echo "--- $f"; quiet "$O/$f.log" | grep -A5 "^forward"; done
  ;;
s12_oq_b)  # session 12: ncu of o_in_q + 3 stages and of one CTA per tile (hdim 128 8k); their forward tests
  NAMES="oq3 single" run oncu bash scripts/profile_fwd_peers.sh
  FH_TEST_FWD_OVERRIDES=o_in_q=true,num_stages=3 run oq_tests python3 -m pytest -q -rf --tb=short \
    tests/test_fwd_gpu.py -k "seqlens or batch_gqa or local or (hdim_dtype and 128) or persistent"
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/oncu.log" | grep -E "==|hmma|srcunit_tex|inst_exec|gpu__time|stalled_(wait|long|gmma|math|barrier)"
  tests_summary oq_tests
  ;;
s12_l2)  # session 12: L2 sector sources of the forward, ours against FA4 (HDIM env, default 128)
  L2=1 NAMES="dispatch fa4" run l2 bash scripts/profile_fwd_peers.sh
  SEQLEN=16384 L2=1 NAMES="dispatch fa4" run l2_16k bash scripts/profile_fwd_peers.sh
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/l2.log" | tail -30; quiet "$O/l2_16k.log" | tail -30
  ;;
s12_l2_wide)  # session 12: s12_l2 at hdim 256 and 64 (FA4 even with us at 256, 3% ahead at 64)
  HDIM=256 SEQLEN=16384 L2=1 NAMES="dispatch fa4" run l2_256 bash scripts/profile_fwd_peers.sh
  HDIM=64 SEQLEN=16384 L2=1 NAMES="dispatch fa4" run l2_64 bash scripts/profile_fwd_peers.sh
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/l2_256.log" | tail -30; quiet "$O/l2_64.log" | tail -30
  ;;
s12_fncu)  # session 12: ncu of the hdim 128 forward, ours (dispatch, cluster) against FA4's
  run fncu bash scripts/profile_fwd_peers.sh
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/fncu.log" | tail -80
  ;;
s12_fclock)  # session 12: forward variants against FA4 by rate per MHz (clock_study.py, sustained streams)
  V="--fh-config default --fh-config persistent=False,dynamic_sched=False"
  V="$V --fh-config late_k_release=False,row_sum_scaled_first=True --fh-config desc_stage_first=True,row_max_chains=4"
  V="$V --fh-config wg_epilogue=False"
  run f128 python3 scripts/clock_study.py --rounds 3 --seconds 1.0 --no-matmul $V
  run f64c512 python3 scripts/clock_study.py --rounds 3 --seconds 1.0 --no-matmul --hdim 64 --seqlen 512 --causal $V
  run f128_8k python3 scripts/clock_study.py --rounds 2 --seconds 1.0 --no-matmul --seqlen 8192 $V
  echo "== end at $(($(date +%s) - T0)) s"
  for f in f128 f64c512 f128_8k; do echo "--- $f"; quiet "$O/$f.log" | grep -A9 "^forward"; done
  ;;
s12_btests)  # session 12: the short-causal hdim 128 backward dispatch (dQ rows interleaved) on the GPU
  run short_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "short_causal or dq_rows"
  run b256 python3 scripts/clock_study.py --bwd --rounds 2 --seconds 1.0 --no-matmul --hdim 256 --seqlen 8192
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary short_tests
  echo "--- b256"; quiet "$O/b256.log" | grep -A4 "^backward"
  ;;
s12_clock)  # session 12: sustained matmul vs forward rates with SM clock / power read (no settings changed)
  run clock16k python3 scripts/clock_study.py --rounds 3 --seconds 1.5
  run clock8k python3 scripts/clock_study.py --rounds 2 --seconds 1.5 --seqlen 8192
  run tiles python3 scripts/tune_fwd.py tiles
  echo "== end at $(($(date +%s) - T0)) s"
  for f in clock16k clock8k; do echo "--- $f"; quiet "$O/$f.log" | tail -5; done
  echo "--- tiles"; grep TFLOP "$O/tiles.log" | sed 's/TFLOP\/s//'
  ;;
s11_short)  # session 11, last call, GPU 0: the forward's short grid points (tune_fwd.py short, 2 rounds)
  run short python3 scripts/tune_fwd.py short
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- short"; grep TFLOP "$O/short.log" | sed 's/TFLOP\/s//'
  ;;
s11_bwdvar)  # session 11, last call, GPU 1: hdim 96 backward (0.85-0.91 of FA4 in s11_rows_keys) with
  # dk_rs / scale_in_ds (hdim 128's switches), cases first; then scale_in_ds at 192 / 256 on the new dispatch
  bg bwd96_cases 120 python3 scripts/bwd_check.py --no-bench --case-hdims 96 --bwd-config dk_rs=True \
    --bwd-config scale_in_ds=True --bwd-config dk_rs=True,scale_in_ds=True
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/bwd96_cases.log"; then
    run bwd96_time python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 96 --seqlens 2048,8192 \
      --bwd-config default --bwd-config dk_rs=True --bwd-config scale_in_ds=True \
      --bwd-config dk_rs=True,scale_in_ds=True
  fi
  run wide_time python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 192,256 --seqlens 2048,8192 \
    --bwd-config default --bwd-config scale_in_ds=True
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- bwd96_cases"; grep -E "^FAIL|failed|rc=" "$O/bwd96_cases.log" | tail -6
  for f in bwd96_time wide_time; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -9; }; done
  ;;
s11_w256)  # session 11: hdim 256 backward tiles with fewer dQ hand-offs per step (ncu: barrier stalls 6.6 per
  # issued instruction against FA4's 2.6; the one smem part goes round 4 times a step, each time after
  # the previous reduce-add has read it): 64 keys with dQ in one chunk (2 hand-offs of 32 KiB), 48 keys
  # with one chunk and the whole dQ tile in smem (no hand-off waits), 48 keys with one chunk and two dO stages
  A=tile_n=64,dq_chunks=1 B=tile_n=48,dq_chunks=1,do_stages=2 D=tile_n=48,dq_chunks=1,dq_slots=0
  bg w256_cases 240 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --bwd-config $A --bwd-config $B \
    --bwd-config $D
  wait
  run w256_time python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 256 --seqlens 1024,4096,16384 \
    --bwd-config default --bwd-config $A --bwd-config $B --bwd-config $D
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- w256_cases"; grep -E "^FAIL|failed|rc=|overrides" "$O/w256_cases.log" | tail -8
  [ -f "$O/w256_time.log" ] && { echo "--- w256_time"; quiet "$O/w256_time.log" | tail -9; }
  ;;
s11_rest)  # session 11, GPU 1: the keys-kernel tests s11_verify's deadline cut (hdim 64's dispatch changed)
  run rest_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py \
    -k "mask_runs or fp16 or packed or finite or deterministic_is_bitwise or deterministic_dq_rows or unwritten"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary rest_tests
  ;;
s11_rows_keys)  # session 11, second GPU beside s10_rows: the keys kernel (hdim 64 / 96) with its dQ rows
  # interleaved: cases and timing only (s10_rows's ROWS_DET step runs the keys kernel's rows tests)
  ROWS_HDIMS=64,96 ROWS_DET= bash "$0" s10_rows
  ;;
s11_conflicts)  # session 11: per-instruction smem conflicts of the forward (ours, FA4's) at hdim 128 and of
  # the backward at 128 (FA4's: our lowest backward point) and 256, 8k
  TARGETS="fwd:128 fwd:128:fa4 bwd:128:fa4 bwd:256 bwd:192:fa4" SEQLEN=8192 run conflicts \
    bash scripts/profile_conflicts.sh
  echo "== end at $(($(date +%s) - T0)) s"
  grep -vE "Warning|warn" "$O/conflicts.log" | tail -90
  ;;
s10_conflicts)  # session 10: which instructions conflict in smem (ncu SourceCounters), hdim 192 and 128
  run conflicts bash scripts/profile_conflicts.sh
  echo "== end at $(($(date +%s) - T0)) s"
  cat "$O/conflicts.log" | tail -70
  ;;
s10_verify)  # session 10, last call: the final dispatch (forward: idle warpgroups skip; backward 192 / 256:
  # dQ through one smem slot) through the API tests, the forward tests not run with it yet, and
  # test_backward's shape list
  run api python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  run fwd_rest python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "cluster or wide_key or hdim_dtype"
  run bwd_main python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py::test_backward
  run bwd_sids python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "scale_in_ds and 256"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary api fwd_rest bwd_main bwd_sids
  ;;
s10_tiles64)  # session 10: hdim 64 forward, 192 vs 128 rows at 512-4k now that idle warpgroups skip
  # their work (skip_idle_wg; config.fwd_narrow_tile took 128 rows for causal 512 / 1k when 192 padded),
  # then the head-major dQ accumulator (s10_accum)
  run tiles64 python3 scripts/tune_fwd.py tiles64
  echo "--- tiles64"; grep TFLOP "$O/tiles64.log" | sed 's/TFLOP\/s//'
  DEADLINE=$(left) bash "$0" s10_accum
  ;;
s10_pdl)  # session 10: programmatic dependent launch of the backward main kernel (BwdConfig.pdl)
  B=tests/test_bwd_gpu.py
  bg pdl_smoke 150 python3 -m pytest -x -q -rf --tb=short $B -k "test_backward_pdl and 17-17"
  wait
  if grep -qE " passed" "$O/pdl_smoke.log" && ! grep -qE "failed" "$O/pdl_smoke.log"; then
    run pdl_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,128,256 --seqlens 512,1024,4096 \
      --bwd-config default --bwd-config pdl=True
    run pdl_tests python3 -m pytest -q -rf --tb=short $B -k "pdl"
  fi
  # then hdim 64 with FA4's 64-row causal step (we take 128 rows), as s9_short did for hdim 128
  run short64 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64 --seqlens 512,1024,2048 \
    --bwd-config default --bwd-config tile_m=64
  run short64_cases python3 scripts/bwd_check.py --no-bench --case-hdims 64 --bwd-config tile_m=64
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/short64.log" ] && { echo "--- short64"; quiet "$O/short64.log" | tail -8; }
  [ -f "$O/short64_cases.log" ] && { echo "--- short64_cases"; grep -E "FAIL|fail|rc=" "$O/short64_cases.log" | tail -4; }
  for f in pdl_smoke pdl_tests; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^E  " "$O/$f.log" | head -8
  done
  [ -f "$O/pdl_time.log" ] && { echo "--- pdl_time"; quiet "$O/pdl_time.log" | tail -20; }
  ;;
s10_accum)  # session 10: the dQ accumulator in (b, h, sq, d) order (BwdConfig.dq_accum_head_major)
  B=tests/test_bwd_gpu.py
  bg accum_smoke 150 python3 -m pytest -x -q -rf --tb=short $B -k "test_backward_dq_accum_head_major and 17-17"
  wait
  if grep -qE " passed" "$O/accum_smoke.log" && ! grep -qE "failed" "$O/accum_smoke.log"; then
    run accum_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,128,192,256 --seqlens 1024,8192 \
      --bwd-config default --bwd-config dq_accum_head_major=True
    run accum_tests python3 -m pytest -q -rf --tb=short $B -k "head_major"
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  for f in accum_smoke accum_tests; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^E  " "$O/$f.log" | head -8
  done
  [ -f "$O/accum_time.log" ] && { echo "--- accum_time"; quiet "$O/accum_time.log" | tail -20; }
  ;;
s10_ncu192)  # session 10: Nsight Compute of the hdim 192 backward, ours against FA4's (scripts/profile_bwd.sh)
  run ncu192 bash scripts/profile_bwd.sh
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/ncu192.log" ] && tail -100 "$O/ncu192.log"
  ;;
s10_slot192|s10_slot256)  # session 10: dq_tma with one smem dQ part (dq_slots=1) in the dispatched tiles
  # 192 also with FA4's P / dS swizzle (pds_swizzle_per_wg) and its step order (dV^T before the
  # all-consumer barrier: dkv_early) without the dQ scaling pass (scale_in_ds)
  if [ "$1" = s10_slot192 ]; then
    H=192 NEW=num_consumer_wg=2,dkv_by_keys=True,ds_stages=1,dq_tma=True,dq_slots=1
    ALT=num_consumer_wg=2,dkv_by_keys=True,ds_stages=1
    ALL=$NEW,pds_swizzle_per_wg=True,dkv_early=True,scale_in_ds=True
    MORE="--bwd-config $NEW,pds_swizzle_per_wg=True --bwd-config $ALL"
  else
    # and FA4's own hdim 256 tile (64 x 48, one dO stage, one pair) with the whole dQ tile in smem
    H=256 NEW=ds_stages=1,dq_tma=True,dq_slots=1 ALT=ds_stages=1 ALL=tile_n=48,do_stages=1,ds_stages=1,dq_tma=True
    MORE="--bwd-config $NEW,scale_in_ds=True --bwd-config $ALL"
  fi
  bg smoke 150 python3 scripts/bwd_check.py --no-bench --case-hdims $H --bwd-config $NEW --bwd-config $ALL
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/smoke.log"; then
    run time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims $H --seqlens 1024,2048,4096,8192,16384 \
      --bwd-config default --bwd-config $NEW --bwd-config $ALT $MORE
    run det python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "(dq_tma and slot and $H) or (fa4_step and $H) or (fa4_tile and $H)"
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- smoke"; grep -E "^FAIL|failed|rc=" "$O/smoke.log" | tail -8
  [ -f "$O/time.log" ] && { echo "--- time"; quiet "$O/time.log" | tail -12; }
  [ -f "$O/det.log" ] && echo "--- det: $(grep -E 'passed|failed' "$O/det.log" | tail -1) $(tail -1 "$O/det.log")"
  ;;
s9_dqtma192|s9_dqtma256)  # session 9: the wide kernel's dQ by TMA reduce-adds (BwdConfig.dq_tma) in FA4's tiles
  if [ "$1" = s9_dqtma192 ]; then
    H=192 NEW=num_consumer_wg=2,dkv_by_keys=True,dq_tma=True,do_stages=1,ds_stages=1
    ALT=num_consumer_wg=2,dkv_by_keys=True,do_stages=1,ds_stages=1
  else
    H=256 NEW=tile_n=64,num_stages=1,do_stages=1,ds_stages=1,dq_tma=True ALT=tile_n=64,num_stages=1,do_stages=1,ds_stages=1
  fi
  bg smoke 120 python3 scripts/bwd_check.py --no-bench --case-hdims $H --bwd-config $NEW
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/smoke.log"; then
    run time python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims $H --seqlens 1024,4096,8192 \
      --bwd-config default --bwd-config $NEW --bwd-config $ALT
    run det python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "dq_tma and $H"
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- smoke"; grep -E "^FAIL|failed|rc=" "$O/smoke.log" | tail -8
  [ -f "$O/time.log" ] && { echo "--- time"; quiet "$O/time.log" | tail -9; }
  [ -f "$O/det.log" ] && echo "--- det: $(grep -E 'passed|failed' "$O/det.log" | tail -1) $(tail -1 "$O/det.log")"
  ;;
s9_ftests)  # session 9, last call, GPU 1: the new short-causal dispatch's tests, the forward grid (bf16, fp16)
  run short_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "short_causal or test_backward_fp16 or finite"
  run fwd_grid python3 -m flashhopper.cli bench --json "$O/fwd_grid.json"
  run fwd_grid_fp16 python3 -m flashhopper.cli bench --dtype fp16 --json "$O/fwd_grid_fp16.json"
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- short_tests: $(grep -E 'passed|failed' "$O/short_tests.log" | tail -1) $(tail -1 "$O/short_tests.log")"
  grep -E "^FAILED|^E  " "$O/short_tests.log" | head -8
  for f in fwd_grid fwd_grid_fp16; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -6; }; done
  ;;
s8c_one)  # session 8, third call, one GPU: fused dQ cast smoke (own limit: the first build hung), tests, timing
  B=tests/test_bwd_gpu.py
  bg fused_smoke 150 python3 -m pytest -x -q -rf --tb=short $B -k "test_backward_fused_dq_cast and 4097 and not pre_zero"
  wait
  if grep -qE " passed" "$O/fused_smoke.log" && ! grep -qE "failed" "$O/fused_smoke.log"; then
    t=$(($(left) - 170))
    bg fused_tests "$t" python3 -m pytest -q -rf --tb=short $B -k "fused_dq_cast and not pre_zero"
    wait
    run fused_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,128 --seqlens 512,2048,8192 \
      --bwd-config default --bwd-config fused_dq_cast=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fused_smoke fused_tests; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^E  " "$O/$f.log" | head -8
  done
  [ -f "$O/fused_time.log" ] && { echo "--- fused_time"; quiet "$O/fused_time.log" | tail -16; }
  ;;
s8a_bwd)  # session 8, first call, GPU 0: the backward switches not timed yet (rounds), then their tests
  run lpt python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,128,256 --seqlens 512,2048,4096 \
    --bwd-config default --bwd-config lpt=True
  run prezero python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,128,256 --seqlens 512,1024 \
    --bwd-config default --bwd-config pre_zero_dq=True
  run sid python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64,96,192,256 --seqlens 1024,8192 \
    --bwd-config default --bwd-config scale_in_ds=True
  run switch_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "lpt or pre_zero"
  run bwd64 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 64 --seqlens 1024,8192 \
    --bwd-config default --bwd-config ds_then_dv=True --bwd-config mask_runs=False
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/switch_tests.log" ] && { echo "--- switch_tests"; grep -E "passed|failed|^FAILED|^E  " "$O/switch_tests.log" | tail -12; }
  for f in lpt prezero sid bwd64; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -20; }; done
  ;;
s8a_tests)  # session 8, first call, GPU 1: the forward and API test files (new seeds), the dQ probe, backward tests
  run fwd_tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py tests/test_api_gpu.py
  run probe python3 scripts/dq_err_probe.py 10
  run bwd_a python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "not wide and not mask_runs and not lpt and not pre_zero"
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fwd_tests bwd_a; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^E  " "$O/$f.log" | head -10
  done
  [ -f "$O/probe.log" ] && { echo "--- probe"; quiet "$O/probe.log" | tail -16; }
  ;;
s7b_fwd)  # session 7, second call, GPU 0: the causal ablation twice around the forward grids, bf16 and fp16
  run ablation_causal python3 -m flashhopper.cli bench --ablation --causal yes
  run fwd_grid python3 -m flashhopper.cli bench --json "$O/fwd_grid.json"
  run fwd_grid_fp16 python3 -m flashhopper.cli bench --dtype fp16 --json "$O/fwd_grid_fp16.json"
  run ablation_causal2 python3 -m flashhopper.cli bench --ablation --causal yes
  echo "== end at $(($(date +%s) - T0)) s"
  for f in ablation_causal ablation_causal2; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -10; }; done
  for f in fwd_grid fwd_grid_fp16; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -42; }; done
  ;;
s7b_tests)  # session 7, second call, GPU 1: tests of the hdim-256 short causal forward, then the wide backward
  F=tests/test_fwd_gpu.py
  run fwd256 python3 -m pytest -q -rf --tb=short $F -k "256 or short"
  t=$(($(left) - 10))
  if [ "$t" -gt 40 ]; then
    bg wide_a "$t" python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "wide"
    bg runs_b "$t" python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "mask_runs"
    wait
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fwd256 wide_a runs_b; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^E  " "$O/$f.log" | head -10
  done
  ;;
s7_bwd)  # session 7, GPU 1: the backward grid with the new dispatch, then the backward tests of it
  run bwd_grid python3 -m flashhopper.cli bench --bwd --json "$O/bwd_grid.json"
  B=tests/test_bwd_gpu.py
  t=$(($(left) - 10))
  if [ "$t" -gt 40 ]; then
    bg bwd_a "$t" python3 -m pytest -q -rf --tb=short $B::test_backward $B::test_backward_fp16 $B::test_backward_packed_qkv
    bg bwd_b "$t" python3 -m pytest -q -rf --tb=short $B::test_deterministic_is_bitwise_reproducible \
      $B::test_gradient_matches_finite_differences $B::test_noncontiguous_grad_output \
      $B::test_deterministic_scale_in_ds_is_bitwise_reproducible $B::test_deterministic_wide_one_pds_buffer_is_bitwise_reproducible \
      $B::test_hopper_and_reference_backends_agree_through_autograd $B::test_backward_scale_in_ds
    wait
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | tail -44; }
  for f in bwd_a bwd_b; do
    [ -f "$O/$f.log" ] && echo "--- $f: $(grep -E 'passed|failed' "$O/$f.log" | tail -1) $(tail -1 "$O/$f.log")"
    [ -f "$O/$f.log" ] && grep -E "^FAILED|^E  " "$O/$f.log" | head -10
  done
  ;;
s18_twocta)  # (needs 5273aed) session 18: two CTAs per SM, one consumer warpgroup each (FwdConfig.ctas_per_sm), at the
  # forward's short points: occupancy under ncu (that two CTAs are resident), its GPU tests, then
  # tune_fwd.py twocta (dispatch / two CTAs / the same 64-row tile at one CTA, 3 rounds)
  TWO="--set tile_m=64 --set num_consumer_wg=1 --set pingpong=false --set ctas_per_sm=2"
  # shellcheck disable=SC2086
  run occupancy timeout -s KILL 120 ncu --clock-control none -k 'regex:Fwd|Forward' -c 1 \
    --metrics launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum \
    python3 scripts/run_one_fwd.py --hdim 64 --seqlen 512 --causal --iters 1 $TWO
  run twocta_tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k two_ctas
  run twocta python3 scripts/tune_fwd.py twocta
  echo "== end at $(($(date +%s) - T0)) s"
  grep -E "launch__|sm__warps|gpu__time" "$O/occupancy.log" | awk '{print $1, $(NF-1), $NF}'
  tests_summary twocta_tests
  [ -f "$O/twocta.log" ] && quiet "$O/twocta.log" | grep -E "TFLOP|FAILED" | sed -E "s/'(tile_m|num_consumer_wg|pingpong)': [^,}]*,? ?//g"
  ;;
s18_qring)  # session 18: the forward's Q in a ring of two (FwdConfig.q_stages): its GPU tests, then
  # tune_fwd.py qring (dispatch / Q ring / Q ring + a third K / V stage at hdim 64, 3 rounds)
  run qring_tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k q_ring
  run qring python3 scripts/tune_fwd.py qring
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary qring_tests
  [ -f "$O/qring.log" ] && quiet "$O/qring.log" | grep -E "TFLOP|FAILED"
  ;;
s18_qdisp)  # session 18: the dispatch with hdim 64's short Q ring (config._SHORT_QRING): the forward and API
  # GPU suites, then tune_fwd.py qring_limit (old path / dispatched / 4 K-V stages at 512-4k, 3 rounds)
  bg fwd_suite 330 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py
  bg api_suite 330 python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  wait
  run qring_limit python3 scripts/tune_fwd.py qring_limit
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_suite api_suite
  [ -f "$O/qring_limit.log" ] && quiet "$O/qring_limit.log" | grep -E "TFLOP|FAILED"
  ;;
s18_fgrid)  # session 18, last call: the forward tests s18_qdisp's suite did not reach in its limit, then the
  # forward grid of the new dispatch (2 rounds)
  run fwd_rest python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "wg_epilogue or skip_idle or cluster or q_ring or short_qring"
  run fwd_grid python3 -m flashhopper.cli bench --rounds 2 --json "$O/fwd_grid.json" --plot "$O/fwd_grid.png"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_rest
  [ -f "$O/fwd_grid.log" ] && { echo "--- fwd_grid"; quiet "$O/fwd_grid.log" | tail -44; }
  ;;
s18_fp16)  # session 18: fp16 against bf16 interleaved (tune_fwd.py fp16: hdim 64 / 128 / 256 at 8k, 3 rounds),
  # then the fp16 forward grid of the new dispatch (1 round)
  run dtypes python3 scripts/tune_fwd.py fp16
  run fwd_grid_fp16 python3 -m flashhopper.cli bench --dtype fp16 --json "$O/fwd_grid_fp16.json"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/dtypes.log" ] && quiet "$O/dtypes.log" | grep -E "TFLOP|FAILED"
  [ -f "$O/fwd_grid_fp16.log" ] && { echo "--- fwd_grid_fp16"; quiet "$O/fwd_grid_fp16.log" | tail -6; }
  ;;
s18_low)  # session 18: a second sample (3 rounds) of the forward grid's points nearest 0.95 (hdim 64 and 256 at
  # 512 / 1k, both masks), to see whether s18_fgrid's "no point under 0.95" holds
  run low python3 -m flashhopper.cli bench --hdim 64 256 --seqlen 512 1024 --rounds 3 --json "$O/low.json"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/low.log" ] && quiet "$O/low.log" | tail -14
  ;;
s19_oinv)  # session 19: O staged in V's ring (FwdConfig.o_in_v): its GPU tests under their own limit (a new
  # hand-off: a hang costs this step), then tune_fwd.py oinv (O in Q vs in V at hdim 256 / 128, 3 rounds)
  oinv_tests_then_tune 240 oinv
  ;;
s19_oinv2)  # session 19: each warpgroup's O part in a V stage of its own (FwdConfig.o_v_stages): the o_in_v GPU
  # tests under their own limit, then tune_fwd.py oinv2 (O in Q / in V / per V stage, 3 rounds)
  oinv_tests_then_tune 300 oinv2
  ;;
s27_host)  # session 27: the backward's host time per call (108-186 us at the 512-token points in session 26,
  # the forward's 32 us) by hdim / mask / size, the autograd step against SDPA's, and cProfiles
  run host python3 scripts/host_overhead.py --bwd
  quiet "$O/host.log" | grep -vE "^ *$" | head -60
  ;;
s27_plan)  # session 27 (prepared, not run): the forward's and backward's dispatch cached per (dtype, shapes,
  # flags) (runtime._fwd_plan, _bwd_plan), the faster argument checks. The host times against SDPA's first
  # (a quiet host), then in parallel the API suite, the backward shape list and autograd-path tests, and
  # the forward tests of every dispatched path; run with DEADLINE=560 or so
  run host python3 scripts/host_overhead.py --sdpa
  L=$(( $(left) - 10 ))
  F=tests/test_fwd_gpu.py
  bg api $L python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  bg bwd_tests $L python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py::test_backward
  bg autograd_tests $L python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "noncontiguous \
    or unaligned_offset or unwritten or test_deterministic_is_bitwise_reproducible or finite or short_causal \
    or lpt_causal_dispatch or backends_agree"
  bg fwd_a $L python3 -m pytest -q -rf --tb=short $F -k "hdim_dtype or seqlens or batch_gqa or test_local \
    or test_softcap or packed or recompile or without_tvm_ffi"
  bg fwd_b $L python3 -m pytest -q -rf --tb=short $F -k "test_persistent or counter or short_"
  wait
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary api bwd_tests autograd_tests fwd_a fwd_b
  quiet "$O/host.log" | grep -E "step|launch|SDPA|per-call" | head -12
  ;;
s28_probe3)  # session 28: s28_probe2's probe with the early views kept alive
  run probe python3 scripts/graph_capture_probe.py step_h64_views_first sdpa_step_h64_views_first
  quiet "$O/probe.log" | tail -4
  ;;
s28_probe2)  # session 28: the probe's cases with the leaves' first use on the legacy stream (ours and SDPA's),
  # then the captured tiny step of host_overhead.py --graph with SDPA's views made inside its step
  run probe python3 scripts/graph_capture_probe.py step_h64 step_h64_views_first sdpa_step_h64 \
    sdpa_step_h64_views_first
  run host python3 scripts/host_overhead.py --graph
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/probe.log" | tail -6
  quiet "$O/host.log" | grep -E "graph step|per-call|rc=" | head -12
  ;;
s28_probe)  # session 28: which calls capture in a CUDA graph (the tiny step of s28_graph did not)
  run probe python3 scripts/graph_capture_probe.py
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/probe.log" | tail -12
  ;;
s28_graph)  # session 28: the tiny training step captured in a CUDA graph, ours and SDPA's (FA2), replayed
  run host python3 scripts/host_overhead.py --graph
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/host.log" | grep -E "graph step|per-call|rc=" | head -12
  ;;
s30_tests)  # session 30: issue 5's GPU checks at the head before it is reported blocked: the backward shape
  # list at every hdim, determinism, finite differences, strided / unaligned inputs, autograd, the API suite
  B=tests/test_bwd_gpu.py
  L=$(( $(left) - 10 ))
  bg main_tests $L python3 -m pytest -q -rf --tb=short $B::test_backward
  bg autograd_tests $L python3 -m pytest -q -rf --tb=short $B -k "noncontiguous or unaligned_offset \
    or unwritten or test_deterministic_is_bitwise_reproducible or finite or backends_agree or fp16 or packed \
    or lpt_causal_dispatch"
  bg api $L python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  wait
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary main_tests autograd_tests api
  ;;
s30_bgrid)  # session 30: the whole backward grid at the head against the peers, 2 rounds (as s25_bgrid)
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json" --plot "$O/bwd_grid.png"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | tail -42; }
  ;;
s29_confirm)  # session 29: the suites that 0489d30's shared layout check touches (API, torch.compile / graphs),
  # then the hdim 256 backward grid of the head against the peers, 3 rounds
  L=$(( $(left) - 10 ))
  L1=$(( L < 240 ? L : 240 ))
  bg api $L1 python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  bg compile_tests $L1 python3 -m pytest -q -rf --tb=short tests/test_torch_compile_gpu.py tests/test_torch_compile.py
  wait
  run bgrid256 python3 -m flashhopper.cli bench --bwd --hdim 256 --rounds 3 --json "$O/bwd_grid256.json"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary api compile_tests
  [ -f "$O/bgrid256.log" ] && { echo "--- bgrid256"; quiet "$O/bgrid256.log" | tail -18; }
  ;;
s28_compile2)  # session 28, after s28_compile: the tile counters allocated by a helper thread (out of the
  # CUDA graph pools of torch.compile's reduce-overhead warm-up); the same tests less the backward's
  L=$(( $(left) - 10 ))
  bg compile_tests $L python3 -m pytest -q -rf --tb=short tests/test_torch_compile_gpu.py tests/test_torch_compile.py
  bg api $L python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  bg counter_tests $L python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "counter or dynamic_scheduler"
  wait
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary compile_tests api counter_tests
  ;;
s28_compile)  # session 28: flash_attn_func under torch.compile (custom operators, flashhopper/ops.py) and in
  # CUDA graphs (a tile counter per captured launch), the CPU stand-in tests too; in parallel the API suite
  # and the scheduler-counter tests (the interface and runtime._tile_counter changed)
  L=$(( $(left) - 10 ))
  bg compile_tests $L python3 -m pytest -q -rf --tb=short tests/test_torch_compile_gpu.py tests/test_torch_compile.py
  bg api $L python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  bg counter_tests $L python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "counter or dynamic_scheduler"
  # the backward's unused semaphore argument is now a view of the LSE rows, not a cached tensor
  bg bwd_tests $L python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py::test_backward
  wait
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary compile_tests api counter_tests bwd_tests
  ;;
s27_counter)  # session 27: the forward's tile counter keyed by the raw stream handle (runtime._tile_counter):
  # the scheduler-counter tests (streams included) and the API suite, then the host times against SDPA's
  bg counter_tests 300 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "counter"
  bg api 300 python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  wait
  run host python3 scripts/host_overhead.py --bwd
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary counter_tests api
  quiet "$O/host.log" | grep -E "host time|period|step|launch|torch|SDPA|per-call" | head -30
  ;;
s27_verify)  # session 27: autograd without a zero-filled LSE gradient a step, LSE / D rows in one allocation
  # (interface.py, runtime.backward): the backward shape list at every hdim, the autograd-path tests and
  # the API suite, in parallel; then s27_host's measurement again and the 512-token backward points (the
  # step no longer fills a (b, h, sq) zero tensor: predicted +0.5..1% there)
  B=tests/test_bwd_gpu.py
  bg main_tests 420 python3 -m pytest -q -rf --tb=short $B::test_backward
  bg autograd_tests 420 python3 -m pytest -q -rf --tb=short $B -k "noncontiguous or unaligned_offset \
    or unwritten or test_deterministic_is_bitwise_reproducible or finite or backends_agree or fp16 or packed \
    or lpt_causal_dispatch"
  bg api 420 python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  wait
  run host python3 scripts/host_overhead.py --bwd
  run b512 python3 -m flashhopper.cli bench --bwd --hdim 64 256 --seqlen 512 --rounds 3
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary main_tests autograd_tests api
  [ -f "$O/b512.log" ] && quiet "$O/b512.log" | tail -8
  quiet "$O/host.log" | grep -E "host time|period|step|launch|torch" | head -30
  ;;
s26_overlap)  # the backward in chunks (BwdConfig.overlap_chunks): later preprocesses and earlier dQ casts
  # on a high-priority side stream with capped grids, beside the main kernels. Tests first (a new stream
  # protocol), then timing at hdim 256 (3 rounds) and 64 / 128 (2 rounds). Predicted at 512: +5..+12%
  # (up to ~90 us of the ~120 us of preprocess and cast hidden, less the SMs they take), ~+1% at 8k.
  bg ov_tests 200 python3 -m pytest -q -rf --tb=short -x tests/test_bwd_gpu.py -k "overlap or pre_zero_dq"
  wait
  if grep -qE "passed" "$O/ov_tests.log" && ! grep -qE "failed|error" "$O/ov_tests.log"; then
    OV="--bwd-config default --bwd-config overlap_chunks=2 --bwd-config overlap_chunks=4 \
      --bwd-config overlap_chunks=4,overlap_ctas=32"
    run ov_time256 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 \
      --seqlens 512,1024,2048,8192 $OV
    run ov_time128 python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 64,128 --seqlens 512,2048 $OV
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary ov_tests
  for f in ov_time256 ov_time128; do
    [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | grep -vE "overrides" | tail -14; }
  done
  ;;
s26_overlap2)  # after s26_overlap: the padded accumulator (hdim 256) in the chunks, narrow() views, two
  # side-stream switches a call; tests, the timeline with host time per call, timing at 512-2k
  bg ov_tests 200 python3 -m pytest -q -rf --tb=short -x tests/test_bwd_gpu.py -k "overlap"
  wait
  if grep -qE "passed" "$O/ov_tests.log" && ! grep -qE "failed|error" "$O/ov_tests.log"; then
    run ov_trace python3 scripts/overlap_trace.py 256:1:512 256:0:1024 128:0:512
    run ov_time256 python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 256 --seqlens 512,1024,2048 \
      --bwd-config default --bwd-config overlap_chunks=2 --bwd-config overlap_chunks=4 \
      --bwd-config overlap_chunks=2,overlap_ctas=32
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary ov_tests
  [ -f "$O/ov_trace.log" ] && quiet "$O/ov_trace.log" | grep -E "^--"
  [ -f "$O/ov_time256.log" ] && { echo "--- ov_time256"; quiet "$O/ov_time256.log" | grep -vE "overrides" | tail -9; }
  ;;
s26_l2rev)  # BwdConfig.l2_reverse: preprocess and dQ cast walk the rows last to first (L2 reuse with the
  # main kernel's first and last CTAs). Predicted +1..+3.5% at 512, +0.5..+1.5% at 1k-2k, ~0 at 8k.
  bg rev_tests 150 python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "l2_reverse"
  wait
  if grep -qE "passed" "$O/rev_tests.log" && ! grep -qE "failed|error" "$O/rev_tests.log"; then
    run rev_time256 python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 512,1024,2048,8192 \
      --bwd-config default --bwd-config l2_reverse=True
    run rev_time128 python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 64,128 --seqlens 512,2048 \
      --bwd-config default --bwd-config l2_reverse=True
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary rev_tests
  for f in rev_time256 rev_time128; do
    [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | grep -vE "overrides|^fh[0-9]" | tail -10; }
  done
  ;;
s26_dvearly)  # session 26, measured: +0.0..+0.7% (one -1.1%), removed, not yet run: hdim 256 backward with dV stored in the last step
  # (BwdConfig.dv_early; the epilogue stores only dK). Cases first (a new store in the step), then its GPU
  # test (NaN-poisoned dK / dV, key blocks no query sees), the hdim 256 tests with the override, then
  # timing (3 rounds) against the dispatch. Predicted +2..+4% at 512, +1..+2% at 1k-2k, ~0 at 8k.
  DV=dv_early=True
  bg dv_cases 240 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap --bwd-config $DV
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/dv_cases.log"; then
    run dv_test python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k dv_early
    tests256 dv_tests $DV
    run dv_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 512,1024,2048,8192 \
      --bwd-config default --bwd-config $DV
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- dv_cases"; grep -E "^FAIL|cases failed|rc=" "$O/dv_cases.log" | tail -6
  tests_summary dv_test dv_tests
  [ -f "$O/dv_time.log" ] && { echo "--- dv_time"; quiet "$O/dv_time.log" | grep -vE "^fh[0-9]|overrides" | tail -12; }
  ;;
s25_diag)  # session 25 (needs f06fe71; diag_no_epilogue removed after it): the hdim 256 backward
  # without its epilogue (dK / dV never written; the GEMMs kept), against the dispatch, 2 rounds: the
  # epilogue's part of a CTA's fixed cost
  run diag_time python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 256 --seqlens 512,2048,8192 \
    --bwd-config default --bwd-config diag_no_epilogue=True
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/diag_time.log" ] && { echo "--- diag_time"; quiet "$O/diag_time.log" | grep -vE "^fh[0-9]|overrides" | tail -9; }
  ;;
s25_bgrid)  # session 25, last call: the backward grid of the head (session 17's dispatch, cubins unchanged since), 2 rounds
  run bwd_grid python3 -m flashhopper.cli bench --bwd --rounds 2 --json "$O/bwd_grid.json" --plot "$O/bwd_grid.png"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/bwd_grid.log" ] && { echo "--- bwd_grid"; quiet "$O/bwd_grid.log" | tail -42; }
  ;;
s25_persist)  # session 25 (needs de528b8, removed after it): the wide backward kernel walks tiles (grid =
  # one CTA per tile, or with BwdConfig.persistent at most one per SM). Cases of both grids (persistent
  # capped at 3 CTAs, so that the small shapes walk many tiles), timing at hdim 256 (3 rounds) and 192
  # (2 rounds), then the new persistent test and the hdim 192 / 256 backward suite on the default grid
  P=persistent=True
  bg persist_cases 240 python3 scripts/bwd_check.py --no-bench --case-hdims 192,256 --ctas-cap 3 \
    --bwd-config default --bwd-config $P
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/persist_cases.log"; then
    run persist_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 512,1024,2048,8192 \
      --bwd-config default --bwd-config $P
    run persist_time192 python3 scripts/bwd_check.py --no-cases --rounds 2 --hdims 192 --seqlens 512,2048,8192 \
      --bwd-config default --bwd-config $P
    run persist_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k persistent
    run wide_tests python3 -m pytest -q -rf --tb=short tests/test_bwd_gpu.py -k "(192 or 256) and not persistent"
  fi
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- persist_cases"; grep -E "^FAIL|cases failed|rc=" "$O/persist_cases.log" | tail -8
  for f in persist_time persist_time192; do
    [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | grep -vE "^fh[0-9]|overrides" | tail -12; }
  done
  tests_summary persist_tests wide_tests
  ;;
s25_qearly)  # prepared in session 24, run in session 25: hdim 256 backward with dK^T issued under the first dQ chunk's
  # hand-off and Q released before the second (sdp_q_early), alone and with one Q stage making room for a
  # 7-box dQ ring (num_stages=1, dq_slot_ring=7: 226,864 B). Cases first (a new order of releases), then the
  # hdim 256 GPU tests of each, then timing (3 rounds) against the dispatch
  QE=sdp_q_early=True
  Q1=sdp_q_early=True,num_stages=1,dq_slot_halves=True,dq_slot_ring=7
  bg qearly_cases 240 python3 scripts/bwd_check.py --no-bench --case-hdims 256 --no-softcap --bwd-config $QE \
    --bwd-config $Q1
  wait
  if grep -qE "^0 of [0-9]+ cases failed" "$O/qearly_cases.log"; then
    tests256 qearly_tests $QE
    tests256 q1_tests $Q1
    run qearly_time python3 scripts/bwd_check.py --no-cases --rounds 3 --hdims 256 --seqlens 512,2048,8192,16384 \
      --bwd-config default --bwd-config $QE --bwd-config $Q1 --bwd-config num_stages=1,dq_slot_ring=7
  fi
  run parts256 python3 scripts/bwd_parts.py 256 512,2048,8192
  echo "== end at $(($(date +%s) - T0)) s"
  echo "--- qearly_cases"; grep -E "^FAIL|cases failed|rc=" "$O/qearly_cases.log" | tail -6
  tests_summary qearly_tests q1_tests
  [ -f "$O/qearly_time.log" ] && { echo "--- qearly_time"; quiet "$O/qearly_time.log" | tail -20; }
  [ -f "$O/parts256.log" ] && { echo "--- parts256"; quiet "$O/parts256.log" | tail -8; }
  ;;
s24_d)  # session 24: fp16 against bf16 per MHz of SM clock with lazy_max (hdim 128 8k, hdim 64 8k; sustained
  # streams, ours and FA4), then the forward GPU tests at hdim 192 / 256 and the API GPU suite on the final head
  run clock128 bash -c "python3 scripts/clock_study.py --hdim 128 --seqlen 8192 --rounds 2 --seconds 1.0 \
    --no-matmul --dtype bf16 && python3 scripts/clock_study.py --hdim 128 --seqlen 8192 --rounds 2 \
    --seconds 1.0 --no-matmul --dtype fp16"
  run clock64 bash -c "python3 scripts/clock_study.py --hdim 64 --seqlen 8192 --rounds 2 --seconds 1.0 \
    --no-matmul --dtype fp16 && python3 scripts/clock_study.py --hdim 64 --seqlen 8192 --rounds 2 \
    --seconds 1.0 --no-matmul --dtype bf16"
  bg fwd_tests 150 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "192 or 256"
  wait
  run api_tests python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  echo "== end at $(($(date +%s) - T0)) s"
  for f in clock128 clock64; do [ -f "$O/$f.log" ] && grep -A4 -E "^(forward|backward) " "$O/$f.log"; done
  tests_summary fwd_tests api_tests
  ;;
s24_c)  # session 24: fp16 and bf16 grids (2 rounds each, fp16 first), the ablation (5 rounds, both masks), ncu of
  # hdim 128 8k with ping-pong on / off, with the intra-warpgroup overlap on and off
  run fwd_grid_fp16 python3 -m flashhopper.cli bench --dtype fp16 --rounds 2 --json "$O/fwd_grid_fp16.json"
  run fwd_grid_bf16 python3 -m flashhopper.cli bench --rounds 2 --json "$O/fwd_grid_bf16.json"
  run ablation python3 -m flashhopper.cli bench --ablation --rounds 5 --json "$O/ablation.json"
  export OVERLAP="true false"
  run ncu bash scripts/profile_fwd.sh
  echo "== end at $(($(date +%s) - T0)) s"
  for f in fwd_grid_fp16 fwd_grid_bf16; do [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -4; }; done
  [ -f "$O/ablation.log" ] && quiet "$O/ablation.log" | tail -12
  [ -f "$O/ncu.log" ] && cat "$O/ncu.log"
  ;;
s24_b)  # session 24: the new default-dispatch tests (seqlens and rising scores at hdim 64), lazy_max at hdim 64's
  # long points again (5 rounds), ping-pong with and without the intra-warpgroup overlap (3 rounds); the bf16 grid
  # (2 rounds, JSON and plot)
  bg tests 120 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "(seqlens or rising) and 64"
  wait
  run lazy64_long python3 scripts/tune_fwd.py lazy64_long
  run pingpong3 python3 scripts/tune_fwd.py pingpong3
  run fwd_grid python3 -m flashhopper.cli bench --rounds 2 --json "$O/fwd_grid.json" --plot "$O/fwd_grid.png"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary tests
  for f in lazy64_long pingpong3; do [ -f "$O/$f.log" ] && python3 scripts/tune_medians.py "$O/$f.log"; done
  [ -f "$O/fwd_grid.log" ] && { echo "--- fwd_grid"; quiet "$O/fwd_grid.log" | tail -44; }
  ;;
s24_a)  # session 24: hdim 64 on 192 x 64 tiles with lazy_max (the only hdim 64 tile whose 160 registers hold
  # it): its forward tests (every hdim <= 128 under the override), timing (3 rounds) against the dispatch;
  # then the ablation with lazy_max dispatched (3 rounds, both masks)
  L64=lazy_max=True,tile_n=64
  FH_TEST_FWD_OVERRIDES=$L64 bg tests 200 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "(rising or hdim_dtype or seqlens or batch_gqa or packed) and not 192 and not 256"
  wait
  run lazy64 python3 scripts/tune_fwd.py lazy64
  run ablation python3 -m flashhopper.cli bench --ablation --rounds 3 --json "$O/ablation.json"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary tests
  python3 scripts/tune_medians.py "$O/lazy64.log"
  [ -f "$O/ablation.log" ] && quiet "$O/ablation.log" | tail -14
  ;;
s23_h)  # session 23: the forward GPU tests s23_f's limit cut, those of the switch variants where lazy_max takes effect
  run fwd_tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "(persistent or dynamic or counter or wg_epilogue or skip_idle or q_ring or rescale_o_before_pv) and (128 or 96)"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_tests
  ;;
s23_f)  # session 23: the lazy_max dispatch (hdim 96 / 128): the forward GPU suite and the API suite, then the grid
  # (1 round, JSON and plot)
  bg fwd_tests 260 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py
  wait
  run api_tests python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py -x
  run fwd_grid python3 -m flashhopper.cli bench --json "$O/fwd_grid.json" --plot "$O/fwd_grid.png"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_tests api_tests
  [ -f "$O/fwd_grid.log" ] && { echo "--- fwd_grid"; quiet "$O/fwd_grid.log" | tail -44; }
  ;;
s23_g)  # session 23: the forward grid again (1 round) and the ablation at hdim 128 8k
  run fwd_grid python3 -m flashhopper.cli bench --json "$O/fwd_grid2.json"
  run ablation python3 -m flashhopper.cli bench --ablation
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/fwd_grid.log" ] && { echo "--- fwd_grid"; quiet "$O/fwd_grid.log" | tail -44; }
  [ -f "$O/ablation.log" ] && quiet "$O/ablation.log" | tail -14
  ;;
s23_e)  # session 23: lazy_max (hdim <= 128): its forward GPU tests (hdim 64 on 128 x 128 tiles), the new rising-score
  # tests on the dispatch, timing (3 rounds), timelines
  LZ=lazy_max=True,tile_m=128,num_consumer_wg=2
  FH_TEST_FWD_OVERRIDES=$LZ run tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "(rising or hdim_dtype or seqlens or local or batch_gqa or packed or softcap) and not 192 and not 256"
  run tests_dispatch python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k rising
  run lazy python3 scripts/tune_fwd.py lazy
  run trace python3 scripts/fwd_trace.py --out "$O" 128:16384:lazy_max=true 128:8192:lazy_max=true \
    64:8192:lazy_max=true,tile_m=128,num_consumer_wg=2
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary tests tests_dispatch
  quiet "$O/trace.log" | grep -E "==|busy|step|softmax|gap" | head -30
  grep -E "FAILED|rc=" "$O/lazy.log" | head -3
  python3 scripts/tune_medians.py "$O/lazy.log"
  ;;
s23_d)  # session 23 (needs 360dc51): the peeled block's running max kept as the offset (diag_stale_max): timelines, timing
  # (3 rounds), then the forward tests with it on (random inputs, where it is exact)
  run trace python3 scripts/fwd_trace.py --out "$O" 128:16384:diag_stale_max=true 64:8192:diag_stale_max=true \
    256:8192:diag_stale_max=true 256:8192
  run stale python3 scripts/tune_fwd.py stale
  FH_TEST_FWD_OVERRIDES=diag_stale_max=True run tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "hdim_dtype or seqlens or local or batch_gqa or softcap"
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/trace.log" | grep -E "==|busy|step|softmax|gap" | head -40
  tests_summary tests
  grep -E "FAILED|rc=" "$O/stale.log" | head -3
  python3 scripts/tune_medians.py "$O/stale.log"
  ;;
s23_c)  # session 23: s23_b's FFMA passes at smaller counts (cost against count), alone and with the EX2 pass
  G=gemm_only=true
  run trace python3 scripts/fwd_trace.py --out "$O" 128:16384:$G,diag_ffma_passes=1 128:16384:$G,diag_ffma_passes=2 \
    128:16384:$G,diag_ffma_passes=1,diag_ex2_passes=1 128:16384:$G,diag_ffma_passes=2,diag_ex2_passes=1 \
    128:16384:$G,diag_ex2_passes=2
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/trace.log" | grep -E "==|busy|step|softmax|gap" | head -60
  ;;
s23_b)  # session 23: what of the softmax's cost is its instruction mix: gemm_only with elementwise FFMA / MUFU.EX2
  # passes in the softmax's place (diag_ffma_passes, diag_ex2_passes), timelines at hdim 128 16k and hdim 64 8k
  G=gemm_only=true
  run trace python3 scripts/fwd_trace.py --out "$O" 128:16384:$G 128:16384:$G,diag_ffma_passes=3 \
    128:16384:$G,diag_ex2_passes=1 128:16384:$G,diag_ffma_passes=3,diag_ex2_passes=1 \
    128:16384:$G,diag_ffma_passes=6 128:16384:$G,diag_ffma_passes=6,diag_ex2_passes=1 128:16384 \
    64:8192:$G,diag_ffma_passes=3,diag_ex2_passes=1 64:8192:$G,diag_ex2_passes=1
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/trace.log" | grep -E "==|busy|step|softmax|gap" | head -60
  ;;
s23_a)  # session 23: O rescaled before P @ V at hdim 64 / 128 (rescale_o_before_pv, dispatched above 128 only):
  # timelines, timing (5 rounds), then its forward GPU tests in what is left
  run trace python3 scripts/fwd_trace.py --out "$O" 128:16384 128:16384:rescale_o_before_pv=true 64:8192 \
    64:8192:rescale_o_before_pv=true
  run resc python3 scripts/tune_fwd.py rescale128
  FH_TEST_FWD_OVERRIDES=rescale_o_before_pv=True run tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "(hdim_dtype or seqlens or local or batch_gqa or softcap) and not 256 and not 192"
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/trace.log" | grep -E "==|busy|step|k_ready|softmax|tail|late" | head -50
  tests_summary tests
  grep -E "FAILED|rc=" "$O/resc.log" | head -3
  python3 scripts/tune_medians.py "$O/resc.log"
  ;;
s22_d)  # session 22: the loads and GEMMs without the softmax (gemm_only, a diagnostic): timing (3 rounds) and
  # timelines, for the rate the tensor pipe sustains with this kernel's loads
  run gemmonly python3 scripts/tune_fwd.py gemmonly
  run trace python3 scripts/fwd_trace.py --out "$O" 128:16384:gemm_only=true 64:8192:gemm_only=true \
    256:8192:gemm_only=true
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/trace.log" | tail -45
  grep -E "FAILED|rc=" "$O/gemmonly.log" | head -3
  python3 scripts/tune_medians.py "$O/gemmonly.log"
  ;;
s22_c)  # session 22 (needs bc6dfc5): the next K's barrier tested right after the softmax (k_try_wait): trace, timing (5 rounds),
  # then its forward GPU tests in what is left
  run trace python3 scripts/fwd_trace.py --out "$O" 128:8192:k_try_wait=true 128:16384:k_try_wait=true 128:16384
  run ktry python3 scripts/tune_fwd.py ktry
  FH_TEST_FWD_OVERRIDES=k_try_wait=True run tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "hdim_dtype or seqlens or local or batch_gqa or softcap or rescale_o_before_pv"
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/trace.log" | grep -E "==|busy|step|k_ready|softmax" | head -40
  tests_summary tests
  grep -E "FAILED|rc=" "$O/ktry.log" | head -3
  python3 scripts/tune_medians.py "$O/ktry.log"
  ;;
s22_b)  # session 22: timeline of the forward main loop from SM clock stamps (FwdConfig.trace, scripts/fwd_trace.py):
  # hdim 128 8k (dispatch, no ping-pong, K released early), 16k; hdim 64 and 256 at 8k
  run trace python3 scripts/fwd_trace.py --out "$O" 128:8192 128:8192:pingpong=false 128:8192:late_k_release=false \
    128:16384 64:8192 256:8192
  echo "== end at $(($(date +%s) - T0)) s"
  quiet "$O/trace.log" | tail -90
  ;;
s22_a)  # session 22 (needs 5d7631d): O's rescale skipped by a warp when no row max changed (rescale_skip): timing at hdim
  # 64 / 128 / 256 (5 rounds), then its forward GPU tests in what is left (no barrier changed: a new uniform
  # branch in the step)
  run rskip python3 scripts/tune_fwd.py rskip
  FH_TEST_FWD_OVERRIDES=rescale_skip=True run tests python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "hdim_dtype or seqlens or softcap or batch_gqa or local or packed or rescale_o_before_pv"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary tests
  grep -E "FAILED|rc=" "$O/rskip.log" | head -3
  python3 scripts/tune_medians.py "$O/rskip.log"
  ;;
s21_d)  # session 21: the row max in 4 FMNMX chains (row_max_chains=4): ncu at hdim 64 8k, then timing (5 rounds)
  NAMES="dispatch chains4" run pipes bash scripts/profile_fwd_pipes.sh
  bg chains $(( $(left) - 10 )) python3 scripts/tune_fwd.py chains
  wait
  echo "== end at $(($(date +%s) - T0)) s"
  cat "$O/pipes.log"
  grep -E "FAILED|rc=" "$O/chains.log" | head -3
  python3 scripts/tune_medians.py "$O/chains.log"
  ;;
s21_c)  # session 21: ncu pipe activity and stalls of hdim 64 8k: the dispatch, exp2 on the FMA pipe for every 8th /
  # 4th column (exp2_poly_every, put back for this run beside rowsum_mma), row sums by WGMMA
  NAMES="dispatch poly8 poly4 rowsum" run pipes bash scripts/profile_fwd_pipes.sh
  echo "== end at $(($(date +%s) - T0)) s"
  cat "$O/pipes.log"
  ;;
s21_b)  # session 21: row sums by a P @ ones WGMMA (rowsum_mma), timed at hdim 64 / 128 (3 rounds) against the
  # dispatch and late_k_release=False; then the forward tests with it on (hdim 256 does not fit it)
  bg rowsum 330 python3 scripts/tune_fwd.py rowsum
  wait
  FH_TEST_FWD_OVERRIDES=rowsum_mma=True run fwd_rsum python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "(hdim_dtype or seqlens or softcap or batch_gqa or local or packed) and not 256"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_rsum
  grep -E "FAILED|rc=" "$O/rowsum.log" | head -3
  python3 scripts/tune_medians.py "$O/rowsum.log"
  ;;
s21_a)  # session 21: every k-th exp2 on the FMA pipe (exp2_poly_every), timed at hdim 64 / 128 / 256 (3 rounds),
  # then the forward tests with it on (k = 4) to the deadline
  bg poly 340 python3 scripts/tune_fwd.py poly
  wait
  FH_TEST_FWD_OVERRIDES=exp2_poly_every=4 run fwd_poly python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py \
    -k "hdim_dtype or seqlens or softcap or batch_gqa"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_poly
  grep -E "FAILED|rc=" "$O/poly.log" | head -3
  python3 scripts/tune_medians.py "$O/poly.log"
  ;;
s20_e)  # session 20: the forward GPU suite on the final head, all but the switch-variant tests, to the deadline
  K="o_in_v or q_ring or short_qring or wg_epilogue or skip_idle or cluster"
  run fwd_a python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "not ($K)"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_a
  ;;
s20_d)  # session 20: fp16 against bf16 on the whole grid in one call, the dtypes alternating (bf16, fp16, bf16,
  # fp16; 1 round each), so that neither runs only on the warmer GPU
  for i in 1 2; do
    for dt in bf16 fp16; do
      run grid_${dt}_$i python3 -m flashhopper.cli bench --dtype $dt --json "$O/grid_${dt}_$i.json"
    done
  done
  echo "== end at $(($(date +%s) - T0)) s"
  for f in grid_bf16_1 grid_fp16_1 grid_bf16_2 grid_fp16_2; do
    [ -f "$O/$f.log" ] && { echo "--- $f"; quiet "$O/$f.log" | tail -4 | head -2; }
  done
  ;;
s20_c)  # session 20: the hdim 192 forward GPU tests of the final dispatch (incl. the new short-sequence
  # tests), the API GPU suite, then the fp16 grid (1 round) on the session's kernels
  bg fwd192 200 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "192"
  wait
  bg api 200 python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  wait
  run fwd_grid_fp16 python3 -m flashhopper.cli bench --dtype fp16 --json "$O/fwd_grid_fp16.json"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd192 api
  [ -f "$O/fwd_grid_fp16.log" ] && { echo "--- fwd_grid_fp16"; quiet "$O/fwd_grid_fp16.log" | tail -4; }
  ;;
s20_b)  # session 20: the hdim 192 GPU tests (the new short-causal dispatch: persistent, O in V's stages, <= 1024),
  # then tune_fwd.py pingpong2 (ping-pong off at more lengths, 5 rounds; hdim 192 no mask with O in V)
  bg fwd192 240 python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "192"
  wait
  bg pingpong2 $(( $(left) - 10 )) python3 scripts/tune_fwd.py pingpong2
  wait
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd192
  [ -f "$O/pingpong2.log" ] && echo "--- pingpong2: $(grep -c TFLOP "$O/pingpong2.log") timings; $(grep -E "FAILED|rc=" "$O/pingpong2.log" | head -3)"
  ;;
s20_a)  # session 20: hdim 192 with O in V's stages (s20_oinv192's timing), then ping-pong on / off at hdim
  # 64 / 128 (2k, 8k) and 192 / 256 (8k), causal and not, 3 rounds (tune_fwd.py pingpong), under its own limit
  run oinv192 python3 scripts/tune_fwd.py oinv192
  bg pingpong $(( $(left) - 10 )) python3 scripts/tune_fwd.py pingpong
  wait
  echo "== end at $(($(date +%s) - T0)) s"
  for f in oinv192 pingpong; do [ -f "$O/$f.log" ] && echo "--- $f: $(grep -c TFLOP "$O/$f.log") timings; $(grep -E "FAILED|rc=" "$O/$f.log" | head -3)"; done
  ;;
s20_oinv192)  # waiting (session 19 built it, GPU-tested in s19_oinv2, never timed): hdim 192 (not in the grid) with
  # O in V's stages against O in Q's buffer, no mask 512-8k and causal 512-2k persistent, 3 rounds
  run oinv192 python3 scripts/tune_fwd.py oinv192
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/oinv192.log" ] && quiet "$O/oinv192.log" | grep -E "TFLOP|FAILED"
  ;;
s19_suite_a)  # session 19, with s19_suite_b on the other GPU: the forward GPU suite of the new dispatch (hdim 256
  # with O in V's stages on the persistent grid, and causal <= 1024), all but the switch-variant tests
  K="o_in_v or q_ring or short_qring or wg_epilogue or skip_idle or cluster"
  run fwd_a python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "not ($K)"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_a
  ;;
s19_suite)  # session 19 on one GPU: s19_suite_a's tests, then s19_suite_b's forward tests
  K="o_in_v or q_ring or short_qring or wg_epilogue or skip_idle or cluster"
  run fwd_a python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "not ($K)"
  run fwd_b python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "$K"
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_a fwd_b
  ;;
s19_suite_b)  # session 19: the forward suite's switch-variant tests, then the API GPU suite
  K="o_in_v or q_ring or short_qring or wg_epilogue or skip_idle or cluster"
  run fwd_b python3 -m pytest -q -rf --tb=short tests/test_fwd_gpu.py -k "$K"
  run api python3 -m pytest -q -rf --tb=short tests/test_api_gpu.py
  echo "== end at $(($(date +%s) - T0)) s"
  tests_summary fwd_b api
  ;;
s19_grid)  # session 19: the forward grid of the new dispatch (2 rounds), JSON and plot
  run fwd_grid python3 -m flashhopper.cli bench --rounds 2 --json "$O/fwd_grid.json" --plot "$O/fwd_grid.png"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/fwd_grid.log" ] && { echo "--- fwd_grid"; quiet "$O/fwd_grid.log" | tail -44; }
  ;;
s19_grid16)  # session 19, beside s19_grid: the fp16 grid (1 round), then the short points again (3 rounds)
  run fwd_grid_fp16 python3 -m flashhopper.cli bench --dtype fp16 --json "$O/fwd_grid_fp16.json"
  run low python3 -m flashhopper.cli bench --hdim 64 256 --seqlen 512 1024 --rounds 3 --json "$O/low.json"
  echo "== end at $(($(date +%s) - T0)) s"
  [ -f "$O/fwd_grid_fp16.log" ] && { echo "--- fwd_grid_fp16"; quiet "$O/fwd_grid_fp16.log" | tail -6; }
  [ -f "$O/low.log" ] && quiet "$O/low.log" | tail -14
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
  echo "usage: bash scripts/gpu_pending.sh s9_fused|s9_short|s9_192|s9_tests|s9_tests_b|s8c_bwd|s8c_fwd|MODE (see the case list)" >&2
  exit 2
  ;;
esac
