"""Can one driver feed a large cluster? The real job over a simulated pool of workers.

    python -m runner.bench.simulate workers=1000 prompts=10000000 item_s=0.7 duration_s=120 \
        [shard_size=8] [out=DIR] [sweep=100:1000000,1000:100000,1000:1000000:0.1] [sweep_s=60]

The job is the real one (`runner.driver.job.main`: config, prompt checks, the lock, the record's resume
plan, `JobRun`, `Dispatcher`, `Results`, the background snapshots of results.parquet and
report.html every 30 s, the summary) on a real temp-dir store; only the workers are simulated:
`SimPool`, a `dispatch.Pool` whose workers start in `startup_s` seconds (uniform), take `item_s`
seconds per item (+-`jitter`, uniform) on their GPU, deliver a shard's rows `write_s` after its GPU
work, and die now and then (`deaths_per_min` in all, at a random point of a random shard; the
dispatcher starts replacements). The simulator runs on the driver's thread, inside `wait`, and
measures its own CPU, which is left out of the driver's. Each run is its own process (so its peak
RSS is its own); the parent writes the prompt files first and, after run 1, the media files the
workers would have written, so that run 2's resume lists them as a real one does.

The main point (N workers, M prompts, item_s R): run 1 plans all M prompts and runs until
`duration_s` after `settle_s` past every worker's first ready, then stops the job the way
`ray job stop` does (SIGTERM: summary written, exit 143); one snapshot is timed at its end state; run 2 resumes it (record
load, one media listing, plan) and is stopped `resume_s` later. Each `sweep` point
(`workers:prompts[:item_s]`) is a run 1 and a snapshot, over `sweep_s`. Figures (a JSON line per
point, a table, `simulate.json` and `simulate.png` under `out`):
- `items_per_s`: rows the driver received per second over the window; `demand_items_per_s` =
  N / item_s, `ready_demand_items_per_s` the same for the workers ready on average (deaths and
  restarts leave a few out); `items_per_s_min`/`_max` over its 5-s intervals;
- `idle_fraction`: of the workers' ready time in the window, the part their GPU had no shard;
- `driver_cpu_s` in the window (the process's user+sys, every thread: dispatch loop, snapshots;
  less the simulator's and the monitoring thread's), `cpu_ms_per_shard`, `cpu_ms_per_item`, and
  `max_items_per_s` = items per driver CPU second: the rate at which it would fill one core (the
  GIL makes the driver one core). A point whose demand exceeds what the driver can take measures
  the ceiling directly (`items_per_s` < demand; the simulator shares that thread, so it is a lower
  bound);
- `plan_s`: the job's start to its pool's start (config, prompt checks, record load, media listing,
  plan, shards); `peak_rss_mb`: the run's peak RSS (VmHWM); `resume_plan_s`, `resume_peak_rss_mb`;
- `record_mb`, `record_bytes_per_row`: `records/` after run 1; `snapshot_s`, `report_s`: one
  rewrite of results.parquet and of report.html at run 1's end state (what the background snapshot
  does; without thumbnails: the simulated media are not written then);
- `load_avg_max`: the machine's 1-minute load average during the window (other work on it).
Not simulated: Ray's own cost on the driver, the network, and a real store's latency. `ray_calls=K`
times the first on a local Ray (`HeldWorker` actors holding K shards in flight, as N = K / 2
workers do with 2 each): `RayPool.submit` of a shard (two remote calls, its items pickled), `RayPool.wait` over
the K futures, `RayPool.result` of a shard's rows, in CPU microseconds of the driver process.

Elastic runs (issue 74), on the virtual clock, to the end of the job:

    python -m runner.bench.simulate elastic gpus=1000 prompts=1000000 [item_s=2.0] \
        [gpus_per_node=1] [arrive_s=600] [preempt_per_h=0.05] [drain_fraction=0.5] [drain_s=120] \
        [replace_s=180] [startup_s=10:40] [jitter=0.2] [shard_size=8] [seed=0] [out=DIR]

Two runs of the real job, each its own process: "elastic" (`ray.min_workers=1`,
`ray.max_workers=gpus`) over a `SimCluster` (nodes arriving evenly over `arrive_s`, preempted at
`preempt_per_h` a node, half of them drained first, replaced `replace_s` later while wanted) whose
pool places each worker on a node (`SimPool.start(rank, node)`); "fixed" (`ray.num_workers=gpus`)
whose slot r is ready once the r-th GPU of the same arrival came, never preempted. Every row
handed to the job's `on_rows` is counted and results.parquet read back (`elastic_run`): rows lost
and duplicated, spans (pool start to the last rows delivered, virtual seconds) and their ratio,
kills, drains, workers lost with their nodes, losses charged, workers started, idle
worker-seconds, driver CPU (the process's less the simulator's); `elastic.json` under `out`, a
table, and exit 0 when the acceptance holds (ratio <= 1.10, 0 lost, 0 duplicated, 0 charged).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..driver.cluster import View, view
from ..driver.dispatch import NodeLost, TaskError, WorkerLost
from ..io.outputs import format_table, write_json
from ..io.prompts import Item
from ..io.storage import atomic_path
from . import parse_args

log = logging.getLogger("runner")
ROW_FIELDS = ("id", "prompt", "negative_prompt", "seed", "height", "width", "num_frames",
              "num_inference_steps", "guidance_scale", "file", "row")      # Item.params()'s keys


@functools.lru_cache(maxsize=1)
def tiny_png() -> bytes:
    """The media file of every simulated item: an 8x8 grey PNG (the report can thumbnail it)."""
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 128, 128)).save(buf, format="PNG")
    return buf.getvalue()


def _row(it: Item, rank: int, fate: str, started_at: float, e2e_s: float) -> dict:
    """A worker's result row for `it` (the same columns as `runner.serve.worker`'s)."""
    row = {k: getattr(it, k) for k in ROW_FIELDS}
    if fate.startswith("fail:"):
        row.update(status="failed", error=fate[5:], output=None, e2e_s=None, started_at=None)
    else:
        row.update(status="ok", error=None, output=f"media/{it.id}.png", e2e_s=e2e_s,
                   started_at=started_at)
    row.update(worker=rank, node_id=None, batch_size=1, denoise_it_s=None)
    return row


class RealClock:
    """Epoch seconds and real sleeps (the bench)."""

    def time(self) -> float:
        return time.time()

    def sleep(self, s: float) -> None:
        time.sleep(s)


class VirtualClock:
    """A clock that moves only when slept on: a simulated run takes no real time (tests)."""

    def __init__(self, start: float = 1.8e9):
        self.now = start

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += max(0.0, s)


@dataclass(eq=False)                       # hashed by identity, as a Pool's futures are
class SimFuture:
    worker: "SimWorker"
    t: float                               # when it completes
    action: Callable[["SimFuture"], None] | None = None   # run at `t`, sets state and value
    state: str = "pending"                 # pending | ok | error | lost
    value: Any = None
    rows: bool = False                     # a shard's finish: its value is the shard's rows


@dataclass(eq=False)
class SimWorker:
    rank: int
    started: float
    ready_at: float
    attempt: int = 1                       # 1: the slot's first worker, 2: its replacement...
    warm_error: str | None = None          # its warm-up raises this
    dead_at: float | None = None
    busy_until: float = 0.0                # its GPU's work queued until then
    pending: list = field(default_factory=list)   # futures not completed yet
    items: int = 0
    failed: int = 0
    generated: int = 0                     # items handed to its GPU (canaries not counted)
    canaries: int = 0
    busy_s: float = 0.0                    # GPU seconds of the shards it ran
    call_ends: list = field(default_factory=list)   # when each of its model calls ends, in order
    idle_s: float = 0.0                    # closed periods of waiting for work while ready
    ready: bool = False
    node: "SimNode | None" = None          # elastic: the node it was placed on
    lost: str = "lost"                     # how its calls fail once dead: lost | node_lost


class SimPool:
    """A `dispatch.Pool` of `size` simulated workers (module docstring). `fate(item)` decides each
    item: "ok", "fail:<error>" (a failed row, the worker lives: a NaN output), "raise:<error>" (the
    shard raises in the worker: `TaskError`), "die" (the worker dies generating it), "die_writing"
    (it dies writing the shard's files, after its GPU work: half a file under a temporary name),
    "hang" (its generate call never returns: the worker lives, silent, until killed).
    `warm_fate(rank, attempt)` is None or the error its warm-up raises. `drift`: {rank: n}: that
    slot's first worker computes wrong after its n-th item, so its canaries fail from then on (a
    canary takes one item's time on its GPU). `media`: a Store to write each ok row's media file
    into when its shard is delivered (tests; the bench writes none).
    Everything runs on the caller's thread, inside `wait`; `sim_cpu_s` is the CPU it took."""

    def __init__(self, size: int, item_s: float, clock=RealClock(), jitter: float = 0.2,
                 startup_s: tuple[float, float] = (10.0, 40.0), write_s: float = 0.05,
                 deaths_per_min: float = 0.0, shard_size: int = 8,
                 fate: Callable[[Item], str] | None = None,
                 warm_fate: Callable[[int, int], str | None] | None = None,
                 media=None, seed: int = 0, drift: dict[int, int] | None = None,
                 gpu_at: Callable[[int], float] | None = None):
        self.size, self.item_s, self.clock, self.jitter = size, item_s, clock, jitter
        self.gpu_at = gpu_at               # a fixed pool's slot `rank` gets its GPU then (or now)
        self.cluster: "SimCluster | None" = None    # elastic: set by `SimCluster(pool, ...)`
        self.last_rows_t: float | None = None       # when rows were last delivered
        self.startup_s, self.write_s, self.media = startup_s, write_s, media
        self.fate, self.warm_fate, self.drift = fate, warm_fate, drift or {}
        self.rng = random.Random(seed)
        # a death per shard with this chance: `deaths_per_min` in all at full speed
        self.death_p = deaths_per_min / 60 * shard_size * item_s / size if size else 0.0
        self.heap: list = []                       # (t, n, future)
        self.n = itertools.count()
        self.undelivered: dict[SimFuture, None] = {}   # done, not yet returned by a wait (ordered)
        self.workers: list[SimWorker] = []
        self.attempts: dict[int, int] = {}
        self.sim_cpu_s = 0.0
        self.rows_delivered = self.shards_delivered = 0
        self.dead_ready_s = self.dead_idle_s = 0.0     # ready / idle seconds of dead workers

    # -- the Pool interface ------------------------------------------------------------------

    def start(self, rank: int, node: str | None = None) -> tuple[SimWorker, SimFuture]:
        """Slot `rank`'s worker: on `node` (elastic: `SimCluster`'s), or, with `gpu_at`, once
        its GPU arrives (a fixed pool's actor waits for its resources as Ray's does)."""
        t0 = time.thread_time()
        now = self.clock.time()
        attempt = self.attempts[rank] = self.attempts.get(rank, 0) + 1
        begin = max(now, self.gpu_at(rank)) if self.gpu_at and node is None else now
        w = SimWorker(rank, now, begin + self.rng.uniform(*self.startup_s), attempt=attempt)
        if node is not None:
            self.cluster.place(w, node)
        w.warm_error = self.warm_fate(rank, attempt) if self.warm_fate else None
        self.workers.append(w)
        f = self._future(w, w.ready_at, self._warmed)
        self.sim_cpu_s += time.thread_time() - t0
        return w, f

    def submit(self, w: SimWorker, seq: int, items) -> tuple[SimFuture, SimFuture]:
        t0 = time.thread_time()
        now = self.clock.time()
        if w.dead_at is not None:                   # not noticed yet: its calls fail
            lost = lambda f: self._set(f, w.lost, "killed")    # noqa: E731
            started, finished = self._future(w, now, lost), self._future(w, now, lost)
        else:
            started, finished = self._run_shard(w, items, now)
        self.sim_cpu_s += time.thread_time() - t0
        return started, finished

    def canary(self, w: SimWorker, seq: int) -> SimFuture:
        now = self.clock.time()
        if w.dead_at is not None:
            return self._future(w, now, lambda f: self._set(f, w.lost, "killed"))
        start = max(now, w.busy_until, w.ready_at)
        w.busy_until = start + self.item_s
        w.busy_s += self.item_s
        w.canaries += 1
        w.call_ends.append(w.busy_until)
        wrong = w.attempt == 1 and self.drift.get(w.rank, math.inf) < w.generated
        verdict = dict(ok=not wrong, rule="bit for bit", differing=0.5 if wrong else 0.0,
                       max_abs=40 if wrong else 0, psnr_db=20.0 if wrong else math.inf,
                       s=self.item_s, rank=w.rank,
                       device=dict(host="sim", node_id=None, pid=None, gpu_index=str(w.rank),
                                   gpu_uuid=None, gpu_name="simulated"))
        return self._future(w, w.busy_until, lambda f: self._set(f, "ok", verdict))

    def phases(self, w: SimWorker, since: int) -> SimFuture:
        events = [("warming up", w.ready_at - w.started)][since:]
        return self._future(w, self.clock.time(), lambda f: self._set(f, "ok", events))

    def metrics(self, w: SimWorker) -> SimFuture:
        return self._future(w, self.clock.time(), lambda f: self._set(f, "ok", self._metrics(w)))

    def progress(self, w: SimWorker) -> SimFuture:
        """Seconds since `w`'s last model call ended (or since it became ready), as a worker
        answers the watchdog; a dead worker's call is lost."""
        now = self.clock.time()
        if w.dead_at is not None:
            return self._future(w, now, lambda f: self._set(f, w.lost, "killed"))
        k = bisect.bisect_right(w.call_ends, now)
        last = w.call_ends[k - 1] if k else w.ready_at
        return self._future(w, now, lambda f: self._set(f, "ok", now - last))

    def wait(self, futures: list, timeout: float) -> list:
        t0 = time.thread_time()
        deadline = self.clock.time() + timeout
        while True:
            self._deliver()
            done = self._done(futures)
            now = self.clock.time()
            if done or now >= deadline:
                self.sim_cpu_s += time.thread_time() - t0
                return done
            # asleep until the next event (which may not be one of `futures`) or the deadline
            wake = min(deadline, self.heap[0][0]) if self.heap else deadline
            self.sim_cpu_s += time.thread_time() - t0
            self.clock.sleep(max(0.0, wake - now))   # (an event may have come due meanwhile)
            t0 = time.thread_time()

    def result(self, f: SimFuture) -> Any:
        assert f.state != "pending", "a Pool's caller reads only done futures"
        if f.state == "error":
            raise TaskError(f.value)
        if f.state == "lost":
            raise WorkerLost(f.value)
        if f.state == "node_lost":
            raise NodeLost(f.value)
        return f.value

    def kill(self, w: SimWorker) -> None:
        if w.node is not None and w.node.drain is not None and w.dead_at is None:
            self.cluster.drain_stops += 1           # stopped by the driver on a draining node
        self._die(w, self.clock.time(), "killed")

    def stop(self, workers: list, timeout_s: float) -> int:
        for w in workers:
            self.kill(w)
        return 0

    def close(self) -> None:
        pass

    # -- the workers -------------------------------------------------------------------------

    def _future(self, w: SimWorker, t: float, action) -> SimFuture:
        f = SimFuture(w, t, action)
        w.pending.append(f)
        heapq.heappush(self.heap, (t, next(self.n), f))
        return f

    def _event(self, w: SimWorker, t: float, action) -> None:
        """Something that happens to `w` at `t` (no caller waits for it)."""
        heapq.heappush(self.heap, (t, next(self.n), SimFuture(w, t, action)))

    def _set(self, f: SimFuture, state: str, value, watched: bool = True) -> None:
        """`f` completes. `watched`: kept for `wait`'s bulk path until returned (what the driver
        waits on in bulk: warm-ups, finishes, phases, metrics); a shard's start future is not
        waited on."""
        f.state, f.value = state, value
        f.worker.pending.remove(f)
        if watched:
            self.undelivered[f] = None

    def _warmed(self, f: SimFuture) -> None:
        w = f.worker
        if w.warm_error is not None:
            self._set(f, "error", w.warm_error)
            return
        w.ready, w.busy_until = True, w.ready_at
        self._set(f, "ok", {"rank": w.rank, "host": "sim", "node_id": w.node and w.node.id,
                            "model_load_s": 0.0,
                            "warmup_s": w.ready_at - w.started})

    def _run_shard(self, w: SimWorker, items, now: float) -> tuple[SimFuture, SimFuture]:
        """The shard's GPU work after what is queued on `w`; its rows `write_s` after that."""
        if w.busy_until == math.inf:                 # hung: queued behind a call that never ends
            return self._future(w, math.inf, None), self._future(w, math.inf, None)
        start = max(now, w.busy_until, w.ready_at)
        if w.ready and now > w.busy_until:           # the GPU waited for this shard
            w.idle_s += now - w.busy_until
        rows, t, death, error, writing = [], start, None, None, None
        die_at = self.rng.randrange(len(items)) if self.rng.random() < self.death_p else None
        for k, it in enumerate(items):
            w.generated += 1
            fate = self.fate(it) if self.fate else "ok"
            dt = self.item_s * (1 + self.jitter * (2 * self.rng.random() - 1))
            if fate == "die" or k == die_at:
                death = t + dt / 2
                break
            if fate == "hang":                       # nothing more of this worker completes
                w.busy_until = math.inf
                return self._future(w, math.inf, None), self._future(w, math.inf, None)
            if fate == "die_writing":
                writing = writing or it
            elif fate.startswith("raise:"):
                error = error or fate[6:]
            rows.append(_row(it, w.rank, fate, t, dt + self.write_s))
            t += dt
            w.call_ends.append(t)
        if death is None and writing is not None:    # its GPU work done, dead while writing
            death = t + self.write_s / 2
        w.busy_until = death if death is not None else t
        w.busy_s += w.busy_until - start
        started = self._future(w, t, lambda f: self._set(f, "ok", len(items), watched=False)) \
            if death is None or writing is not None else self._future(w, math.inf, None)
        if death is not None:                        # every call still on it is lost then
            self._event(w, death, lambda f: self._die(f.worker, f.t, "actor died (simulated)",
                                                      half=writing))
            return started, self._future(w, math.inf, None)
        finish = (lambda f: self._set(f, "error", error)) if error else \
            (lambda f: self._finish(f, rows))
        finished = self._future(w, t + self.write_s, finish)
        finished.rows = True
        return started, finished

    def _write_half(self, item: Item) -> None:
        """What a worker killed mid-write leaves: half a file under a temporary name."""
        if self.media is not None and self.media.local:
            os.makedirs(self.media.path("media"), exist_ok=True)
            with open(f"{self.media.path('media')}/.tmp-sim0000-{item.id}.png", "wb") as f:
                f.write(tiny_png()[:20])

    def _finish(self, f: SimFuture, rows: list[dict]) -> None:
        w = f.worker
        ok = [r for r in rows if r["status"] == "ok"]
        w.items += len(ok)
        w.failed += len(rows) - len(ok)
        if self.media is not None:
            for r in ok:
                self.media.write_bytes_atomic(r["output"], tiny_png())
        self._set(f, "ok", rows)

    def _die(self, w: SimWorker, t: float, why: str, half: Item | None = None,
             node_lost: bool = False) -> None:
        """`w` is gone at `t`: every call on it lost (`node_lost`: with its node, `NodeLost`)."""
        if w.dead_at is not None:
            return
        if half is not None:
            self._write_half(half)
        w.dead_at, w.lost = t, "node_lost" if node_lost else "lost"
        if w.node is not None:
            w.node.workers.pop(w, None)             # its GPU is free again
        if w.ready:
            self.dead_ready_s += t - w.ready_at
            self.dead_idle_s += w.idle_s + max(0.0, t - w.busy_until)
        for f in list(w.pending):
            if f.state == "pending":
                self._set(f, w.lost, why)

    def _deliver(self) -> None:
        """Run every event due by now, in time order."""
        now = self.clock.time()
        while self.heap and self.heap[0][0] <= now:
            _, _, f = heapq.heappop(self.heap)
            if f.state == "pending" and f.action is not None:
                f.action(f)

    def _done(self, futures: list) -> list:
        """The done ones of `futures`: a few looked at one by one, many through `undelivered`."""
        if len(futures) <= 8:
            done = [f for f in futures if f.state != "pending"]
        else:
            wanted = set(futures)
            done = [f for f in self.undelivered if f in wanted]
        for f in done:
            if self.undelivered.pop(f, 1) is None and f.rows and f.state == "ok":
                self.rows_delivered += len(f.value)        # first delivery of a shard's rows
                self.shards_delivered += 1
                self.last_rows_t = self.clock.time()
        return done

    def _metrics(self, w: SimWorker) -> dict:
        now = self.clock.time()
        serving = max(0.0, (w.dead_at or now) - w.ready_at)
        return {"rank": w.rank, "host": "sim", "node_id": None, "gpu_name": None,
                "items": w.items, "failed": w.failed, "steps": 0, "model_load_s": 0.0,
                "warmup_s": w.ready_at - w.started, "steady_it_s": None, "e2e_mean_s": None,
                "e2e_p95_s": None, "peak_mem_gb": None, "gpu_util": None, "serving_s": serving,
                "busy_fraction": min(1.0, w.busy_s / serving) if serving else None,
                "gpu_ms_per_item": None, "canaries": w.canaries, "canary_s": w.canaries * self.item_s,
                "time_s": {"denoise": w.busy_s, "wait": self._idle(w, now)}}

    # -- figures -----------------------------------------------------------------------------

    def _idle(self, w: SimWorker, now: float) -> float:
        return w.idle_s + max(0.0, now - w.busy_until) if w.ready else 0.0

    def worker_seconds(self) -> tuple[float, float]:
        """(ready, idle) worker-seconds so far, dead workers included: the idle fraction of a
        window is the ratio of their differences."""
        now = self.clock.time()
        live = [w for w in self.workers if w.ready and w.dead_at is None]
        return (self.dead_ready_s + sum(now - w.ready_at for w in live),
                self.dead_idle_s + sum(self._idle(w, now) for w in live))


@dataclass(eq=False)
class SimNode:
    id: str
    gpus: int
    arrived: float
    alive: bool = True
    drain: float | None = None             # its deadline (the clock's epoch s) once draining
    workers: dict = field(default_factory=dict)    # SimWorker -> None: the GPUs taken


def arrival(t0: float, arrive_s: float, gpus: int, gpus_per_node: int) -> Callable[[int], float]:
    """`SimCluster`'s arrival as a fixed pool's `gpu_at`: slot `rank` gets the `rank`-th GPU."""
    nodes = math.ceil(gpus / gpus_per_node)
    return lambda rank: t0 + arrive_s * (rank // gpus_per_node + 1) / nodes


class SimCluster:
    """A `dispatch.Cluster` of simulated nodes, for `pool` (it sets `pool.cluster`): `gpus` GPUs
    in nodes of `gpus_per_node`, arriving one node at a time, evenly over `arrive_s` from now (the
    last at `arrive_s`). Each live node is preempted at `preempt_per_h` (a Poisson rate per node
    and hour): with `drain_fraction`'s chance drained first (a deadline `drain_s` ahead, then
    killed), else killed outright: its workers die with `NodeLost` and the view reports it dead
    at once. The autoscaler replaces a preempted node `replace_s` after it died, if the driver
    still wants (`want`) more GPUs than the live and coming ones. `poll` builds the `View` with
    `runner.driver.cluster.view` from the node records, as `RayCluster` does from Ray's node table; its
    CPU is the simulator's (`pool.sim_cpu_s`). Counts: `kills`, `drains`, `workers_lost`
    (workers on a node at its death), `replaced`, `not_replaced`."""

    def __init__(self, pool: SimPool, gpus: int, gpus_per_node: int = 1, arrive_s: float = 600.0,
                 preempt_per_h: float = 0.0, drain_fraction: float = 0.5, drain_s: float = 120.0,
                 replace_s: float = 180.0, seed: int = 0):
        self.pool, pool.cluster = pool, self
        self.gpus_per_node, self.rate = gpus_per_node, preempt_per_h / 3600.0
        self.drain_fraction, self.drain_s, self.replace_s = drain_fraction, drain_s, replace_s
        self.rng = random.Random(seed + 7919)
        self.nodes: dict[str, SimNode] = {}
        self.n = itertools.count()
        self.wanted, self.wants = 0, 0          # the last `want`, and how many calls changed it
        self.max_gpus = gpus
        self.excluded: dict[str | None, str] = {}
        self.kills = self.drains = self.workers_lost = self.replaced = self.not_replaced = 0
        self.polls, self.preempted_workers = 0, set()
        self.drain_stops = 0                    # workers the driver stopped on draining nodes
        t0 = pool.clock.time()
        nodes = math.ceil(gpus / gpus_per_node)
        self.coming = gpus                      # GPUs on their way (arrivals, replacements)
        for i in range(nodes):
            g = min(gpus_per_node, gpus - i * gpus_per_node)
            pool._event(None, t0 + arrive_s * (i + 1) / nodes, lambda f, g=g: self._add(g, f.t))


    # -- the Cluster interface ---------------------------------------------------------------

    def poll(self) -> View:
        c0 = time.thread_time()
        self.polls += 1
        rows, free, draining = [], {}, {}
        for n in self.nodes.values():
            rows.append({"NodeID": n.id, "Alive": n.alive,
                         "Resources": {"GPU": n.gpus, "CPU": n.gpus}})
            if n.alive:
                left = n.gpus - len(n.workers)
                free[n.id] = {"GPU": left, "CPU": left}
                if n.drain is not None:
                    draining[n.id] = int(n.drain * 1000)
        v = view(rows, free, draining, self.max_gpus, lambda node, kind: node not in self.excluded)
        self.pool.sim_cpu_s += time.thread_time() - c0
        return v

    def want(self, n: int) -> None:
        if n != self.wanted:
            self.wanted, self.wants = n, self.wants + 1

    def exclude(self, node: str | None, why: str) -> None:
        self.excluded[node] = why

    # -- the nodes ---------------------------------------------------------------------------

    def place(self, w: SimWorker, node_id: str) -> None:
        n = self.nodes[node_id]
        assert n.alive and len(n.workers) < n.gpus, f"no free GPU on {node_id}"
        w.node = n
        n.workers[w] = None

    def _add(self, gpus: int, t: float) -> None:
        self.coming -= gpus
        n = SimNode(f"node-{next(self.n):05d}", gpus, t)
        self.nodes[n.id] = n
        if self.rate:
            self.pool._event(None, t + self.rng.expovariate(self.rate),
                             lambda f: self._preempt(n, f.t))

    def _preempt(self, n: SimNode, t: float) -> None:
        if not n.alive or n.drain is not None:
            return
        if self.rng.random() < self.drain_fraction:
            self.drains += 1
            n.drain = t + self.drain_s
            self.pool._event(None, n.drain, lambda f: self._kill(n, f.t, "drained: its deadline"))
        else:
            self.kills += 1
            self._kill(n, t, "preempted")

    def _kill(self, n: SimNode, t: float, why: str) -> None:
        if not n.alive:
            return
        n.alive = False
        for w in list(n.workers):
            self.workers_lost += 1
            self.preempted_workers.add(w.rank)
            self.pool._die(w, t, f"node {n.id} {why} (simulated)", node_lost=True)
        self.coming += n.gpus
        self.pool._event(None, t + self.replace_s, lambda f: self._replace(n.gpus, f.t))

    def _replace(self, gpus: int, t: float) -> None:
        """The autoscaler's new node for a preempted one, if the driver still wants it."""
        live = sum(n.gpus for n in self.nodes.values() if n.alive and n.drain is None)
        if self.wanted > live + self.coming - gpus:
            self.replaced += 1
            self._add(gpus, t)
        else:
            self.coming -= gpus
            self.not_replaced += 1

# ---------------------------------------------------------------------------------------------
# The bench: one process per run, a parent that prepares, measures and plots.

USAGE = ("python -m runner.bench.simulate workers=N prompts=M item_s=R [duration_s=120] "
         "[shard_size=8] [settle_s=10] [resume_s=20] [startup_s=10:40] [jitter=0.2] "
         "[deaths_per_min=3] [sweep=N:M[:R],...] [sweep_s=60] [ray_calls=2000] [out=DIR]\n"
         "       python -m runner.bench.simulate replot=DIR   (table and plot from DIR/simulate.json)")
DEFAULTS = {"workers": "1000", "prompts": "10000000", "item_s": "0.7", "duration_s": "120",
            "shard_size": "8", "settle_s": "10", "resume_s": "20", "startup_s": "10:40",
            "jitter": "0.2", "deaths_per_min": "3", "sweep": "", "sweep_s": "60",
            "out": "/tmp/runner-simulate", "seed": "0", "ray_calls": "0", "replot": None,
            "child": None, "job_dir": None, "prompts_file": None}


def write_prompts(path: str, n: int) -> None:
    """`n` prompts (ids p00000000..., ~40 characters) as one Parquet file, built column-wise."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    if os.path.exists(path):
        return
    k = pc.cast(pa.array(range(n), pa.int64()), pa.string())
    ids = pc.binary_join_element_wise("p", pc.utf8_lpad(k, 8, "0"), "")
    prompts = pc.binary_join_element_wise("a photo of a red fox in the snow, number ", k, "")
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), tmp)
    os.replace(tmp, path)


def _job_argv(o: dict) -> list[str]:
    return ["job=demo_image", f"prompts.path={o['prompts_file']}", f"output.dir={o['job_dir']}",
            "job.name=sim", f"run.shard_size={o['shard_size']}", f"ray.num_workers={o['workers']}",
            "output.results_every_s=30"]


def _sample(pool: SimPool) -> dict:
    """The figures so far; `cpu` is the process's (every thread), `sim_cpu` the simulator's and
    `monitor_cpu` this monitoring thread's: the driver's is the first less the others."""
    ready_s, idle_s = pool.worker_seconds()
    t = os.times()
    return dict(t=time.time(), cpu=t.user + t.system, sim_cpu=pool.sim_cpu_s,
                monitor_cpu=time.thread_time(), rows=pool.rows_delivered,
                shards=pool.shards_delivered, ready_s=ready_s, idle_s=idle_s,
                load=os.getloadavg()[0])


def _monitor(state: dict, settle_s: float, duration_s: float) -> None:
    """Once every slot was ready: wait `settle_s`, sample every 5 s for `duration_s`, then stop
    the job as `ray job stop` does (SIGTERM: its handler records the signal, the dispatch loop
    raises; SIGINT would be ignored in a process started in the background, as Python does)."""
    while "pool" not in state:
        time.sleep(0.2)
    pool = state["pool"]
    while len({w.rank for w in pool.workers if w.ready}) < pool.size:
        time.sleep(0.5)
    state["t_all_ready"] = time.time()
    time.sleep(settle_s)
    samples = state["samples"] = [_sample(pool)]
    end = time.time() + duration_s
    while time.time() < end - 0.01:
        time.sleep(min(5.0, end - time.time()))
        samples.append(_sample(pool))
    os.kill(os.getpid(), signal.SIGTERM)


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _child_run(o: dict) -> dict:
    """One run of the job (`python -m runner` in this process) over a SimPool, stopped by
    `_monitor`; its figures."""
    from ..driver import job
    state: dict = {}
    lo, hi = (float(x) for x in o["startup_s"].split(":"))

    def start_pool(j, limits) -> SimPool:
        state["t_pool"] = time.time()
        state["pool"] = SimPool(j["ray"].num_workers, float(o["item_s"]), RealClock(),
                                jitter=float(o["jitter"]), startup_s=(lo, hi),
                                deaths_per_min=float(o["deaths_per_min"]),
                                shard_size=int(o["shard_size"]), seed=int(o["seed"]))
        return state["pool"]
    threading.Thread(target=_monitor, args=(state, float(o["settle_s"]), float(o["duration_s"])),
                     daemon=True).start()
    t0 = time.time()
    status = job.main(_job_argv(o), start_pool=start_pool)
    t_end = time.time()
    s = state.get("samples") or []
    out = dict(status=status, plan_s=state["t_pool"] - t0, peak_rss_mb=_peak_rss_mb(),
               all_ready_s=state.get("t_all_ready", t_end) - state["t_pool"],
               stop_s=t_end - s[-1]["t"] if s else None)
    if len(s) >= 2:
        out.update(_window(s, int(o["workers"]), float(o["item_s"])))
    pool = state["pool"]
    out.update(deaths=sum(w.dead_at is not None for w in pool.workers) - pool.size,
               started=len(pool.workers))
    return out


def _window(s: list[dict], workers: int, item_s: float) -> dict:
    a, b = s[0], s[-1]
    dt, rows, shards = b["t"] - a["t"], b["rows"] - a["rows"], b["shards"] - a["shards"]
    cpu = (b["cpu"] - a["cpu"]) - (b["sim_cpu"] - a["sim_cpu"]) - (b["monitor_cpu"] - a["monitor_cpu"])
    rates = [(y["rows"] - x["rows"]) / (y["t"] - x["t"]) for x, y in zip(s, s[1:])]
    ready = (b["ready_s"] - a["ready_s"]) / dt          # workers ready on average (deaths, restarts)
    return dict(window_s=dt, items=rows, shards=shards, items_per_s=rows / dt,
                items_per_s_min=min(rates), items_per_s_max=max(rates),
                demand_items_per_s=workers / item_s, ready_workers=ready,
                ready_demand_items_per_s=ready / item_s,
                idle_fraction=(b["idle_s"] - a["idle_s"]) / (b["ready_s"] - a["ready_s"]),
                driver_cpu_s=cpu, driver_cpu_fraction=cpu / dt,
                sim_cpu_s=b["sim_cpu"] - a["sim_cpu"],
                cpu_ms_per_shard=1e3 * cpu / shards, cpu_ms_per_item=1e3 * cpu / rows,
                max_items_per_s=rows / cpu, load_avg_max=max(x["load"] for x in s))


def _child_snapshot(o: dict) -> dict:
    """One background snapshot's work at the job directory's end state: results.parquet from the
    record, then report.html (its timeline as the run left it)."""
    import pyarrow.parquet as pq

    from ..driver.report import write_report
    from ..driver.results import Results
    from ..io.storage import resolve
    job_dir = os.path.join(o["job_dir"], "sim")
    ids = pq.read_table(o["prompts_file"], columns=["id"]).column("id").to_pylist()
    t0 = time.perf_counter()
    results = Results(resolve(job_dir)).load()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    table = results.write_table(ids)
    snapshot_s = time.perf_counter() - t0
    with open(os.path.join(job_dir, "report", "timeline.json")) as f:
        timeline = json.load(f)
    t0 = time.perf_counter()
    write_report(job_dir, table, {"job": "sim", "items": len(ids)}, timeline=timeline,
                 thumb_budget_s=5)
    records = resolve(job_dir).list("records")
    return dict(record_load_s=load_s, snapshot_s=snapshot_s, report_s=time.perf_counter() - t0,
                record_rows=len(results.rows), record_mb=sum(records.values()) / 2**20,
                record_bytes_per_row=sum(records.values()) / max(1, len(results.rows)))


def _touch_media(job_dir: str) -> int:
    """The media files the simulated workers would have written (1 byte each), for the ok rows of
    the record: what the resume's one listing of media/ then finds."""
    from ..driver.results import Results
    from ..io.storage import resolve
    d = os.path.join(job_dir, "sim", "media")
    os.makedirs(d, exist_ok=True)
    rows = Results(resolve(os.path.join(job_dir, "sim"))).load().rows
    n = 0
    for r in rows.values():
        if r["status"] == "ok":
            with open(os.path.join(d, f"{r['id']}.png"), "wb") as f:
                f.write(b"x")
            n += 1
    return n


def _spawn(child: str, o: dict, log: str, **kw) -> dict:
    args = [sys.executable, "-m", "runner.bench.simulate", f"child={child}",
            *(f"{k}={v}" for k, v in {**o, **kw}.items() if v is not None and k not in ("child", "sweep"))]
    with open(log, "a") as f:
        r = subprocess.run(args, stdout=subprocess.PIPE, stderr=f, text=True)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise SystemExit(f"{child} failed ({r.returncode}); see {log}")
    return json.loads(lines[-1])


def measure(o: dict, workers: int, prompts: int, item_s: float, duration_s: float,
            resume: bool) -> dict:
    """One point: run 1 (plan, serve, stop), one snapshot at its end state, and with `resume` the
    resumed run 2."""
    import shutil
    prompts_file = os.path.join(o["out"], f"prompts-{prompts}.parquet")
    write_prompts(prompts_file, prompts)
    name = f"job-{workers}w-{prompts}p-{item_s}s"
    job_dir = os.path.join(o["out"], name)
    shutil.rmtree(job_dir, ignore_errors=True)
    log = os.path.join(o["out"], f"{name}.log")
    if os.path.exists(log):
        os.remove(log)
    o = {**o, "workers": workers, "prompts": prompts, "item_s": item_s, "duration_s": duration_s,
         "prompts_file": prompts_file, "job_dir": job_dir}
    row = dict(workers=workers, prompts=prompts, item_s=item_s, shard_size=int(o["shard_size"]),
               **_spawn("run", o, log))
    if "items_per_s" not in row:
        log_warning = (f"{name}: the job ended before its measuring window did (too few prompts "
                       f"for duration_s): no throughput figures")
        print(log_warning, file=sys.stderr)
    row.update(_spawn("snapshot", o, log))
    if resume:
        row["media_files"] = _touch_media(job_dir)
        r2 = _spawn("run", o, log, duration_s=o["resume_s"], seed=int(o["seed"]) + 1)
        row.update(resume_plan_s=r2["plan_s"], resume_peak_rss_mb=r2["peak_rss_mb"],
                   resume_items_per_s=r2.get("items_per_s"), resume_status=r2["status"])
    shutil.rmtree(job_dir, ignore_errors=True)       # up to ~1 GB of record and media at 10M
    print(json.dumps(row), flush=True)
    return row


def _sweep(o: dict) -> list[tuple[int, int, float]]:
    """`100:1000000,1000:100000:0.1` -> (workers, prompts, item_s) points (item_s: the main's)."""
    points = []
    for part in filter(None, o["sweep"].split(",")):
        try:
            n, m, *r = part.split(":")
            points.append((int(n), int(m), float(r[0]) if r else float(o["item_s"])))
        except ValueError:
            raise SystemExit(f"sweep={o['sweep']!r}: give workers:prompts[:item_s],...\n"
                             f"usage: {USAGE}") from None
    return points


TABLE = ["workers", "prompts", "item_s", "items_per_s", "demand_items_per_s", "idle_fraction",
         "cpu_ms_per_shard", "cpu_ms_per_item", "max_items_per_s", "driver_cpu_fraction",
         "plan_s", "peak_rss_mb", "record_bytes_per_row", "snapshot_s", "report_s",
         "resume_plan_s", "load_avg_max"]


def plot(rows: list[dict], main: dict, path: str) -> None:
    """Received against demanded items/s (every point), and each cost against workers (prompts
    and item_s fixed) and against prompts (workers and item_s fixed)."""
    from matplotlib.figure import Figure
    # a job that ran out of prompts in its window (it ended: status 0) shows its tail, not a steady
    # rate: its plan, memory and snapshot figures only
    steady = [r for r in rows if r.get("items_per_s") and r["status"] != 0]
    fig = Figure(figsize=(13, 7), dpi=110, layout="constrained")
    axes = fig.subplots(2, 3).flat
    ax = next(axes)
    top = max(r["demand_items_per_s"] for r in steady) * 1.1
    ax.plot([0, top], [0, top], ":", color="gray", label="received = demanded")
    for r in steady:
        ax.plot(r["demand_items_per_s"], r["items_per_s"], "o", color="tab:blue")
        ax.annotate(f"{r['workers']}w {r['prompts']:.0e}p {r['item_s']}s", (r["demand_items_per_s"],
                    r["items_per_s"]), fontsize=6, xytext=(3, -8), textcoords="offset points")
    ax.set(title="items/s received by the driver", xlabel="demanded: workers / item_s",
           ylabel="items/s")
    ax.legend(fontsize=7, frameon=False)
    same = [r for r in rows if r["item_s"] == main["item_s"]]
    by_m = max({r["prompts"] for r in same}, key=lambda m: len({r["workers"] for r in same if r["prompts"] == m}))
    vs_n = sorted((r for r in same if r["prompts"] == by_m), key=lambda r: r["workers"])
    vs_m = sorted((r for r in same if r["workers"] == main["workers"]), key=lambda r: r["prompts"])
    for ax, key, title in zip(axes, ("idle_fraction", "cpu_ms_per_item", "peak_rss_mb", "plan_s",
                                     "snapshot_s"),
                              ("workers' time waiting for work", "driver CPU ms per item",
                               "driver peak RSS, MiB", "plan (start to first worker), s",
                               "one results.parquet rewrite, s")):
        for pts, axis, style, fixed in ((vs_n, "workers", "o-", f"{by_m:.0e} prompts"),
                                        (vs_m, "prompts", "s--", f"{main['workers']} workers")):
            if key in ("idle_fraction", "cpu_ms_per_item"):
                pts = [r for r in pts if r in steady]
            if len(pts) > 1:
                ax.plot([r[axis] for r in pts], [r[key] for r in pts], style,
                        label=f"vs {axis} ({fixed})")
        ax.set(title=title, xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle(f"runner.bench.simulate: the real driver over simulated workers "
                 f"(x: workers or prompts, log; item_s {main['item_s']} s unless marked)")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


class HeldWorker:
    """A `WorkerContract` stand-in for timing `RayPool` on real Ray: shards are held (never done)
    until `release`, so that the calls in flight pile up as at N workers x 2 shards."""

    def __init__(self):
        self.released = threading.Event()

    def warmup(self, asked_at: float | None = None) -> dict:
        return {}

    def start_shard(self, seq: int, items) -> int:
        self.released.wait()
        return len(items)

    def finish_shard(self, seq: int) -> list[dict]:
        self.released.wait()
        return []

    def rows(self, items) -> list[dict]:
        return [_row(it, 0, "ok", 1.8e9, 1.4) for it in items]

    def release(self) -> None:
        self.released.set()


def _child_ray(o: dict) -> dict:
    """What Ray costs the driver per shard, which the simulation leaves out: `RayPool.submit` of a
    shard's items (two remote calls), `RayPool.wait` over `ray_calls` futures in flight, and
    `RayPool.result` of a shard's rows; CPU microseconds per call of this process (Ray's own
    threads in it included), on a local Ray."""
    import ray

    from ..driver.raypool import RayPool
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    n = int(o["ray_calls"])
    make = ray.remote(HeldWorker).options(num_cpus=0, max_concurrency=n + 10)
    actors = [make.remote() for _ in range(4)]
    pool = RayPool(lambda rank: actors[rank], 4)
    ray.get([a.warmup.remote() for a in actors])
    shard = [it for it in _items(int(o["shard_size"]))]

    def per_call(fn, k: int) -> float:
        c = time.process_time()
        for _ in range(k):
            fn()
        return (time.process_time() - c) / k * 1e6
    futures: list = []
    submit_us = per_call(lambda: futures.extend(pool.submit(actors[len(futures) % 4], len(futures),
                                                            shard)), n)
    time.sleep(2)
    finishes = futures[1::2]
    wait_us = per_call(lambda: pool.wait(finishes, timeout=0), 200)
    rows = [actors[0].rows.remote(shard) for _ in range(200)]
    ray.wait(rows, num_returns=len(rows))
    it = iter(rows)
    result_us = per_call(lambda: pool.result(next(it)), 200)
    for a in actors:
        a.release.remote()
    ray.shutdown()
    return dict(ray_calls_in_flight=len(finishes), submit_us_per_shard=submit_us,
                wait_us_per_call=wait_us, result_us_per_shard=result_us)


def _items(n: int) -> list[Item]:
    return [Item(id=f"p{i:08d}", prompt=f"a photo of a red fox in the snow, number {i}",
                 negative_prompt="", seed=i, height=128, width=128, num_frames=None,
                 num_inference_steps=4, guidance_scale=4.5, file="/data/prompts.parquet", row=i)
            for i in range(n)]


def replot(out: str) -> None:
    """The table and the plot again from `out`/simulate.json."""
    with open(os.path.join(out, "simulate.json")) as f:
        rows = json.load(f)["rows"]
    print(format_table(rows, TABLE))
    plot(rows, rows[0], os.path.join(out, "simulate.png"))


# ---------------------------------------------------------------------------------------------
# Elastic runs (issue 74): the real job over a SimCluster on the virtual clock, and the same
# arrival as a fixed pool.

ELASTIC_USAGE = (
    "python -m runner.bench.simulate elastic [gpus=1000] [gpus_per_node=1] [prompts=1000000] "
    "[item_s=2.0] [arrive_s=600] [preempt_per_h=0.05] [drain_fraction=0.5] [drain_s=120] "
    "[replace_s=180] [startup_s=10:40] [jitter=0.2] [shard_size=8] [seed=0] [out=DIR]")
ELASTIC_DEFAULTS = {"gpus": "1000", "gpus_per_node": "1", "prompts": "1000000", "item_s": "2.0",
                    "arrive_s": "600", "preempt_per_h": "0.05", "drain_fraction": "0.5",
                    "drain_s": "120", "replace_s": "180", "startup_s": "10:40", "jitter": "0.2",
                    "shard_size": "8", "seed": "0", "out": "/tmp/runner-simulate-elastic",
                    "child": None, "mode": None, "prompts_file": None, "job_dir": None}


def _elastic_argv(o: dict, mode: str) -> list[str]:
    pool = ([f"ray.min_workers=1", f"ray.max_workers={o['gpus']}"] if mode == "elastic"
            else [f"ray.num_workers={o['gpus']}"])
    # snapshots while running off (the final results.parquet and report are written): on the
    # virtual clock a 1M-row rewrite every 30 s would be most of the real time
    return ["job=demo_image", f"prompts.path={o['prompts_file']}", f"output.dir={o['job_dir']}",
            "job.name=sim", f"run.shard_size={o['shard_size']}", "output.results_every_s=1e9",
            *pool]


def elastic_run(o: dict, mode: str) -> dict:
    """One job (`runner.driver.job.main`, in this process, on a `VirtualClock`) over the SimPool of
    `mode`: "elastic" (a `SimCluster`: arrivals, preemptions, replacements; `ray.min_workers=1`,
    `ray.max_workers=gpus`) or "fixed" (`ray.num_workers=gpus`, slot r ready once the r-th GPU
    of the same arrival came, no preemption). Every row handed to the job's `on_rows` is counted
    (by its row number) and the final results.parquet read back: `rows_lost` (a prompt without
    exactly one ok row there, or never delivered), `rows_duplicated` (delivered more than once)."""
    import pyarrow.parquet as pq

    from ..driver import job
    clock = VirtualClock()
    gpus, prompts = int(o["gpus"]), int(o["prompts"])
    lo, hi = (float(x) for x in o["startup_s"].split(":"))
    delivered = bytearray(prompts)
    state: dict = {}

    def start_pool(j, limits) -> SimPool:
        t0 = state["t0"] = clock.time()
        common = dict(jitter=float(o["jitter"]), startup_s=(lo, hi), write_s=0.05,
                      shard_size=int(o["shard_size"]), seed=int(o["seed"]))
        if mode == "elastic":
            pool = SimPool(1, float(o["item_s"]), clock, **common)
            SimCluster(pool, gpus, int(o["gpus_per_node"]), float(o["arrive_s"]),
                       float(o["preempt_per_h"]), float(o["drain_fraction"]), float(o["drain_s"]),
                       float(o["replace_s"]), seed=int(o["seed"]))
        else:
            pool = SimPool(gpus, float(o["item_s"]), clock, **common,
                           gpu_at=arrival(t0, float(o["arrive_s"]), gpus, int(o["gpus_per_node"])))
        state["pool"] = pool
        return pool

    on_rows = job.JobRun.on_rows

    def counted(self, rows):
        for r in rows:
            k = r["row"]
            delivered[k] = min(255, delivered[k] + 1)
        return on_rows(self, rows)
    job.JobRun.on_rows = counted
    c0, w0 = os.times(), time.time()
    try:
        status = job.main(_elastic_argv(o, mode), start_pool=start_pool, clock=clock.time)
    finally:
        job.JobRun.on_rows = on_rows
    c1, wall_s = os.times(), time.time() - w0
    pool = state["pool"]
    d = os.path.join(o["job_dir"], "sim")
    table = pq.read_table(os.path.join(d, "results.parquet"), columns=["row", "status"])
    ok = bytearray(prompts)
    for k, s in zip(table.column("row").to_pylist(), table.column("status").to_pylist()):
        ok[k] = min(255, ok[k] + (s == "ok"))
    with open(os.path.join(d, "summary.json")) as f:
        summary = json.load(f)
    timing = summary.get("timing", summary)
    losses = timing.get("losses") or []
    ready_s, idle_s = pool.worker_seconds()
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    out = dict(mode=mode, status=status, gpus=gpus, prompts=prompts, item_s=float(o["item_s"]),
               span_s=pool.last_rows_t - state["t0"], job_span_s=timing.get("span_s"),
               rows_ok=sum(1 for x in ok if x == 1), rows_in_results=table.num_rows,
               rows_lost=sum(1 for x, y in zip(delivered, ok) if x == 0 or y != 1),
               rows_duplicated=sum(1 for x in delivered if x > 1),
               workers_started=len(pool.workers), losses=len(losses),
               losses_charged=sum(1 for x in losses if x.get("charged")),
               losses_node=sum(1 for x in losses if x.get("kind") == "node lost"),
               rows_back=sum(x.get("rows_back") or 0 for x in losses),
               idle_worker_s=timing.get("idle_worker_s"), gpu_ready_s=ready_s, gpu_idle_s=idle_s,
               idle_fraction=idle_s / ready_s if ready_s else None,
               shards=timing.get("shards"), driver_cpu_s=cpu - pool.sim_cpu_s,
               sim_cpu_s=pool.sim_cpu_s, wall_s=wall_s, peak_rss_mb=_peak_rss_mb())
    c = pool.cluster
    if c is not None:
        out.update(kills=c.kills, drains=c.drains, workers_lost_with_nodes=c.workers_lost,
                   drain_stops=c.drain_stops,
                   replaced=c.replaced, not_replaced=c.not_replaced, polls=c.polls,
                   nodes=len(c.nodes),
                   # every loss of a worker on a preempted node: none charged
                   preempted_charged=sum(1 for x in losses if x.get("charged")
                                         and x.get("rank") in c.preempted_workers))
    return out


ELASTIC_TABLE = ["mode", "span_s", "rows_lost", "rows_duplicated", "kills", "drains",
                 "drain_stops", "workers_lost_with_nodes", "losses_charged", "replaced",
                 "workers_started", "idle_worker_s", "idle_fraction", "shards", "driver_cpu_s",
                 "sim_cpu_s", "wall_s", "peak_rss_mb"]


def elastic_main(argv: list[str]) -> int:
    """`elastic`: the elastic run and the fixed one, each its own process; JSON and a table."""
    import shutil
    o, _ = parse_args(argv, ELASTIC_DEFAULTS, ELASTIC_USAGE)
    if o["child"] == "run":
        print(json.dumps(elastic_run(o, o["mode"])))
        return 0
    os.makedirs(o["out"], exist_ok=True)
    o["prompts_file"] = os.path.join(o["out"], f"prompts-{o['prompts']}.parquet")
    write_prompts(o["prompts_file"], int(o["prompts"]))
    rows = []
    for mode in ("elastic", "fixed"):
        job_dir = os.path.join(o["out"], f"job-{mode}")
        shutil.rmtree(job_dir, ignore_errors=True)
        log_path = os.path.join(o["out"], f"{mode}.log")
        args = [sys.executable, "-m", "runner.bench.simulate", "elastic", "child=run",
                f"mode={mode}", *(f"{k}={v}" for k, v in {**o, "job_dir": job_dir}.items()
                                  if v is not None and k not in ("child", "mode"))]
        with open(log_path, "w") as f:
            r = subprocess.run(args, stdout=subprocess.PIPE, stderr=f, text=True)
        lines = r.stdout.strip().splitlines()
        if r.returncode != 0 or not lines:
            raise SystemExit(f"the {mode} run failed ({r.returncode}); see {log_path}")
        rows.append(json.loads(lines[-1]))
        print(lines[-1], flush=True)
        shutil.rmtree(job_dir, ignore_errors=True)
    elastic, fixed = rows
    verdict = dict(span_ratio=elastic["span_s"] / fixed["span_s"],
                   rows_lost=elastic["rows_lost"] + fixed["rows_lost"],
                   rows_duplicated=elastic["rows_duplicated"] + fixed["rows_duplicated"],
                   preempted_charged=elastic.get("preempted_charged"))
    verdict["met"] = (verdict["span_ratio"] <= 1.10 and verdict["rows_lost"] == 0
                      and verdict["rows_duplicated"] == 0 and not verdict["preempted_charged"])
    write_json(os.path.join(o["out"], "elastic.json"),
               {"argv": ["elastic", *argv], "options": o, "rows": rows, "verdict": verdict})
    print(format_table(rows, ELASTIC_TABLE))
    print(json.dumps(verdict))
    return 0 if verdict["met"] else 1

def main(argv: list[str]) -> int:
    if argv[:1] == ["elastic"]:
        return elastic_main(argv[1:])
    o, _ = parse_args(argv, DEFAULTS, USAGE)
    if o["replot"]:
        replot(o["replot"])
        return 0
    if o["child"] == "run":
        print(json.dumps(_child_run(o)))
        return 0
    if o["child"] == "snapshot":
        print(json.dumps(_child_snapshot(o)))
        return 0
    if o["child"] == "ray":
        print(json.dumps(_child_ray(o)))
        return 0
    os.makedirs(o["out"], exist_ok=True)
    main_point = (int(o["workers"]), int(o["prompts"]), float(o["item_s"]))
    rows = [measure(o, *main_point, float(o["duration_s"]), resume=True)]
    for point in _sweep(o):
        if point != main_point:
            rows.append(measure(o, *point, float(o["sweep_s"]), resume=False))
    ray_cost = None
    if int(o["ray_calls"]):
        ray_cost = _spawn("ray", o, os.path.join(o["out"], "ray-calls.log"))
        print(json.dumps(ray_cost), flush=True)
    write_json(os.path.join(o["out"], "simulate.json"), {"argv": argv, "rows": rows, "ray": ray_cost})
    print(format_table(rows, TABLE))
    if len(rows) > 1 and rows[0].get("items_per_s"):
        plot(rows, rows[0], os.path.join(o["out"], "simulate.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
