#!/usr/bin/env bash
# next_x4.sh for a 2-GPU machine (nvidia-h100-x2: the largest kind lent on 2026-11-26), ~20 min in
# the background, the GPUs never idle between phases:
#   1. the whole gpu suite on the 2 GPUs (families_x4.sh's first phase: its wall time for README);
#   2. GPU 0: the Latte O3 + reuse table, then TI2V-5B's image rows; GPU 1: the ready-time A/B
#      against a9a589a (ready_ab.sh) of PixArt, then of Latte (issue 46's ready bound);
#   3. scaling_x4.sh pixart at 1 and 2 workers, cold and warm (warm: 64 and 500 prompts): the warm
#      worker ready time (issue 48's <= 15 s at PixArt's size) and the 2-worker warm span.
# Here first: `git archive -o .ab/a9a589a.tgz a9a589a`; carry .devbundle, .whl and .ab. There:
#   source .devbundle/install.sh && setsid nohup bash benchmarks/next_x2.sh /tmp/n >/dev/null 2>&1 &
#   cat /tmp/n/phase; bash benchmarks/families_x4.sh /tmp/n/fam status     # where it stands
# Stop: touch /tmp/n/stop (no further phase); then the anchored pkills of families_x4.sh.
set -u
Q=${1:?usage: next_x2.sh DIR}
mkdir -p "$Q"
phase() { echo "$1 since $(date +%T)" > "$Q/phase"; [ ! -e "$Q/stop" ]; }
phase "1 gpu suite" && TABLES=" " GPUS=" " bash benchmarks/families_x4.sh "$Q/fam"
phase "2 tables and ready A/B" && {
  SKIP_SUITE=1 TABLES="latte ti2v_img" GPUS=0 bash benchmarks/families_x4.sh "$Q/fam" &
  GPU=1 JOBS="pixart_batch latte_batch" bash benchmarks/ready_ab.sh "$Q/ready" > "$Q/ready.log" 2>&1 &
  wait
}
phase "3 scaling pixart" && PIXART_WORKERS=1,2 PIXART_WARM=64,500 \
  timeout 590 bash benchmarks/scaling_x4.sh pixart "$Q/scaling" > "$Q/scaling-pixart.log" 2>&1
echo "done at $(date +%T)" > "$Q/phase"
