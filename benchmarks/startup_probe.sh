#!/usr/bin/env bash
# A warm PixArt-α O3 worker's start-up, one GPU (issue 48's <= 15 s): warm_probe.py without and
# with bytecode (pyc.sh), then with bytecode and compile.compile_text_encoder=false, and
# load_probe.py with bytecode. Every figure into OUT (JSON lines; the .log files are the summaries).
#   source .devbundle/install.sh && bash benchmarks/startup_probe.sh $OUT
set -u
OUT=${1:?usage: startup_probe.sh OUT}
ARGS=(job=pixart_batch model.source=random compile.mode=O3)
env | grep -E '^PYTHON(DONTWRITEBYTECODE|PYCACHEPREFIX)=' > "$OUT/env.txt"
if [ "${SKIP_PLAIN:-0}" != 1 ]; then
  timeout 200 python3 benchmarks/warm_probe.py runs=1 "${ARGS[@]}" compile.cache_dir=/tmp/sp-cache \
      > "$OUT/warm_plain.jsonl" 2> "$OUT/warm_plain.log"
fi
source benchmarks/pyc.sh 2>> "$OUT/env.txt"
timeout 200 python3 benchmarks/warm_probe.py runs=2 "${ARGS[@]}" compile.cache_dir=/tmp/sp-cache \
    > "$OUT/warm_pyc.jsonl" 2> "$OUT/warm_pyc.log"
timeout 200 python3 benchmarks/warm_probe.py runs=1 "${ARGS[@]}" compile.cache_dir=/tmp/sp-cache \
    compile.compile_text_encoder=false > "$OUT/warm_pyc_not5.jsonl" 2> "$OUT/warm_pyc_not5.log"
timeout 120 python3 benchmarks/load_probe.py > "$OUT/load_pyc.jsonl" 2> "$OUT/load_pyc.log"
cat "$OUT/env.txt"
for f in "$OUT"/warm_*.jsonl; do
  python3 - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("phase") == "warm":
        p = r.get("startup_parts_s") or {}
        print(sys.argv[1].rsplit("/", 1)[-1], "run", r["run"], "process %.1f imports %.1f init %.1f warmup %.1f" % (
            r["process_s"], r.get("imports_s", -1), r.get("init_s", -1), r.get("warmup_s", -1)),
            {k: round(v, 2) for k, v in p.items()}, "error" in r and r["error"][-300:] or "")
PY
done
grep -h "^{'variant'" "$OUT/load_pyc.log" | cut -c1-300
