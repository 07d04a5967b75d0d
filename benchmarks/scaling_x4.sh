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
#   steps computed, as in 2026-11-25-step-reuse-h100.md), 8 prompts per worker (1: 8, 2: 16,
#   4: 32), run.shard_size=1 (a video is ~5 s: shards of one keep the 4 workers' tails even);
#   groups 1+2 cold, 1+2 warm, 4 cold, 4 warm.
# all: pixart then wan (~16 min: more than one 10-minute device command; run the two phases as
#   two commands there).
# Wall time (H100, from known figures: PixArt O3 ~1.5 images/s per worker, cold first ready ~55 s
# (compile ~34 s), warm ~20 s (Ray and process start ~10 s, load ~6 s, warm-up ~6 s); Wan 1.3B
# 33f/20 O3 + residual ~0.195 videos/s per worker (5.1 s/video), cold ready ~85 s, warm ~40 s;
# + ~5 s per run for Ray's shutdown, ~10 s for the bench itself):
#   pixart: 1+2 cold ~105 s (55 + 64/1.5 = 98 s; the 2-worker run ~101 s) + 1+2 warm ~68 s
#           + 4 cold ~106 s (55 + 256/6 + ramp) + 4 warm 1,000 ~192 s (20 + 1000/6) ≈ 480 s
#   wan:    1+2 cold ~136 s (85 + 8 x 5.1 + ramp) + 1+2 warm ~87 s + 4 cold ~136 s
#           + 4 warm ~87 s ≈ 460 s
# Each bench is limited to 560 s (timeout: room for the copies in one 600 s device command); what finished is kept (the bench writes scaling.json
# after every group). Sizes: PIXART_PER_WORKER, PIXART_WARM (warm prompts per worker count),
# WAN_PER_WORKER; 8 GPUs: PIXART_WORKERS=1+2+4,8 PIXART_WARM=64,128,256,2000 (and WAN_WORKERS).
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
keep() { keep_runs "$1" "$out/$2" 'w[0-9]*' 'scaling.*'; }   # the table and each run's figures

table() {  # the short table, and each run's workers' own start-up
  python3 - "$out/$1/scaling.json" <<'EOF'
import json, sys
from runner.bench.scaling import SHORT
from runner.outputs import format_table
rows = json.load(open(sys.argv[1]))["rows"]
print(format_table(rows, SHORT))
f = lambda v: "-" if v is None else f"{v:.1f}"
for r in rows:
    print(f"{r['run']:>8}: worker_ready_s by rank {r.get('worker_ready_s_by_rank')}, model_load_s "
          f"{f(r.get('model_load_s'))}, cache_wait_s {f(r.get('cache_wait_s'))}, warm-up with cache "
          f"{f(r.get('warmup_with_cache_s'))} / with compile {f(r.get('warmup_with_compile_s'))}")
EOF
}

t0=$SECONDS
if [ "$phase" = pixart ] || [ "$phase" = all ]; then
  timeout 560 python3 -m runner.bench.scaling job=pixart_batch workers=${PIXART_WORKERS:-1+2,4} \
      prompts_per_worker=${PIXART_PER_WORKER:-64} cache=both warm_prompts=${PIXART_WARM:-64,128,1000} \
      model.source=random compile.mode=O3 run.shard_size=4 out=/tmp/scaling-pixart \
      > "$out/pixart.log" 2>&1
  echo "pixart: exit $? after $((SECONDS - t0)) s"
  keep /tmp/scaling-pixart pixart
  table pixart
fi
t1=$SECONDS
if [ "$phase" = wan ] || [ "$phase" = all ]; then
  timeout 560 python3 -m runner.bench.scaling job=wan_batch workers=${WAN_WORKERS:-1+2,4} \
      prompts_per_worker=${WAN_PER_WORKER:-8} cache=both model.source=random compile.mode=O3 \
      generation.num_frames=33 generation.num_inference_steps=20 step_cache.method=residual \
      step_cache.compute_ratio=0.75 step_cache.first_blocks=1 run.shard_size=1 \
      out=/tmp/scaling-wan > "$out/wan.log" 2>&1
  echo "wan: exit $? after $((SECONDS - t1)) s"
  keep /tmp/scaling-wan wan
  table wan
fi
