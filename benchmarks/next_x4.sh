#!/usr/bin/env bash
# What issues 46 and 48 still need from a 4-GPU machine (nvidia-h100-x4), in one background script
# of ~25 minutes, the GPUs never idle between phases:
#   1. the whole gpu suite on the 4 GPUs (families_x4.sh's first phase: its wall time for README);
#   2. at once, a GPU each: the Latte O3 + reuse table (GPU 0), TI2V-5B's image rows (GPU 1), the
#      ready-time A/B against a9a589a (ready_ab.sh) of PixArt (GPU 2) and of Latte (GPU 3): the
#      families issue 46's ready bound sits with (Latte, PixArt, FLUX; FLUX's A/B, ~5 min, would
#      hold the phase back);
#   3. scaling_x4.sh pixart, then wan (all 4 GPUs each).
# Here first: `git archive -o .ab/a9a589a.tgz a9a589a`; carry .devbundle, .whl and .ab. There:
#   source .devbundle/install.sh && setsid nohup bash benchmarks/next_x4.sh /tmp/n >/dev/null 2>&1 &
#   cat /tmp/n/phase; bash benchmarks/families_x4.sh /tmp/n/fam status     # where it stands
# Stop: touch /tmp/n/stop (no further phase); then the anchored pkills of families_x4.sh.
set -u
Q=${1:?usage: next_x4.sh DIR}
mkdir -p "$Q"
phase() { echo "$1 since $(date +%T)" > "$Q/phase"; [ ! -e "$Q/stop" ]; }
phase "1 gpu suite" && TABLES=" " bash benchmarks/families_x4.sh "$Q/fam"
phase "2 tables and ready A/B" && {
  SKIP_SUITE=1 TABLES=latte GPUS=0 bash benchmarks/families_x4.sh "$Q/fam" &
  SKIP_SUITE=1 TABLES=ti2v_img GPUS=1 bash benchmarks/families_x4.sh "$Q/fam" &
  GPU=2 JOBS=pixart_batch bash benchmarks/ready_ab.sh "$Q/ready-pixart" > "$Q/ready-pixart.log" 2>&1 &
  GPU=3 JOBS=latte_batch bash benchmarks/ready_ab.sh "$Q/ready-latte" > "$Q/ready-latte.log" 2>&1 &
  wait
}
phase "3 scaling pixart" && timeout 600 bash benchmarks/scaling_x4.sh pixart "$Q/scaling" > "$Q/scaling-pixart.log" 2>&1
phase "4 scaling wan" && timeout 600 bash benchmarks/scaling_x4.sh wan "$Q/scaling" > "$Q/scaling-wan.log" 2>&1
echo "done at $(date +%T)" > "$Q/phase"
