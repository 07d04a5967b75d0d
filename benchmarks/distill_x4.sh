#!/usr/bin/env bash
# Issue 59's tables on a 4-GPU machine (nvidia-h100-x4), one device command, all at once:
#   GPUs 0+1  Wan 2.1 T2V 14B LightX2V (a random rank-64 adapter, original Wan layout) 480x832x81,
#             4 steps, guidance 1.0: job O3 (adapter fused) beside diffusers + the adapter fused
#             (load_lora_weights, fuse_lora) + torch.compile (vs_loop lanes=2: a GPU each)
#   GPU 2     Wan 2.2 T2V A14B Lightning 720x1280x81, 4 steps (2 + 2), a random adapter per expert:
#             job O3 on one 80 GB GPU (FP8 weights), its memory peak
#   GPU 3     Wan 2.1 1.3B 480x832x81, 4 steps, guidance 1.0 (O3: GPU busy, the fixed costs), then
#             FastWan TI2V-5B 704x1280x121, 3 steps (O3)
# From the checkout root with the bundle: source .devbundle/install.sh && bash benchmarks/distill_x4.sh DIR
# DIR gets <table>.log and <table>.json (vs_loop.json) and versions.txt; EXPS="e1 e3" runs those.
set -u
Q=${1:?usage: distill_x4.sh DIR}
mkdir -p "$Q" /tmp/dx
source "$(dirname "$0")/keep.sh"
export TORCHINDUCTOR_CACHE_DIR=/tmp/dx/inductor
R="model.source=random compile.cache_dir=/tmp/dx/cc"
versions > "$Q/versions.txt" 2>&1
lora() { python3 -m runner.bench.lora out="$1" "${@:2}" > /dev/null; }
run() {   # run NAME GPUS vs_loop-args...
  local name=$1 gpus=$2; shift 2
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$gpus timeout ${LIMIT:-560} python3 -m runner.bench.vs_loop "$@" \
      out=/tmp/dx/media-$name > "$Q/$name.log" 2>&1
  echo "rc=$? in $((SECONDS - t0)) s" >> "$Q/$name.log"
  cp /tmp/dx/media-$name/vs_loop.json "$Q/$name.json" 2>/dev/null
  return 0
}
e1() {
  lora /tmp/dx/l14.safetensors preset=wan21_t2v_14b rank=64 layout=wan
  run e1 0,1 job=wan_distill_batch $R "model.adapters=[{path: /tmp/dx/l14.safetensors}]" \
      prompts=3 arms=job,loop_compile modes=O3 lanes=2
}
e2() {
  lora /tmp/dx/la1.safetensors preset=wan22_t2v_a14b_lightning rank=64 layout=wan
  lora /tmp/dx/la2.safetensors preset=wan22_t2v_a14b_lightning rank=64 layout=wan expert=transformer_2 seed=1
  run e2 2 job=wan22_lightning_batch $R prompts=2 arms=job modes=O3 \
      "model.adapters=[{path: /tmp/dx/la1.safetensors}, {path: /tmp/dx/la2.safetensors, expert: transformer_2}]"
}
e3() {
  run e3 3 job=wan_batch $R prompts=6 arms=job modes=O3 generation.num_frames=81 \
      generation.num_inference_steps=4 generation.guidance_scale=1.0
  LIMIT=$((560 - SECONDS)) run e3b 3 job=fastwan_batch $R prompts=3 arms=job modes=O3
}
for e in ${EXPS:-e1 e2 e3}; do $e & done
wait
