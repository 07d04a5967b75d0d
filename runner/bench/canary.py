"""What the canary costs: one worker of a job through a real window of batches, the canary on its
own schedule, against the same window without it.

    python -m runner.bench.canary [job=pixart_batch] [batches=N] [arms=on|on,off|off]
        [settle=1] [out=FILE.json] [dir=DIR] [key=value ...]

`key=value` arguments other than the bench's own go to the job's config (default, before them:
`model.source=random compile.mode=O3`: PixArt-α 1024², 20 steps, O3, random weights at full size).
Each arm builds one worker of the job in this process from the job's own config
(`runner.driver.job.worker_config`: its batch size, shard size, compile mode, canary tolerance), warms it
up as the job does (compile, warm-up call and, with the canary on, the reference batch), runs
`settle` shards of the window's shape outside it (first allocations, first writes), then runs
the window through the job's own dispatcher (`runner.driver.dispatch.Dispatcher`, the job's `INFLIGHT`
shards in flight, `canary_every` = `run.canary_every_items`, default `config.CANARY_BATCHES`
batches, and `run.canary_every_s`) over an in-process pool (`LocalPool`): the canaries fire where
the dispatcher asks for them in a job, none is called by hand.

The window: `batches` batches of the job's default shape (default: one canary period,
`run.canary_every_items` / `run.batch_size`; `config.CANARY_BATCHES` unless the job sets it), in
shards of `run.shard_size`, followed by one more shard outside the window: the dispatcher asks a
canary only of a worker that has more work queued, so the period's canary comes before that shard
as it would in a longer job. The window runs from the first shard's submission to the later of its
last shard's rows written and the verdict of the last canary asked before the extra shard.
`arms=on,off` also runs the window with the canary off (`run.canary_every_items=0`, no reference
at start-up), on a fresh worker (the compile cache of the first arm's, under `dir`).

Figures per arm (a JSON line each; all in `out`): `window_s` (wall), `items` and `items_per_s`
over the window, `canaries` (the verdicts of the canaries in the window: `s`, the worker's own
seconds for each, `ok`, `psnr_db`, `max_abs`), `canary_s` (their sum; the worker's metrics agree:
`worker_canary_s`), `share` = canary_s / window_s (the canary's part of the window's wall time),
`canary_ref_s` (the reference at start-up, not in the window), `schedule` (the dispatcher's calls in
order: `shard:N` items, `canary`, `extra:N`). With both arms: `rate_cost` = 1 - items_per_s(on) /
items_per_s(off). One run on one GPU: its figures are that run's, not a promise.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import sys
import tempfile
import time
from typing import Any

from . import parse_args, release_gpu

USAGE = ("python -m runner.bench.canary [job=pixart_batch] [batches=N] [arms=on|on,off|off] "
         "[settle=1] [out=FILE.json] [dir=DIR] [key=value ...]")
DEFAULT_OVERRIDES = ("model.source=random", "compile.mode=O3")
ARMS = ("on", "off")


class LocalPool:
    """A `runner.driver.dispatch.Pool` of one `runner.serve.worker.Worker` in this process: each call of the
    worker (they block, as an actor's threaded calls do) on a thread of its own, a
    concurrent.futures future for each. Notes when each shard and canary was asked and done
    (`calls`: kind, items or None, asked, future, done time) for the window's figures. A worker lost
    or restarted is an error: a bench does not go on with another worker."""

    size = 1

    def __init__(self, make_worker, settle: list | None = None):
        self.make_worker, self.worker, self.settle = make_worker, None, settle
        self.threads = cf.ThreadPoolExecutor(16, thread_name_prefix="bench-call")
        self.calls: list[dict] = []

    def _call(self, fn, *args) -> cf.Future:
        return self.threads.submit(fn, *args)

    def _noted(self, kind: str, items, future: cf.Future) -> None:
        note = dict(kind=kind, items=items, asked=time.perf_counter(), done=None, future=future)
        future.add_done_callback(lambda f: note.update(done=time.perf_counter()))
        self.calls.append(note)

    def start(self, rank: int) -> tuple[Any, cf.Future]:
        if self.worker is not None:
            raise RuntimeError("the bench's worker was lost (see the log above); no restart")
        self.worker = w = self.make_worker(rank)

        def warm_up():
            ready = w.warmup()
            if self.settle:              # outside the dispatcher: not counted toward a canary
                w.run_shard(self.settle)
            return ready
        return w, self._call(warm_up)

    def submit(self, worker, seq: int, items) -> tuple[cf.Future, cf.Future]:
        started = self._call(worker.start_shard, seq, list(items))
        finished = self._call(worker.finish_shard, seq)
        self._noted("shard", list(items), finished)
        return started, finished

    def canary(self, worker, seq: int) -> cf.Future:
        f = self._call(worker.canary, seq)
        self._noted("canary", None, f)
        return f

    def phases(self, worker, since: int) -> cf.Future:
        return self._call(worker.phases, since)

    def metrics(self, worker) -> cf.Future:
        return self._call(worker.metrics)

    def progress(self, worker) -> cf.Future:
        return self._call(worker.progress)

    def wait(self, futures: list, timeout: float) -> list:
        if not futures:
            time.sleep(timeout)
            return []
        done, _ = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return list(done)

    def result(self, future: cf.Future) -> Any:
        from ..driver.dispatch import TaskError
        try:
            return future.result()
        except Exception as e:           # raised in the worker's call: it lives on
            raise TaskError(f"{type(e).__name__}: {e}") from e

    def kill(self, worker) -> None:      # nothing to kill in-process; `start` refuses a restart
        pass

    def stop(self, workers: list, timeout_s: float) -> int:
        return 0

    def close(self) -> None:
        self.threads.shutdown(wait=True)


def _items(job: dict, n: int, file: str, first: int = 0) -> list:
    """`n` prompts at the job's default shape, steps and guidance (as a prompt file leaving those
    columns out gives them), consecutive rows of `file`."""
    from ..io.prompts import Item
    g = job["generation"]
    frames = g.num_frames if job["model"].family.kind == "video" else None
    return [Item(id=f"{file}-{k:05d}", prompt=f"a photo of a lighthouse number {k}",
                 negative_prompt=g.negative_prompt, seed=k, height=g.height, width=g.width,
                 num_frames=frames, num_inference_steps=g.num_inference_steps,
                 guidance_scale=g.guidance_scale, file=file, row=k)
            for k in range(first, first + n)]


def config(job_name: str, overrides: list[str], arm: str, root: str) -> dict:
    """The arm's job config: the job's, `overrides` after the defaults, its output under `root`
    (one job directory per arm, one compile cache for both: `root`/.compile-cache)."""
    from ..config import load_config, split
    off = ["run.canary_every_items=0", "run.canary_every_s=null"] if arm == "off" else []
    return split(load_config([f"job={job_name}", *DEFAULT_OVERRIDES, *overrides,
                              f"output.dir={root}", f"job.name=canary-{arm}", *off]))


def run_arm(job: dict, batches: int, settle: int = 1) -> dict:
    """One worker of `job` through a window of `batches` batches and one extra shard, through the
    job's dispatcher (module docstring), after `settle` shards run outside it; the window's
    figures."""
    import torch

    from ..driver import job as runner_job
    from ..driver.checks import constraints
    from ..driver.dispatch import Dispatcher
    from ..io.prompts import Shard, plan_shards
    from ..serve.worker import Worker
    opts = job["run"]
    on_gpu = torch.cuda.is_available()
    cfg = runner_job.worker_config(job, constraints(job["model"]), on_gpu=on_gpu)
    window = _items(job, batches * opts.batch_size, "window")
    extra = _items(job, opts.shard_size, "extra")
    shards = plan_shards(window, opts.shard_size)
    shards += [Shard(len(shards) + k, s.items)
               for k, s in enumerate(plan_shards(extra, opts.shard_size))]
    rows: list[dict] = []
    pool = LocalPool(lambda rank: Worker(rank, cfg), _items(job, settle * opts.shard_size, "settle"))
    dispatcher = Dispatcher(pool, 1, shards, rows.extend, runner_job.INFLIGHT,
                            opts.max_shard_retries, 0, opts.max_row_deaths,
                            job["ray"].worker_start_timeout_s,
                            canary_every=opts.canary_items, canary_every_s=opts.canary_every_s,
                            hang_timeout_s=0.0, batch_size=opts.batch_size)
    try:
        dispatcher.run()
        metrics = pool.worker.metrics()
    finally:
        pool.close()
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"{len(failed)} rows failed, the first: {failed[0].get('error')}")
    calls = pool.calls
    extra_at = next((c["asked"] for c in calls if c["kind"] == "shard"
                     and c["items"][0].file == "extra"), float("inf"))
    in_window = [c for c in calls if c["asked"] < extra_at]
    t0 = in_window[0]["asked"]
    window_s = max(c["done"] for c in in_window) - t0
    verdicts = [c["future"].result() for c in in_window if c["kind"] == "canary"]
    canary_s = sum(v["s"] for v in verdicts)
    del pool, dispatcher
    return dict(
        device=metrics.get("gpu_name") or metrics.get("device"), batch_size=opts.batch_size,
        shard_size=opts.shard_size, canary_every_items=opts.canary_items,
        canary_every_s=opts.canary_every_s, batches=batches, items=len(window),
        window_s=round(window_s, 4), items_per_s=round(len(window) / window_s, 4),
        canaries=[dict(s=round(v["s"], 4), ok=v["ok"], rule=v["rule"], max_abs=v["max_abs"],
                       psnr_db=None if v["psnr_db"] == float("inf") else round(v["psnr_db"], 2))
                  for v in verdicts],
        canary_s=round(canary_s, 4), share=round(canary_s / window_s, 5),
        worker_canaries=metrics["canaries"], worker_canary_s=round(metrics["canary_s"], 4),
        canary_ref_s=metrics.get("canary_ref_s") and round(metrics["canary_ref_s"], 4),
        schedule=[f"{'shard' if c['items'][0].file == 'window' else 'extra'}:{len(c['items'])}"
                  if c["kind"] == "shard" else "canary" for c in calls])


def main(argv: list[str]) -> dict:
    opts, overrides = parse_args(argv, dict(job="pixart_batch", batches="", arms="on", out="",
                                            dir="", settle="1"), USAGE, passthrough=True)
    arms = [a for a in opts["arms"].split(",") if a]
    if not arms or set(arms) - set(ARMS):
        raise SystemExit(f"arms={opts['arms']!r}: on, off or on,off\nusage: {USAGE}")
    root = opts["dir"] or tempfile.mkdtemp(prefix="bench-canary-")
    report: dict = dict(job=opts["job"], overrides=[*DEFAULT_OVERRIDES, *overrides], arms={})
    try:
        batches = int(opts["batches"] or 0) or _period_batches(
            config(opts["job"], overrides, "on", root)["run"])
        report.update(batches=batches)
        for arm in arms:
            job = config(opts["job"], overrides, arm, root)
            report.update(compile_mode=job["compile"].mode)
            row = report["arms"][arm] = dict(arm=arm, **run_arm(job, batches, int(opts["settle"])))
            print(json.dumps(row), flush=True)
            release_gpu()
    finally:
        if not opts["dir"]:
            shutil.rmtree(root, ignore_errors=True)
    if {"on", "off"} <= set(report["arms"]):
        on, off = report["arms"]["on"], report["arms"]["off"]
        report["rate_cost"] = round(1 - on["items_per_s"] / off["items_per_s"], 5)
    print(_table(report))
    if opts["out"]:
        from ..io.outputs import write_json
        write_json(opts["out"], report)
    return report


def _period_batches(run) -> int:
    """The job's canary period in batches (`run.canary_every_items` / `run.batch_size`, at least
    one); a job whose canary runs only by time (or not at all) has none: `batches=` then."""
    if not run.canary_items:
        raise SystemExit("this job's canary has no period in items (run.canary_every_items=0): "
                         "give the window as batches=N")
    return max(1, run.canary_items // run.batch_size)


def _table(report: dict) -> str:
    from ..io.outputs import format_table
    rows = [dict(r, canaries=len(r["canaries"])) for r in report["arms"].values()]
    text = format_table(rows, ["arm", "device", "batches", "items", "window_s", "items_per_s",
                               "canaries", "canary_s", "share", "canary_ref_s"])
    if "rate_cost" in report:
        text += f"\nrate cost of the canary (1 - on/off items/s): {100 * report['rate_cost']:.2f} %"
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
