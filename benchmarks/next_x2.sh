#!/usr/bin/env bash
# What issues 46 and 48 still need from a 2-GPU machine (nvidia-h100-x2), as foreground phases of
# under 10 minutes, one device command each, every figure tarred into OUT/r.tgz (media left out):
#   ab      GPU 0: the ready-time A/B against a9a589a (ready_ab.sh) of PixArt-α O3; GPU 1: of Latte
#           (issue 46's ready bound; ~3-4 min each: two cold jobs)
#   tables  GPU 0: TI2V-5B's image rows (families_x4.sh ti2v_img); GPU 1: the Latte O3 + reuse
#           table again (issue 46's >= 0.27 videos/s, the ready A/B's machine)
#   suite   the whole gpu suite on both GPUs (501 s on 2 H100s, 2026-11-26)
# Here first: `git archive -o .ab/a9a589a.tgz a9a589a`; carry .devbundle, .whl and .ab. There:
#   source .devbundle/install.sh && bash benchmarks/next_x2.sh ab $OUT
# Why not one background script, as next_x4.sh was: it lives only while the machine stays held,
# and on 2026-11-26 the machine was handed back twice between polling calls, the runs lost with
# their logs; a foreground command writes what it has into $OUT even when its limit ends it.
set -u
phase=${1:?usage: next_x2.sh ab|tables|suite OUT}; OUT=${2:?usage: next_x2.sh PHASE OUT}
Q=/tmp/next-$phase; mkdir -p "$Q" "$OUT"
pack() { tar -czf "$OUT/r.tgz" -C /tmp --exclude='media-*' --exclude='*.mp4' --exclude='*.png' \
             "next-$phase"; }
trap pack EXIT   # also when the device's limit (timeout) ends the command
case $phase in
  ab)
    GPU=0 JOBS=pixart_batch timeout 560 bash benchmarks/ready_ab.sh "$Q/pixart" > "$Q/pixart.log" 2>&1 &
    GPU=1 JOBS=latte_batch timeout 560 bash benchmarks/ready_ab.sh "$Q/latte" > "$Q/latte.log" 2>&1 &
    wait; cat "$Q"/*/ready.tsv ;;
  tables)   # the image rows' peer-free job needs no ftfy; installed once here all the same, so the
            # two lanes' own once-only install cannot race
    [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    SKIP_SUITE=1 TABLES=ti2v_img GPUS=0 timeout 560 bash benchmarks/families_x4.sh "$Q" &
    SKIP_SUITE=1 TABLES=latte GPUS=1 timeout 560 bash benchmarks/families_x4.sh "$Q" &
    wait; bash benchmarks/families_x4.sh "$Q" status ;;
  suite)
    timeout 560 python3 -m pytest -m gpu -n auto --dist loadgroup -v -p no:cacheprovider \
        --junitxml="$Q/junit.xml" > "$Q/suite.log" 2>&1
    tail -3 "$Q/suite.log" ;;
  *) echo "next_x2.sh: unknown phase '$phase' (ab, tables or suite)" >&2; exit 2 ;;
esac
