#!/usr/bin/env bash
# Issue 59's tables on a 2-GPU machine (nvidia-h100-x2), two device commands of < 10 minutes:
#   PHASE=1  GPU 0: Wan 2.2 T2V A14B Lightning 720x1280x81, 4 steps (2 + 2), a random rank-64 adapter
#            per expert: job O3 on one 80 GB GPU (FP8 weights), its memory peak (e2).
#            GPU 1: tests/test_gpu_adapters.py (the fused adapter on the full-size 14B and A14B
#            expert against diffusers' unfused path; FP8 with an adapter), then Wan 2.1 1.3B
#            480x832x81, 4 steps, guidance 1.0, O3: GPU busy and the fixed costs (e3)
#   PHASE=2  Wan 2.1 T2V 14B LightX2V (a random rank-64 adapter, original Wan layout) 480x832x81, 4
#            steps, guidance 1.0: job O3 (adapter fused) on GPU 0 beside diffusers + the adapter
#            fused (load_lora_weights, fuse_lora) + torch.compile on GPU 1 (vs_loop lanes=2) (e1)
#   PHASE=3  FastWan TI2V-5B 704x1280x121, 3 steps, job O3 (e4)
#   PHASE=4  (one H100, nvidia-h100-x1) the 14B LightX2V job arm alone (e5), then the adapter and
#            int8-attention gpu tests
# From the checkout root with the bundle:
#   source .devbundle/install.sh && PHASE=1 bash benchmarks/distill_x2.sh DIR
# DIR gets <exp>.log, <exp>.json (vs_loop.json) and versions.txt.
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
  lora /tmp/dx/l14.safetensors preset=wan21_t2v_14b rank=64 layout=original
  run e1 0,1 job=wan_distill_batch $R "model.adapters=[{path: /tmp/dx/l14.safetensors}]" \
      prompts=3 arms=job,loop_compile modes=O3 lanes=2
}
e2() {
  lora /tmp/dx/la1.safetensors preset=wan22_t2v_a14b_lightning rank=64 layout=original
  lora /tmp/dx/la2.safetensors preset=wan22_t2v_a14b_lightning rank=64 layout=original expert=transformer_2 seed=1
  run e2 0 job=wan22_lightning_batch $R prompts=2 arms=job modes=O3 \
      "model.adapters=[{path: /tmp/dx/la1.safetensors}, {path: /tmp/dx/la2.safetensors, expert: transformer_2}]"
}
e3() {
  run e3 1 job=wan_batch $R prompts=6 arms=job modes=O3 generation.num_frames=81 \
      generation.num_inference_steps=4 generation.guidance_scale=1.0
}
e4() { run e4 0 job=fastwan_batch $R prompts=3 arms=job modes=O3; }
e5() {
  lora /tmp/dx/l14.safetensors preset=wan21_t2v_14b rank=64 layout=original
  LIMIT=290 run e5 0 job=wan_distill_batch $R "model.adapters=[{path: /tmp/dx/l14.safetensors}]" \
      prompts=4 arms=job modes=O3
}
tests4() {
  CUDA_VISIBLE_DEVICES=0 timeout 160 python3 -m pytest -m gpu tests/test_int8_attention.py \
      tests/test_gpu_adapters.py -v -s -p no:cacheprovider -k "not full_size_wan_self" \
      > "$Q/tests4.log" 2>&1
  echo "rc=$?" >> "$Q/tests4.log"
}
tests() {
  CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m pytest -m gpu tests/test_gpu_adapters.py -v -s \
      -p no:cacheprovider > "$Q/tests.log" 2>&1
  echo "rc=$?" >> "$Q/tests.log"
}
case ${PHASE:-1} in
  1) e2 & { tests; LIMIT=$((560 - SECONDS)) e3; } & ;;
  2) e1 & ;;
  3) e4 & ;;
  4) { e5; tests4; } & ;;
esac
wait
