"""The batch job, top to bottom: load config, check prompts and plan shards, start workers,
stream results, summarize. `main(argv)` is what `python -m runner` runs.

Everything that can be wrong with the input is checked before any worker starts or any model is
built. A rerun into the same directory resumes: prompts whose output is complete are skipped (see
`results.py`); with nothing left it says so in one line and keeps the last summary. One driver per
job directory (`lock.py`). The job directory is a `storage.Store`: a local directory, `s3://` or
`gs://`, through the same calls; workers write their media to it themselves, so no filesystem needs
to be shared. `run.dry_run=true` stops after the checks and prints the plan against the job
directory.

A run is a `JobRun`: it owns the run's state (the record, the timeline, the progress, the
background snapshot, the timing marks) and the dispatcher's callbacks are its methods. Shards are
handed out dynamically and survive worker failures (`dispatch.py`) on a `dispatch.Pool`: Ray actors
(`raypool.py`, the driver's only Ray code) unless `run(argv, start_pool=...)` is given another (the
fake pools of tests/test_jobrun.py; the simulated cluster of `runner.bench.simulate`). Each shard's
rows are recorded as they arrive (one `records/` object per shard); `results.parquet` and
report.html are rewritten atomically at most every `output.results_every_s` by a background thread
(the dispatch loop never waits for a full rewrite), and at the end. This module imports no Ray.

Exit status: 0 all ok (or a dry run, or nothing to do); 1 some items failed; 2 bad input or the job
could not run (the message names the key or file and the fix); 3 stopped early on a persistent
fault; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM: `ray job stop`, Kubernetes, Slurm).
Interrupted or terminated, the workers are stopped, finished outputs are kept and the summary and
metrics of what was done are written.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import pyarrow.fs as pafs
from omegaconf import OmegaConf

from . import step_cache
from .config import (ConfigError, OutputOptions, RayOptions, WorkerConfig, help_text, load_config,
                     split)
from .dispatch import DispatchError, Dispatcher, PersistentFault, Pool
from .images import fill_hashes
from .lock import LockedError, job_lock, holder as lock_holder
from .progress import PhasePrinter, Progress
from .prompts import Constraints, Item, PromptError, Shard, check_prompts, plan_shards
from .results import (JOURNAL, RECORDS, Plan, Results, config_changes, fingerprint,
                      remove_temp_files, settings_id, start_fresh)
from .storage import Store, resolve
from .summary import json_text, work_after, write_summary

log = logging.getLogger("runner")
INFLIGHT = 2   # shards queued per worker: the next is ready the moment one finishes


class JobError(RuntimeError):
    pass


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
    Python itself does. Again once the pool started (`ray.init` installs its own SIGTERM handler)."""
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


StartPool = Callable[[dict, Constraints], Pool]   # (the job's typed config, limits) -> its pool


def main(argv: list[str] | None = None, start_pool: StartPool | None = None,
         clock: Callable[[], float] = time.time) -> int:
    """`python -m runner`: `run(argv)`, its outcome as the exit status (module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv) or not argv:
        print(help_text(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _handle_stop_signals()
    try:
        summary = run(argv, start_pool, clock)
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


@dataclass(frozen=True)
class Checked:
    """The job's input, checked against the model."""
    limits: Constraints
    files: list[str]
    items: list[Item]
    skipped: int                  # rows with an empty prompt left out (prompts.on_empty=skip)


def run(argv: list[str], start_pool: StartPool | None = None,
        clock: Callable[[], float] = time.time) -> dict:
    """The job of `argv`; its workers from `start_pool` (default: Ray actors), its timing marks
    on `clock` (epoch seconds, the clock of the rows' `started_at`)."""
    # 1. Config: merged, checked (the compile options parsed once), split into typed pieces.
    cfg = load_config(argv)
    job = split(cfg)
    # 2. Prompts and output directory: all checked before any worker or model.
    checked = check_input(job)
    _check_output_dir(job["output"].job_dir, create=not job["run"].dry_run)
    if job["run"].dry_run:
        return _dry_run(cfg, job, checked.items)
    with job_lock(_store(job["output"].job_dir)):                  # one driver per job directory
        return _run_locked(cfg, job, checked, start_pool or start_ray_pool, clock)


def check_input(job: dict) -> Checked:
    limits = constraints(job["model"])
    step_cache.prepare(job)                      # step reuse: offered for this model? step graph off
    p = job["prompts"]
    files, raw_rows, items = check_prompts(p.paths, job["generation"], limits, p.on_empty, p.strict)
    step_cache.check_steps(job["step_cache"], items)   # compute_steps within every row's steps
    skipped = sum(raw_rows.values()) - len(items)      # empty prompts, prompts.on_empty=skip
    if skipped:
        log.warning("%d rows with an empty prompt skipped (prompts.on_empty=skip)", skipped)
    return Checked(limits, files, items, skipped)


def _run_locked(cfg, job: dict, checked: Checked, start_pool: StartPool, clock) -> dict:
    # 3. Plan: what is already done (made from exactly these parameters), shards of the rest.
    out, items = job["output"], checked.items
    results = _open_results(cfg, out)
    items = fill_hashes(items, results.rows)     # image rows: their images' current content
    plan = results.plan(items)
    shards = plan_shards(items, job["run"].shard_size, plan.done)
    if items and not shards:   # the last run's config.yaml and summary stay as they are
        return _nothing_to_do(results, items, out)
    _write_config(cfg, out.job_dir)
    log.info("%d prompts in %d files; %d already done; %d shards to run; outputs in %s",
             len(items), len(checked.files), len(plan.done), len(shards), out.job_dir)
    _log_plan(plan, out.job_dir)
    # 4. Workers and stream: shards handed out, rows recorded as they arrive.
    run = JobRun(results, items, plan, out, _head(job), checked.skipped, clock)
    if shards:
        run.serve(start_pool(job, checked.limits), shards, job["run"].max_shard_retries, job["ray"])
    # 5. Summarize (stopped on a persistent fault: the store may be what failed; then say so).
    return run.finish()


def start_ray_pool(job: dict, limits: Constraints) -> Pool:
    """The job's workers as Ray actors: one per GPU, or `ray.*`'s count (`raypool.py`)."""
    from .raypool import RayPool, RayStartError
    try:
        return RayPool.open(job["ray"], gpu=job["model"].device != "cpu",
                            worker_config=functools.partial(worker_config, job, limits),
                            shared_cache=job["compile"].options.has("cache"), inflight=INFLIGHT)
    except RayStartError as e:
        raise JobError(str(e)) from e


def _head(job: dict) -> dict:
    """What the summary says the job was."""
    return dict(job=job["name"], model=job["model"].preset, source=job["model"].source,
                compile_mode=job["compile"].mode)


class JobRun:
    """One run of the job: `serve` its shards on a pool (every row recorded as it arrives, the
    results table and report rewritten in the background), then `finish`: the summary. Its state
    is its own; the dispatcher calls back into its methods (`on_rows`, `on_ready`, `on_tick`)."""

    def __init__(self, results: Results, items: list[Item], plan: Plan, out: OutputOptions,
                 head: dict, skipped: int, clock: Callable[[], float]):
        self.results, self.items, self.plan, self.out = results, items, plan, out
        self.head, self.skipped, self.clock = head, skipped, clock
        self.store = _store(out.job_dir)
        self.ids = [it.id for it in items]      # the rows results.parquet keeps, in prompt order
        self.pool: Pool | None = None
        self.slots: list = []                   # the dispatcher's, live: who served, also if stopped
        self.timeline: list[tuple] = []         # (s since start, ok, failed) of this run: report.html
        self.progress = self.phases = None
        self.t_start, self.t_ready, self.t_done, self.t_all_ready = clock(), None, None, None
        # The driver's own cost (user+sys of every thread of this process, Ray's client threads
        # too) from here, before the pool starts, to the dispatch loop's end, and its part until the
        # first worker is ready (Ray's start): the rest is what serving the shards costs it.
        self.cpu_start, self.driver_cpu_s, self.startup_cpu_s = time.process_time(), None, None
        self.shards = 0                         # shards handed to workers (the dispatcher's count)
        self.ready_ranks: set[int] = set()      # slots ever ready (a replacement adds nothing)
        self.steady_items = 0.0                 # items' worth of work done once all were ready
        self.stopped: KeyboardInterrupt | None = None
        self.aborted: str | None = None
        self.snapshots = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self.pending, self.last_snapshot = None, clock()

    # -- 4. serving ------------------------------------------------------------------------------

    def serve(self, pool: Pool, shards: list[Shard], max_retries: int, ray: RayOptions) -> None:
        """Every shard through the dispatcher, until done, stopped (Ctrl-C, SIGTERM) or aborted
        (a persistent fault). Every worker gone: the record is closed, then JobError."""
        _handle_stop_signals()           # again: starting the pool may have replaced them
        self.pool, self.phases = pool, PhasePrinter(pool)
        self.progress = Progress(sum(map(len, shards)))
        dispatcher = Dispatcher(pool, pool.size, shards, self.on_rows, INFLIGHT, max_retries,
                                ray.max_worker_restarts, ray.worker_start_timeout_s,
                                on_ready=self.on_ready, slots=self.slots, on_tick=self.on_tick,
                                clock=self.clock)
        try:
            with self.progress.logging():
                dispatcher.run()
        except KeyboardInterrupt as e:           # Ctrl-C or SIGTERM (_check_stop)
            self.stopped = e
            log.warning("%s: stopping workers; finished outputs are kept, rerun to resume",
                        "terminated" if _terminated() else "interrupted")
        except PersistentFault as e:             # the same error on every output: stop, summarize
            self.aborted = str(e)
            log.error("stopping: %s", e)
        except DispatchError as e:               # every worker gone
            self.results.write_table(self.ids)
            self.results.compact()
            remove_temp_files(self.store)
            raise JobError(str(e)) from e
        finally:
            self.progress.close()
            _settle(self.pending)         # a stale snapshot must not land after the final write
            self.snapshots.shutdown()
            self.shards = dispatcher.submitted
        self.t_done = self.clock()
        self.driver_cpu_s = time.process_time() - self.cpu_start

    def on_rows(self, rows: list[dict]) -> None:
        """A shard's rows: recorded (one object), counted, and a snapshot started when one is due
        (at most one at a time)."""
        try:
            self.results.add(rows)
        except OSError as e:     # the record cannot be written: nothing further can count
            raise PersistentFault(f"the job's record could not be written ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:300]}). Finished outputs are "
                                  f"kept: fix the storage and rerun the same command to resume.")
        self.progress.update(len(rows))
        now = self.clock()
        n_ok, n_failed = self.timeline[-1][1:] if self.timeline else (0, 0)
        ok = sum(r["status"] == "ok" for r in rows)
        self.timeline.append((now - self.t_start, n_ok + ok, n_failed + len(rows) - ok))
        if self.t_all_ready is not None:
            self.steady_items += work_after(rows, self.t_all_ready)
        if now - self.last_snapshot >= self.out.results_every_s and (
                self.pending is None or self.pending.done()):
            self.pending = self.snapshots.submit(self._snapshot)
            self.last_snapshot = now

    def _snapshot(self) -> None:
        """results.parquet and report.html so far, off the dispatch loop's thread (a full rewrite
        costs seconds at a million rows; the loop only records O(shard) per shard)."""
        _report(self.out.job_dir, self.results.write_table(self.ids),
                dict(job=self.head["job"], items=len(self.items)), timeline=list(self.timeline),
                thumb_budget_s=5)

    def on_ready(self, slot) -> None:
        self.phases.poll(self.slots, flush=slot)
        log.info("worker %d: ready in %.1f s", slot.rank, self.clock() - slot.started)
        self.progress.start()     # the bar's rate counts generation from the first ready worker
        if self.t_ready is None:
            self.t_ready, self.startup_cpu_s = self.clock(), time.process_time() - self.cpu_start
        self.ready_ranks.add(slot.rank)
        if len(self.ready_ranks) == self.pool.size and self.t_all_ready is None:
            self.t_all_ready = self.clock()

    def on_tick(self) -> None:
        """About once a second: a stop signal raises here; start-up phases, progress lines."""
        _check_stop()
        self.phases.poll(self.slots)
        self.progress.tick()

    # -- 5. summary ------------------------------------------------------------------------------

    def finish(self) -> dict:
        """The summary; a stop is raised again once it is written. A store that fails under it
        (results, record, summary): every finished output is recorded already; stopped, the exit
        status stays the stop's, else exit 3 naming the cause."""
        try:
            return self._summarize()
        except OSError as e:
            cause = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log.error("the summary could not be written: %s", cause)
            if self.stopped is not None:
                raise self.stopped from None
            return dict(aborted=self.aborted or f"the results or summary could not be written "
                                                f"({cause}); finished outputs are recorded: fix the "
                                                f"store and rerun the same command to write the "
                                                f"results table", failed=0)

    def _summarize(self) -> dict:
        metrics = self._metrics(timeout_s=60.0 if self.stopped is None else 30.0)
        if self.stopped is not None:   # stopped: no file may land after the summary
            self._stop_workers()
        table = self.results.write_table(self.ids)
        self.results.compact()
        summary = write_summary(self.store, self.head, len(self.items), table, self.slots, metrics,
                                len(self.plan.done), self.stopped is not None, self._timing(),
                                self.plan)
        _report(self.out.job_dir, table, summary, metrics, timeline=self.timeline or None)
        if self.stopped is not None:
            raise self.stopped
        self._stop_workers()
        return summary

    def _timing(self) -> dict:
        t0 = self.t_start
        ready = self.t_ready or t0
        timing = dict(startup_s=ready - t0, generate_s=(self.t_done or t0) - ready,
                      span_s=(self.t_done or t0) - t0,   # start-up included: the job's length
                      driver_cpu_s=self.driver_cpu_s, driver_startup_cpu_s=self.startup_cpu_s,
                      shards=self.shards)
        if self.t_all_ready is not None and self.t_done is not None and self.t_done > self.t_all_ready:
            # Throughput once every worker serves: the figure that scales with workers (the ramp
            # while later workers load and warm is in generate_s). Items in flight when the last
            # worker became ready count by the part of their run after that moment.
            timing.update(all_ready_s=self.t_all_ready - t0,
                          steady_items_per_s=self.steady_items / (self.t_done - self.t_all_ready))
        timing["aborted"] = self.aborted
        timing["skipped_empty"] = self.skipped   # rows never run: empty prompts, on_empty=skip
        return timing

    def _metrics(self, timeout_s: float) -> list[dict]:
        """Every ready worker's metrics, asked at once, waited for `timeout_s` in all (after an
        interrupt a worker answers once its running shard is done; SIGTERM's grace period is
        short), each written to `metrics/worker-<rank>.json`."""
        asked = {self.pool.metrics(s.actor): s for s in self.slots if s.state == "ready"}
        deadline, metrics = self.clock() + timeout_s, []
        while asked:
            done = self.pool.wait(list(asked), timeout=max(0.1, deadline - self.clock()))
            if not done:
                break
            for f in done:
                s = asked.pop(f)
                try:
                    m = self.pool.result(f)
                except Exception as e:   # a worker that died at the very end: its rows are in
                    log.warning("no metrics from worker %d: %s", s.rank, e)
                    continue
                m["restarts"] = s.restarts
                self.store.write_text(f"metrics/worker-{m['rank']}.json", json_text(m))
                metrics.append(m)
        for s in asked.values():
            log.warning("no metrics from worker %d within %.0f s", s.rank, timeout_s)
        return sorted(metrics, key=lambda m: m["rank"])

    def _stop_workers(self) -> None:
        """Every worker gone before the caller goes on: a worker mid-write could otherwise still
        put a file after the summary. A worker that died mid-write left a temp file (its item was
        requeued, or is not recorded): removed."""
        if not self.slots:
            return
        left = self.pool.stop([s.actor for s in self.slots], timeout_s=15.0)
        if left:
            log.warning("%d stopped worker(s) still running after 15 s", left)
        remove_temp_files(self.store)


def _write_config(cfg, job_dir: str) -> None:
    try:
        _store(job_dir).write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    except OSError as e:       # a full disk, a store that refuses writes: before any GPU time
        raise JobError(f"output.dir: cannot write {job_dir}/config.yaml ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:300]}); free space or fix access, then rerun") from e


@functools.lru_cache(maxsize=8)
def _store(job_dir: str) -> Store:
    """The job directory as a Store (one per location and process: an S3 client is not free)."""
    return resolve(job_dir)


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


def worker_config(job: dict, limits: Constraints, on_gpu: bool) -> WorkerConfig:
    """What each worker needs to know (the only part of the config a worker sees)."""
    return WorkerConfig(model=job["model"], generation=job["generation"], limits=limits,
                        on_empty=job["prompts"].on_empty,
                        job_dir=_store(job["output"].job_dir).uri(),
                        batch_size=job["run"].batch_size, warmup_steps=job["run"].warmup_steps,
                        fps=job["output"].fps, compile=job["compile"],
                        step_cache=job["step_cache"], encode_batch=job["run"].shard_size,
                        num_threads=None if on_gpu else job["ray"].cpus_per_worker,
                        cache_wait_s=job["ray"].worker_start_timeout_s)


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
                           f"credentials in the environment (docs/cloud.md)") from e
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


