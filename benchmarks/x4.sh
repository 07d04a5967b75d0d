#!/usr/bin/env bash
# One x4 machine (nvidia-h100-x4), two commands:
#   suite4  the whole gpu suite on the 4 GPUs (benchmarks/gpu_suite.sh)
#   mixed   the whole gpu suite on GPUs 0-1 (CUDA_VISIBLE_DEVICES=0,1: two test processes), and
#           issue 59's H100 tables on GPUs 2 and 3 (benchmarks/distill_h100.sh PHASE=c, d)
#   tables  issue 59's H100 tables on GPUs 2 and 3 (PHASE=j, d) alone: beside a gpu suite that
#           `bg.sh` started on GPUs 0-1 (it outlives this call; the next call collects it)
#   pair    (x2) the 14B job on GPU 0 beside its peer, then AnyFlow, on GPU 1 (PHASE=e, f)
#   suite2  (x2) the whole gpu suite on the 2 GPUs
#   h100    (x1) Wan 2.2 A14B Lightning 720P, then AnyFlow (distill_h100.sh PHASE=b)
#   a14     (x1) Wan 2.2 A14B Lightning 720P alone (distill_h100.sh PHASE=g)
#   i2v     (x2) Wan 2.2 I2V A14B Lightning 720P (GPU 0) and Wan 2.1 I2V 14B 720P (GPU 1), FP8
# From the checkout root with the bundle:  source .devbundle/install.sh && bash benchmarks/x4.sh MODE OUT
# A device call brings back at most 8 files (device README): the runs write under /tmp/x4-MODE and
# the script ends with them packed into OUT/MODE.tgz, the whole mode cut (SIGINT, then KILL 15 s
# later) at CAP s (default 560) so the packing happens inside the call's 600 s.
set -u
mode=${1:?usage: x4.sh suite4|suite2|mixed|tables|pair|h100|a14|i2v OUT}; DEST=${2:?usage: x4.sh MODE OUT}
if [ -z "${X4_INNER:-}" ]; then
  rm -rf "/tmp/x4-$mode"; mkdir -p "/tmp/x4-$mode" "$DEST"
  # each run's own limit ends by X4_DEADLINE (distill_h100.sh, gpu_suite.sh), 30 s before the cap,
  # so that its files are kept; the cap itself is the backstop (2026-11-28: a14's adapters took
  # their time first and the cap killed the run before it kept anything)
  CAP=${CAP:-560}
  export X4_DEADLINE=$(( $(date +%s) + CAP - 30 ))
  X4_INNER=1 timeout -s INT -k 15 "$CAP" bash "$0" "$mode" "/tmp/x4-$mode"
  echo "x4.sh $mode rc=$?"
  tar czf "$DEST/$mode.tgz" -C /tmp "x4-$mode" && ls -l "$DEST"
  exit 0
fi
OUT=$DEST
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$OUT/gpus.txt"
case $mode in
  suite4) bash benchmarks/gpu_suite.sh "$OUT/suite4" ;;
  h100) PHASE=b bash benchmarks/distill_h100.sh "$OUT/b" > "$OUT/b.out" 2>&1 ;;   # x1: A14B, AnyFlow
  a14) PHASE=g bash benchmarks/distill_h100.sh "$OUT/g" > "$OUT/g.out" 2>&1 ;;   # x1: A14B 720P
  i2v) # x2: issue 59 point 3's image-to-video 720P rows, one a GPU (distill_h100.sh PHASE=h, i)
    CUDA_VISIBLE_DEVICES=0 PHASE=h bash benchmarks/distill_h100.sh "$OUT/h" > "$OUT/h.out" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 PHASE=i bash benchmarks/distill_h100.sh "$OUT/i" > "$OUT/i.out" 2>&1 &
    wait ;;
  suite2) CUDA_VISIBLE_DEVICES=0,1 bash benchmarks/gpu_suite.sh "$OUT/suite2" ;;
  mixed)
    CUDA_VISIBLE_DEVICES=2 PHASE=c bash benchmarks/distill_h100.sh "$OUT/c" > "$OUT/c.out" 2>&1 &
    CUDA_VISIBLE_DEVICES=3 PHASE=d bash benchmarks/distill_h100.sh "$OUT/d" > "$OUT/d.out" 2>&1 &
    CUDA_VISIBLE_DEVICES=0,1 bash benchmarks/gpu_suite.sh "$OUT/suite2"
    wait ;;
  tables)
    CUDA_VISIBLE_DEVICES=2 PHASE=j bash benchmarks/distill_h100.sh "$OUT/j" > "$OUT/j.out" 2>&1 &
    CUDA_VISIBLE_DEVICES=3 PHASE=d bash benchmarks/distill_h100.sh "$OUT/d" > "$OUT/d.out" 2>&1 &
    wait ;;
  pair)   # x2: issue 59's 14B table side by side, then AnyFlow
    CUDA_VISIBLE_DEVICES=0 PHASE=e bash benchmarks/distill_h100.sh "$OUT/e" > "$OUT/e.out" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 PHASE=f bash benchmarks/distill_h100.sh "$OUT/f" > "$OUT/f.out" 2>&1 &
    wait ;;
esac
for f in "$OUT"/*/*.log; do echo "== $f"; grep -v "^ \|Warning\|torchao\|^\[" "$f" | tail -4; done
