#!/usr/bin/env bash
# Gpu tests run alone, one a GPU side by side, each with its CPU seconds (GNU time) and the
# `seconds:` line it prints: where a long test's time goes outside the suite's contention.
#   source .devbundle/install.sh && bash benchmarks/test_parts.sh OUT TEST_ID [TEST_ID ...]
# OUT/tK.log for the K-th test id (pytest -s; GNU time -v at the end), a summary on stdout.
set -u
OUT=${1:?usage: test_parts.sh OUT TEST_ID [TEST_ID ...]}; shift
# one GPU a test: more test ids than GPUs would put two on one GPU (or none on a missing one)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$#" -eq 0 ] || [ "$#" -gt "$gpus" ]; then
  echo "test_parts.sh: $# test id(s) for $gpus GPU(s): give 1 to $gpus" >&2
  exit 2
fi
mkdir -p "$OUT"
k=0
for t in "$@"; do
  CUDA_VISIBLE_DEVICES=$k /usr/bin/time -v python3 -m pytest -m gpu -p no:cacheprovider -s -q "$t" \
    > "$OUT/t$k.log" 2>&1 &
  k=$((k + 1))
done
wait
for ((i = 0; i < k; i++)); do
  echo "== t$i"
  grep -E " passed | failed |^seconds|Elapsed|User time|System time" "$OUT/t$i.log"
done
