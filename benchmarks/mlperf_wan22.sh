#!/usr/bin/env bash
# MLPerf Inference's text-to-video setting (jobs/mlperf_wan22_t2v.yaml: Wan2.2-T2V-A14B, 720x1280,
# 81 frames, 20 steps, guidance 4.0 / 3.0) on one GPU with random weights at full size, one row a
# device call, then the rows as s/video and videos per GPU-hour:
#   source .devbundle/install.sh && bash benchmarks/mlperf_wan22.sh ROW DIR     # on the GPU machine
#   bash benchmarks/mlperf_wan22.sh table DIR [DIR ...]                        # anywhere, after
# ROW (each `python -m runner.bench.vs_loop`, one video, into DIR/ROW/):
#   o3        the job, compile.mode=O3 (FP8 linears, 8-bit attention), no step reuse
#   o2        the job, compile.mode=O2 (lossless: the job's default)
#   peer      diffusers + torch.compile at the same settings (vs_loop's loop_compile arm,
#             after one untimed 2-step call that compiles both experts' graphs)
#   o3_reuse  O3 + step reuse (step_cache.method=residual, 11 of 20 steps computed): a
#             separate, labelled row, not MLPerf's computation
# Measured on one H200 (2026-12-02, benchmarks/2026-12-02-per-row-mlperf-h200.md): O3's worker
# was ready 498 s after its start on a cold compile cache (load 26 s, compile and warm-up 471 s),
# so a row and its compile do not fit one 10-minute call. Two calls a row, the second within the
# machine's 30 s idle window (the machine, /tmp and the compile cache stay):
#   STEPS=2 bash benchmarks/mlperf_wan22.sh o3 $OUT/warm    # fills the compile cache (shared by
#                                                           # the job rows: CACHE)
#   bash benchmarks/mlperf_wan22.sh o3 $OUT                 # the row, warm
# STEPS=N runs N steps instead of 20 where a row does not fit a call (o2 and peer are near the
# 600 s limit): the table then gives the 20-step figure scaled from the denoising seconds, marked.
# Each row: SIGINT at LIMIT s (default 580); DIR/ROW/ keeps vs_loop.json, the job's summary.json
# and metrics/ and the log, not the videos. The rows' s/video is one video's, once the worker (or
# the loop) is warm: the job's from its worker's ready to the file written (text encoding, 20
# steps, decode and the mp4 write, which a longer batch overlaps with the next video).
set -u
ROW=${1:?usage: mlperf_wan22.sh o2|o3|o3_reuse|peer DIR | table DIR...}
shift
if [ "$ROW" = table ]; then
  exec python3 - "$@" <<'PY'
import glob, json, os, sys
rows = []
for d in sys.argv[1:]:
    for f in sorted(glob.glob(os.path.join(d, "**", "vs_loop.json"), recursive=True)):
        rec = json.load(open(f))
        steps = rec.get("config", {}).get("generation", {}).get("num_inference_steps", 20)
        for r in rec["rows"]:
            rate = r.get("items_per_s")
            s = 1 / rate if rate else None
            scaled = ""
            if s and steps != 20:                      # the denoising part scaled to 20 steps
                den = (r.get("time_s") or {}).get("denoise")
                den = den / max(r.get("items") or 1, 1) if den else s   # the loop: all of it
                s, scaled = s + den * (20 / steps - 1), f" (scaled from {steps} steps)"
            calls = r.get("call_items_per_s")
            call_s = 1 / calls * (20 / steps if scaled else 1) if calls else None
            rows.append((f, r["arm"], r["mode"], s, scaled, call_s,
                         r.get("peak_mem_gb"), r.get("ready_s"), r.get("error")))
print("| row | arm | mode | s/video | videos per GPU-hour | s/video, pipe call only | peak GiB | ready s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for f, arm, mode, s, scaled, calls, peak, ready, err in rows:
    row = os.path.basename(os.path.dirname(f))
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"
    if err:
        print(f"| {row} | {arm} | {mode} | error: {err[:120]} | | | | |")
        continue
    print(f"| {row} | {arm} | {mode} | {fmt(s)}{scaled} | {fmt(3600 / s if s else None, 2)} | "
          f"{fmt(calls)} | {fmt(peak)} | {fmt(ready, 0)} |")
PY
fi
DIR=${1:?usage: mlperf_wan22.sh ROW DIR}
STEPS=${STEPS:-20}
LIMIT=${LIMIT:-580}
CACHE=${CACHE:-${TMPDIR:-/tmp}/mlperf_wan22-compile-cache}   # the job rows' compile.cache_dir
case "$ROW" in
  o2) ARGS=(arms=job modes=O2 compile.cache_dir="$CACHE") ;;
  o3) ARGS=(arms=job modes=O3 compile.cache_dir="$CACHE") ;;
  o3_reuse) ARGS=(arms=job modes=O3+residual compile.cache_dir="$CACHE") ;;
  peer) ARGS=(arms=loop_compile loop_warmup=2) ;;
  *) echo "mlperf_wan22.sh: row $ROW: o2, o3, o3_reuse, peer or table" >&2; exit 2 ;;
esac
OUT=$DIR/$ROW
WORK=${TMPDIR:-/tmp}/mlperf_wan22-$ROW
mkdir -p "$OUT" "$WORK"
{
  python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"
  git rev-parse --short HEAD 2>/dev/null || echo "tree: not a git checkout"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} > "$OUT/versions.txt" 2>&1
t0=$(date +%s)
timeout -s INT "$LIMIT" python3 -m runner.bench.vs_loop job=mlperf_wan22_t2v model.source=random \
    prompts=1 "${ARGS[@]}" out="$WORK" generation.num_inference_steps="$STEPS" > "$OUT/vs_loop.log" 2>&1
rc=$?
echo "row $ROW rc=$rc wall $(( $(date +%s) - t0 )) s steps $STEPS" | tee "$OUT/rc.txt"
# what to keep: the figures, not the video
cp "$WORK"/vs_loop.json "$OUT/" 2>/dev/null
for j in "$WORK"/job-*/; do
  [ -d "$j" ] || continue
  mkdir -p "$OUT/$(basename "$j")"
  cp -r "$j"summary.json "$j"summary.txt "$j"metrics "$OUT/$(basename "$j")/" 2>/dev/null
done
tail -5 "$OUT/vs_loop.log"
exit $rc
