#!/usr/bin/env bash
# Issue 46's ready-time bound (HEAD's cold start <= 1.25x a9a589a's), like for like: the same job on
# the same GPU, one after the other, each tree with a fresh compile cache (its Inductor and Triton
# caches, the int8 kernel's build at HEAD), a local Ray of its own, 2 prompts. Carry the old tree:
#   git archive -o .ab/a9a589a.tgz a9a589a        (here; .ab/ is ignored: carry=[".devbundle", ".ab"])
#   source .devbundle/install.sh && bash benchmarks/ready_ab.sh /tmp/ab          (on the device)
# JOBS="wan_batch pixart_batch" (default), MODE=O3, GPU=0, SOURCE=random (tiny: a CPU check),
# EXTRA="key=value ..." for both trees (a CPU check of Latte: EXTRA=generation.num_frames=4).
# Per job and tree: the job's log, its metrics/ and summary, and one line in DIR/ready.tsv: tree,
# job, the worker's model_load_s and warmup_s (what both trees record), their sum, the job's wall
# time, and which tree's worker code ran (`code`: head|old, by a metric only HEAD records; the
# checkout is on PYTHONPATH there); DIR/versions.txt: the packages and GPUs.
set -u
Q=${1:?usage: ready_ab.sh DIR}
source "$(dirname "$0")/keep.sh"
OLD=/tmp/ab-$$-a9a589a     # this run's own copy: two of these may run at once, a GPU each
mkdir -p "$Q" "$OLD"
versions > "$Q/versions.txt" 2>&1
tar -xzf .ab/a9a589a.tgz -C "$OLD"
python3 - "$Q/prompts.parquet" <<'PY'
import sys, pyarrow as pa, pyarrow.parquet as pq
pq.write_table(pa.table({"id": ["ab-0", "ab-1"], "prompt": ["a red fox in the snow, cinematic",
                                                            "a city street at night in the rain"]}), sys.argv[1])
PY
printf "tree\tjob\tmodel_load_s\twarmup_s\tready_s\tjob_wall_s\trc\tcode\n" > "$Q/ready.tsv"
for job in ${JOBS:-wan_batch pixart_batch}; do
  for tree in a9a589a head; do
    dir=$PWD; [ "$tree" = a9a589a ] && dir=$OLD
    cache=/tmp/ab-$$-cache-$tree-$job out=$Q/$tree-$job
    rm -rf "$cache" "$out"
    t0=$SECONDS
    (cd "$dir" && CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 900 python3 -m runner job="$job" \
        model.source="${SOURCE:-random}" compile.mode="${MODE:-O3}" compile.cache_dir="$cache" \
        prompts.path="$Q/prompts.parquet" output.dir="$out" ${EXTRA:-} > "$Q/$tree-$job.log" 2>&1)
    rc=$?
    python3 - "$out" "$tree" "$job" "$((SECONDS - t0))" "$rc" >> "$Q/ready.tsv" <<'PY'
import glob, json, sys
out, tree, job, wall, rc = sys.argv[1:]
for p in sorted(glob.glob(f"{out}/**/metrics/worker-*.json", recursive=True)):
    m = json.load(open(p))
    ready = m.get("model_load_s", 0) + m.get("warmup_s", 0)
    code = "head" if "loaded_at" in m else "old"    # which tree's worker ran (only HEAD records loaded_at)
    print(f"{tree}\t{job}\t{m.get('model_load_s', 0):.1f}\t{m.get('warmup_s', 0):.1f}\t{ready:.1f}\t{wall}\t{rc}\t{code}")
PY
    find "$out" -name '*.mp4' -o -name '*.png' | xargs -r rm -f     # the media stay behind
  done
done
cat "$Q/ready.tsv"
