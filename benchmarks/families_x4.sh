#!/usr/bin/env bash
# Issues 46 and 48 on a 4-GPU machine (nvidia-h100-x4), in the background so it outlives one device
# command: the whole gpu suite on the 4 GPUs first (its wall time is the figure), then the family
# tables, each `runner.bench.vs_loop` command alone on one GPU, the four GPUs taking the next
# table of the list as they free up (priority order). From the checkout root, with the bundle:
#   source .devbundle/install.sh && setsid nohup bash benchmarks/families_x4.sh /tmp/q >/dev/null 2>&1 &
#   bash benchmarks/families_x4.sh /tmp/q status        # what ran, what runs (any later command)
#   touch /tmp/q/stop                                   # start no further table
#   pkill -f "^bash benchmarks/families_x4.sh"; pkill -f "^python3 -m (runner|pytest)"   # stop now
#     (anchored patterns: the device's own wrapper holds the whole command line, unanchored ones
#     match it and end the call)
# The I2V peer needs ftfy: here, `python3 -m pip download --no-deps --only-binary=:all:
#   --python-version 3.12 --platform any -d .whl ftfy wcwidth`, then carry .whl along.
# SKIP_SUITE=1 goes straight to the tables; TABLES="wan81 flux" runs only those (in that order);
# GPUS="1 3" runs lanes on those GPUs only; TABLE_peer is TABLE's cachedit arm alone. LANES=2
# (with GPUS="0" or "0 2"): each table on two GPUs, its job's arms and its loops' at once, one
# vs_loop command (`lanes=2`): a table too long for one device command on one GPU.
# Everything lands in /tmp/q: suite.log (+ junit.xml), <table>.log, <table>/vs_loop.json with each
# job's summary.json and metrics/ (the media stay in /tmp/q/media-<table>).
set -u
Q=${1:?usage: families_x4.sh DIR [status]}
mkdir -p "$Q"
if [ "${2:-}" = status ]; then
  for f in "$Q"/*.state; do [ -e "$f" ] && echo "$(basename "$f" .state): $(cat "$f")"; done
  tail -3 "$Q"/suite.log 2>/dev/null; exit 0
fi
# The image-to-video peer calls diffusers' prompt cleaning, which needs ftfy (the bench extra has it;
# the device bundle does not): wheels under .whl/ (ftfy, wcwidth; carried along) go into /tmp/site.
if [ -d .whl ] && [ ! -d /tmp/site/ftfy ]; then   # once: lanes of two of these share /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
source "$(dirname "$0")/keep.sh"
export TORCHINDUCTOR_CACHE_DIR=/tmp/cc/inductor   # one Inductor cache and one kernel build for all
CACHE_ARG="compile.cache_dir=/tmp/cc"   # (not CC: that is the C compiler nvcc and Inductor use)
LEMICA='[0,1,2,3,4,5,6,7,8,9,10,11,12,14,16,18,21,24,29,35,40,44,47,48,49]'
BEFORE=cudagraphs:cache-all:max-optimize:low-precision   # O3 as it was before int8-attention
R="model.source=random $CACHE_ARG"

table() {   # the vs_loop arguments of each table
  case $1 in
    ti2v)  echo "job=wan22_ti2v_batch $R prompts=2 images=none arms=job,cachedit,cachedit_sage \
                 modes=$BEFORE+residual,O3+residual+cfg step_cache.compute_ratio=0.5" ;;
    wan81) echo "job=wan_batch $R prompts=2 arms=job,cachedit,cachedit_sage \
                 modes=$BEFORE+residual,O3+residual+cfg generation.num_frames=81 \
                 generation.num_inference_steps=50 step_cache.compute_steps=$LEMICA step_cache.first_blocks=1" ;;
    i2v14b) echo "job=wan_i2v_batch $R prompts=2 arms=job,cachedit modes=O3+residual \
                 generation.num_inference_steps=40 step_cache.compute_ratio=0.5" ;;
    a14b)  echo "job=wan22_a14b_batch $R prompts=2 arms=job,cachedit modes=O3+residual \
                 step_cache.compute_ratio=0.5" ;;
    flux)  echo "job=flux_batch $R prompts=6 arms=job,cachedit modes=O3,O3+residual step_cache.compute_ratio=0.75" ;;
    pixart) echo "job=pixart_batch $R prompts=16 arms=job,cachedit modes=O3,O3+residual \
                 generation.num_inference_steps=20 step_cache.compute_ratio=0.7" ;;
    latte) echo "job=latte_batch $R prompts=8 arms=job modes=O3+residual" ;;
    *_peer) table "${1%_peer}" | sed -E 's/arms=[a-z_,]+/arms=cachedit/' ;;   # its peer arm alone
    ti2v_img) echo "job=wan22_ti2v_batch $R prompts=2 images=all arms=job,cachedit modes=O3+residual+cfg \
                 step_cache.compute_ratio=0.5" ;;   # issue 48: the cachedit arm in every table
  esac
}
TABLES=${TABLES:-"ti2v wan81 i2v14b a14b flux pixart latte ti2v_img"}

lane() {   # GPU $1: claim the next unclaimed table (mkdir is atomic), run it, repeat
  local gpu=$1 t
  for t in $TABLES; do
    [ -e "$Q/stop" ] && return
    mkdir "$Q/claim-$t" 2>/dev/null || continue
    echo "running on GPU $gpu since $(date +%T)" > "$Q/$t.state"
    local t0=$SECONDS
    set -f   # the step lists ([0,1,...]) are arguments, not glob patterns
    # shellcheck disable=SC2046
    local devs=$gpu two=   # LANES=2: the job's arms on GPU g, the loops' on g+1, at once (lanes=2)
    [ "${LANES:-1}" = 2 ] && { devs="$gpu,$((gpu + 1))"; two=lanes=2; }
    CUDA_VISIBLE_DEVICES=$devs timeout 1500 python3 -m runner.bench.vs_loop $(table "$t") $two \
        out="$Q/media-$t" > "$Q/$t.log" 2>&1
    local rc=$?
    set +f
    keep_runs "$Q/media-$t" "$Q/$t" 'job-*' vs_loop.json 'psnr_*.json'
    echo "rc=$rc in $((SECONDS - t0)) s on GPU $gpu" > "$Q/$t.state"
  done
}

versions > "$Q/versions.txt" 2>&1
if [ -z "${SKIP_SUITE:-}" ]; then
  echo "running since $(date +%T)" > "$Q/suite.state"
  t0=$SECONDS
  timeout 1500 python3 -m pytest -m gpu -n auto --dist loadgroup -v -p no:cacheprovider \
      --junitxml="$Q/junit.xml" > "$Q/suite.log" 2>&1
  echo "rc=$? in $((SECONDS - t0)) s" > "$Q/suite.state"
fi
for g in ${GPUS:-0 1 2 3}; do lane "$g" & done
wait
echo done > "$Q/all.state"
