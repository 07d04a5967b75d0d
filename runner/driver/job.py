"""The batch job, top to bottom: load config, check, plan shards, start workers, stream results,
summarize. `main(argv)` is what `python -m runner` runs.

Everything that can be wrong with the input is checked before any worker starts or any model is
built (`checks.py`). A rerun into the same directory resumes: prompts whose output is complete are skipped (see
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

Exit status: 0 all ok (or a dry run, or nothing to do); 1 some items failed (or are suspect: a
worker's canary failed after it made them); 2 bad input or the job could not run (the message
names the key or file and the fix); 3 stopped early on a persistent fault, or the store of the
job's images did not answer the checks before the start (`images.check_sample`); 130
interrupted (Ctrl-C); 143 terminated (SIGTERM: `ray job stop`, Kubernetes, Slurm).
Interrupted or terminated, the workers are stopped, finished outputs are kept and the summary and
metrics of what was done are written.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import sys
import textwrap
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from omegaconf import OmegaConf

from .checks import Checked, JobError, check_job, check_same_config
from ..config import (ConfigError, OutputOptions, RayOptions, RunOptions, WorkerConfig, help_text,
                     load_config, split)
from .dispatch import DispatchError, Dispatcher, PersistentFault, Pool
from .ending import Ending, first_line
from ..io.images import StoreUnreachable, fill_hashes
from .lock import LockedError, job_lock, holder as lock_holder
from .progress import PhasePrinter, Progress
from ..io.prompts import Constraints, Item, PromptError, Shard, plan_shards
from .results import (Plan, Results, fallback_settings_id, remove_temp_files, settings_id,
                      start_fresh, write_parquet)
from ..io.storage import Store, StoreTimeout, uri_of
from ..io.outputs import plural
from .summary import LEGEND, WIDTH, json_text, summarize, summary_text, work_after
from .terminal import legend_due, plain_off_terminal

log = logging.getLogger("runner")
INFLIGHT = 2   # shards queued per worker: the next is ready the moment one finishes
STOPPED_METRICS_S = 5.0   # a worker stopped by the driver: its metrics waited for this long


# The stop signals received (SIGINT: Ctrl-C, SIGTERM). The handler only records the first: the
# dispatch loop, awake at least once a second, raises KeyboardInterrupt at a point of its own
# (`_check_stop`). A handler that raised wherever the main thread stood (inside a Ray call, or
# the snapshot executor's submit) could leave a lock held: a CI run's driver wrote its summary
# after SIGTERM, then hung at exit for 15 minutes. A second signal raises at once, as Python's
# Ctrl-C does, for a stop that something stuck would never reach.
STOPS: list[int] = []
# While the job's input is checked (`run`, until it takes the job's lock) nothing is held or
# written that a stop could leave half-done: a stop signal there raises at once, where the main
# thread stands. Recorded only, it waited for the checks to end (issue 75: 6.4 s; a frozen image
# store's lookup, its whole timeout). Their threads (lookups) are left: EXIT_AT_ONCE.
CHECKING: list[bool] = []


def _on_stop_signal(signum, frame):
    STOPS.append(signum)
    if len(STOPS) > 1:
        raise KeyboardInterrupt(signal.Signals(signum).name)
    if CHECKING:
        EXIT_AT_ONCE.append("the input check abandoned")
        raise Stopped(signal.Signals(signum).name, "the input was being checked: nothing ran")


def _handle_stop_signals() -> None:
    """SIGTERM, and SIGINT unless the process started with it ignored (`cmd &` in a
    non-interactive shell: docs/failures.md), as Python itself does. Again once the pool started (`ray.init` installs its own SIGTERM handler)."""
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


class Stopped(KeyboardInterrupt):
    """A stop signal's end of the run; `kept` says what the terminal is told was kept."""

    def __init__(self, signame: str, kept: str):
        super().__init__(signame)
        self.kept = kept


# Why the process must end as soon as `main` returns, if it must (`python -m runner` then flushes
# and calls os._exit): a thread left behind that the interpreter's exit would wait for (Ray's
# start abandoned on Ctrl-C; a call on a stalled store, which pyarrow's S3 finalization waits
# for: 33 s measured). Everything the job writes is written, or named as not written, by then.
EXIT_AT_ONCE: list[str] = []


StartPool = Callable[[dict, Constraints], Pool]   # (the job's typed config, limits) -> its pool


def main(argv: list[str] | None = None, start_pool: StartPool | None = None,
         clock: Callable[[], float] = time.time) -> int:
    """`python -m runner`: `run(argv)`, its outcome as the exit status (module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv) or not argv:
        print(help_text(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv == ["--explain"]:
        print(textwrap.fill(LEGEND, WIDTH))
        return 0
    _configure_logging()
    _handle_stop_signals()
    try:
        summary = run(argv, start_pool, clock)
    except (ConfigError, PromptError, JobError, LockedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StoreUnreachable as e:    # the images' store did not answer the checks: not bad input
        EXIT_AT_ONCE.append("lookups on a stalled image store may still be running")
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:
        # a second signal stops at once: the summary may not have been written
        kept = ("finished outputs are kept (a second signal: the summary may be missing)"
                if len(STOPS) > 1 else getattr(e, "kept", None)
                or "finished outputs and the summary so far are written")
        if _terminated():
            print(f"terminated (SIGTERM): {kept}; rerun the same command to resume", file=sys.stderr)
            return 143
        print(f"interrupted: {kept}; rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        CHECKING.clear()
    if summary.get("aborted"):   # 3: stopped early on a persistent fault (summary.txt says which)
        print(f"error: {summary['aborted']}", file=sys.stderr)
        return 3
    for line in summary.get("notes") or ():   # the report not written (a full disk): said last
        print(f"note: {line}", file=sys.stderr)
    # 1: some items failed, or are suspect (see summary.txt); the others are complete. Every
    # output complete with only the report missing is still 0: the report is a view of the
    # outputs, made again by `python -m runner.driver.report DIR`, and a pipeline must not redo a
    # finished job for it.
    return 0 if summary["failed"] == 0 and not summary.get("suspect") else 1


def _configure_logging() -> None:
    """The runner's own lines at INFO; libraries' at WARNING (matplotlib's font-cache notice and
    the like stay off), and no Python warnings of libraries on the user's terminal, unless the
    user asked for them (`python -W ...`, PYTHONWARNINGS). Off a terminal, no colour codes."""
    plain_off_terminal()      # first: the log handler below takes the stream as it is then
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    # matplotlib (report.html's plots) says "building the font cache" at WARNING on a first run
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    if not sys.warnoptions:
        warnings.simplefilter("ignore")


def exit_now(status: int) -> None:
    """The end of the process with `status`, not waiting for threads left behind (EXIT_AT_ONCE).
    The processes it started go first: a local Ray abandoned mid-start dies with this process
    (Ray ties its processes to ours), but not the agents its raylet started (seen alive after
    a minute)."""
    _kill_descendants()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def adopt_orphans() -> None:
    """This process made a child subreaper (Linux): a descendant whose parent dies is handed to
    it, not to init, so `_kill_descendants` still finds it. Ctrl-C reaches a starting local Ray's
    raylet too; it dies before its agents, which left our tree and outlived the job (a CI run)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)                          # PR_SET_CHILD_SUBREAPER


def _descendants() -> list[int]:
    """The live (not zombie) processes below this one, from Linux's /proc (elsewhere none)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:   # "pid (comm) state ppid ..."
                        state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                except (OSError, ValueError, IndexError):   # gone meanwhile
                    continue
                if state != "Z":
                    children.setdefault(int(ppid), []).append(int(name))
    todo, found = [os.getpid()], []
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_descendants(timeout_s: float = 2.0, settle_s: float = 0.1) -> None:
    """SIGKILL to every process this one started, and theirs, scanning again until two scans
    `settle_s` apart find none not signalled yet, or `timeout_s`. A kill lands after a fork in
    flight completes: a raylet killed while starting its agents left one that no scan saw (CI,
    under load: Ray's dashboard and runtime-env agents alive after the job's exit). It does not
    wait for them to end. Elsewhere than Linux, nothing: Ray's reaper process is left to do it."""
    end, killed, quiet = time.monotonic() + timeout_s, set(), 0
    while quiet < 2 and time.monotonic() < end:
        new = set(_descendants()) - killed
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        killed |= new
        quiet = 0 if new else quiet + 1
        if not new:
            time.sleep(settle_s)


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


def run(argv: list[str], start_pool: StartPool | None = None,
        clock: Callable[[], float] = time.time) -> dict:
    """The job of `argv`; its workers from `start_pool` (default: Ray actors), its timing marks
    on `clock` (epoch seconds, the clock of the rows' `started_at`)."""
    CHECKING.append(True)      # a stop raises at once until the lock is taken (`main` clears it)
    # 1. Config: merged, checked (the compile options parsed once), split into typed pieces.
    cfg = load_config(argv)
    job = split(cfg)
    # 2. Model, prompts and output directory: all checked before any worker or model (checks.py).
    checked, store = check_job(job)     # store: the job directory, one Store for the whole run
    if job["run"].dry_run:
        return _dry_run(cfg, job, checked.items, store)
    CHECKING.clear()
    ending = Ending(remote=not store.local)   # once stopping, one deadline (the lock's included)
    try:
        with job_lock(store, release_s=ending.lock_budget):       # one driver per job directory
            return _run_locked(cfg, job, checked, store, start_pool or start_ray_pool, clock, ending)
    finally:
        if ending.abandoned:
            EXIT_AT_ONCE.append("calls on a failed store may still be running")


def _run_locked(cfg, job: dict, checked: Checked, store: Store, start_pool: StartPool, clock,
                ending: Ending) -> dict:
    # 3. Plan: what is already done (made from exactly these parameters), shards of the rest.
    out, items = job["output"], checked.items
    results = _open_results(cfg, out, store)
    # image rows: their images' current content
    items = fill_hashes(items, results.rows, job["prompts"].max_image_bytes)
    plan = results.plan(items)
    shards = plan_shards(items, job["run"].shard_size, plan.done)
    # the last run's config.yaml and summary stay as they are; outputs made without
    # int8-attention's kernel alone start no pool (on a cluster without it, every worker would
    # load and compile a model to take nothing): they are remade beside real work
    if items and not shards:
        return _nothing_to_do(results, items, ending, len(plan.fallback))
    later = fallback_shards(plan, items, job["run"].shard_size, len(shards))
    _write_config(cfg, store)
    log.info("%s in %s; %d already done; %s to run; outputs in %s", plural(len(items), "prompt"),
             plural(len(checked.files), "file"), len(plan.done), plural(len(shards), "shard"),
             out.job_dir)
    _log_plan(plan, out.job_dir)
    _retire(results, plan)      # no old output stays under a changed row's name, whatever follows
    # 4. Workers and stream: shards handed out, rows recorded as they arrive.
    run = JobRun(results, items, plan, out, _head(job), checked.skipped, clock, ending)
    if shards:
        run.serve(start_pool(job, checked.limits), shards, job["run"], job["ray"], later)
    # 5. Summarize (stopped on a persistent fault: the store may be what failed; then say so).
    return run.finish()


def fallback_shards(plan: Plan, items: list[Item], shard_size: int, first: int) -> list[Shard]:
    """Shards of the outputs an earlier run made without int8-attention's kernel (its workers
    could not run it: `Plan.fallback`), numbered from `first`: the dispatcher's `later` shards,
    remade by workers that run the kernel, if any is ready; else they stay as they are. Only
    beside other shards: a run with nothing else to do starts no pool (`_nothing_to_do`)."""
    if not plan.fallback:
        return []
    remake = {it.id for it in plan.fallback}
    log.info("%s made without int8-attention's kernel by an earlier run: remade by workers "
             "that run it, if any", plural(len(remake), "output"))
    keep = {it.id for it in items} - remake
    return [Shard(first + k, s.items) for k, s in enumerate(plan_shards(items, shard_size, keep))]


def runs_int8_attention(slot) -> bool:
    """Whether a ready worker runs int8-attention's kernel (its warm-up's ready info)."""
    return (slot.ready_info or {}).get("int8_attention") is True


def start_ray_pool(job: dict, limits: Constraints) -> Pool:
    """The job's workers as Ray actors: one per GPU, or `ray.*`'s count (`raypool.py`). Ray's
    start (seconds: importing Ray, a local cluster's processes) can be interrupted."""
    def open_pool() -> Pool:
        from .raypool import RayPool, RayStartError
        try:
            return RayPool.open(job["ray"], gpu=gpu_need(job["model"]),
                                worker_config=functools.partial(worker_config, job, limits),
                                shared_cache=job["compile"].options.has("cache"), inflight=INFLIGHT,
                                need_gib=placement_gib(job))
        except RayStartError as e:
            raise JobError(str(e)) from e
    return _interruptible(open_pool, "ray-start")


def gpu_need(model) -> str:
    """Whether the job's workers need GPUs: "no" with model.device=cpu; "if any" for a tiny
    model with model.device=auto (CPU workers on a cluster without GPUs, as on a laptop); "yes"
    otherwise: a full-size model never runs on CPU by accident (it waits for GPUs instead)."""
    if model.device == "cpu":
        return "no"
    return "if any" if model.device == "auto" and model.source == "tiny" else "yes"


def placement_gib(job: dict) -> float | None:
    """The GPU memory a worker needs to be placed on a GPU type: ray.gpu_gib, else the preset's
    stated need (with O3's FP8 weights where the preset states that need)."""
    if job["ray"].gpu_gib is not None:
        return job["ray"].gpu_gib
    info, fp8 = job["model"].info, job["compile"].options.has("low_precision")
    need = info.get("gpu_gib_fp8" if fp8 and "gpu_gib_fp8" in info else "gpu_gib")
    return None if need is None else need * (2 if job["model"].dtype == "fp32" else 1)


def _interruptible(fn: Callable[[], Pool], name: str) -> Pool:
    """`fn()` on a thread of its own while the main thread checks for a stop signal every 0.1 s:
    Ctrl-C during Ray's start (seconds in calls that do not return to Python: Ctrl-C was seen
    after 8.7 s) ends the job at once, the start abandoned (EXIT_AT_ONCE: a local Ray's
    processes die with this one). The thread stays until the process ends, done or not: Ray ties
    the processes it starts to the thread that started them (Linux's PR_SET_PDEATHSIG), so a
    thread that ended would take the local Ray down with it."""
    box: dict = {}
    done = threading.Event()

    def start():
        try:
            box["pool"] = fn()
        except BaseException as e:                   # handed to the main thread
            box["error"] = e
        finally:
            done.set()
        threading.Event().wait()                     # see the docstring

    threading.Thread(target=start, name=name, daemon=True).start()
    while not done.wait(0.1):
        if STOPS:
            EXIT_AT_ONCE.append("Ray's start abandoned")
            raise Stopped(signal.Signals(STOPS[0]).name,
                          "Ray was still starting: no worker ran")
    if "error" in box:
        raise box["error"]
    return box["pool"]


def _retire(results: Results, plan: Plan) -> None:
    """Changed rows' old outputs removed, and recorded so (`Results.retire`), before any shard
    runs: if a regeneration fails or never runs, no file made from old inputs stays under the
    row's name (issue 37 D3)."""
    try:
        retired = results.retire(plan)
    except OSError as e:       # a store that refuses: before any GPU time
        raise JobError(f"cannot remove the old outputs of changed rows ({first_line(e)}); fix "
                       f"access to output.dir, then rerun") from e
    if retired:
        log.info("removed the old outputs of %s before regenerating them: %s",
                 plural(len(retired), "changed row"), _few(retired, 5))


def _head(job: dict) -> dict:
    """What the summary says the job was."""
    return dict(job=job["name"], model=job["model"].preset, source=job["model"].source,
                compile_mode=job["compile"].mode)


class JobRun:
    """One run of the job: `serve` its shards on a pool (every row recorded as it arrives, the
    results table and report rewritten in the background), then `finish`: the summary. Its state
    is its own; the dispatcher calls back into its methods (`on_rows`, `on_ready`, `on_tick`).
    Once it stops (a signal, a persistent fault), its end has one deadline (`ending.Ending`)."""

    def __init__(self, results: Results, items: list[Item], plan: Plan, out: OutputOptions,
                 head: dict, skipped: int, clock: Callable[[], float], ending: Ending):
        self.results, self.items, self.plan, self.out = results, items, plan, out
        self.head, self.skipped, self.clock, self.ending = head, skipped, clock, ending
        self.store = results.store              # the job directory, opened once by `run`
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
        self.canaries = 0                       # canaries that passed (the dispatcher's count)
        self.canary_failures: list[dict] = []   # each failed canary: worker, device, suspect ids
        self.hangs: list[dict] = []             # each hung worker: device, bound, rows it held
        self.losses: list[dict] = []            # each worker lost: cause, node, charged, rows back
        self.idle_s = 0.0                       # worker-seconds ready without work (dispatcher)
        self.stopped_metrics: list[dict] = []   # metrics of the workers stopped (canary, hang)
        self.ready_ranks: set[int] = set()      # slots ever ready (a replacement adds nothing)
        self.int8_off: dict[int, str] = {}      # rank -> why int8-attention's kernel did not run
        # outputs made without the kernel by an earlier run, handed out again (`fallback_shards`):
        # a failed remake keeps the ok row (`on_rows`); the ones remade ok (or suspect: their
        # file was replaced) are this run's work
        self.remake = {it.id for it in plan.fallback}
        self.remade: set[str] = set()
        self.steady_items = 0.0                 # items' worth of work done once all were ready
        self.stopped: KeyboardInterrupt | None = None
        self.aborted: str | None = None
        self.snapshots = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self.pending, self.last_snapshot = None, clock()

    # -- 4. serving ------------------------------------------------------------------------------

    def serve(self, pool: Pool, shards: list[Shard], opts: RunOptions, ray: RayOptions,
              later: list[Shard] = ()) -> None:
        """Every shard through the dispatcher, until done, stopped (Ctrl-C, SIGTERM) or aborted
        (a persistent fault); then `later` (`fallback_shards`) on workers that run int8-attention's
        kernel. Every worker gone: the record is closed, then JobError."""
        _handle_stop_signals()           # again: starting the pool may have replaced them
        self.pool, self.phases = pool, PhasePrinter(pool)
        self.progress = Progress(sum(map(len, shards)) + sum(map(len, later)))
        dispatcher = Dispatcher(pool, pool.size, shards, self.on_rows, INFLIGHT,
                                opts.max_shard_retries, ray.max_worker_restarts,
                                opts.max_row_deaths, ray.worker_start_timeout_s,
                                on_ready=self.on_ready, slots=self.slots, on_tick=self.on_tick,
                                clock=self.clock, canary_every=opts.canary_items,
                                canary_every_s=opts.canary_every_s,
                                on_canary_failed=self.on_canary_failed,
                                later=later, takes_later=runs_int8_attention,
                                hang_timeout_s=opts.hang_timeout_s,
                                batch_size=opts.batch_size, on_hung=self.on_hung,
                                cluster=getattr(pool, "cluster", None),
                                max_workers=ray.num_workers or ray.max_workers,
                                gpu_wait_s=ray.gpu_wait_s, scale_in=ray.num_workers is None,
                                on_stop=self._stopped_metrics, on_lost=self.on_lost,
                                wall=self.clock)
        try:
            with self.progress.logging():
                dispatcher.run()
        except KeyboardInterrupt as e:           # Ctrl-C or SIGTERM (_check_stop)
            self.stopped = e
            self.ending.begin()
            log.warning("%s: stopping workers; finished outputs are kept, rerun to resume",
                        "terminated" if _terminated() else "interrupted")
        except PersistentFault as e:             # the same error on every output: stop, summarize
            self.aborted = str(e)
            self.ending.begin()
            log.error("stopping: %s", e)
        except DispatchError as e:               # every worker gone
            self._close_pool()
            self._write_results(self._table())
            self.ending.write("removing temporary files", remove_temp_files, self.store)
            raise JobError(str(e)) from e
        finally:
            self.progress.close()
            self._settle_snapshot()       # a stale snapshot must not land after the final write
            self.shards, self.canaries = dispatcher.submitted, dispatcher.canaries
            self.idle_s = dispatcher.idle_s
        self.t_done = self.clock()
        self.driver_cpu_s = time.process_time() - self.cpu_start

    def _record(self, rows: list[dict]) -> None:
        try:
            self.results.add(rows)
        except OSError as e:     # the record cannot be written: nothing further can count
            self.ending.saw(e)
            raise PersistentFault(f"the job's record could not be written ({first_line(e)}). "
                                  f"Finished outputs are kept: fix the storage and rerun the "
                                  f"same command to resume.")

    def on_rows(self, rows: list[dict]) -> None:
        """A shard's rows: recorded (one object), counted, and a snapshot started when one is due
        (at most one at a time). A failed remake is not recorded (`_kept`)."""
        n = len(rows)                 # a failed remake is progress too
        if self.remake:
            rows = self._kept(rows)
        self._record(rows)
        self.progress.update(n)
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

    def _kept(self, rows: list[dict]) -> list[dict]:
        """`rows` but failed remakes: the output made without the kernel is done, and stays (its
        file is replaced only by a remake that succeeds, atomically), so its ok row stays too;
        one line says which remake failed and why. The remakes that succeeded are noted. A
        suspect remake is kept: its file was replaced, by a worker whose canary then failed."""
        kept = []
        for r in rows:
            if r["id"] not in self.remake:
                kept.append(r)
            elif r["status"] in ("ok", "suspect"):    # this run's work (`_resumed`)
                self.remade.add(r["id"])
                kept.append(r)
            else:
                log.warning("remaking %s with int8-attention's kernel failed (%s): its output made "
                            "without the kernel stays", r["id"],
                            (r.get("error") or "?").splitlines()[0][:300])
        return kept

    def on_canary_failed(self, slot, verdict: dict, rows: list[dict], suspect: list[str]) -> None:
        """A worker failed its canary: `rows`, ok rows it returned since its last good canary,
        recorded again as suspect; the failure named (worker, node, GPU) in the log and, at the
        end, in the summary and report."""
        from ..serve.canary import describe, where
        self._record(rows)
        now = self.clock()
        if self.timeline:            # they were counted ok
            _, n_ok, n_failed = self.timeline[-1]
            self.timeline.append((now - self.t_start, n_ok - len(rows), n_failed + len(rows)))
        dev = verdict.get("device") or {}
        self._stopped_metrics(slot, "its canary failed")
        self.canary_failures.append(dict(rank=slot.rank, at_s=round(now - self.t_start, 1),
                                         device=dev, verdict=describe(verdict),
                                         suspect=len(suspect), suspect_ids=suspect[:10]))
        log.error("worker %d (%s) failed its canary (%s): it is stopped; what it made since its "
                  "last good canary (%s) is marked suspect (%s): a rerun regenerates it",
                  slot.rank, where(dev), describe(verdict), plural(len(suspect), "output"),
                  _few(suspect, 5))

    def on_hung(self, slot, info: dict) -> None:
        """A worker was declared hung (the dispatcher logged it and stops it): kept for the
        summary and report, which name its host and GPU."""
        self._stopped_metrics(slot, "hung")
        self.hangs.append(dict(rank=slot.rank, at_s=round(self.clock() - self.t_start, 1), **info))

    def on_lost(self, loss: dict) -> None:
        """A worker lost (the dispatcher's record: cause, node, charged): kept for the summary,
        its time as seconds since the job started."""
        loss["at_s"] = round(loss.pop("at", self.clock()) - self.t_start, 1)
        self.losses.append(loss)

    def _stopped_metrics(self, slot, why: str) -> None:
        """The metrics of a worker the dispatcher is about to stop (a failed canary, a hang), asked
        now: it served, so it has its line in the summary's worker table (a worker stopped by its
        canary was missing there: issue 60). It is alive and answers from a thread of its own
        (a hung one too, unless every thread is taken); `STOPPED_METRICS_S` at most, else left
        out, said in a line."""
        future = self.pool.metrics(slot.actor)
        try:
            if not self.pool.wait([future], timeout=STOPPED_METRICS_S):
                raise TimeoutError(f"no answer within {STOPPED_METRICS_S:.0f} s")
            m = self.pool.result(future)
        except Exception as e:
            log.warning("no metrics from worker %d (stopped: %s): %s", slot.rank, why, e)
            return
        self.stopped_metrics.append(dict(m, restarts=slot.restarts, stopped=why))

    def _snapshot(self) -> None:
        """results.parquet and report.html so far, off the dispatch loop's thread (a full rewrite
        costs seconds at a million rows; the loop only records O(shard) per shard)."""
        _report(self.store, self.results.write_table(self.ids),
                dict(job=self.head["job"], items=len(self.items)), timeline=list(self.timeline),
                thumb_budget_s=5)

    def _settle_snapshot(self) -> None:
        """The background snapshot done before the final writes; once stopping, within the time
        left: one that does not finish by then (a stalled store) is left behind, and the final
        writes are skipped, so that it cannot land after them."""
        if self.pending is not None:
            self.ending.within("the last background snapshot", self.pending.exception)
        self.snapshots.shutdown(wait=not self.ending.abandoned)

    def on_ready(self, slot) -> None:
        self.phases.poll(self.slots, flush=slot)
        now = self.clock()
        # the summary's clock (seconds since the job started); the worker's own start-up beside
        log.info("worker %d: ready at %.1f s (%.1f s after it was started)", slot.rank,
                 now - self.t_start, now - slot.started)
        self.progress.start()     # the bar's rate counts generation from the first ready worker
        if self.t_ready is None:
            self.t_ready, self.startup_cpu_s = now, time.process_time() - self.cpu_start
        self.ready_ranks.add(slot.rank)
        if len(self.ready_ranks) == self.pool.size and self.t_all_ready is None:
            self.t_all_ready = now
        info = slot.ready_info or {}
        if info.get("int8_attention") is False:
            why = self.int8_off[slot.rank] = info.get("int8_attention_off") or "?"
            log.warning("worker %d: int8-attention's kernel cannot run here (%s): its outputs are "
                        "made with SDPA and recorded under the settings without it (%s); a rerun "
                        "where the kernel runs remakes them", slot.rank, why, self.results.fallback)

    def on_tick(self) -> None:
        """About once a second: a stop signal raises here; start-up phases, progress lines."""
        _check_stop()
        self.phases.poll(self.slots)
        self.progress.tick()

    # -- 5. summary ------------------------------------------------------------------------------

    def finish(self) -> dict:
        """The summary. The workers are stopped first (no file lands after it; their output ends
        before the job's last lines), then the results table, the record's compaction, metrics,
        summary and report are written through `self.ending`: after the first that fails, the
        rest are skipped, and the summary printed to the terminal says which. A stop is raised
        again at the end. A store that failed under the end of a run that was not stopped is
        exit 3 naming it (every finished output is recorded already)."""
        metrics = self._metrics()
        self._stop_workers()
        self._close_pool()
        table = self._table()
        summary = summarize(self.head, len(self.items), table, self.slots, metrics,
                            self._resumed(), self.stopped is not None, self._timing(),
                            self.plan, self.clock())
        self._write_results(table)                # first: what a rerun reads
        if self.ending.stopping:
            summary["unrecorded_media"] = self._unrecorded_media()
        if self.results.fallback:
            summary["int8_fallback"] = dict(
                outputs=sum(r.get("settings") == self.results.fallback and r["status"] == "ok"
                            for r in table),
                settings=self.results.fallback, workers=self.int8_off)
        text = summary_text(summary, metrics, self.plan, table)
        # the legend on a terminal once, always in summary.txt (issue 75: after every run)
        shown = (text if legend_due(LEGEND, sys.stdout)
                 else summary_text(summary, metrics, self.plan, table, legend=False))
        self.ending.write("summary.json", self.store.write_text, "summary.json", json_text(summary))
        self.ending.write("summary.txt", self.store.write_text, "summary.txt", text)
        for m in metrics:
            name = metrics_name(m)
            self.ending.write(name, self.store.write_text, name, json_text(m))
        self._write_report(table, summary, metrics, text)
        if not self.store.local:        # the page's staging directory: the last page is written
            from .report import remove_stage
            remove_stage(self.store)
        self._print(summary, shown)
        if self.stopped is not None:
            raise Stopped(str(self.stopped), "finished outputs and the summary so far are written"
                          if "summary.txt" not in self.ending.not_written else
                          "finished outputs are kept; the summary (above) could not be written "
                          "to the store") from None
        if self.ending.failed_step not in (None, "report.html") and not self.aborted:
            summary["aborted"] = (f"the results or summary could not be written "
                                  f"({self.ending.failed}); finished outputs are recorded: fix "
                                  f"the store and rerun the same command to write them")
        return summary

    def _resumed(self) -> int:
        """Outputs of earlier runs this run kept: the done ones, but those remade (this run's
        work, in its rate)."""
        return len(self.plan.done) - len(self.remade)

    def _table(self) -> list[dict]:
        """results.parquet's rows: one per id of the input that has a row in the record (the
        record's own dicts: read, never change them)."""
        rows = self.results.rows
        return [rows[i] for i in self.ids if i in rows]

    def _write_results(self, table: list[dict]) -> None:
        """results.parquet, then the record compacted (both from the record in memory)."""
        self.ending.write("results.parquet", write_parquet, self.store, "results.parquet", table)
        self.ending.write("the record's compaction", self.results.compact)

    def _write_report(self, table, summary: dict, metrics, text: str) -> None:
        """report.html last: it is a view of the rest (`python -m runner.driver.report DIR` makes it
        again). Its failure (a full disk at the report stage) is said at the end, and in
        summary.txt when that can be rewritten; it never changes the exit status."""
        if self.ending.skip("report.html"):
            return
        try:
            from .report import write_report
            write_report(self.store, table, summary, metrics,
                         timeline=self.timeline or None)
            return
        except Exception as e:     # a full disk, a stalled store, a plot that cannot be drawn
            cause = first_line(e)
            if isinstance(e, StoreTimeout):      # stalled: nothing more is tried
                self.ending.saw(e)
                self.ending.fail("report.html", cause)
            else:
                self.ending.not_written["report.html"] = cause
        done = "every output is complete" if summary["ok"] == summary["items"] else "the rest is written"
        note = (f"report.html not written ({cause}); {done}: `python -m runner.driver.report "
                f"{self.store.uri()}` makes it once the cause is fixed")
        summary["notes"] = [note]
        if not self.ending.not_written.keys() - {"report.html"}:
            self.ending.write("summary.txt (the note on report.html)", self.store.write_text,
                              "summary.txt", f"{text}\nnote: {note}\n")

    def _print(self, summary: dict, text: str) -> None:
        """The summary on the terminal, with what of it could not be written to the store (a
        report not written alone: said last by `main`, once)."""
        summary["not_written"] = dict(self.ending.not_written)
        said_by_main = list(self.ending.not_written) == ["report.html"] and not (
            self.stopped or self.aborted)
        missing = [] if said_by_main else self.ending.summary_lines()
        print("\n" + text + "".join(f"\n{line}\n" for line in missing), flush=True)

    def _unrecorded_media(self) -> int | None:
        """Files in media/ without an ok row in the record: written after the last record update
        (the driver stopped before their shard's rows came back). One listing; None if it could
        not be made in the time left."""
        names = self.ending.within("the media listing", self.store.list, "media")
        if names is None:
            return None
        recorded = {(r.get("output") or "").replace(os.sep, "/")
                    for r in self.results.rows.values() if r.get("status") == "ok"}
        return sum(f"media/{n}" not in recorded for n in names)

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
        timing.update(canaries=self.canaries, canary_failures=self.canary_failures,
                      hangs=self.hangs, losses=self.losses, idle_worker_s=round(self.idle_s, 1))
        return timing

    def _metrics(self) -> list[dict]:
        """Every ready worker's metrics, asked at once, waited for 60 s in all, or once stopping
        30 s within the time left (after an interrupt a worker answers once its running shard is
        done; SIGTERM's grace period is short). Written by `finish`."""
        timeout_s = min(30.0, self.ending.left()) if self.ending.stopping else 60.0
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
                metrics.append(m)
        for s in asked.values():
            log.warning("no metrics from worker %d within %.0f s", s.rank, timeout_s)
        return sorted(metrics + self.stopped_metrics, key=lambda m: (m["rank"], m["restarts"]))

    def _stop_workers(self) -> None:
        """Every worker gone before the caller goes on: a worker mid-write could otherwise still
        put a file after the summary. A worker that died mid-write left a temp file (its item was
        requeued, or is not recorded): removed."""
        if not self.slots:
            return
        wait_s = min(15.0, max(1.0, self.ending.left(default=15.0)))
        left = self.pool.stop([s.actor for s in self.slots], timeout_s=wait_s)
        if left:
            log.warning("%s still running after %.0f s", plural(left, "stopped worker"), wait_s)
        self.ending.write("removing temporary files", remove_temp_files, self.store)

    def _close_pool(self) -> None:
        """No more output from the pool (Ray: unread errors of abandoned calls, workers' log lines)
        once the job's own last lines are due."""
        if self.pool is not None:
            self.pool.close()


def metrics_name(m: dict) -> str:
    """A worker's metrics file: `metrics/worker-<rank>.json`; a worker the driver stopped (its
    slot then served on with a replacement) `worker-<rank>-stopped-<restarts>.json`."""
    if m.get("stopped"):
        return f"metrics/worker-{m['rank']}-stopped-{m.get('restarts', 0)}.json"
    return f"metrics/worker-{m['rank']}.json"


def _write_config(cfg, store: Store) -> None:
    try:
        store.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    except OSError as e:       # a full disk, a store that refuses writes: before any GPU time
        raise JobError(f"output.dir: cannot write {store.uri('config.yaml')} ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:300]}); free space or fix access, then rerun") from e


def _report(store: Store, *args, **kw) -> None:
    """report.html (see report.py): a failure to draw it is logged, never fatal to the job."""
    try:
        from .report import write_report
        write_report(store, *args, **kw)
    except Exception as e:
        log.warning("report.html not written: %s: %s", type(e).__name__, e)


def _log_plan(plan: Plan, job_dir: str) -> None:
    if plan.suspect:
        log.warning("%s suspect (a worker's canary failed after it made them): regenerating "
                    "them: %s", plural(len(plan.suspect), "output"), _few(plan.suspect, 5))
    if plan.changed:
        log.warning("%s changed since their outputs were made (%s): regenerating them",
                    plural(len(plan.changed), "row"), plan.changed_by_file())
    if plan.gone:
        log.warning("%s in %s of ids no longer in the input (kept, listed in summary.txt): "
                    "%s", plural(len(plan.gone), "output"), job_dir, _few(plan.gone))


def _few(ids: list[str], n: int = 10) -> str:
    return ", ".join(ids[:n]) + (f", ... ({len(ids) - n} more)" if len(ids) > n else "")


def _dry_run(cfg, job, items, store: Store) -> dict:
    """run.dry_run=true: the plan against the job directory; nothing written, no Ray."""
    out, opts, r = job["output"], job["run"], job["ray"]
    results = Results(store, settings_id(cfg), fallback_settings_id(cfg))
    if not cfg.output.overwrite:
        check_same_config(cfg, out, store)
        results.load()
    items = fill_hashes(items, results.rows, job["prompts"].max_image_bytes)
    plan = results.plan(items)
    shards = plan_shards(items, opts.shard_size, plan.done)
    workers = r.num_workers or f"one per GPU ({r.cpu_workers} without GPUs)"
    changed = f": {plan.changed_by_file()}" if plan.changed else ""
    gone = f": {_few(plan.gone)}" if plan.gone else ""
    stale = sum(map(len, plan.stale.values()))     # old outputs of changed rows, removed first
    lines = [f"dry run of {out.job_dir}"
             + (" (output.overwrite=true: everything regenerated)" if cfg.output.overwrite else "") + ":",
             f"  {len(items) - len(plan.done)} to run ({len(plan.changed)} changed{changed}"
             + (f", {len(plan.suspect)} suspect" if plan.suspect else "") + ")",
             *([f"  {plural(stale, 'old output')} of changed rows would be removed before they run: "
                f"{_few(sorted(plan.stale), 5)}"] if stale else []),
             f"  {len(plan.done)} already done",
             *([f"    {without_kernel_line(len(plan.fallback))}"] if plan.fallback else []),
             f"  {len(plan.gone)} no longer in the input (kept){gone}",
             f"  {plural(len(shards), 'shard')} of up to {plural(opts.shard_size, 'row')}; "
             f"workers: {workers}"]
    held = lock_holder(store)
    if held is not None:
        lines.append(f"  note: a driver runs in this directory now (pid {held.get('pid')} on host "
                     f"{held.get('host')}, started {held.get('started')}); a run would exit 2")
    print("\n".join(lines))
    return dict(dry_run=True, items=len(items), to_run=len(items) - len(plan.done),
                done=len(plan.done), without_kernel=len(plan.fallback), changed=len(plan.changed),
                stale_outputs=stale, not_in_input=len(plan.gone),
                shards=len(shards), failed=0)


def worker_config(job: dict, limits: Constraints, on_gpu: bool) -> WorkerConfig:
    """What each worker needs to know (the only part of the config a worker sees)."""
    return WorkerConfig(model=job["model"], generation=job["generation"], limits=limits,
                        on_empty=job["prompts"].on_empty,
                        job_dir=uri_of(job["output"].job_dir),
                        batch_size=job["run"].batch_size, warmup_steps=job["run"].warmup_steps,
                        fps=job["output"].fps, compile=job["compile"],
                        step_cache=job["step_cache"], encode_batch=job["run"].shard_size,
                        num_threads=None if on_gpu else job["ray"].cpus_per_worker,
                        start_timeout_s=job["ray"].worker_start_timeout_s,
                        max_image_bytes=job["prompts"].max_image_bytes, canary=job["run"].canary,
                        canary_min_psnr_db=job["run"].canary_min_psnr_db)


def _open_results(cfg, out, store: Store) -> Results:
    """Resume what a previous run into this directory finished, if its config is compatible
    (called holding the job's lock: it removes files)."""
    if cfg.output.overwrite:
        start_fresh(store)
    else:
        check_same_config(cfg, out, store)
    removed = remove_temp_files(store)
    if removed:
        log.info("removed %s left by an earlier run", plural(removed, "half-written file"))
    return Results(store, settings_id(cfg), fallback_settings_id(cfg)).load()


def _nothing_to_do(results: Results, items, ending: Ending, without_kernel: int = 0) -> dict:
    """A rerun with every prompt done: say so in one line (and one more for `without_kernel`
    outputs made without int8-attention's kernel, not remade alone); the last real summary stays
    in place. A results table or record that cannot be written (the cause that ended the run
    before, not fixed yet) is exit 3 naming it, as at the end of a run."""
    ids = [it.id for it in items]
    store = results.store
    table_path = store.uri("results.parquet")
    try:
        import pyarrow.parquet as pq
        stale = pq.read_table(store.open_input("results.parquet"),
                              columns=["id"]).column("id").to_pylist() != ids
    except Exception:                    # missing or unreadable (the driver died before writing it)
        stale = True
    try:
        if stale:
            results.write_table(ids)
        results.compact()
    except OSError as e:                 # a full disk, a store that refuses or does not answer
        ending.saw(e)
        return {"failed": 0, "items": len(ids), "ok": len(ids), "nothing_to_do": True,
                "aborted": f"every prompt is done, but the results could not be written "
                           f"({first_line(e)}): fix the store and rerun the same command to "
                           f"write them"}
    info = store.fs.get_file_info(store.path("summary.txt"))
    if info.is_file:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.mtime.timestamp()))
        kept = f"summary from {when} kept in {store.uri('summary.txt')}"
    else:
        kept = f"results in {table_path}"

    print(f"nothing to do: all {plural(len(ids), 'prompt')} already done ({kept}); "
          f"output.overwrite=true regenerates them")
    if without_kernel:
        print(without_kernel_line(without_kernel))
    return {"failed": 0, "items": len(ids), "ok": len(ids), "nothing_to_do": True,
            "without_kernel": without_kernel}


def without_kernel_line(n: int) -> str:
    """Done outputs made without int8-attention's kernel, in one line: when they are remade."""
    return (f"{n} of them were made without int8-attention's kernel (their workers could not run "
            f"it): a rerun with work to do on a cluster where the kernel runs remakes them")


