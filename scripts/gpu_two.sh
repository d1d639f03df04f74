#!/usr/bin/env bash
# Two gpu_pending.sh modes at once on a two-GPU machine (one per GPU), logs packed into $OUT/logs.tgz
# (the device tool brings back at most 8 files). Usage: bash scripts/gpu_two.sh MODE_GPU0 MODE_GPU1
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
D="${DEADLINE:-560}"
CUDA_VISIBLE_DEVICES=0 OUT=/tmp/fh0 DEADLINE=$D bash scripts/gpu_pending.sh "$1" >/tmp/fh0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 OUT=/tmp/fh1 DEADLINE=$D bash scripts/gpu_pending.sh "$2" >/tmp/fh1.txt 2>&1 &
wait
mkdir -p /tmp/fh0 /tmp/fh1
cp /tmp/fh0.txt /tmp/fh0/summary.txt; cp /tmp/fh1.txt /tmp/fh1/summary.txt
tar -czf "${OUT:-/tmp}/logs.tgz" -C /tmp fh0 fh1
cp /tmp/fh0/*.json /tmp/fh1/*.json "${OUT:-/tmp}/" 2>/dev/null
echo "===== GPU0: $1"; cat /tmp/fh0.txt
echo "===== GPU1: $2"; cat /tmp/fh1.txt
