"""Scaling benchmark: the same job with 1, 2, ... workers, side by side in one run.

    python -m runner.bench.scaling job=pixart_batch workers=1,2 prompts=128 out=/tmp/scaling [key=value ...]
    python -m runner.bench.scaling job=pixart_batch workers=1,2,4 prompts_per_worker=128 ...
    python -m runner.bench.scaling job=latte_batch workers=1+2+4,8 prompts_per_worker=16 ...

For each worker count it runs `python -m runner` (its own local Ray) on `prompts` generated prompts
(a list gives each run its own count; with `prompts_per_worker=N`, N x workers of them: weak
scaling, the same work per GPU),
with a fresh compile cache per run (so each run shows who compiled and who loaded), then prints a
markdown table and writes `scaling.json`, `scaling.svg`/`scaling.png` (throughput and efficiency against
workers, matplotlib) and `scaling.txt` (the same as text) under `out`.
Other `key=value` arguments go to every run unchanged (e.g. `model.source=random compile.mode=O2`).
Runs joined by `+` start at the same time on disjoint GPUs (CUDA_VISIBLE_DEVICES): 1+2+4 fills 7
GPUs of an 8-GPU machine in the time of one run. They share only the host (CPU cores, disk); the
per-worker it/s (`worker_it_s` in scaling.json) shows whether that slowed any of them. Row field
`alongside` names them. Each run starts from nothing (its output and compile-cache directories
under `out` are removed first) and with its own local Ray (RAY_ADDRESS is not passed on).

Figures per run (a row of `scaling.json` and of the table), from the run's summary.json and
metrics/*.json; the job's times run from the driver's start of the run (after the config, prompt
checks and resume plan, the same for every worker count; before Ray and the workers start) to the
dispatch loop's end, the last item in (`wall_s`, the whole command, adds the interpreter start and
Ray's shutdown):
- `span_s`: the job's length, start-up included; `span_items_per_s` over it: the whole-span rate,
  what a user waits for;
- `items_per_s` from the first worker ready (`first_ready_s`) to the last item (includes the ramp
  while later workers wait for the compile artifact and warm up); `steady_items_per_s` once every
  worker serves (`all_ready_s`; items in flight at that moment count by their part after it);
- `compiled` / `loaded`: workers that compiled / loaded the shared compile artifact (their
  metrics' `cache_hit`: false / true; neither without compile);
- `gpu_util`: each worker's NVML utilisation over its serving window (0-1, by rank; None on CPU);
  `worker_it_s`: each worker's steady denoising steps/s, by rank;
- `driver_cpu_s`: the driver process's CPU seconds (user+sys, every thread) over `span_s`;
  `shards` handed to workers (retries included); `driver_cpu_s_per_shard` the one over the other,
  `serve_cpu_s_per_shard` the same without the driver's CPU until the first worker was ready
  (starting Ray and the pool: on a short run most of it, and not a cost per shard).
Speed-up and efficiency are against the run with the fewest workers (`base_workers`, normally 1) of
the same figure: `span_efficiency` = span_items_per_s / (workers / base_workers x the base's),
likewise `efficiency` and `steady_efficiency` (with `prompts_per_worker`, the runs' prompt counts
differ: the rates still compare); `ready_ratio` is the time to all workers ready against that run's.
The plots draw the whole-span (start-up included) and steady rates.
`python -m runner.bench.scaling replot=DIR` prints the table and rewrites the plots from DIR/scaling.json.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

from ..outputs import atomic_path, format_table, write_json, write_text
from . import parse_args


SPAN_LABEL = "whole span, start-up included"
USAGE = ("python -m runner.bench.scaling job=NAME [workers=1,2,4,8] [prompts=N | prompts_per_worker=N] "
         "[out=DIR] [key=value ...]\n"
         "       python -m runner.bench.scaling replot=DIR   (table and plots again from DIR/scaling.json)")


def _args(argv):
    opts, rest = parse_args(argv, {"workers": "1,2", "prompts": "128", "prompts_per_worker": None,
                                   "out": "scaling", "job": None, "replot": None}, USAGE,
                            passthrough=True)
    if not opts["job"] and not opts["replot"]:
        raise SystemExit(f"usage: {USAGE}")
    return opts, rest


COLUMNS = ["workers", "prompts", "alongside", "ok", "compiled", "loaded", "first_ready_s",
           "all_ready_s", "ready_ratio", "generate_s", "span_s", "span_items_per_s", "span_speedup",
           "span_efficiency", "items_per_s", "speedup", "efficiency", "steady_items_per_s",
           "steady_speedup", "steady_efficiency", "gpu_util", "shards", "driver_cpu_s",
           "driver_cpu_s_per_shard", "serve_cpu_s_per_shard", "warmup_with_compile_s",
           "warmup_with_cache_s"]


def _plot(rows, out):
    """Throughput against workers (once all serve, and over the whole span, start-up included)
    with the linear line from the first run, and the efficiency of both: `scaling.svg`, `.png`."""
    from matplotlib.figure import Figure   # no pyplot: no global backend or state
    xs = [r["workers"] for r in rows]
    ys, span = [_steady(r) for r in rows], [_span(r) for r in rows]
    fig = Figure(figsize=(9, 3.6), dpi=120, layout="constrained")
    ax, ax_eff = fig.subplots(1, 2, width_ratios=[3, 2])
    ax.plot(xs, [ys[0] * x / xs[0] for x in xs], color="gray", ls="--", lw=1, label="linear from the first run")
    ax.plot(xs, span, "s-", color="tab:orange", lw=2, label=SPAN_LABEL)
    ax.plot(xs, ys, "o-", color="tab:blue", lw=2, label="once all workers serve")
    for x, y in zip(xs, ys):
        ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set(xlabel="workers", ylabel="items/s", title="Throughput")
    for a in (ax, ax_eff):
        a.set_xticks(xs)
        a.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.margins(x=0.08)
    ax.legend(fontsize=8, frameon=False)
    for key, style, color, label in (("steady_efficiency", "o-", "tab:blue", "once all workers serve"),
                                     ("span_efficiency", "s-", "tab:orange", SPAN_LABEL)):
        pts = [(r["workers"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax_eff.plot(*zip(*pts), style, color=color, lw=2, label=label)
    ax_eff.axhline(1.0, color="gray", ls="--", lw=1, label="linear")
    ax_eff.set(xlabel="workers", ylabel="efficiency (vs linear)", title="Scaling efficiency")
    ax_eff.set_ylim(0, max([1.1] + [r.get(k) or 0 for r in rows
                                    for k in ("span_efficiency", "steady_efficiency")]) * 1.05)
    ax_eff.legend(fontsize=8, frameon=False)
    for ext in ("svg", "png"):
        with atomic_path(os.path.join(out, f"scaling.{ext}")) as tmp:
            fig.savefig(tmp, format=ext)


def _plan(workers: str) -> list[list[int]]:
    """`1,2,4` -> [[1], [2], [4]]: one run after another; `1+2+4,8` -> [[1, 2, 4], [8]]: the runs
    of a `+` group start together, each on its own GPUs."""
    try:
        groups = [[int(x) for x in g.split("+")] for g in workers.split(",")]
    except ValueError:
        groups = []
    if not groups or any(k < 1 for g in groups for k in g):
        raise SystemExit(f"workers={workers!r}: give worker counts, e.g. 1,2,4,8 (or 1+2+4,8 to run "
                         "the first three at once on disjoint GPUs)")
    return groups


def _gpu_slices(group: list[int], cpu: bool = False) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each run of a group: disjoint GPUs (taken from the GPUs this process
    may use), so that runs started together never share one; None (inherit) for a run alone, a
    CPU run or a machine without GPUs."""
    import torch
    n = torch.cuda.device_count()
    if len(group) == 1 or n == 0 or cpu:
        return [None] * len(group)
    if sum(group) > n:
        raise SystemExit(f"workers group {'+'.join(map(str, group))} needs {sum(group)} GPUs, this "
                         f"machine has {n}: split the group (e.g. {','.join(map(str, group))})")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")][:n] if visible else [str(i) for i in range(n)]
    first = [sum(group[:i]) for i in range(len(group))]
    return [",".join(ids[a:a + k]) for a, k in zip(first, group)]


def _span(r: dict) -> float:
    """A run's items/s over the whole span, start-up included, for the plots (0 if it has none)."""
    return r.get("span_items_per_s") or 0.0


def _steady(r: dict) -> float:
    """A run's items/s once all workers serve, else over the whole span, for the plots."""
    return r.get("steady_items_per_s") or _span(r)


def _text_plot(rows) -> str:
    """The same plot as text, for a markdown record: one bar per run, measured against linear."""
    base = _steady(rows[0])
    ideal = {r["workers"]: base * r["workers"] / rows[0]["workers"] for r in rows}
    top = max([f(r) for r in rows for f in (_steady, _span)] + list(ideal.values())) or 1.0
    lines = [("items/s once all workers serve (#), whole span with start-up (=), linear from the "
              "first run (|)")]
    for r in rows:
        for mark, v in (("#", _steady(r)), ("=", _span(r))):
            bar = list(mark * round(50 * v / top) + " " * 52)
            bar[round(50 * ideal[r["workers"]] / top)] = "|"
            lines.append(f"{r['workers']:>3} {''.join(bar).rstrip():<52} {v:.3g}")
    return "\n".join(lines) + "\n"


def _wait_all(procs: list) -> list[tuple[int, float]]:
    """(exit status, end time) of each process, each taken when that process ends."""
    done: dict[int, tuple[int, float]] = {}
    while len(done) < len(procs):
        for i, p in enumerate(procs):
            if i not in done and p.poll() is not None:
                done[i] = (p.returncode, time.perf_counter())
        time.sleep(0.2)
    return [done[i] for i in range(len(procs))]


def main(argv: list[str]) -> list[dict]:
    opts, rest = _args(argv)
    if opts["replot"]:
        path = os.path.join(opts["replot"], "scaling.json")
        if not os.path.exists(path):
            raise SystemExit(f"replot={opts['replot']!r}: no scaling.json there (give the out=... "
                             "directory of a scaling run)")
        d = json.load(open(path))
        for r in d["rows"]:
            _backfill_span(r)
        _summarize(d["rows"], d["argv"], os.path.abspath(opts["replot"]))
        return d["rows"]
    out = os.path.abspath(opts["out"])
    os.makedirs(out, exist_ok=True)
    groups = _plan(opts["workers"])
    counts = [k for g in groups for k in g]
    if len(set(counts)) != len(counts):
        raise SystemExit(f"workers={opts['workers']!r}: each worker count once (runs are named w<count>)")
    per_worker = int(opts["prompts_per_worker"]) if opts["prompts_per_worker"] else None
    sizes = [int(x) for x in opts["prompts"].split(",")]
    if not per_worker and len(sizes) not in (1, len(counts)):
        raise SystemExit(f"prompts={opts['prompts']!r}: give one count or one per worker count {counts}")
    n_of = {k: per_worker * k if per_worker else sizes[i if len(sizes) > 1 else 0]
            for i, k in enumerate(counts)}
    slices = [_gpu_slices(g, cpu="model.device=cpu" in rest) for g in groups]  # before any run
    rows = []
    for group, gpus in zip(groups, slices):
        runs = []
        for k, visible in zip(group, gpus):
            for old in (f"w{k}", f"cache-w{k}"):   # every run from nothing, its compile cache too
                shutil.rmtree(os.path.join(out, old), ignore_errors=True)
            cmd = _command(opts["job"], k, _write_prompts(out, k, n_of[k]), out, rest)
            env = {key: v for key, v in os.environ.items() if key != "RAY_ADDRESS"}  # own local Ray
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            print("$", *([f"CUDA_VISIBLE_DEVICES={visible}"] if visible else []), *cmd, flush=True)
            runs.append((k, subprocess.Popen(cmd, env=env), time.perf_counter()))
        failed = []
        for (k, _, t0), (rc, t1) in zip(runs, _wait_all([p for _, p, _ in runs])):
            try:                      # exit status 1: some items failed; the run still measured
                if rc not in (0, 1):
                    raise RuntimeError(f"exit status {rc}")
                rows.append(_row(out, k, n_of[k], t1 - t0, [j for j in group if j != k]))
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                failed.append(f"run with {k} workers failed ({e})")
        rows.sort(key=lambda r: r["workers"])
        if rows:
            _summarize(rows, argv, out)   # after every group: a later run failing loses nothing
        if failed:
            raise SystemExit("; ".join(failed))
    return rows


def _backfill_span(r: dict) -> None:
    """A row of a scaling.json from before `span_s`: the span from its parts (a fresh run from
    nothing: every ok item is this run's)."""
    if "span_s" not in r and r.get("generate_s") is not None:
        r["span_s"] = r["first_ready_s"] + r["generate_s"]
        r["span_items_per_s"] = r["ok"] / r["span_s"] if r["span_s"] else None


def _write_prompts(out: str, k: int, n: int) -> str:
    """`n` generated prompts for the run with `k` workers; returns the Parquet path."""
    words = "cat dog robot castle river forest city ocean mountain flower".split()
    prompts = os.path.join(out, f"prompts-w{k}.parquet")   # per run: runs may start together
    pq.write_table(pa.table({"id": [f"s{i:05d}" for i in range(n)],
                             "prompt": [f"a {words[i % 10]} and a {words[i * 7 % 10]}, photo {i}"
                                        for i in range(n)],
                             "seed": list(range(n))}), prompts)
    return prompts


def _command(job: str, k: int, prompts: str, out: str, rest: list[str]) -> list[str]:
    name = f"w{k}"
    return [sys.executable, "-m", "runner", f"job={job}", f"prompts.path={prompts}",
            f"output.dir={out}", f"job.name={name}", f"ray.num_workers={k}",
            f"compile.cache_dir={out}/cache-{name}", "output.overwrite=true", *rest]


def _row(out: str, k: int, n: int, wall: float, alongside: list[int]) -> dict:
    name = f"w{k}"
    s = json.load(open(os.path.join(out, name, "summary.json")))
    ms = [json.load(open(p)) for p in glob.glob(os.path.join(out, name, "metrics", "*.json"))]
    return dict(
        workers=k, prompts=n, alongside=alongside, ok=s["ok"], failed=s["failed"], wall_s=wall,
        first_ready_s=s["startup_s"], all_ready_s=s.get("all_ready_s"), generate_s=s["generate_s"],
        span_s=s["span_s"], span_items_per_s=s["span_items_per_s"],
        items_per_s=s["items_per_s"], steady_items_per_s=s.get("steady_items_per_s"),
        **_driver(s), **_workers(ms))


def _driver(s: dict) -> dict:
    """The driver's CPU seconds over the job, per shard it handed out, and per shard without its
    start-up part (Ray's and the pool's start: a fixed cost)."""
    cpu, startup, shards = s["driver_cpu_s"], s["driver_startup_cpu_s"], s["shards"]
    ok = cpu is not None and shards
    serve = cpu - startup if ok and startup is not None else None
    return {"driver_cpu_s": cpu, "shards": shards,
            "driver_cpu_s_per_shard": cpu / shards if ok else None,
            "serve_cpu_s_per_shard": serve / shards if serve is not None else None}


def _workers(ms: list[dict]) -> dict:
    """The workers' figures from their metrics: who compiled and who loaded the shared artifact
    (`cache_hit` false / true; absent without compile), per-rank lists, warm-ups (the slowest)."""
    ms = sorted(ms, key=lambda m: m["rank"])
    return {
        "compiled": sum(1 for m in ms if m.get("cache_hit") is False),
        "loaded": sum(1 for m in ms if m.get("cache_hit") is True),
        "warmup_with_compile_s": max((m["warmup_with_compile_s"] for m in ms
                                      if "warmup_with_compile_s" in m), default=None),
        "warmup_with_cache_s": max((m["warmup_with_cache_s"] for m in ms
                                    if "warmup_with_cache_s" in m), default=None),
        "worker_it_s": [round(m["steady_it_s"] or 0, 2) for m in ms],
        "gpu_util": [None if m.get("gpu_util") is None else round(m["gpu_util"], 3) for m in ms],
        "gpus": sorted({m.get("gpu_name") or "cpu" for m in ms})}


def _summarize(rows, argv, out):
    base = rows[0]   # the fewest workers that ran (normally 1): what speed-up and efficiency are against
    for r in rows:
        for key in ("speedup", "efficiency", "steady_speedup", "steady_efficiency", "span_speedup",
                    "span_efficiency", "ready_ratio"):
            r.pop(key, None)   # recomputed against the current base
        r["base_workers"] = base["workers"]
        for key in ("items_per_s", "steady_items_per_s", "span_items_per_s"):
            if r.get(key) and base.get(key):
                r[key.replace("items_per_s", "speedup")] = r[key] / base[key]
                r[key.replace("items_per_s", "efficiency")] = (r[key] / base[key]) / (r["workers"] / base["workers"])
        if r.get("all_ready_s") and base.get("all_ready_s"):
            r["ready_ratio"] = r["all_ready_s"] / base["all_ready_s"]   # goal at 8 workers: <= 1.5
    write_json(os.path.join(out, "scaling.json"), {"argv": argv, "rows": rows})
    _plot(rows, out)
    plot = _text_plot(rows)
    write_text(os.path.join(out, "scaling.txt"), plot)
    print(plot)
    print(format_table(rows, COLUMNS), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
