"""Where a warm worker's start-up goes (issue 48: a warm worker ready in <= 15 s at PixArt's size).

A job's worker, in this process instead of a Ray actor (as `python -m runner.warm` runs it): first
`runner.warm` fills `compile.cache_dir` (the cold compile, skipped when the artifact is there),
then, in fresh processes, a worker starts from that cache: `Worker()` (model load) and
`warmup()` (artifact load, compile_pipe, the first compiled call, the canary; run on the calling
thread, which cProfile sees) each under cProfile.
One JSON line per start: the worker's own split (`startup_parts_s`, `compile_times_s`, load and
warm-up seconds) and each phase's costliest functions (cumulative and own time).

    python3 benchmarks/warm_probe.py [runs=2] job=pixart_batch model.source=random compile.mode=O3 \
        compile.cache_dir=/tmp/warm-probe-cache > warm_probe.jsonl
    python3 benchmarks/warm_probe.py job=demo_image compile.mode=O3 compile.cache_dir=/tmp/wp  (CPU)
"""
import json
import subprocess
import sys
import time

CHILD = r"""
import cProfile, io, json, pstats, sys, time
t0 = time.perf_counter()
import torch
from runner.config import load_config, split
from runner.job import constraints, worker_config
from runner import step_cache
from runner.worker import Worker
out = {"imports_s": time.perf_counter() - t0}
job = split(load_config(sys.argv[1:]))
limits = constraints(job["model"])
step_cache.prepare(job)
cfg = worker_config(job, limits, on_gpu=torch.cuda.is_available())

def top(prof, key, n):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
    return [l for l in s.getvalue().splitlines() if l.strip()][-n - 1:]

for phase in ("init", "warmup"):
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    if phase == "init":
        w = Worker(0, cfg)
    else:   # on this thread, not the worker's gpu thread: cProfile sees only its own thread
        w._warmup(None)
    prof.disable()
    out[phase + "_s"] = time.perf_counter() - t
    out[phase + "_cumulative"] = top(prof, "cumulative", 45)
    out[phase + "_own"] = top(prof, "tottime", 25)
keys = ("model_load_s", "startup_parts_s", "warmup_s", "compile_call_s", "cache_hit",
        "cache_source", "compile_times_s", "warmup_with_cache_s", "warmup_with_compile_s")
out.update({k: w.m.get(k) for k in keys})
out["report"] = getattr(w.pipe, "_compile_report", None)
print("PROBE " + json.dumps(out, default=str))
"""


def main(argv):
    runs = 2
    if argv and argv[0].startswith("runs="):
        runs, argv = int(argv[0][5:]), argv[1:]
    print(json.dumps({"args": argv, "runs": runs}), flush=True)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "runner.warm", *argv], capture_output=True, text=True,
                       timeout=540)
    fill = {"phase": "fill", "rc": r.returncode, "process_s": time.perf_counter() - t,
            "stdout": r.stdout[-1500:], "stderr": r.stderr[-1500:] if r.returncode else ""}
    print(json.dumps(fill), flush=True)
    print({k: v for k, v in fill.items() if k != "stderr"}, file=sys.stderr, flush=True)
    for i in range(runs):
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True,
                               timeout=300)
            line = [x for x in r.stdout.splitlines() if x.startswith("PROBE ")]
            row = json.loads(line[0][6:]) if line else {"error": r.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            row = {"error": "no result in 300 s"}
        row.update(phase="warm", run=i, process_s=time.perf_counter() - t)
        print(json.dumps(row, default=str), flush=True)   # a line a start: a limit keeps the rest
        brief = {k: v for k, v in row.items() if not k.endswith(("_cumulative", "_own"))}
        print(json.dumps(brief, default=str)[:3000], file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
