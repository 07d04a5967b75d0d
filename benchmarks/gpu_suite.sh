#!/usr/bin/env bash
# The whole gpu suite in one command, a test process per GPU (README "Tests"):
#   source .devbundle/install.sh && bash benchmarks/gpu_suite.sh DIR
# DIR gets suite.log (pytest -v; its last section lists every gpu test with its GPU, outcome and
# seconds), junit.xml, gpus.txt and versions.txt. SIGINT at LIMIT s (default 590): pytest still
# prints its summary and writes the XML of what ran.
set -u
Q=${1:?usage: gpu_suite.sh DIR}
mkdir -p "$Q"
source "$(dirname "$0")/keep.sh"
versions > "$Q/versions.txt" 2>&1
t0=$(date +%s.%N)
LIMIT=$(by_deadline "${LIMIT:-590}")
timeout -s INT "$LIMIT" python3 -m pytest -m gpu -n auto --dist loadgroup -v \
    -p no:cacheprovider --junitxml="$Q/junit.xml" > "$Q/suite.log" 2>&1
rc=$?
echo "pytest rc=$rc wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee -a "$Q/suite.log"
tail -4 "$Q/suite.log"
