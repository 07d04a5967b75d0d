#!/usr/bin/env bash
# Issue 36's measurements on a 2-GPU H100 machine (nvidia-h100-x2), two tables at a time, one per
# GPU, each table's arms in one command. From the checkout root on the GPU machine, with the device
# bundle (../shared/device/README.md: diffusers, ray, omegaconf, imageio-ffmpeg, cache-dit):
#   source .devbundle/install.sh && bash benchmarks/step_reuse_h100.sh a|b OUTDIR
# a: Wan VAE decode variants + gpu tests (GPU 0); PixArt-a table, Latte-1 reuse job (GPU 1)
# b: Wan 2.1 1.3B 33 frames x 20 steps table, Wan VAE gpu test (GPU 0); 81 frames x 50 steps (GPU 1)
# c: the PixArt-a table alone (one GPU)
# d: both tables at once on nvidia-h100-x2, each alone on its GPU with half the host's cores
#    (taskset, 16 of 32: what a 1-GPU machine has), arms in one command each; then the VAE test
# f: issue 46's unconditional-branch reuse on one GPU: Wan 2.1 1.3B 81 frames x 50 steps, LeMiCa
#    B=25, O3+residual against O3+residual+cfg (s/video, PSNR of the decoded frames against the
#    job without cfg_reuse), then its gpu test (full-size O3 + residual + cfg_reuse)
set -u
phase=$1; out=$2; mkdir -p "$out"
python3 -c "import torch, triton, diffusers, cache_dit; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, 'cache-dit', cache_dit.__version__)"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
# LeMiCa's published 50-step schedule for Wan 2.1 T2V 1.3B, budget B=25 (LeMiCa4Wan2.1)
LEMICA25='[0,1,2,3,4,5,6,7,8,9,10,11,12,14,16,18,21,24,29,35,40,44,47,48,49]'
if [ "$phase" = a ]; then
  (
    CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m runner.bench.decode model=wan21_t2v_1_3b frames=81 iters=3 out="$out/decode81.json"
    CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        tests/test_video_vae.py tests/test_step_reuse.py tests/test_step_cache.py -k full_size
  ) > "$out/gpu0.log" 2>&1 &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 420 python3 -m runner.bench.vs_loop job=pixart_batch model.source=random \
        prompts=16 arms=loop,cachedit,job modes=O3,O3+residual step_cache.compute_ratio=0.7 \
        step_cache.first_blocks=1 out=/tmp/pixart
    cp /tmp/pixart/vs_loop.json "$out/pixart_vs_loop.json"
    CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m runner.bench.vs_loop job=latte_batch model.source=random \
        prompts=8 arms=job modes=O3+residual out=/tmp/latte
    cp /tmp/latte/vs_loop.json "$out/latte_vs_loop.json"
  ) > "$out/gpu1.log" 2>&1 &
elif [ "$phase" = b ]; then
  # b: Wan 2.1 1.3B 33 frames x 20 steps table, then the Wan VAE gpu test (GPU 0); 81 frames x 50
  # steps (GPU 1)
  (
    CUDA_VISIBLE_DEVICES=0 timeout 480 python3 -m runner.bench.vs_loop job=wan_batch model.source=random \
        prompts=4 arms=loop,cachedit,job modes=O3,O3+residual step_cache.compute_ratio=0.75 \
        step_cache.first_blocks=1 out=/tmp/wan33
    cp /tmp/wan33/vs_loop.json "$out/wan33_vs_loop.json"
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        tests/test_video_vae.py -k full_size
  ) > "$out/gpu0.log" 2>&1 &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 560 python3 -m runner.bench.vs_loop job=wan_batch model.source=random \
        prompts=2 arms=job modes=O3,O3+residual generation.num_frames=81 generation.num_inference_steps=50 \
        "step_cache.compute_steps=$LEMICA25" step_cache.first_blocks=1 out=/tmp/wan81
    cp /tmp/wan81/vs_loop.json "$out/wan81_vs_loop.json"
  ) > "$out/gpu1.log" 2>&1 &
elif [ "$phase" = d ]; then
  export TORCHINDUCTOR_COMPILE_THREADS=16
  (
    CUDA_VISIBLE_DEVICES=0 timeout 590 taskset -c 0-15 python3 -m runner.bench.vs_loop job=wan_batch \
        model.source=random prompts=4 arms=job,cachedit,loop modes=O3,O3+residual \
        step_cache.compute_ratio=0.75 step_cache.first_blocks=1 out=/tmp/wan33
    cp /tmp/wan33/vs_loop.json "$out/wan33_vs_loop.json"; cp /tmp/wan33/*.json "$out/" 2>/dev/null
  ) > "$out/gpu0.log" 2>&1 &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 590 taskset -c 16-31 python3 -m runner.bench.vs_loop job=pixart_batch \
        model.source=random prompts=16 arms=job,loop,cachedit modes=O3,O3+residual \
        step_cache.compute_ratio=0.7 step_cache.first_blocks=1 out=/tmp/pixart
    cp /tmp/pixart/vs_loop.json "$out/pixart_vs_loop.json"
  ) > "$out/gpu1.log" 2>&1 &
elif [ "$phase" = e ]; then
  # e: the Wan 33-frame table in one command on nvidia-h100-x2: the job's arms on GPU 0, the loops'
  # on GPU 1 at once (vs_loop lanes=2; they share the host's 32 cores); then the VAE gpu test
  timeout 480 python3 -m runner.bench.vs_loop job=wan_batch model.source=random prompts=${PROMPTS:-8} \
      arms=loop,cachedit,job modes=O3,O3+residual lanes=2 step_cache.compute_ratio=0.75 \
      step_cache.first_blocks=1 out=/tmp/wan33 > "$out/gpu0.log" 2>&1 &
  wait
  cp /tmp/wan33/*.json "$out/"
  [ "${VAE:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=1 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_video_vae.py -k full_size > "$out/gpu1.log" 2>&1
elif [ "$phase" = f ]; then
  (
    timeout 590 python3 -m runner.bench.vs_loop job=wan_batch model.source=random prompts=${PROMPTS:-3} \
        arms=job modes=O3+residual,O3+residual+cfg generation.num_frames=81 \
        generation.num_inference_steps=50 "step_cache.compute_steps=$LEMICA25" \
        step_cache.first_blocks=1 out=/tmp/wan81cfg
    cp /tmp/wan81cfg/vs_loop.json "$out/wan81_cfg_vs_loop.json"
    cp /tmp/wan81cfg/job-O3-residual-cfg/metrics/*.json "$out/" 2>/dev/null
    timeout 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_cfg_reuse.py -k full_size
  ) > "$out/gpu0.log" 2>&1 &
else
  # c: the PixArt-a table alone on one GPU (its cachedit arm compiled past 6 minutes in (a), beside
  # another table's compiles)
  (
    timeout 570 python3 -m runner.bench.vs_loop job=pixart_batch model.source=random \
        prompts=16 arms=job,loop,cachedit modes=O3,O3+residual step_cache.compute_ratio=0.7 \
        step_cache.first_blocks=1 out=/tmp/pixart
    cp /tmp/pixart/vs_loop.json "$out/pixart_vs_loop.json"
  ) > "$out/gpu0.log" 2>&1 &
fi
wait
for f in "$out"/gpu*.log; do echo "=== $f"; grep -v "Cache-DiT" "$f" | tail -40; done
