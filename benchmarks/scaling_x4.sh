#!/usr/bin/env bash
# Issue 48's scaling table on a 4-GPU H100 machine (nvidia-h100-x4): 1, 2 and 4 workers, each
# worker count cold (a fresh compile cache: one worker compiles, the others load its artifact)
# and warm (the cluster's second job: compile.cache_dir holds the artifact the cold run left).
# From the checkout root on the GPU machine, with the device bundle (../shared/device/README.md):
#   source .devbundle/install.sh && bash benchmarks/scaling_x4.sh pixart|wan|all OUTDIR
# pixart: PixArt-alpha 1024², 20 steps, compile O3, random weights at the published size.
#   Cold 64 prompts per worker (1: 64, 2: 128, 4: 256); warm 64, 128 and the 1,000-prompt
#   4-worker job (the acceptance's whole span with a warm cache); run.shard_size=4.
#   One bench command: groups 1+2 (GPUs 0 | 1,2, at once) cold, 1+2 warm, 4 cold, 4 warm.
# wan: Wan 2.1 T2V 1.3B, 480x832 x 33 frames, 20 steps, O3 + step reuse (residual, 15 of 20
#   steps computed, as in 2026-11-25-step-reuse-h100.md), 16 prompts per worker (1: 16, 2: 32,
#   4: 64; at 8 a worker, 2026-11-26, the last video's tail was ~15 % of the steady window),
#   run.shard_size=1 (a video is ~5 s: shards of one keep the 4 workers' tails even);
#   groups 1+2 cold, 1+2 warm, 4 cold, 4 warm.
# all: pixart then wan.
# One command on the device is at most 10 minutes, and a phase is more (measured on 4 H100s,
# 2026-11-26-scaling-h100x4.md): ONLY=1+2 runs that group alone, ONLY=4 the 4-worker group, each
# with resume=true, so the second call keeps the first's rows (the 1-worker base) and adds its own.
# Their walls there: pixart 1+2 cold 150 s + warm 100 s = 250 s; 4 cold 145 s + 4 warm 1,000
# prompts ~220 s (ready 46 s, 6.1 images/s) = ~365 s. wan (at 8 a worker) 1+2 cold 214 s + warm
# 96 s, 4 cold 156 s; at 16 a worker ~380 s (ONLY=1+2) and ~315 s (ONLY=4).
# Always resume=true: a fresh machine has no /tmp/scaling-*, a warm one goes on with it; to start
# over there, remove /tmp/scaling-PHASE first.
# Each bench is limited to 560 s (timeout: room for the copies in one 600 s device command); what
# finished is kept (the bench writes scaling.json after every group). Sizes: PIXART_PER_WORKER,
# PIXART_WARM (warm prompts per worker count), WAN_PER_WORKER; 8 GPUs: PIXART_WORKERS=1+2+4,8
# PIXART_WARM=64,128,256,2000 (and WAN_WORKERS).
# Every figure is in OUTDIR/<pixart|wan>/scaling.json, one row per run (cache cold|warm):
# first_ready_s / all_ready_s (the job's clock: Ray's start included), worker_ready_s (the slowest
# worker's own Worker() to ready; per rank in worker_ready_s_by_rank), model_load_s, cache_wait_s,
# span_s / span_efficiency (against one worker doing the same prompts, same cache), steady_items_per_s
# / steady_efficiency, compiled / loaded, gpu_util; with scaling.txt/.svg/.png, each run's
# summary.json and metrics/ (w1/, w1-warm/, ...), and the log. The media stay in /tmp.
set -u
phase=$1; out=$2; mkdir -p "$out"
source "$(dirname "$0")/keep.sh"
versions
ONLY=${ONLY:+only=$ONLY}   # one group of the bench now (see above), else all of them
keep() { keep_runs "$1" "$out/$2" 'w[0-9]*' 'scaling.*'; }   # the table and each run's figures

table() {  # the short table, and each run's workers' own start-up
  python3 - "$out/$1/scaling.json" <<'EOF'
import glob, json, os, sys
from runner.bench.scaling import SHORT
from runner.outputs import format_table
rows = json.load(open(sys.argv[1]))["rows"]
print(format_table(rows, SHORT))
f = lambda v: "-" if v is None else f"{v:.1f}"
for r in rows:
    print(f"{r['run']:>8}: worker_ready_s by rank {r.get('worker_ready_s_by_rank')}, model_load_s "
          f"{f(r.get('model_load_s'))}, cache_wait_s {f(r.get('cache_wait_s'))}, warm-up with cache "
          f"{f(r.get('warmup_with_cache_s'))} / with compile {f(r.get('warmup_with_compile_s'))}")
    # the slowest worker's start-up by part, and Dynamo/Inductor's largest phases (its metrics)
    ms = [json.load(open(p)) for p in glob.glob(f"{os.path.dirname(sys.argv[1])}/{r['run']}/metrics/worker-*.json")]
    if ms:
        w = max(ms, key=lambda m: m.get("ready_at") or 0)
        top = sorted((w.get("compile_times_s") or {}).items(), key=lambda kv: -kv[1])[:6]
        print(f"{'':>10}startup_parts_s {({k: round(v, 1) for k, v in (w.get('startup_parts_s') or {}).items()})}; "
              f"compile_times_s {dict(top)}")
EOF
}

t0=$SECONDS
if [ "$phase" = pixart ] || [ "$phase" = all ]; then
  timeout 560 python3 -m runner.bench.scaling job=pixart_batch workers=${PIXART_WORKERS:-1+2,4} \
      prompts_per_worker=${PIXART_PER_WORKER:-64} cache=both warm_prompts=${PIXART_WARM:-64,128,1000} \
      model.source=random compile.mode=O3 run.shard_size=4 out=/tmp/scaling-pixart $ONLY resume=true \
      > "$out/pixart.log" 2>&1
  echo "pixart: exit $? after $((SECONDS - t0)) s"
  keep /tmp/scaling-pixart pixart
  table pixart
fi
t1=$SECONDS
if [ "$phase" = wan ] || [ "$phase" = all ]; then
  timeout 560 python3 -m runner.bench.scaling job=wan_batch workers=${WAN_WORKERS:-1+2,4} \
      prompts_per_worker=${WAN_PER_WORKER:-16} cache=both model.source=random compile.mode=O3 \
      generation.num_frames=33 generation.num_inference_steps=20 step_cache.method=residual \
      step_cache.compute_ratio=0.75 step_cache.first_blocks=1 run.shard_size=1 \
      out=/tmp/scaling-wan $ONLY resume=true > "$out/wan.log" 2>&1
  echo "wan: exit $? after $((SECONDS - t1)) s"
  keep /tmp/scaling-wan wan
  table wan
fi
