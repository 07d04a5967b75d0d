"""The batch job, top to bottom: load config, check prompts and plan shards, start workers,
stream results, summarize. `main(argv)` is what `python -m runner` runs.

Everything that can be wrong with the input is checked before Ray starts or any model is built.
A rerun into the same directory resumes: prompts whose output is complete are skipped (see
`results.py`); with nothing left it says so in one line and keeps the last summary. Shards are
handed out dynamically and survive worker failures (see `dispatch.py`). Each shard's rows are
recorded as they arrive (one `records/` object per shard); `results.parquet` and report.html are
rewritten atomically at most every `output.results_every_s` by a background thread (the dispatch
loop never waits for a full rewrite), and at the end. One driver per job directory (`lock.py`).
The job directory is a `storage.Store`: a local directory, `s3://` or `gs://`, through the same
calls; workers write their media to it themselves, so no filesystem needs to be shared.
`run.dry_run=true` stops after the checks and prints the plan against the job directory.

Exit status: 0 all ok (or a dry run, or nothing to do); 1 some items failed; 2 bad input or the job
could not run (the message names the key or file and the fix); 130 interrupted (Ctrl-C); 143
terminated (SIGTERM: `ray job stop`, Kubernetes, Slurm). Interrupted or terminated, the workers are
stopped, finished outputs are kept and the summary and metrics of what was done are written.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs
from omegaconf import OmegaConf

from .config import ConfigError, help_text, load_config, split
from .dispatch import DispatchError, PersistentFault, dispatch
from .lock import LockedError, job_lock, holder as lock_holder
from .outputs import format_table
from .progress import PhasePrinter, Progress
from .images import fill_hashes
from .prompts import Constraints, PromptError, check_prompts, plan_shards
from . import step_cache
from .results import (JOURNAL, RECORDS, Plan, Results, config_changes, fingerprint,
                      remove_temp_files, settings_id, start_fresh)
from .storage import Store, resolve

log = logging.getLogger("runner")
INFLIGHT = 2   # shards queued per worker: the next is ready the moment one finishes


# Printed under the per-worker table: the columns' units and what steady_it_s measures.
LEGEND = ("model_load_s, warmup_s: seconds to load the model / to compile (or load the compile cache) "
          "and warm up; steady_it_s: denoising steps/s, from the end of step 1 of each call (its "
          "one-off costs excluded); e2e_mean_s, e2e_p95_s: seconds per call (one batch), from its "
          "start to its last file written, mean / 95th percentile; peak_mem_gb: peak GPU memory while "
          "serving, GiB. Over the serving window (first call to last batch): busy_fraction: share the "
          "model thread was generating (not waiting for work); gpu_util: NVML's utilisation, what "
          "nvidia-smi shows (it falls when the GPU idles). gpu_ms_text, gpu_ms_denoise, "
          "gpu_ms_decode: GPU milliseconds per item of text encoding (a shard's prompts in one "
          "call), denoising and VAE decoding, from CUDA events around each (GPU figures null on "
          "CPU). Seconds per stage: summed per worker; encoding and writing overlap with "
          "generating.")


class JobError(RuntimeError):
    pass


def _worker_detail(m: dict) -> dict:
    """A worker's line of the summary: its metrics' headline figures, GPU ms per item flattened."""
    d = {k: m.get(k) for k in ("rank", "host", "node_id", "gpu_name", "items", "failed", "restarts",
                                "model_load_s", "warmup_s", "steady_it_s", "e2e_mean_s", "e2e_p95_s",
                                "peak_mem_gb", "busy_fraction", "gpu_util", "serving_s", "time_s")}
    ms = m.get("gpu_ms_per_item") or {}
    d.update(gpu_ms_text=ms.get("text_encode"), gpu_ms_denoise=ms.get("denoise"),
             gpu_ms_decode=ms.get("decode"))
    return d


# The stop signals received (SIGINT: Ctrl-C, SIGTERM). The handler only records the first: the
# dispatch loop, awake at least once a second, raises KeyboardInterrupt at a point of its own
# (`_check_stop`). A handler that raised wherever the main thread stood (inside a Ray call, or
# the snapshot executor's submit) could leave a lock held: a CI run's driver wrote its summary
# after SIGTERM, then hung at exit for 15 minutes. A second signal raises at once, as Python's
# Ctrl-C does, for a stop that something stuck would never reach.
STOPS: list[int] = []


def _on_stop_signal(signum, frame):
    STOPS.append(signum)
    if len(STOPS) > 1:
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _handle_stop_signals() -> None:
    """SIGTERM, and SIGINT unless the process started with it ignored (`nohup`, `cmd &`), as
    Python itself does. Again after `ray.init`, which installs its own SIGTERM handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_stop_signal)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_stop_signal)


def _check_stop() -> None:
    """Called from the dispatch loop: a received stop signal becomes KeyboardInterrupt here."""
    if STOPS:
        raise KeyboardInterrupt(signal.Signals(STOPS[0]).name)


def _terminated() -> bool:
    return bool(STOPS) and STOPS[0] == signal.SIGTERM


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv) or not argv:
        print(help_text(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _handle_stop_signals()
    try:
        summary = run(argv)
    except (ConfigError, PromptError, JobError, LockedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # a second signal stops at once: the summary may not have been written
        kept = ("finished outputs are kept (a second signal: the summary may be missing)"
                if len(STOPS) > 1 else "finished outputs and the summary so far are written")
        if _terminated():
            print(f"terminated (SIGTERM): {kept}; rerun the same command to resume", file=sys.stderr)
            return 143
        print(f"interrupted: {kept}; rerun the same command to resume", file=sys.stderr)
        return 130
    if summary.get("aborted"):   # 3: stopped early on a persistent fault (summary.txt says which)
        print(f"error: {summary['aborted']}", file=sys.stderr)
        return 3
    # 1: some items failed (see summary.txt); the others are complete.
    return 0 if summary["failed"] == 0 else 1


def exit_within(status: int, timeout_s: float = 30.0) -> None:
    """A last guard on the exit: past `timeout_s` (Ray's shutdown in `atexit`, a thread that
    never ends), say so and end the process with `status`. Every output, record and summary is
    written by then, and the job's lock released: nothing is left to finish."""
    def guard():
        time.sleep(timeout_s)
        sys.stdout.flush()                           # os._exit flushes nothing
        print(f"runner: the exit (Ray's shutdown, or a thread that does not end) took over "
              f"{timeout_s:.0f} s; exiting anyway with status {status}", file=sys.stderr, flush=True)
        os._exit(status)
    threading.Thread(target=guard, name="exit-guard", daemon=True).start()


def run(argv: list[str]) -> dict:
    # 1. Config: merged, checked, split into typed pieces.
    cfg = load_config(argv)
    job = split(cfg)
    model, out, opts = job["model"], job["output"], job["run"]

    # 2. Prompts and output directory: all checked before Ray or any model.
    limits = constraints(model)
    step_cache.prepare(job)                      # step reuse: offered for this model? step graph off
    compile_flags = check_compile(job["compile"])
    files, raw_rows, items = check_prompts(job["prompts"].paths, job["generation"], limits,
                                           job["prompts"].on_empty, job["prompts"].strict)
    step_cache.check_steps(job["step_cache"], items)   # compute_steps within every row's steps
    skipped = sum(raw_rows.values()) - len(items)      # empty prompts, prompts.on_empty=skip
    if skipped:
        log.warning("%d rows with an empty prompt skipped (prompts.on_empty=skip)", skipped)
    _check_output_dir(out.job_dir, create=not opts.dry_run)
    if opts.dry_run:
        return _dry_run(cfg, job, items)
    with job_lock(_store(out.job_dir)):                  # one driver per job directory
        return _run_locked(cfg, job, limits, compile_flags, files, items, skipped)


def _run_locked(cfg, job, limits, compile_flags, files, items, skipped: int = 0) -> dict:
    model, out, opts = job["model"], job["output"], job["run"]
    # Find what is already done (made from exactly these parameters), plan shards of the rest.
    results = _open_results(cfg, out)
    items = fill_hashes(items, results.rows)     # image rows: their images' current content
    plan = results.plan(items)
    done = plan.done
    shards = plan_shards(items, opts.shard_size, done)
    if items and not shards:   # the last run's config.yaml and summary stay as they are
        return _nothing_to_do(results, items, out)
    try:
        _store(out.job_dir).write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    except OSError as e:       # a full disk, a store that refuses writes: before any GPU time
        raise JobError(f"output.dir: cannot write {out.job_dir}/config.yaml ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:300]}); free space or fix access, then rerun") from e
    log.info("%d prompts in %d files; %d already done; %d shards to run; outputs in %s",
             len(items), len(files), len(done), len(shards), out.job_dir)
    _log_plan(plan, out.job_dir)
    by_row = {(it.file, it.row): it for it in items}
    ids = [it.id for it in items]          # the rows results.parquet keeps, in prompt order

    def items_of(shard):
        return [by_row[(shard.file, r)] for r in range(shard.start, shard.stop)
                if (shard.file, r) in by_row]

    # 3. Workers: one Ray actor per GPU (or cpu_workers CPU actors), each loads and warms once.
    slots, stopped, aborted, t_start = [], None, None, time.perf_counter()
    timeline = []                          # (s since start, ok, failed) of this run: report.html
    t_ready = t_done = t_all_ready = t_all_ready_wall = None
    ready_ranks, steady_items = set(), 0.0   # slots ever ready; items' worth of work once all were
    background, pending = ThreadPoolExecutor(1, thread_name_prefix="snapshot"), None
    if shards:
        import ray
        from .actor import WorkerActor
        _ray_init(job["ray"])
        _handle_stop_signals()
        gpus = int(ray.cluster_resources().get("GPU", 0)) if model.device != "cpu" else 0
        n = job["ray"].num_workers or (gpus or job["ray"].cpu_workers)
        actor_opts = dict(num_gpus=1, num_cpus=1) if gpus else dict(num_cpus=job["ray"].cpus_per_worker)
        broker = None
        if "cache-all" in compile_flags:
            from .compile_cache import CacheBroker
            broker = ray.remote(CacheBroker).options(num_cpus=0, max_concurrency=1000).remote()
        wcfg = worker_config(job, limits, on_gpu=bool(gpus))
        # Threaded: a shard's two calls (start_shard, finish_shard) for each shard in flight,
        # metrics() and phases(); the worker orders the GPU work itself.
        RemoteWorker = ray.remote(WorkerActor).options(max_restarts=0, scheduling_strategy="SPREAD",
                                                  max_concurrency=2 * INFLIGHT + 1, **actor_opts)
        log.info("starting %d %s workers (each loads the model, compiles or loads the compile cache, "
                 "warms up)", n, "GPU" if gpus else "CPU")

        # Each starting worker's phases, polled from the dispatch loop (progress.py).
        phases = PhasePrinter()

        # 4. Stream: dynamic hand-out, each shard's rows recorded as they arrive (records/).
        progress = Progress(sum(len(items_of(s)) for s in shards))
        last_write = time.monotonic()

        def snapshot():
            """results.parquet and report.html so far, off the dispatch loop's thread (a full
            rewrite costs seconds at a million rows; the loop only records O(shard) per shard)."""
            _report(out.job_dir, results.write_table(ids), dict(job=job["name"], items=len(items)),
                    timeline=list(timeline), thumb_budget_s=5)

        def on_rows(rows):
            nonlocal last_write, steady_items, pending
            try:
                results.add(rows)
            except OSError as e:     # the record cannot be written: nothing further can count
                raise PersistentFault(f"the job's record could not be written ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:300]}). Finished outputs are "
                                      f"kept: fix the storage and rerun the same command to resume.")
            progress.update(len(rows))
            n_ok, n_failed = timeline[-1][1:] if timeline else (0, 0)
            ok = sum(r["status"] == "ok" for r in rows)
            timeline.append((time.perf_counter() - t_start, n_ok + ok, n_failed + len(rows) - ok))
            if t_all_ready is not None:
                steady_items += work_after(rows, t_all_ready_wall)
            if time.monotonic() - last_write >= out.results_every_s and (
                    pending is None or pending.done()):      # at most one snapshot at a time
                pending = background.submit(snapshot)
                last_write = time.monotonic()

        def on_ready(slot):
            nonlocal t_ready, t_all_ready, t_all_ready_wall
            phases.poll(slots, flush=slot)
            log.info("worker %d: ready in %.1f s", slot.rank, time.monotonic() - slot.started)
            progress.start()     # the bar's rate counts generation from the first ready worker
            t_ready = t_ready or time.perf_counter()
            ready_ranks.add(slot.rank)   # a replacement of a slot that was ready adds nothing
            if len(ready_ranks) == n and t_all_ready is None:
                t_all_ready, t_all_ready_wall = time.perf_counter(), time.time()

        try:
            with progress.logging():
                dispatch(lambda k: RemoteWorker.remote(k, wcfg, broker), n, shards, items_of,
                         on_rows, inflight=INFLIGHT, max_retries=opts.max_shard_retries,
                         max_restarts=job["ray"].max_worker_restarts,
                         start_timeout_s=job["ray"].worker_start_timeout_s, on_ready=on_ready,
                         slots=slots, on_tick=lambda: (_check_stop(), phases.poll(slots), progress.tick()))
        except KeyboardInterrupt as e:           # Ctrl-C or SIGTERM (_check_stop)
            stopped = e
            log.warning("%s: stopping workers; finished outputs are kept, rerun to resume",
                        "terminated" if _terminated() else "interrupted")
        except PersistentFault as e:         # the same error on every output: stop, summarize
            aborted = str(e)
            log.error("stopping: %s", e)
        except DispatchError as e:           # every worker gone
            results.write_table(ids)
            results.compact()
            remove_temp_files(out.job_dir)
            raise JobError(str(e)) from e
        finally:
            progress.close()
            _settle(pending)          # a stale snapshot must not land after the final write
        t_done = time.perf_counter()

    # 5. Summarize (stopped on a persistent fault: the store may be what failed; then say so).
    def stop_workers():
        import ray
        for s in slots:
            ray.kill(s.actor)
        # ray.kill only asks: a worker mid-write could still put a file after the summary.
        _wait_dead(ray, [s.actor for s in slots], timeout_s=15.0)
        # A worker that died mid-write left a temp file (its item was requeued, or is not recorded).
        remove_temp_files(out.job_dir)

    def summarize() -> dict:
        metrics = _collect_metrics(slots, out, timeout_s=60.0 if stopped is None else 30.0)
        if stopped is not None and slots:   # stopped: no file may land after the summary
            stop_workers()
        table = results.write_table(ids)
        results.compact()
        timing = dict(startup_s=(t_ready or t_start) - t_start,
                      generate_s=(t_done or t_start) - (t_ready or t_start))
        if t_all_ready is not None and t_done is not None and t_done > t_all_ready:
            # Throughput once every worker serves: the figure that scales with workers (the ramp
            # while later workers load and warm is in generate_s). Items in flight when the last
            # worker became ready count by the part of their run after that moment.
            timing.update(all_ready_s=t_all_ready - t_start,
                          steady_items_per_s=steady_items / (t_done - t_all_ready))
        timing["aborted"] = aborted
        timing["skipped_empty"] = skipped   # rows never run: empty prompts, on_empty=skip
        summary = _summarize(job, items, table, slots, metrics, len(done), stopped is not None, timing,
                             plan)
        _report(out.job_dir, table, summary, metrics, timeline=timeline or None)
        if slots and stopped is None:
            stop_workers()
        if stopped is not None:
            raise stopped
        return summary

    try:
        return summarize()
    except OSError as e:
        # the store failed under the end of the run (results, record, summary): every finished
        # output is recorded already; stopped: the exit status stays the stop's; else exit 3
        cause = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        log.error("the summary could not be written: %s", cause)
        if stopped is not None:
            raise stopped from None
        return dict(aborted=aborted or f"the results or summary could not be written ({cause}); "
                                       f"finished outputs are recorded: fix the store and rerun "
                                       f"the same command to write the results table", failed=0)


@functools.lru_cache(maxsize=8)
def _store(job_dir: str) -> Store:
    """The job directory as a Store (one per location and process: an S3 client is not free)."""
    return resolve(job_dir)


def json_text(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"


def _settle(future) -> None:
    """Waits for a background snapshot (its errors are logged by `_report`)."""
    if future is not None:
        with contextlib.suppress(Exception):
            future.result()


def _report(job_dir: str, *args, **kw) -> None:
    """report.html (see report.py): a failure to draw it is logged, never fatal to the job."""
    try:
        from .report import write_report
        write_report(job_dir, *args, **kw)
    except Exception as e:
        log.warning("report.html not written: %s: %s", type(e).__name__, e)


def _log_plan(plan: Plan, job_dir: str) -> None:
    if plan.changed:
        log.warning("%d rows changed since their outputs were made (%s): regenerating them",
                    len(plan.changed), plan.changed_by_file())
    if plan.gone:
        log.warning("%d outputs in %s are of ids no longer in the input (kept, listed in "
                    "summary.txt): %s", len(plan.gone), job_dir, _few(plan.gone))


def _few(ids: list[str], n: int = 10) -> str:
    return ", ".join(ids[:n]) + (f", ... ({len(ids) - n} more)" if len(ids) > n else "")


def _dry_run(cfg, job, items) -> dict:
    """run.dry_run=true: the plan against the job directory; nothing written, no Ray."""
    out, opts, r = job["output"], job["run"], job["ray"]
    results = Results(_store(out.job_dir), settings_id(cfg))
    if not cfg.output.overwrite:
        _check_same_config(cfg, out)
        results.load()
    items = fill_hashes(items, results.rows)
    plan = results.plan(items)
    shards = plan_shards(items, opts.shard_size, plan.done)
    workers = r.num_workers or f"one per GPU ({r.cpu_workers} without GPUs)"
    changed = f": {plan.changed_by_file()}" if plan.changed else ""
    gone = f": {_few(plan.gone)}" if plan.gone else ""
    lines = [f"dry run of {out.job_dir}"
             + (" (output.overwrite=true: everything regenerated)" if cfg.output.overwrite else "") + ":",
             f"  {len(items) - len(plan.done)} to run ({len(plan.changed)} changed{changed})",
             f"  {len(plan.done)} already done",
             f"  {len(plan.gone)} no longer in the input (kept){gone}",
             f"  {len(shards)} shards of up to {opts.shard_size} rows; workers: {workers}"]
    held = lock_holder(_store(out.job_dir))
    if held is not None:
        lines.append(f"  note: a driver runs in this directory now (pid {held.get('pid')} on host "
                     f"{held.get('host')}, started {held.get('started')}); a run would exit 2")
    print("\n".join(lines))
    return dict(dry_run=True, items=len(items), to_run=len(items) - len(plan.done),
                done=len(plan.done), changed=len(plan.changed), not_in_input=len(plan.gone),
                shards=len(shards), failed=0)


def worker_config(job: dict, limits: Constraints, on_gpu: bool):
    """What each worker needs to know (the only part of the config a worker sees)."""
    from .actor import WorkerConfig
    return WorkerConfig(model=job["model"], generation=job["generation"], limits=limits,
                        on_empty=job["prompts"].on_empty,
                        job_dir=_store(job["output"].job_dir).uri(),
                        batch_size=job["run"].batch_size, warmup_steps=job["run"].warmup_steps,
                        fps=job["output"].fps, compile=job["compile"],
                        step_cache=job["step_cache"], encode_batch=job["run"].shard_size,
                        num_threads=None if on_gpu else job["ray"].cpus_per_worker,
                        cache_wait_s=job["ray"].worker_start_timeout_s)


def check_compile(c) -> frozenset:
    """Compile options are checked on the driver, before any GPU time."""
    import compiler
    try:
        return compiler.parse_options(c.options).flags
    except ValueError as e:
        raise ConfigError(f"compile: {e}") from e


def _open_results(cfg, out) -> Results:
    """Resume what a previous run into this directory finished, if its config is compatible
    (called holding the job's lock: it removes files)."""
    if cfg.output.overwrite:
        start_fresh(_store(out.job_dir))
    else:
        _check_same_config(cfg, out)
    removed = remove_temp_files(out.job_dir)
    if removed:
        log.info("removed %d half-written files left by an earlier run", removed)
    return Results(_store(out.job_dir), settings_id(cfg)).load()


def _check_same_config(cfg, out) -> None:
    store = _store(out.job_dir)
    old_cfg = store.read_text("config.yaml")
    if old_cfg is not None and (store.exists(JOURNAL) or store.list(RECORDS)):
        old = OmegaConf.create(old_cfg)
        changes = config_changes(fingerprint(old), fingerprint(cfg))
        # the fingerprint holds whether the mode is lossy; the user changed the mode: name it
        mode = f"compile.mode: {OmegaConf.select(old, 'compile.mode')!r} -> {cfg.compile.mode!r}"
        named = {"lossy: False -> True": f"{mode} (lossless -> lossy)",
                 "lossy: True -> False": f"{mode} (lossy -> lossless)"}
        changes = [named.get(c, c) for c in changes]
        if changes:
            raise JobError(f"{out.job_dir} holds results of a different config ({'; '.join(changes)}); "
                           f"set output.overwrite=true to regenerate everything, or choose another "
                           f"job.name or output.dir")


def _nothing_to_do(results: Results, items, out) -> dict:
    """A rerun with every prompt done: say so in one line; the last real summary stays in place."""
    ids = [it.id for it in items]
    store = _store(out.job_dir)
    table_path = store.uri("results.parquet")
    try:
        import pyarrow.parquet as pq
        stale = pq.read_table(store.open_input("results.parquet"),
                              columns=["id"]).column("id").to_pylist() != ids
    except Exception:                    # missing or unreadable (the driver died before writing it)
        stale = True
    if stale:
        results.write_table(ids)
    results.compact()
    info = store.fs.get_file_info(store.path("summary.txt"))
    if info.is_file:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.mtime.timestamp()))
        kept = f"summary from {when} kept in {store.uri('summary.txt')}"
    else:
        kept = f"results in {table_path}"

    print(f"nothing to do: all {len(ids)} prompts already done ({kept}); "
          f"output.overwrite=true regenerates them")
    return {"failed": 0, "items": len(ids), "ok": len(ids), "nothing_to_do": True}


def _wait_dead(ray, actors, timeout_s: float) -> None:
    """Return once every killed actor's process is gone (a call to it fails), or after
    `timeout_s` with a warning naming how many still answer."""
    deadline = time.monotonic() + timeout_s
    alive = list(actors)
    while alive and time.monotonic() < deadline:
        calls = [(a, a.__ray_ready__.remote()) for a in alive]
        alive = []
        for a, ref in calls:
            try:       # an answer, or none in time: the kill has not reached it yet
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                pass
            except Exception:                  # RayActorError: dead, as asked
                continue
            alive.append(a)
        if alive:
            time.sleep(0.2)
    if alive:
        log.warning("%d stopped worker(s) still running after %.0f s", len(alive), timeout_s)


def _collect_metrics(slots, out, timeout_s: float = 60.0) -> list[dict]:
    """Every ready worker's metrics, asked in parallel, waited for `timeout_s` in all (after an
    interrupt a worker answers once its running shard is done; SIGTERM's grace period is short)."""
    import ray
    metrics = []
    asked = [(s, s.actor.metrics.remote()) for s in slots if s.state == "ready"]
    deadline = time.monotonic() + timeout_s
    for s, ref in asked:
        try:
            m = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except Exception as e:           # a worker that died at the very end: its rows are in
            log.warning("no metrics from worker %d: %s", s.rank, e)
            continue
        m["restarts"] = s.restarts
        _store(out.job_dir).write_text(f"metrics/worker-{m['rank']}.json", json_text(m))
        metrics.append(m)
    return metrics


def constraints(model) -> Constraints:
    from .models import ModelLoadError, check_pretrained, video_length
    try:
        check_pretrained(model)
    except ModelLoadError as e:
        raise JobError(str(e)) from e
    fam = model.family
    return Constraints(size_factor=model.info["size_factor"], video_length=video_length(model),
                       frame_step=fam.frame_step, min_steps=fam.min_steps, image=fam.image)


def _check_output_dir(job_dir: str, create: bool = True) -> None:
    """The job directory can be created and written (created if `create`; else its nearest
    existing parent is probed, so a dry run writes nothing that stays). On an object store: a
    probe object is written and deleted (a dry run only lists)."""
    if "://" in job_dir and not job_dir.startswith("file://"):
        store = _store(job_dir)
        try:
            if create:
                probe = f".probe-{os.getpid()}-{time.time_ns()}"
                store.write_text(probe, "")
                store.delete(probe)
            else:   # read only: the bucket must exist (listing a missing one says nothing)
                bucket = store.base.split("/", 1)[0]
                if store.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    raise OSError(f"the bucket {bucket!r} does not exist")
                store.list(RECORDS)
        except (OSError, ValueError) as e:
            raise JobError(f"output.dir: cannot write {job_dir!r} ({e}); check the bucket and the "
                           f"credentials in the environment (README: Cloud storage)") from e
        return
    job_dir = _store(job_dir).base
    p = job_dir
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise JobError(f"output.dir: {p!r} exists and is a file; set output.dir to a directory "
                       f"(or remove the file)")
    try:
        if create:
            os.makedirs(job_dir, exist_ok=True)
            p = job_dir
        with tempfile.NamedTemporaryFile(dir=p, prefix=".tmp-probe-"):
            pass
    except OSError as e:
        raise JobError(f"output.dir: cannot create or write {job_dir!r} ({e.strerror or e}); set "
                       f"output.dir to a writable directory") from e


def _ray_init(opts) -> None:
    import ray
    if ray.is_initialized():
        return
    address = opts.address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        # Embedded local Ray, always a new one ("local": never attach to a cluster that `ray start`
        # left running; that takes ray.address=auto), with enough CPU slots for the CPU workers
        # even on a small machine. Quiet: no usage stats, and token auth on, as Ray 2.60 turns it
        # on for a new local cluster, but set explicitly, which is what silences its warning. A
        # value the user set wins; a user's own cluster (the branch above) is untouched.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if "RAY_AUTH_MODE" not in os.environ:
            os.environ["RAY_AUTH_MODE"] = "token"        # inherited by every process of the cluster
            try:   # this process read its config at `import ray`: re-read it, as ray.init does
                from ray._raylet import Config
                Config.initialize("")
            except Exception:                             # a Ray without token auth
                pass
        need = (opts.num_workers or opts.cpu_workers) * opts.cpus_per_worker
        log.info("starting a local Ray (ray.address or RAY_ADDRESS: use a cluster instead)")
        start_local_ray(ray, num_cpus=max(os.cpu_count() or 1, need))


def start_local_ray(ray, num_cpus: int, attempts: int = 3) -> None:
    """ray.init of a new local Ray. Ray waits a fixed 30 s for its raylet to register, which a
    loaded machine can exceed ("The current node timed out during startup"; seen on 2 cores with
    other jobs starting): `attempts` tries in all, then a JobError naming it (exit 2) instead of a
    traceback."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     logging_level=logging.WARNING)
            return
        except Exception as e:
            if "timed out during startup" not in str(e):
                raise
            ray.shutdown()
            if attempt == attempts:
                raise JobError(f"the local Ray did not start, {attempts} times ({e}); the machine may "
                               f"be overloaded: rerun when it is not, or set ray.address to a "
                               f"running cluster") from e
            log.warning("the local Ray did not start in time (%s); starting it again (%d of %d)",
                        e, attempt + 1, attempts)


def work_after(rows: list[dict], t_from: float) -> float:
    """Items' worth of work in one shard's `rows` done after `t_from` (epoch seconds): each ok row
    ran from `started_at` (epoch, its batch's call start) for `e2e_s` seconds; a row that started
    before `t_from` counts by the share of its run after it. (The pipelined worker overlaps a
    batch's writing with the next batch's generation, so the runs cannot be laid end to end back
    from the shard's arrival: that undercounted the first shards.) Failed rows count 0."""
    credit = 0.0
    for r in rows:
        start, dur = r.get("started_at"), r.get("e2e_s")
        if r.get("status") != "ok" or start is None or not dur:
            continue
        credit += min(1.0, max(0.0, (start + dur - t_from) / dur))
    return credit


def _served(slots, metrics) -> int:
    """Worker slots that became ready (also when interrupted before their metrics came back)."""
    return len({s.rank for s in slots if s.ready_info is not None} | {m["rank"] for m in metrics})


def _summarize(job, items, table, slots, metrics, resumed, interrupted, timing, plan=None) -> dict:
    out = job["output"]
    startup_s, gen_s = timing["startup_s"], timing["generate_s"]
    ok = [r for r in table if r["status"] == "ok"]
    failed = [r for r in table if r["status"] != "ok"]
    errors: dict[str, int] = {}
    for r in failed:
        key = (r["error"] or "?").splitlines()[0][:160]
        errors[key] = errors.get(key, 0) + 1
    summary = dict(
        job=job["name"], model=job["model"].preset, source=job["model"].source,
        compile_mode=job["compile"].options["mode"], workers=_served(slots, metrics), items=len(items),
        ok=len(ok), failed=len(failed), not_run=len(items) - len(table), resumed=resumed,
        worker_restarts=sum(s.restarts for s in slots),
        interrupted=interrupted, errors=errors, **timing,
        regenerated=len(plan.changed) if plan else 0,       # rows whose parameters had changed
        not_in_input=len(plan.gone) if plan else 0,         # outputs kept of ids no longer in the input
        not_in_input_ids=plan.gone if plan else [],
        items_per_s=(len(ok) - resumed) / gen_s if gen_s else None,
        steps_per_s=sum(m["steps"] for m in metrics) / gen_s if gen_s else None,
        workers_detail=[_worker_detail(m) for m in metrics],
    )
    _store(out.job_dir).write_text("summary.json", json_text(summary))
    table_txt = format_table(summary["workers_detail"],
                             ["rank", "host", "items", "failed", "restarts", "model_load_s",
                              "warmup_s", "steady_it_s", "e2e_mean_s", "e2e_p95_s", "peak_mem_gb",
                              "busy_fraction", "gpu_util", "gpu_ms_text", "gpu_ms_denoise",
                              "gpu_ms_decode"])
    table_txt += "\n" + textwrap.fill(LEGEND, 100)
    rate = f"{summary['items_per_s']:.3g} items/s" if summary["items_per_s"] else "-"
    text = (f"job {summary['job']}: {summary['ok']}/{summary['items']} ok, {summary['failed']} failed"
            f", {summary['not_run']} not run ({resumed} done by an earlier run)"
            f"{', INTERRUPTED' if interrupted else ''}; model {summary['model']} "
            f"({summary['source']}), compile {summary['compile_mode']}\n"
            f"{summary['workers']} workers ({summary['worker_restarts']} restarts) ready in "
            f"{startup_s:.1f} s; generated in {gen_s:.1f} s = {rate}"
            + (f"; all ready at {timing['all_ready_s']:.1f} s, then {timing['steady_items_per_s']:.3g} items/s"
               if "steady_items_per_s" in timing else "") + f"\n\n{table_txt}\n")
    if metrics:   # where each worker's serving seconds went
        stages = list(metrics[0]["time_s"])
        text += "\nseconds per stage:\n" + format_table(
            [{"rank": m["rank"], **m["time_s"]} for m in metrics], ["rank", *stages]) + "\n"
    if plan and plan.gone:
        text += (f"\n{len(plan.gone)} outputs of ids no longer in the input (kept): "
                 f"{', '.join(plan.gone)}\n")
    if errors:
        text += "\nfailures:\n" + "\n".join(f"  {n} x {e}" for e, n in errors.items()) + "\n"
    if timing.get("skipped_empty"):
        text += f"\n{timing['skipped_empty']} rows with an empty prompt skipped (prompts.on_empty=skip)\n"
    if timing.get("aborted"):
        text += f"\nSTOPPED before the end: {timing['aborted']}\n"
    _store(out.job_dir).write_text("summary.txt", text)
    print("\n" + text)
    return summary
