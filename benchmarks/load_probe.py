"""Where a worker's `model_load_s` goes (issue 48: a warm worker ready in <= 15 s at PixArt's size).

On 4 H100s (2026-11-26-scaling-h100x4.md) a PixArt-α O3 worker reported model_load_s 21.8 s with
random weights at the published size, against 12.9 s for the tree at a9a589a (ready_ab.sh): this
times the same steps as `Worker.__init__` in a fresh process per variant, one GPU:
  imports      torch, then diffusers + transformers
  cuda         the CUDA context (`check_gpu_memory`'s mem_get_info)
  build        `build_pipeline` (random weights built on the GPU), synchronized
  text_cache   `TextCache.of`
variants: `plain`, and `prewarm` (compiler.prewarm's thread started first, as a compiling worker
does: its imports and torch-source hash share the GIL with the build). `profile` adds the build's
20 costliest functions (cProfile, cumulative) to the plain variant. One JSON line per variant.

    python3 benchmarks/load_probe.py [preset=pixart_alpha_1024] [dtype=fp16] > load_probe.jsonl
    python3 benchmarks/load_probe.py source=tiny device=cpu dtype=fp32     (the probe itself, on a CPU)
"""
import json
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
variant, preset, dtype, source, device = sys.argv[1:6]
out = {"variant": variant}
if variant == "prewarm":
    import compiler
    thread = compiler.prewarm()
import torch
out["import_torch_s"] = time.perf_counter() - t0
t = time.perf_counter()
import diffusers, transformers  # noqa: F401  (what build_pipeline imports first)
out["import_diffusers_s"] = time.perf_counter() - t
from runner.config import ModelSpec
from runner.models import build_pipeline, check_gpu_memory
from runner.text import TextCache
spec = ModelSpec(preset, source=source, dtype=dtype, device=device).resolved()
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
t = time.perf_counter()
check_gpu_memory(spec)
out["cuda_s"] = time.perf_counter() - t
if variant == "profile":
    import cProfile, io, pstats
    prof = cProfile.Profile()
    prof.enable()
t = time.perf_counter()
pipe = build_pipeline(spec)
sync()
out["build_s"] = time.perf_counter() - t
if variant == "profile":
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(20)
    out["profile"] = s.getvalue().splitlines()[-30:]
t = time.perf_counter()
TextCache.of(pipe, spec.family, spec.mask_feature)
sync()
out["text_cache_s"] = time.perf_counter() - t
if variant == "prewarm":
    out["prewarm_alive_after_build"] = thread.is_alive()
out["total_s"] = time.perf_counter() - t0
print("PROBE " + json.dumps(out))
"""


def main(argv):
    opts = dict(preset="pixart_alpha_1024", dtype="fp16", source="random", device="cuda")
    for a in argv:
        k, _, v = a.partition("=")
        if k not in opts:
            raise SystemExit(f"unknown argument {k!r}; valid: {', '.join(opts)}")
        opts[k] = v
    print(json.dumps({"opts": opts}), flush=True)
    for variant in ("plain", "prewarm", "plain", "prewarm", "profile"):   # twice: page cache
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, variant, *opts.values()],
                               capture_output=True, text=True, timeout=240)
            line = [x for x in r.stdout.splitlines() if x.startswith("PROBE ")]
            row = json.loads(line[0][6:]) if line else {"variant": variant, "error": r.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            row = {"variant": variant, "error": "no result in 240 s"}
        row["process_s"] = time.perf_counter() - t
        print({k: v for k, v in row.items() if k != "profile"}, file=sys.stderr, flush=True)
        print(json.dumps(row), flush=True)   # a line a variant: a time limit keeps what finished


if __name__ == "__main__":
    main(sys.argv[1:])
