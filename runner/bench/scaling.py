"""Scaling benchmark: the same job with 1, 2, ... workers, side by side in one run.

    python -m runner.bench.scaling job=pixart_batch workers=1,2 prompts=128 out=/tmp/scaling [key=value ...]
    python -m runner.bench.scaling job=pixart_batch workers=1,2,4 prompts_per_worker=128 ...
    python -m runner.bench.scaling job=latte_batch workers=1+2+4,8 prompts_per_worker=16 ...
    python -m runner.bench.scaling job=pixart_batch workers=1+2,4 prompts_per_worker=64 cache=both \
        warm_prompts=64,128,1000 ...

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

`cache=` which compile cache the runs start with (row field `cache`):
- `cold` (default): a fresh, empty one per run (`cache-w<k>`): one worker compiles, the others load
  its artifact through the job's broker: a cluster's first job;
- `both`: each group cold, then again warm (runs `w<k>-warm`, caches `cache-w<k>-warm`): the
  cluster's second job, its `compile.cache_dir` holding the artifact the first left (only the
  `*.artifact` files of the cold run's cache are copied, as a fresh node sees an object-store
  cache; not the Inductor/Triton working files beside them). Each run of a `+` group has its own;
- `warm`: warm runs only, from the artifact in `cache_from=DIR` (a compile.cache_dir), else from
  one `python -m runner.driver.warm` run with the same job arguments first (`cache-fill`).
`warm_prompts=` gives the warm runs their own prompt counts (one, or one per worker count: e.g. a
1,000-prompt 4-worker job against 64- and 128-prompt bases).
`resume=true` goes on with a bench a time limit cut short (a GPU machine's 10-minute command): the
rows `out/scaling.json` holds from the same arguments are kept and their groups not run again; a
group cut off midway runs again from nothing (its runs' partial outputs are not resumed: their
figures would be wrong). A warm group needs its cold runs' caches still under `out`.
`only=` runs those groups of `workers` alone (e.g. `only=1+2`, then `only=4 resume=true`): a bench
longer than one command split ahead of time, every row still against the same base.

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
- `worker_ready_s`: the slowest worker's own start-up, its `Worker()` to ready (model load, compile
  or cache load, warm-up call, canary reference; its metrics' `ready_at - started_at`; not the
  process start and imports, which `all_ready_s` includes), per rank in `worker_ready_s_by_rank`;
  `model_load_s` and `cache_wait_s` (waiting for another worker's artifact): the slowest worker's;
- `gpu_util`: each worker's NVML utilisation over its serving window (0-1, by rank; None on CPU);
  `worker_it_s`: each worker's steady denoising steps/s, by rank;
- `driver_cpu_s`: the driver process's CPU seconds (user+sys, every thread) over `span_s`;
  `shards` handed to workers (retries included); `driver_cpu_s_per_shard` the one over the other,
  `serve_cpu_s_per_shard` the same without the driver's CPU until the first worker was ready
  (starting Ray and the pool: on a short run most of it, and not a cost per shard).
Speed-up and efficiency are against the run with the fewest workers (`base_workers`, normally 1)
with the same cache (warm rows against the warm base). `efficiency` and `steady_efficiency`: the
rate over the base's, over workers / base_workers (rates compare whatever the prompt counts).
`span_speedup`: the base's job length for this run's items, its start-up plus them at its rate
(`first_ready_s + ok / items_per_s`; its own span_s at equal counts), over this run's span_s;
`span_efficiency` that over workers / base_workers. So a 4-worker 1,000-prompt job against a
1-worker 250-prompt base (prompts_per_worker=250) is measured against one worker doing the 1,000
prompts, not against a base rate its start-up weighs on 4x as much. `ready_ratio` is the time to
all workers ready against the base's. The plots draw the whole-span (start-up included) and
steady rates. After the full table the bench prints a short one (`SHORT`: the record's columns).
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

from ..io.outputs import atomic_path, format_table, write_json, write_text
from . import parse_args


SPAN_LABEL = "whole span, start-up included"
CACHES = ("cold", "warm", "both")
RUNS = {"cold": ("cold",), "warm": ("warm",), "both": ("cold", "warm")}   # the runs of each cache=
USAGE = ("python -m runner.bench.scaling job=NAME [workers=1,2,4,8] [prompts=N | prompts_per_worker=N] "
         "[cache=cold|warm|both] [warm_prompts=N,...] [cache_from=DIR] [only=GROUPS] [resume=true] "
         "[out=DIR] [key=value ...]\n"
         "       python -m runner.bench.scaling replot=DIR   (table and plots again from DIR/scaling.json)")


def _args(argv):
    opts, rest = parse_args(argv, {"workers": "1,2", "prompts": "128", "prompts_per_worker": None,
                                   "out": "scaling", "job": None, "replot": None, "cache": "cold",
                                   "warm_prompts": None, "cache_from": None, "resume": "false",
                                   "only": None},
                            USAGE,
                            passthrough=True)
    if not opts["job"] and not opts["replot"]:
        raise SystemExit(f"usage: {USAGE}")
    if opts["cache"] not in CACHES:
        raise SystemExit(f"cache={opts['cache']!r}: one of {', '.join(CACHES)} (cold: a fresh "
                         "compile cache per run; warm: one a previous job filled; both: each "
                         "worker count cold, then warm from its cold run's cache)")
    if opts["cache_from"] and opts["cache"] != "warm":
        raise SystemExit(f"cache_from={opts['cache_from']!r} is for cache=warm (cache=both warms "
                         "each run from its own cold run's cache)")
    if opts["resume"] not in ("true", "false"):
        raise SystemExit(f"resume={opts['resume']!r}: true or false")
    return opts, rest


def _resumed(out: str, argv: list[str]) -> list[dict]:
    """resume=true: the rows an earlier call with the same arguments left in out/scaling.json."""
    path = os.path.join(out, "scaling.json")
    if not os.path.exists(path):
        return []
    d = json.load(open(path))
    same = lambda args: [a for a in args if not a.startswith(("resume=", "only="))]
    if same(d["argv"]) != same(argv):
        raise SystemExit(f"resume=true: {path} was made by other arguments ({' '.join(d['argv'])}); "
                         "give the same ones, or another out= for a new bench")
    return d["rows"]


COLUMNS = ["workers", "cache", "prompts", "alongside", "ok", "compiled", "loaded", "first_ready_s",
           "all_ready_s", "worker_ready_s", "cache_wait_s", "ready_ratio", "generate_s", "span_s", "span_items_per_s", "span_speedup",
           "span_efficiency", "items_per_s", "speedup", "efficiency", "steady_items_per_s",
           "steady_speedup", "steady_efficiency", "gpu_util", "shards", "driver_cpu_s",
           "driver_cpu_s_per_shard", "serve_cpu_s_per_shard", "warmup_with_compile_s",
           "warmup_with_cache_s"]
# the record's table: start-up (the job's clock, and the slowest worker's own), span and steady
SHORT = ["workers", "cache", "prompts", "compiled", "loaded", "first_ready_s", "all_ready_s",
         "worker_ready_s", "span_s", "span_efficiency", "steady_items_per_s", "steady_efficiency"]


def _plot(rows, out):
    """Throughput against workers (once all serve, and over the whole span, start-up included)
    with the linear line from the first run, and the efficiency of both: `scaling.svg`, `.png`.
    Runs with a warm compile cache (cache=warm|both) are drawn dashed beside the cold ones."""
    from matplotlib.figure import Figure   # no pyplot: no global backend or state
    fig = Figure(figsize=(9, 3.6), dpi=120, layout="constrained")
    ax, ax_eff = fig.subplots(1, 2, width_ratios=[3, 2])
    xs = sorted({r["workers"] for r in rows})
    first = rows[0]
    ax.plot(xs, [_steady(first) * x / first["workers"] for x in xs], color="gray", ls="--", lw=1,
            label="linear from the first run")
    for cache, group in _by_cache(rows):
        style, tag = ("-", "") if cache == "cold" else (":", " (warm cache)")
        gx = [r["workers"] for r in group]
        ys = [_steady(r) for r in group]
        ax.plot(gx, [_span(r) for r in group], "s" + style, color="tab:orange", lw=2,
                label=SPAN_LABEL + tag)
        ax.plot(gx, ys, "o" + style, color="tab:blue", lw=2, label="once all workers serve" + tag)
        for x, y in zip(gx, ys):
            ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
        for key, mark, color, label in (("steady_efficiency", "o", "tab:blue", "once all workers serve"),
                                        ("span_efficiency", "s", "tab:orange", SPAN_LABEL)):
            pts = [(r["workers"], r[key]) for r in group if r.get(key) is not None]
            if pts:
                ax_eff.plot(*zip(*pts), mark + style, color=color, lw=2, label=label + tag)
    ax.set(xlabel="workers", ylabel="items/s", title="Throughput")
    for a in (ax, ax_eff):
        a.set_xticks(xs)
        a.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.margins(x=0.08)
    ax.legend(fontsize=8, frameon=False)
    ax_eff.axhline(1.0, color="gray", ls="--", lw=1, label="linear")
    ax_eff.set(xlabel="workers", ylabel="efficiency (vs linear)", title="Scaling efficiency")
    ax_eff.set_ylim(0, max([1.1] + [r.get(k) or 0 for r in rows
                                    for k in ("span_efficiency", "steady_efficiency")]) * 1.05)
    ax_eff.legend(fontsize=8, frameon=False)
    for ext in ("svg", "png"):
        with atomic_path(os.path.join(out, f"scaling.{ext}")) as tmp:
            fig.savefig(tmp, format=ext)


def _by_cache(rows) -> list[tuple[str, list[dict]]]:
    """The rows per compile cache (cold first), each by workers."""
    return [(c, sorted((r for r in rows if r.get("cache", "cold") == c), key=lambda r: r["workers"]))
            for c in CACHES if any(r.get("cache", "cold") == c for r in rows)]


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
    """The same plot as text, for a markdown record: one bar per run, measured against linear
    from the first run of the same cache (warm rows are marked so)."""
    lines = [("items/s once all workers serve (#), whole span with start-up (=), linear from the "
              "first run (|)")]
    groups = _by_cache(rows)
    ideal = {(c, r["workers"]): _steady(g[0]) * r["workers"] / g[0]["workers"]
             for c, g in groups for r in g}
    top = max([f(r) for r in rows for f in (_steady, _span)] + list(ideal.values())) or 1.0
    for cache, group in groups:
        for r in group:
            for mark, v in (("#", _steady(r)), ("=", _span(r))):
                bar = list(mark * round(50 * v / top) + " " * 52)
                bar[round(50 * ideal[cache, r["workers"]] / top)] = "|"
                tag = "" if cache == "cold" else f" {cache}"
                lines.append(f"{r['workers']:>3} {''.join(bar).rstrip():<52} {v:.3g}{tag}")
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
    now = _plan(opts["only"]) if opts["only"] else groups
    if any(g not in groups for g in now):
        raise SystemExit(f"only={opts['only']!r}: give groups of workers={opts['workers']!r} "
                         f"({', '.join('+'.join(map(str, g)) for g in groups)})")
    counts = [k for g in groups for k in g]
    if len(set(counts)) != len(counts):
        raise SystemExit(f"workers={opts['workers']!r}: each worker count once (runs are named w<count>)")
    n_of = _sizes(opts, counts)
    slices = [_gpu_slices(g, cpu="model.device=cpu" in rest) for g in groups]  # before any run
    rows = _resumed(out, argv) if opts["resume"] == "true" else []
    _check_split(opts, out, groups, now, rows)
    return _run_groups(opts, argv, out, rest, zip(groups, slices), now, n_of, rows)


def _done(rows: list[dict]) -> set[tuple[int, str]]:
    """(workers, cache) of each row kept (rows of a scaling.json from before cache= are cold)."""
    return {(r["workers"], r.get("cache", "cold")) for r in rows}


def _check_split(opts: dict, out: str, groups: list, now: list, rows: list[dict]) -> None:
    """Before any run: a bench split by only= keeps every row against the same base. Refused: only=
    over an earlier scaling.json without resume=true (its rows would be replaced); a base (the
    fewest workers) neither run now nor kept (rows against themselves: efficiency 1.0 whatever
    they measure); a warm run whose cold run is kept but whose cache is gone."""
    caches, done = RUNS[opts["cache"]], _done(rows)
    if opts["only"] and opts["resume"] != "true" and os.path.exists(os.path.join(out, "scaling.json")):
        raise SystemExit(f"only={opts['only']!r}: {out}/scaling.json holds an earlier bench's rows; "
                         "add resume=true to go on with it, or give another out=")
    base = min(k for g in groups for k in g)
    for cache in caches:
        if not any(base in g for g in now) and (base, cache) not in done:
            raise SystemExit(f"only={opts['only']!r}: no {cache} row with {base} worker(s), the base "
                             f"of every other, in {out}/scaling.json: run its group first (on this "
                             "machine: a bench's rows compare runs side by side)")
    for g in now if opts["cache"] == "both" else []:   # its cold runs kept, its warm ones to run
        kept = all((k, "cold") in done for k in g) and not all((k, "warm") in done for k in g)
        for k in g if kept else []:
            if glob.glob(os.path.join(out, f"cache-w{k}", "*.artifact")):
                continue
            raise SystemExit(f"resume=true: the warm run with {k} workers needs the compile artifact "
                             f"its cold run left in {out}/cache-w{k}, gone (another machine?): run "
                             "the bench again from its first group")


def _run_groups(opts: dict, argv: list[str], out: str, rest: list[str], planned, now: list,
                n_of: dict, rows: list[dict]) -> list[dict]:
    """Each (group, its GPUs) of `planned` that is in `now`, cold and/or warm, skipping what `rows`
    (kept by resume=true) already holds; the table and plots rewritten after every group."""
    caches, done = RUNS[opts["cache"]], _done(rows)
    if opts["cache"] == "warm" and not all((k, "warm") in done for g in now for k in g):
        fill = _fill(opts, out, rest)
    else:
        fill = None
    for group, gpus in planned:
        for cache in caches if group in now else []:   # both: cold, then warm from its cold runs
            if all((k, cache) in done for k in group):
                print(f"resume: {cache} runs with {'+'.join(map(str, group))} workers kept from "
                      "scaling.json", flush=True)
                continue
            rows = [r for r in rows if not (r["workers"] in group and r.get("cache", "cold") == cache)]
            new, failed = _run_group(opts, out, rest, group, gpus, cache, n_of[cache], fill)
            rows = sorted(rows + new, key=lambda r: (CACHES.index(r.get("cache", "cold")), r["workers"]))
            if rows:
                _summarize(rows, argv, out)   # after every group: a later run failing loses nothing
            if failed:
                raise SystemExit("; ".join(failed))
    return rows


def _run_group(opts: dict, out: str, rest: list[str], group: list[int], gpus: list, cache: str,
               n_of: dict[int, int], fill: str | None) -> tuple[list[dict], list[str]]:
    """The runs of one `+` group at the same time (each on its GPUs, its own local Ray and a fresh
    compile cache; a warm run's holds the artifact its cold run, or the fill, left). Returns their
    rows and what failed."""
    runs = []
    for k, visible in zip(group, gpus):
        name = f"w{k}" if cache == "cold" else f"w{k}-warm"
        _fresh_cache(out, name, fill or (os.path.join(out, f"cache-w{k}") if cache == "warm" else None))
        cmd = _command(opts["job"], name, k, _write_prompts(out, name, n_of[k]), out, rest)
        env = {key: v for key, v in os.environ.items() if key != "RAY_ADDRESS"}   # own local Ray
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        print("$", *([f"CUDA_VISIBLE_DEVICES={visible}"] if visible else []), *cmd, flush=True)
        runs.append((k, name, subprocess.Popen(cmd, env=env), time.perf_counter()))
    rows, failed = [], []
    for (k, name, _, t0), (rc, t1) in zip(runs, _wait_all([r[2] for r in runs])):
        try:                      # exit status 1: some items failed; the run still measured
            if rc not in (0, 1):
                raise RuntimeError(f"exit status {rc}")
            rows.append(_row(out, name, k, n_of[k], t1 - t0, [j for j in group if j != k], cache))
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            failed.append(f"{cache} run with {k} workers failed ({e})")
    return rows, failed


def _sizes(opts: dict, counts: list[int]) -> dict[str, dict[int, int]]:
    """Prompts per run: {"cold": {workers: n}, "warm": {...}} from prompts / prompts_per_worker,
    and warm_prompts (a count, or one per worker count) for the warm runs (else as the cold ones)."""
    def listed(key: str) -> list[int]:
        try:
            sizes = [int(x) for x in opts[key].split(",")]
        except ValueError:
            sizes = []
        if len(sizes) not in (1, len(counts)) or min(sizes, default=0) < 1:
            raise SystemExit(f"{key}={opts[key]!r}: give one count or one per worker count {counts}")
        return sizes * len(counts) if len(sizes) == 1 else sizes
    per_worker = int(opts["prompts_per_worker"]) if opts["prompts_per_worker"] else None
    cold = [per_worker * k for k in counts] if per_worker else listed("prompts")
    warm = listed("warm_prompts") if opts["warm_prompts"] else cold
    return {"cold": dict(zip(counts, cold)), "warm": dict(zip(counts, warm))}


def _fill(opts: dict, out: str, rest: list[str]) -> str:
    """cache=warm: the compile cache a previous job left. `cache_from=DIR` (a compile.cache_dir
    holding the job's artifact), else filled now by `python -m runner.driver.warm` with the same job
    arguments (this machine's first GPU)."""
    if opts["cache_from"]:
        src = os.path.abspath(opts["cache_from"])
        if not glob.glob(os.path.join(src, "*.artifact")):
            raise SystemExit(f"cache_from={opts['cache_from']!r}: no compile artifact (*.artifact) "
                             "there: give a compile.cache_dir a job (or runner.driver.warm) filled")
        return src
    src = os.path.join(out, "cache-fill")
    shutil.rmtree(src, ignore_errors=True)
    cmd = [sys.executable, "-m", "runner.driver.warm", f"job={opts['job']}", f"compile.cache_dir={src}",
           f"output.dir={out}", "job.name=fill", *rest]
    print("$", *cmd, flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit("filling the compile cache (runner.driver.warm, above) failed")
    return src


def _fresh_cache(out: str, name: str, artifacts_from: str | None) -> None:
    """The run's output and compile-cache directories from nothing; a warm run's cache then gets
    the job's artifact(s) alone, as a fresh node of a cluster sees a cache_dir a previous job
    filled (not the Inductor/Triton working files the earlier run left beside them)."""
    cache = os.path.join(out, f"cache-{name}")
    for old in (os.path.join(out, name), cache):
        shutil.rmtree(old, ignore_errors=True)
    if artifacts_from is None:
        return
    found = glob.glob(os.path.join(artifacts_from, "*.artifact"))
    if not found:
        raise SystemExit(f"no compile artifact in {artifacts_from} for the warm run {name}: its "
                         "cold run left none (a compile mode without a cache? O2 and O3 keep one)")
    os.makedirs(cache)
    for f in found:
        shutil.copy2(f, cache)


def _backfill_span(r: dict) -> None:
    """A row of a scaling.json from before `span_s`: the span from its parts (a fresh run from
    nothing: every ok item is this run's)."""
    if "span_s" not in r and r.get("generate_s") is not None:
        r["span_s"] = r["first_ready_s"] + r["generate_s"]
        r["span_items_per_s"] = r["ok"] / r["span_s"] if r["span_s"] else None


def _write_prompts(out: str, name: str, n: int) -> str:
    """`n` generated prompts for the run `name`; returns the Parquet path."""
    words = "cat dog robot castle river forest city ocean mountain flower".split()
    prompts = os.path.join(out, f"prompts-{name}.parquet")   # per run: runs may start together
    pq.write_table(pa.table({"id": [f"s{i:05d}" for i in range(n)],
                             "prompt": [f"a {words[i % 10]} and a {words[i * 7 % 10]}, photo {i}"
                                        for i in range(n)],
                             "seed": list(range(n))}), prompts)
    return prompts


def _command(job: str, name: str, k: int, prompts: str, out: str, rest: list[str]) -> list[str]:
    return [sys.executable, "-m", "runner", f"job={job}", f"prompts.path={prompts}",
            f"output.dir={out}", f"job.name={name}", f"ray.num_workers={k}",
            f"compile.cache_dir={out}/cache-{name}", "output.overwrite=true", *rest]


def _row(out: str, name: str, k: int, n: int, wall: float, alongside: list[int],
         cache: str = "cold") -> dict:
    s = json.load(open(os.path.join(out, name, "summary.json")))
    ms = [json.load(open(p)) for p in glob.glob(os.path.join(out, name, "metrics", "*.json"))]
    return dict(
        workers=k, cache=cache, run=name, prompts=n, alongside=alongside, ok=s["ok"], failed=s["failed"], wall_s=wall,
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
    # each worker's own start-up: its Worker() to ready (model load, compile or cache, warm-up,
    # canary reference; not the process's start and imports, which all_ready_s includes)
    own = [m["ready_at"] - m["started_at"] if "ready_at" in m and "started_at" in m
           else (m.get("model_load_s") or 0) + (m.get("warmup_s") or 0) for m in ms]
    return {
        "worker_ready_s": max(own, default=None),
        "worker_ready_s_by_rank": [round(x, 2) for x in own],
        "model_load_s": max((m["model_load_s"] for m in ms if "model_load_s" in m), default=None),
        "cache_wait_s": max((m["cache_wait_s"] for m in ms if "cache_wait_s" in m), default=None),
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
    for r in rows:
        r.setdefault("cache", "cold")   # rows of a scaling.json from before cache=
        for key in ("speedup", "efficiency", "steady_speedup", "steady_efficiency", "span_speedup",
                    "span_efficiency", "ready_ratio"):
            r.pop(key, None)   # recomputed against the current base
    for cache in CACHES:       # like with like: warm rows against the warm base
        group = [r for r in rows if r["cache"] == cache]
        if group:
            _against_base(group, min(group, key=lambda r: r["workers"]))
    write_json(os.path.join(out, "scaling.json"), {"argv": argv, "rows": rows})
    _plot(rows, out)
    plot = _text_plot(rows)
    write_text(os.path.join(out, "scaling.txt"), plot)
    print(plot)
    print(format_table(rows, COLUMNS), flush=True)
    print("\n" + format_table(rows, SHORT), flush=True)


def _against_base(rows: list[dict], base: dict) -> None:
    """Speed-up and efficiency of each row against `base` (the fewest workers with the same cache).
    Rates (`items_per_s`, `steady_items_per_s`) compare as they are. The whole span compares job
    lengths on the same prompts: the base's, for this row's items, is its start-up plus the items
    at its rate (`first_ready_s + ok / items_per_s`: its own span when the counts are equal), so a
    row with more prompts (prompts_per_worker, warm_prompts) is not flattered by a base whose
    start-up weighs on fewer items."""
    for r in rows:
        r["base_workers"] = base["workers"]
        scale = r["workers"] / base["workers"]
        for key in ("items_per_s", "steady_items_per_s"):
            if r.get(key) and base.get(key):
                r[key.replace("items_per_s", "speedup")] = r[key] / base[key]
                r[key.replace("items_per_s", "efficiency")] = r[key] / base[key] / scale
        if r.get("span_s") and r.get("ok") and base.get("items_per_s") \
                and base.get("first_ready_s") is not None:
            r["span_speedup"] = (base["first_ready_s"] + r["ok"] / base["items_per_s"]) / r["span_s"]
            r["span_efficiency"] = r["span_speedup"] / scale
        if r.get("all_ready_s") and base.get("all_ready_s"):
            r["ready_ratio"] = r["all_ready_s"] / base["all_ready_s"]   # goal at 8 workers: <= 1.5


if __name__ == "__main__":
    main(sys.argv[1:])
