#!/usr/bin/env bash
# A warm PixArt-α O3 worker's start-up without a profiler, one GPU, bytecode on (pyc.sh): what the
# bundle's torchao and the compiled text encoder each add. `runner.warm` (through warm_probe.py
# runs=0) on a filled cache is a warm worker's start in one process: its model_load_s and
# warmup_with_cache_s are the figures. Twice each:
#   base        the job as it runs (torchao importable: transformers imports it when installed)
#   no-torchao  the same with the bundle's torchao hidden (PYTHONPATH through a copy of /tmp/site
#               without it: as on a user's machine that has no torchao)
#   no-t5       compile.compile_text_encoder=false (its own cache: filled cold first)
#   source .devbundle/install.sh && bash benchmarks/startup_ab.sh $OUT
set -u
OUT=${1:?usage: startup_ab.sh OUT}
source "$(dirname "$0")/pyc.sh"
read -ra ARGS <<< "${JOB_ARGS:-job=pixart_batch model.source=random compile.mode=O3}"   # JOB_ARGS: another job
probe() {   # NAME CACHE_DIR [extra args]: one warm_probe fill, its figures as one line
  local name=$1 dir=$2; shift 2
  timeout 200 python3 benchmarks/warm_probe.py runs=0 "${ARGS[@]}" compile.cache_dir="$dir" "$@" \
      > "$OUT/$name.jsonl" 2> "$OUT/$name.log"
  python3 - "$OUT/$name.jsonl" "$name" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("phase") == "fill":
        try:
            m = json.loads(r["stdout"])
            print(f"{sys.argv[2]:>14}: load {m['model_load_s']:.1f} s, warm-up with cache "
                  f"{m['warmup_with_cache_s'] or float('nan'):.1f} s, with compile "
                  f"{m['warmup_with_compile_s'] or float('nan'):.1f} s, process {r['process_s']:.1f} s")
        except Exception:
            print(sys.argv[2], "failed:", r.get("stderr", "")[-500:])
PY
}
probe cold /tmp/ab-cache                      # fills the cache (cold compile)
for i in 1 2; do probe base-$i /tmp/ab-cache; done
rm -rf /tmp/site-notorchao && mkdir /tmp/site-notorchao
for e in /tmp/site/* /tmp/site/.[!.]*; do
  case $(basename "$e") in torchao|torchao-*) ;; *) ln -s "$e" /tmp/site-notorchao/ ;; esac
done
for i in 1 2; do PYTHONPATH=/tmp/site-notorchao:$PWD probe no-torchao-$i /tmp/ab-cache; done
probe no-t5-cold /tmp/ab-cache-not5 compile.compile_text_encoder=false
for i in 1 2; do probe no-t5-$i /tmp/ab-cache-not5 compile.compile_text_encoder=false; done
