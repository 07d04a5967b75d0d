#!/usr/bin/env bash
# Issue 40's scaling tables on a 2-GPU H100 machine (nvidia-h100-x2): the same job with 1, then 2
# workers (each run its own local Ray and a fresh compile cache: one worker compiles, the other
# loads its artifact), one command per table. From the checkout root on the GPU machine, with the
# device bundle (../shared/device/README.md: diffusers, ray, omegaconf, imageio-ffmpeg, cache-dit):
#   source .devbundle/install.sh && bash benchmarks/scaling_x2.sh a|b|ab OUTDIR
# a: PixArt-alpha 1024², 20 steps, compile O3, 256 prompts (PROMPTS_A to change)
# b: Latte-1 512² x 16 frames, 50 steps, O3 + step reuse (residual), 32 prompts (PROMPTS_B)
# ab: both, one after the other (each is sized to end within one 10-minute device command)
# Every figure is in OUTDIR/<pixart|latte>/scaling.json, one row per worker count: span_s and
# span_items_per_s / span_efficiency (the job's start to its last item, start-up included),
# steady_items_per_s / steady_efficiency, all_ready_s / ready_ratio, compiled / loaded, gpu_util
# (NVML, per GPU), driver_cpu_s_per_shard; with scaling.txt/.svg/.png, each run's summary.json and
# metrics/ (w1/, w2/), and the log. The media stay in /tmp.
set -u
phase=$1; out=$2; mkdir -p "$out"
source "$(dirname "$0")/keep.sh"
versions
keep() { keep_runs "$1" "$out/$2" 'w[0-9]*' 'scaling.*'; }   # the table and each run's figures

if [ "$phase" = a ] || [ "$phase" = ab ]; then
  timeout 580 python3 -m runner.bench.scaling job=pixart_batch workers=1,2 prompts=${PROMPTS_A:-256} \
      model.source=random compile.mode=O3 out=/tmp/scaling-pixart > "$out/pixart.log" 2>&1
  keep /tmp/scaling-pixart pixart
  tail -20 "$out/pixart.log"
fi
if [ "$phase" = b ] || [ "$phase" = ab ]; then
  timeout 580 python3 -m runner.bench.scaling job=latte_batch workers=1,2 prompts=${PROMPTS_B:-32} \
      model.source=random compile.mode=O3 step_cache.method=residual out=/tmp/scaling-latte \
      > "$out/latte.log" 2>&1
  keep /tmp/scaling-latte latte
  tail -20 "$out/latte.log"
fi
