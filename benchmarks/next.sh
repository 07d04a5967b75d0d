#!/usr/bin/env bash
# What issues 46 and 48 still need from a GPU machine, as foreground phases of under 10 minutes,
# one device command each, every figure tarred into OUT/r.tgz (media left out):
#   ab       GPU 0: the ready-time A/B against a9a589a (ready_ab.sh) of PixArt-α O3; GPU 1: of
#            Latte (issue 46's ready bound; ~3-4 min each: two cold jobs)
#   tables   GPU 0: TI2V-5B's image rows with the cachedit arm (families_x4.sh ti2v_img, ~8 min
#            estimated); GPU 1: the Latte O3 + reuse
#            table (issue 46's >= 0.27 videos/s)
#   both     4 GPUs: tables on GPUs 0 and 1, ab on GPUs 2 and 3, at once
#   pixart12 4 GPUs: scaling_x4.sh pixart, its 1+2 group (1 and 2 workers, cold then warm: ~250 s),
#            and meanwhile on the fourth GPU the one gpu test that failed on 2026-11-26 (test_models
#            -k finite_check; a fixture's fault, since mended), then Inductor's torch_key timed
#            alone (load_probe.py and warm_probe.py ran on one H100 on 2026-11-27: startup_probe.sh)
#   pixart4  4 GPUs: then its 4-worker group, cold and the warm 1,000-prompt job (~365 s; the same
#            bench goes on: run it on the machine pixart12 ran on, within its 30 s idle release)
#   wan12, wan4  the same for scaling_x4.sh wan (~380 s, ~315 s)
#   suite    the whole gpu suite, a test process per GPU (334 s on 4 H100s, 501 s on 2, 2026-11-26;
#            354 s on 4 H100s, 2026-11-27)
#   ti2v_img one GPU: the TI2V image rows alone (~8 min: a one-GPU kind counts less device time)
#   round17  i2v14b on GPUs 0-1, the TI2V-5B decode with and without time Winograd on GPU 3
#            (runner.bench.decode variants=winograd), the Latte table on GPU 2 after 200 s
#   decode   GPU 0: runner.bench.decode variants=winograd; GPU 1: tests/test_video_vae.py's gpu tests
#   triton   GPU 0: the decode bench with the Winograd passes as Triton kernels, the kernels' gpu
#            tests; GPU 1: TI2V's full-size decode gpu tests with Winograd (Triton on and off)
#   triton4  x4: the decode bench at 1 and 2 latent frames a pass (GPU 0), test_video_vae.py's
#            gpu tests on GPUs 1-3
#   final18  x2: the decode bench as installed (GPU 0); the Triton gpu tests (GPU 1)
#   tune19   x4: the Winograd kernels' launch settings and their gpu tests (GPU 0); the TI2V
#            decode bench with conv_out direct as a row (GPU 1); TI2V's Triton decode and Wan
#            2.1's decode gpu tests (GPU 2); Wan 2.1's decode bench with time Winograd (GPU 3)
#   tune20   x4: the kernels' settings at the large shapes (GPUs 0-1), the decode benches with the
#            output convolution as one GEMM to its taps (Wan 2.1 GPU 2, TI2V GPU 3), gpu tests
#   tune21   x4: the same decode benches and gpu tests with the tuned settings, TI2V also at 4
#            latent frames a pass
#   final21  x2: TI2V's decode as installed (4 latent frames a pass) and at 2; its gpu tests
#   vaecode  GPU 0: that decode bench with TORCH_LOGS=output_code (the Winograd transforms' kernels)
#   i2v14b   GPUs 0 and 1: Wan 2.1 I2V 14B 480P's table in one command (its peer ran in a second one
#            on 2026-11-26), the job's arm and the peer's at once (`lanes=2`; ~6-7 min estimated
#            from that day's arms: job 183 s ready + 88 s a video, peer 127 s a video)
# Here first: `git archive -o .ab/a9a589a.tgz a9a589a`; carry .devbundle, .whl and .ab. There:
#   source .devbundle/install.sh && bash benchmarks/next.sh ab $OUT
# Not one background script: it lives only while the machine stays held, and on 2026-11-26 the
# machine was handed back twice between polling calls, the runs lost with their logs; a
# foreground command writes what it has into $OUT even when its limit ends it.
set -u
# Bytecode for every package first (pyc.sh: the lent machines keep none; a user's pip install does)
source "$(dirname "$0")/pyc.sh"
phase=${1:?usage: next.sh ab|tables|both|ti2v_img|i2v14b|round17|decode|triton|triton4|final18|tune19|tune20|tune21|final21|vaecode|pixart12|pixart4|wan12|wan4|suite OUT}; OUT=${2:?usage: next.sh PHASE OUT}
Q=/tmp/next-$phase; mkdir -p "$Q" "$OUT"
pack() { tar -czf "$OUT/r.tgz" -C /tmp --exclude='media-*' --exclude='*.mp4' --exclude='*.png' \
             "next-$phase"; }
trap pack EXIT   # also when the device's limit (timeout) ends the command

ab() {   # GPUs $1 and $2
  GPU=$1 JOBS=pixart_batch timeout 560 bash benchmarks/ready_ab.sh "$Q/ready-pixart" > "$Q/ready-pixart.log" 2>&1 &
  GPU=$2 JOBS=latte_batch timeout 560 bash benchmarks/ready_ab.sh "$Q/ready-latte" > "$Q/ready-latte.log" 2>&1 &
}
tables() {   # GPUs $1 and $2; ftfy's wheels installed once here, so the two lanes' own
             # once-only install cannot race (the image rows' peer-free job needs none)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  SKIP_SUITE=1 TABLES=ti2v_img GPUS=$1 timeout 560 bash benchmarks/families_x4.sh "$Q" &
  SKIP_SUITE=1 TABLES=latte GPUS=$2 timeout 560 bash benchmarks/families_x4.sh "$Q" &
}
decode_bench() {   # GPU $1, iters $2, log $3 (more environment before the call: TORCH_LOGS)
  CUDA_VISIBLE_DEVICES=$1 timeout 560 python3 -m runner.bench.decode model=wan22_ti2v_5b frames=121 \
      variants=winograd iters="$2" chunks="${CHUNKS:-auto}" out="$Q/decode_winograd.json" > "$3" 2>&1
}
case $phase in
  ab)     ab 0 1; wait ;;
  tables) tables 0 1; wait ;;
  both)   tables 0 1; ab 2 3; wait ;;
  i2v14b)
    SKIP_SUITE=1 TABLES=i2v14b GPUS=0 LANES=2 timeout 570 bash benchmarks/families_x4.sh "$Q" ;;
  round17)   # GPUs 0-1: i2v14b; GPU 3: the TI2V decode with time Winograd; GPU 2: Latte's
             # table once I2V's two lanes have compiled (~200 s) and are on their GPUs
    decode_bench 3 3 "$Q/decode_winograd.log" &
    ( sleep 200; SKIP_SUITE=1 TABLES=latte GPUS=2 timeout 360 bash benchmarks/families_x4.sh "$Q" ) &
    SKIP_SUITE=1 TABLES=i2v14b GPUS=0 LANES=2 timeout 570 bash benchmarks/families_x4.sh "$Q"
    wait; tail -12 "$Q/decode_winograd.log" ;;
  decode)    # GPU 0: the TI2V decode with and without time Winograd; GPU 1: its gpu tests
    ( CUDA_VISIBLE_DEVICES=1 timeout 560 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
        -p no:cacheprovider > "$Q/test_video_vae.log" 2>&1 ) &
    decode_bench 0 3 "$Q/decode_winograd.log"
    wait; tail -12 "$Q/decode_winograd.log"; grep -E "passed|failed|PSNR" "$Q/test_video_vae.log" ;;
  triton)    # GPU 0: the decode bench (Triton passes, Inductor's, no Winograd), then the kernels'
             # gpu tests; GPU 1: TI2V's full-size decode tests with Winograd, Triton on and off
    ( CUDA_VISIBLE_DEVICES=1 timeout 560 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
        -p no:cacheprovider -k "wan22_chunked_decode_matches_diffusers and 4" > "$Q/test_decode.log" 2>&1 ) &
    decode_bench 0 3 "$Q/decode_winograd.log"
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
        -p no:cacheprovider -k triton_winograd > "$Q/test_kernels.log" 2>&1
    wait; tail -8 "$Q/decode_winograd.log"; grep -E "passed|failed|PSNR|max abs|Error" "$Q"/test_*.log | tail -40 ;;
  triton4)   # x4. GPU 0: the decode bench, installed at 1 and 2 latent frames a pass, Inductor's
             # passes, no Winograd; GPUs 1-3: test_video_vae.py's gpu tests
    gt() { CUDA_VISIBLE_DEVICES=$1 timeout 560 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
             -p no:cacheprovider -k "$2" > "$Q/test_$1.log" 2>&1; }
    gt 1 "matches_diffusers and (0-False-1 or 4-False-1)" &
    gt 2 "matches_diffusers and 4-True" &
    gt 3 "triton_winograd or matches_eager" &
    CHUNKS=1,2 decode_bench 0 3 "$Q/decode_winograd.log"
    wait; tail -8 "$Q/decode_winograd.log"; grep -hE "passed |failed |PSNR|Error" "$Q"/test_*.log | tail -40 ;;
  final18)   # x2. GPU 0: the decode bench as installed (Triton passes, 2 latent frames a pass),
             # Inductor's passes, no Winograd; GPU 1: the kernels' and TI2V's Triton decode gpu tests
    ( CUDA_VISIBLE_DEVICES=1 timeout 560 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
        -p no:cacheprovider -k "triton_winograd or (matches_diffusers and 4-True)" > "$Q/test_1.log" 2>&1 ) &
    decode_bench 0 3 "$Q/decode_winograd.log"
    wait; tail -8 "$Q/decode_winograd.log"; grep -hE "passed |failed |PSNR|Error" "$Q"/test_*.log | tail -30 ;;
  tune19)    # x4. GPU 0: the Winograd passes' kernels per launch setting, then their gpu tests;
             # GPU 1: the TI2V decode bench (installed, conv_out direct, Inductor's passes, no
             # Winograd); GPU 2: TI2V's Triton decode gpu tests and Wan 2.1's; GPU 3: Wan 2.1's
             # decode bench with and without time Winograd (its passes as Triton kernels)
    ( CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m runner.bench.winograd_kernels \
          out="$Q/kernels.json" > "$Q/kernels.log" 2>&1
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
          -p no:cacheprovider -k triton_winograd > "$Q/test_0.log" 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=2 timeout 540 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
          -p no:cacheprovider -k "(matches_diffusers and 4-True) or matches_eager" > "$Q/test_2.log" 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=3 timeout 540 python3 -m runner.bench.decode model=wan21_t2v_1_3b \
          frames=81 variants=winograd iters=3 out="$Q/decode_wan21.json" > "$Q/decode_wan21.log" 2>&1 ) &
    decode_bench 1 3 "$Q/decode_winograd.log"
    wait; sed -n '/fastest/,$p' "$Q/kernels.log"; tail -8 "$Q/decode_winograd.log"
    tail -6 "$Q/decode_wan21.log"; grep -hE "passed |failed |PSNR|Error" "$Q"/test_*.log | tail -30 ;;
  tune20)    # x4. GPUs 0-1: the Winograd kernels' launch settings at the 176x320 and 352x640
             # shapes (tune19 timed out after the first three), then the taps and kernel gpu tests
             # (GPU 0) and Wan 2.1's decode test (GPU 1); GPU 2: Wan 2.1's decode bench, then
             # TI2V's Triton decode test; GPU 3: TI2V's decode bench (conv_out as taps and not)
    ( CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m runner.bench.winograd_kernels shapes=2,3 \
          iters=20 out="$Q/kernels_23.json" > "$Q/kernels_23.log" 2>&1
      CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
          -p no:cacheprovider -k "taps_conv or triton_winograd" > "$Q/test_0.log" 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m runner.bench.winograd_kernels shapes=4,5 \
          iters=20 out="$Q/kernels_45.json" > "$Q/kernels_45.log" 2>&1
      CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
          -p no:cacheprovider -k "matches_eager" > "$Q/test_1.log" 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=2 timeout 330 python3 -m runner.bench.decode model=wan21_t2v_1_3b \
          frames=81 variants=winograd iters=3 out="$Q/decode_wan21.json" > "$Q/decode_wan21.log" 2>&1
      CUDA_VISIBLE_DEVICES=2 timeout 200 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
          -p no:cacheprovider -k "matches_diffusers and 4-True-2" > "$Q/test_2.log" 2>&1 ) &
    decode_bench 3 3 "$Q/decode_winograd.log"
    wait; sed -n '/fastest/,$p' "$Q"/kernels_*.log; tail -7 "$Q/decode_winograd.log"
    tail -6 "$Q/decode_wan21.log"; grep -hE "passed |failed |PSNR|Error|max abs" "$Q"/test_*.log | tail -30 ;;
  tune21)    # x4, with the tuned launch settings, taps without a padded copy and the shortcut's
             # bias in winograd_out. GPU 0: TI2V's decode at 2 and 4 latent frames a pass
             # (variants=quick); GPU 1: TI2V's full decode table; GPU 2: the kernels', taps' and
             # TI2V's Triton decode gpu tests, then Wan 2.1's; GPU 3: Wan 2.1's decode table
    ( CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m runner.bench.decode model=wan22_ti2v_5b frames=121 \
          variants=quick chunks=2,4 iters=3 out="$Q/decode_quick.json" > "$Q/decode_quick.log" 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=2 timeout 330 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
          -p no:cacheprovider -k "taps_conv or triton_winograd or (matches_diffusers and 4-True-2)" \
          > "$Q/test_2.log" 2>&1
      CUDA_VISIBLE_DEVICES=2 timeout 200 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
          -p no:cacheprovider -k "matches_eager" > "$Q/test_2b.log" 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=3 timeout 400 python3 -m runner.bench.decode model=wan21_t2v_1_3b \
          frames=81 variants=winograd iters=3 out="$Q/decode_wan21.json" > "$Q/decode_wan21.log" 2>&1 ) &
    decode_bench 1 3 "$Q/decode_winograd.log"
    wait; tail -5 "$Q/decode_quick.log"; tail -7 "$Q/decode_winograd.log"
    tail -6 "$Q/decode_wan21.log"; grep -hE "passed |failed |PSNR|Error|max abs" "$Q"/test_*.log | tail -30 ;;
  final21)   # x2. GPU 0: TI2V's decode as installed (4 latent frames a pass) and at 2 (quick);
             # GPU 1: TI2V's Triton decode gpu tests at 2 and 4 latent frames a pass
    ( CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m pytest -m gpu tests/test_video_vae.py -v -s \
          -p no:cacheprovider -k "matches_diffusers and (4-True-4 or 4-True-2)" > "$Q/test_1.log" 2>&1 ) &
    CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m runner.bench.decode model=wan22_ti2v_5b frames=121 \
        variants=quick chunks=4,2 iters=3 out="$Q/decode_quick.json" > "$Q/decode_quick.log" 2>&1
    wait; tail -5 "$Q/decode_quick.log"; grep -hE "passed |failed |PSNR|Error|max abs" "$Q"/test_*.log | tail -30 ;;
  vaecode)   # GPU 0: the same decode rows with Inductor's generated code logged (which kernels
             # take the 808 ms outside the convolutions with Winograd on: 2026-11-27's record)
    TORCH_LOGS=output_code decode_bench 0 1 "$Q/decode_code.log"
    grep -c "def triton_" "$Q/decode_code.log"; tail -6 "$Q/decode_code.log" ;;
  ti2v_img)
    SKIP_SUITE=1 TABLES=ti2v_img GPUS=0 timeout 570 bash benchmarks/families_x4.sh "$Q" ;;
  pixart12|wan12)
    if [ "$phase" = pixart12 ]; then   # GPU 3 is free while the 1+2 group runs
      ( CUDA_VISIBLE_DEVICES=3 timeout 200 python3 -m pytest -m gpu tests/test_models.py -k finite_check \
          -v -s -p no:cacheprovider > "$Q/finite_check.log" 2>&1
        # what Inductor's torch_key (a hash of torch's sources) costs alone: 3-5 s inside a
        # worker's prewarm thread (warm_probe.py, 2026-11-27), how much of it its own?
        for i in 1 2; do python3 -c "import time; from torch._inductor import codecache as c
t = time.perf_counter(); c.torch_key(); print('torch_key_s', round(time.perf_counter() - t, 3),
      'settable', hasattr(c.torch_key, 'set'))"; done > "$Q/torch_key.log" 2>&1 ) &
    fi
    ONLY=1+2 bash benchmarks/scaling_x4.sh "${phase%12}" "$Q" > "$Q/scaling.log" 2>&1
    wait; tail -30 "$Q/scaling.log"; tail -3 "$Q/finite_check.log" "$Q/torch_key.log" 2>/dev/null ;;
  pixart4|wan4)
    ONLY=4 bash benchmarks/scaling_x4.sh "${phase%4}" "$Q" > "$Q/scaling.log" 2>&1; tail -30 "$Q/scaling.log" ;;
  suite)
    timeout 560 python3 -m pytest -m gpu -n auto --dist loadgroup -v -p no:cacheprovider \
        --junitxml="$Q/junit.xml" > "$Q/suite.log" 2>&1
    tail -3 "$Q/suite.log" ;;
  *) echo "next.sh: unknown phase '$phase' (ab, tables, both, ti2v_img, i2v14b, round17, decode, triton, triton4, final18, tune19, vaecode, pixart12, pixart4, wan12, wan4 or suite)" >&2
     exit 2 ;;
esac
case $phase in ab|tables|both|ti2v_img|i2v14b|round17)
  bash benchmarks/families_x4.sh "$Q" status; cat "$Q"/ready-*/ready.tsv 2>/dev/null ;;
esac
