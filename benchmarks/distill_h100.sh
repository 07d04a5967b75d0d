#!/usr/bin/env bash
# Issue 59's H100 tables, one device command each on one H100 (nvidia-h100-x1), chained on the warm
# machine (its compile caches under /tmp/dh carry over from one command to the next):
#   PHASE=a  Wan 2.1 T2V 14B LightX2V 480x832x81, 4 steps, guidance 1.0, a random rank-64 adapter in
#            LightX2V's layout: job O3 (adapter fused; 14 prompts, so the steady figure is a long
#            run's), then diffusers + the same adapter fused + torch.compile (3 prompts) (h1)
#   PHASE=b  Wan 2.2 T2V A14B Lightning 720x1280x81, 4 steps (2 + 2), a random rank-64 adapter per
#            expert: job O3 (FP8 weights), its load and serving memory peaks (h2); AnyFlow 1.3B 4
#            steps, 16 prompts, job O3: GPU busy (h3)
#   PHASE=c, d  on two GPUs of an x4 machine beside the gpu suite on the other two
#            (benchmarks/x4.sh mixed): GPU 2 the 14B job, AnyFlow, FastWan; GPU 3 the 14B peer,
#            A14B 720P
#   PHASE=g  PHASE=b's A14B 720P alone (limit H2_LIMIT s, default 380)
#   PHASE=h  Wan 2.2 I2V A14B Lightning 720x1280x81, 4 steps (2 + 2), a random rank-64 adapter per
#            expert, drawn images: job O3 (FP8 weights), s/video and memory peaks (h5)
#   PHASE=i  Wan 2.1 I2V 14B 720x1280x81 O3 (FP8 weights), 4 steps with CFG (the published 40 would
#            take ~13 min a video: its memory peaks, not its speed) (h6)
#   PHASE=e, f  the 14B job beside its peer, then AnyFlow, on an x2 (benchmarks/x4.sh pair)
#   PHASE=j  PHASE=c without AnyFlow (the 14B job, then FastWan), beside PHASE=d (x4.sh tables)
# (2026-11-28: PHASE=a's job took 338 s, its peer ~210 s on an H200; the calls' limit is 600 s.)
# From the checkout root with the bundle:
#   source .devbundle/install.sh && PHASE=a bash benchmarks/distill_h100.sh DIR
# DIR gets <exp>.log, <exp>.json (vs_loop.json), <exp>/ (the job's summary and metrics), versions.txt.
set -u
Q=${1:?usage: distill_h100.sh DIR}
mkdir -p "$Q" /tmp/dh
source "$(dirname "$0")/keep.sh"
export TORCHINDUCTOR_CACHE_DIR=/tmp/dh/inductor
R="model.source=random compile.cache_dir=/tmp/dh/cc"
versions > "$Q/versions.txt" 2>&1
lora() { python3 -m runner.bench.lora out="$1" "${@:2}" > /dev/null; }
run() {   # run NAME LIMIT vs_loop-args...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  limit=$(by_deadline "$limit")   # x4.sh's deadline bounds every run's own limit
  timeout "$limit" python3 -m runner.bench.vs_loop "$@" out=/tmp/dh/media-$name > "$Q/$name.log" 2>&1
  echo "rc=$? in $((SECONDS - t0)) s" >> "$Q/$name.log"
  cp /tmp/dh/media-$name/vs_loop.json "$Q/$name.json" 2>/dev/null
  keep_runs /tmp/dh/media-$name "$Q/$name" "*" > /dev/null
  return 0
}
l14() { lora "$1" preset=wan21_t2v_14b rank=64 layout=original diffs=true; }
a14() {
  lora /tmp/dh/la1.safetensors preset=wan22_t2v_a14b_lightning rank=64 layout=original
  lora /tmp/dh/la2.safetensors preset=wan22_t2v_a14b_lightning rank=64 layout=original \
      expert=transformer_2 seed=1
  run h2 "$1" job=wan22_lightning_batch $R prompts=3 arms=job modes=O3 \
      "model.adapters=[{path: /tmp/dh/la1.safetensors}, {path: /tmp/dh/la2.safetensors, expert: transformer_2}]"
}
case ${PHASE:-a} in
  # x4, beside the gpu suite on GPUs 0-1 (`benchmarks/x4.sh mixed`): one chain a GPU
  c) l14 /tmp/dh/l14c.safetensors     # GPU 2: the 14B job, then AnyFlow, then FastWan
     run h1job 370 job=wan_distill_batch $R "model.adapters=[{path: /tmp/dh/l14c.safetensors}]" \
         prompts=14 arms=job modes=O3
     run h3 120 job=anyflow_batch $R prompts=16 arms=job modes=O3
     run h4 $((575 - SECONDS)) job=fastwan_batch $R prompts=3 arms=job modes=O3 ;;
  j) l14 /tmp/dh/l14j.safetensors     # x4.sh tables, GPU 2: the 14B job, then FastWan
     run h1job 370 job=wan_distill_batch $R "model.adapters=[{path: /tmp/dh/l14j.safetensors}]" \
         prompts=14 arms=job modes=O3
     run h4 $((575 - SECONDS)) job=fastwan_batch $R prompts=3 arms=job modes=O3 ;;
  # x2 (`benchmarks/x4.sh pair`): GPU 0 the 14B job alone, GPU 1 the 14B peer then AnyFlow
  e) l14 /tmp/dh/l14e.safetensors
     run h1job 400 job=wan_distill_batch $R "model.adapters=[{path: /tmp/dh/l14e.safetensors}]" \
         prompts=14 arms=job modes=O3 ;;
  f) l14 /tmp/dh/l14f.safetensors
     run h1peer 255 job=wan_distill_batch $R "model.adapters=[{path: /tmp/dh/l14f.safetensors}]" \
         prompts=3 arms=loop_compile
     run h3 $((400 - SECONDS)) job=anyflow_batch $R prompts=16 arms=job modes=O3 ;;
  d) l14 /tmp/dh/l14d.safetensors     # GPU 3: the 14B peer, then A14B 720P
     run h1peer 255 job=wan_distill_batch $R "model.adapters=[{path: /tmp/dh/l14d.safetensors}]" \
         prompts=3 arms=loop_compile
     a14 $((575 - SECONDS)) ;;
  a) l14 /tmp/dh/l14.safetensors      # 14 + 3 videos one after the other: ~580 s on an H100
     A="model.adapters=[{path: /tmp/dh/l14.safetensors}]"
     run h1job 360 job=wan_distill_batch $R "$A" prompts=14 arms=job modes=O3
     run h1peer $((590 - SECONDS)) job=wan_distill_batch $R "$A" prompts=3 arms=loop_compile ;;
  g) a14 "${H2_LIMIT:-380}" ;;        # A14B 720P alone, on what time is left (x4.sh a14)
  h) lora /tmp/dh/li1.safetensors preset=wan22_i2v_a14b_lightning rank=64 layout=original
     lora /tmp/dh/li2.safetensors preset=wan22_i2v_a14b_lightning rank=64 layout=original \
         expert=transformer_2 seed=1
     run h5 570 job=wan22_i2v_lightning_batch $R prompts=3 arms=job modes=O3 images=all \
         "model.adapters=[{path: /tmp/dh/li1.safetensors}, {path: /tmp/dh/li2.safetensors, expert: transformer_2}]" ;;
  i) run h6 570 job=wan_i2v_batch model.preset=wan21_i2v_14b_720p generation.height=720 \
         generation.width=1280 generation.num_inference_steps=4 $R prompts=2 arms=job modes=O3 \
         images=all ;;
  b) lora /tmp/dh/la1.safetensors preset=wan22_t2v_a14b_lightning rank=64 layout=original
     lora /tmp/dh/la2.safetensors preset=wan22_t2v_a14b_lightning rank=64 layout=original \
         expert=transformer_2 seed=1
     run h2 380 job=wan22_lightning_batch $R prompts=3 arms=job modes=O3 \
         "model.adapters=[{path: /tmp/dh/la1.safetensors}, {path: /tmp/dh/la2.safetensors, expert: transformer_2}]"
     run h3 $((575 - SECONDS)) job=anyflow_batch $R prompts=16 arms=job modes=O3 ;;
esac
