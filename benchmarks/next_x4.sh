#!/usr/bin/env bash
# What issues 46 and 48 still need from a 4-GPU machine (nvidia-h100-x4), as foreground phases of
# under 10 minutes, one device command each, every figure tarred into OUT/r.tgz (media left out):
#   tables   GPU 0: TI2V-5B's image rows (families_x4.sh ti2v_img); GPU 1: the Latte O3 + reuse
#            table; GPUs 2 and 3: the ready-time A/B against a9a589a (ready_ab.sh) of PixArt-α and
#            of Latte (issue 46's ready bound)
#   pixart   scaling_x4.sh pixart: 1, 2, 4 workers cold and warm, the 1,000-prompt warm job
#   wan      scaling_x4.sh wan
#   suite    the whole gpu suite on the 4 GPUs
# Here first: `git archive -o .ab/a9a589a.tgz a9a589a`; carry .devbundle, .whl and .ab. There:
#   source .devbundle/install.sh && bash benchmarks/next_x4.sh tables $OUT
# Not one background script any more: see next_x2.sh (a machine handed back between polls takes
# a background run and its logs with it).
set -u
phase=${1:?usage: next_x4.sh tables|pixart|wan|suite OUT}; OUT=${2:?usage: next_x4.sh PHASE OUT}
Q=/tmp/next-$phase; mkdir -p "$Q" "$OUT"
pack() { tar -czf "$OUT/r.tgz" -C /tmp --exclude='media-*' --exclude='*.mp4' --exclude='*.png' \
             "next-$phase"; }
trap pack EXIT   # also when the device's limit (timeout) ends the command
case $phase in
  tables)
    [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    SKIP_SUITE=1 TABLES=ti2v_img GPUS=0 timeout 560 bash benchmarks/families_x4.sh "$Q" &
    SKIP_SUITE=1 TABLES=latte GPUS=1 timeout 560 bash benchmarks/families_x4.sh "$Q" &
    GPU=2 JOBS=pixart_batch timeout 560 bash benchmarks/ready_ab.sh "$Q/ready-pixart" > "$Q/ready-pixart.log" 2>&1 &
    GPU=3 JOBS=latte_batch timeout 560 bash benchmarks/ready_ab.sh "$Q/ready-latte" > "$Q/ready-latte.log" 2>&1 &
    wait; bash benchmarks/families_x4.sh "$Q" status; cat "$Q"/ready-*/ready.tsv ;;
  pixart|wan)
    bash benchmarks/scaling_x4.sh "$phase" "$Q" > "$Q/scaling-$phase.log" 2>&1; tail -30 "$Q/scaling-$phase.log" ;;
  suite)
    timeout 560 python3 -m pytest -m gpu -n auto --dist loadgroup -v -p no:cacheprovider \
        --junitxml="$Q/junit.xml" > "$Q/suite.log" 2>&1
    tail -3 "$Q/suite.log" ;;
  *) echo "next_x4.sh: unknown phase '$phase' (tables, pixart, wan or suite)" >&2; exit 2 ;;
esac
