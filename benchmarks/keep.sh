# Sourced by the benchmark scripts (scaling_x2.sh, scaling_x4.sh, families_x4.sh, ready_ab.sh):
# what a bench run leaves worth keeping, without its media, and what it ran on.
#   versions                        the packages and GPUs the figures were measured with (stdout)
#   keep_runs SRC DST RUNS TOP...   copies SRC's TOP files (globs: the bench's table, PSNRs) to
#   DST, and of each run directory SRC/RUNS (a glob: w[0-9]*, job-*) its summary.json,
#   summary.txt, metrics/ and config.yaml, where it has them, to DST/<run>/.
keep_runs() {
  local src=$1 dst=$2 runs=$3 top r
  shift 3
  mkdir -p "$dst"
  for top in "$@"; do cp "$src"/$top "$dst/" 2>/dev/null; done
  for r in "$src"/$runs/; do
    [ -d "$r" ] || continue
    mkdir -p "$dst/$(basename "$r")"
    cp -r "$r"summary.json "$r"summary.txt "$r"metrics "$r"config.yaml "$dst/$(basename "$r")/" 2>/dev/null
  done
  return 0
}

versions() {
  python3 - <<'PY'
import importlib
for name in ("torch", "triton", "diffusers", "ray", "cache_dit"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:   # cache_dit: only the peer arms need it
        print(name, "not importable:", type(e).__name__)
PY
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
}

# by_deadline LIMIT: LIMIT seconds, or fewer where x4.sh's X4_DEADLINE (epoch s) comes sooner, so a
# run ends (and keeps its files) before x4.sh's cap
by_deadline() {
  local limit=$1 left
  [ -n "${X4_DEADLINE:-}" ] || { echo "$limit"; return; }
  left=$(( X4_DEADLINE - $(date +%s) ))
  echo $(( limit < left ? limit : left ))
}
