#!/usr/bin/env bash
# The gpu suite in one command, a test process per GPU (README "Tests"), whole or in two parts:
#   source .devbundle/install.sh && bash benchmarks/gpu_suite.sh DIR [1|2]
# Part 1: the files of PART1 below (the adapter tests with the A14B 720P one, the VAE decode tests);
# part 2: every other gpu test. Together they run every gpu test once; on one H200 each part should
# fit one 10-minute device call (~495 and ~475 s from the per-test seconds of 2026-12-04, not yet
# run so: benchmarks/README.md "The gpu suite on one GPU"). Without a part: the whole suite.
# DIR gets suite.log (pytest -v, `--durations=0`: every test's setup, call and teardown seconds; the
# last section lists every gpu test with its GPU, outcome and seconds), junit.xml, gpus.txt,
# versions.txt and rc.txt (pytest's exit status and wall time). SIGINT at LIMIT s (default 590;
# 540 for a part): pytest still prints its summary and writes the XML of what ran.
set -u
Q=${1:?usage: gpu_suite.sh DIR [1|2]}
PART=${2:-}
PART1=(tests/test_gpu_adapters.py tests/test_video_vae.py)
case "$PART" in
  "") SELECT=(); DEFAULT_LIMIT=590 ;;
  1) SELECT=("${PART1[@]}"); DEFAULT_LIMIT=540 ;;
  2) SELECT=(); for f in "${PART1[@]}"; do SELECT+=("--ignore=$f"); done; DEFAULT_LIMIT=540 ;;
  *) echo "gpu_suite.sh: part $PART: 1 or 2 (or none: the whole suite)" >&2; exit 2 ;;
esac
mkdir -p "$Q"
{
  python3 - <<'PY'
import importlib
for name in ("torch", "triton", "diffusers", "ray", "cache_dit"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:   # cache_dit: only the peer arms need it
        print(name, "not importable:", type(e).__name__)
PY
  git rev-parse --short HEAD 2>/dev/null || echo "tree: not a git checkout"
} > "$Q/versions.txt" 2>&1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$Q/gpus.txt" 2>&1
LIMIT=${LIMIT:-$DEFAULT_LIMIT}
t0=$(date +%s.%N)
echo "gpu_suite.sh part=${PART:-whole} limit=${LIMIT}s: python3 -m pytest -m gpu ${SELECT[*]:-}" > "$Q/suite.log"
timeout -s INT "$LIMIT" python3 -m pytest -m gpu -n auto --dist loadgroup -v -p no:cacheprovider \
    --durations=0 --durations-min=0 --junitxml="$Q/junit.xml" "${SELECT[@]}" >> "$Q/suite.log" 2>&1
rc=$?
wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
echo "pytest rc=$rc wall $wall s (part ${PART:-whole})" | tee -a "$Q/suite.log" > "$Q/rc.txt"
cat "$Q/rc.txt"
# every gpu test's outcome and seconds (gpu_spread's summary), then pytest's last lines
sed -n '/gpu tests: the GPU that ran each/,$p' "$Q/suite.log" | grep -E "^gw|^GPU| s  tests/" | tail -120
tail -4 "$Q/suite.log"
exit $rc
