"""Hands shards to workers and survives their failures.

Contract of `Dispatcher(pool, n_workers, shards, on_rows, ...).run()`:
- Each worker slot holds at most `inflight` shards; when one finishes, the slot takes the next from
  the queue (dynamic, not a static split). A shard travels with its validated items (`Shard.items`)
  as two calls on the (threaded) actor: `start_shard(seq, items)`, done when its GPU work is, and
  `finish_shard(seq)`, its rows once written; `seq` numbers the slot's shards so the worker runs
  them in order while it writes one shard and generates the next. Rows go to `on_rows` as each
  shard finishes.
- A worker that dies (process killed, node lost, CUDA error, out of memory: any Ray error that is
  not an exception raised inside the worker's methods) loses only its unfinished shards. Rows that
  came back before are kept; every other row it held (generating or being written) was in flight
  at that death, which is counted for the row. A row in flight at `max_deaths` deaths is recorded
  failed, naming the last death's cause (the pool's `WorkerLost` text: out of memory when the
  worker was killed for memory) and the row's input, and is never handed out again in this job;
  the others go back to the front of the queue as single rows run isolated (alone on their
  worker), so a later death is pinned on exactly one row. The slot gets a new actor, which warms
  up like the first.
- Restarts (`max_restarts` per slot) count only deaths not pinned on a row: a death at which a
  row that was then failed for its deaths was in flight costs that row, not the slot's budget, so
  a poison row among a million costs one failed row, with one worker or many. The budget stops a
  worker that keeps dying of something else (its node, its start-up).
- A shard that raises in the worker (`TaskError`: the worker lives) is charged one attempt. A
  failing shard of several rows is split into single rows, so one poison prompt cannot take its
  neighbours down; a row that raises more than `max_retries` times is recorded as failed and the
  job goes on.
- A row whose input's store did not answer its worker (its error starts with
  `images.INPUT_FAULT`) is the store's fault: the shard's other rows are recorded, that row is
  not (it stays pending), and the job stops at once (`PersistentFault`, exit 3, naming the store).
- Canaries (`canary_every` items, `canary_every_s` seconds; `runner.serve.canary`): a ready slot whose
  actor was handed that many items (or had that time) since its last canary, and which has more
  to do, is asked for one in turn with its shards (`Pool.canary`: it runs after the GPU work of
  the shards handed out before it). Its shards carry the number of canaries asked before them
  (an epoch); the ok rows they return are kept until a canary after them passes. A canary that
  fails stops the worker: every ok row it made since its last good canary (returned, or done by
  then) is marked `suspect` (`on_canary_failed` gets the rows returned earlier, to record again;
  rows done by then go to `on_rows` as suspect), its unfinished shards go back to the queue as
  they were (no row is blamed), and the slot restarts like after a death not pinned on a row (a
  fresh process reloads the weights; its own first canary is its reference). The outputs after
  a worker's last canary are not checked.
- A ready worker that makes no progress (no model call finished: no shard or canary back, and,
  asked through `Pool.progress` once silent past its bound, none finished since) for longer than
  its bound is hung (`runner.driver.watchdog`: a multiple of its own measured time for one call of the
  work it holds, a floor, the ceiling `hang_timeout_s`; 0: off; unanswered within
  `watchdog.ASK_S`: hung too): it is killed (`Pool.kill`) and replaced like a dead one,
  the shard it was on is blamed as for a death (a row in flight at `max_deaths` hangs is failed:
  "no progress for N s while generating it"), the shards behind it go back as they were, and
  `on_hung(slot, info)` is told (its host and GPU, the bound, the rows).
- A slot whose actor has not become ready within `start_timeout_s` (a restart waiting for resources
  that left with a lost node waits forever in Ray) is given up. When no slot is ready or starting,
  the job stops with `DispatchError` instead of hanging.
- `slots` (optional) is a list the caller owns, filled with the live slots as they change: after an
  interrupt (an exception out of dispatch) the caller still knows which workers served.
- `later` (optional): shards handed out once the others are, only to slots `takes_later(slot)`
  accepts (the job's outputs made without int8-attention's kernel, remade by workers that run
  it); left when no slot that takes them is ready and none is starting. A retried or split one
  joins the queue like any shard.
- `on_ready(slot)` runs when a slot's actor is ready, `on_tick()` at least once a second.
- Elastic (`cluster`, a `Cluster`: `runner.driver.cluster.RayCluster` on Ray): the slots are not fixed.
  Once a second the dispatcher reads the cluster's `View` and asks the cluster for room for the
  workers the work left can keep busy (`Cluster.want`: between `n_workers`, the minimum, and
  `max_workers`, less the slots retired for their own deaths), and starts a worker, a new rank,
  on each place the view offers (`Pool.start(rank, node)`) up to that. A worker lost with its
  node (`NodeLost`, or its node dead or draining in the view) is a node loss: never charged, its
  rows go back as they were, its rank is not restarted (a new worker starts where there is room).
  A draining node's workers get no new shards; one with nothing in flight is stopped, one still
  busy is stopped and its shards requeued `DRAIN_MARGIN_S` before the node's deadline (none
  given: it finishes what it holds). Once nothing is queued, a ready worker left without work for
  `IDLE_STOP_S` is stopped (`on_stop(slot, why)` first: its metrics), so its node can go; the
  worker-seconds spent ready without work are `idle_s`. With no worker ready or starting and
  work left, the job waits for room (a line every `WAIT_LINE_S`) `gpu_wait_s` at most, then
  stops with `NoRoom` (a `PersistentFault`: exit 3) naming what it waited for. Every loss is in
  `losses` (`on_lost(info)` as it happens) with its cause and whether it was charged.
- Restarts are counted per slot and per hour it served: a slot is replaced after a death of its
  own while its charged deaths are at most `max_restarts` x max(1, hours served).
- A loop iteration costs O(what happened) plus one `Pool.wait` over the shards in flight, not
  O(slots): starting and hungry (ready, with room for a shard) slots are kept as they change
  (`runner.bench.simulate` measures the loop at 1000 workers).

These rules live in `Dispatcher`, which reaches its workers only through a `Pool` (start a worker
and its warm-up, submit a shard, wait for futures, read a result as a value, `TaskError` or
`WorkerLost`, kill a worker; and for the rest of the driver: phases, metrics, stop and wait until
dead, close): `runner.driver.raypool.RayPool` is the Ray one (the driver's only Ray code), tests drive the
same rules with in-memory pools, and `runner.bench.simulate` with a simulated cluster. A worker is
anything with the methods of `runner.serve.worker.WorkerContract`. This module imports no Ray.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..serve import canary
from ..io.images import INPUT_FAULT
from ..io.outputs import failed_row, plural
from ..io.prompts import Item, Shard
from .results import error_cause
from ..io.storage import StoreTimeout
from .watchdog import ASK_S, Pace, Watchdog, units

log = logging.getLogger("runner")


class DispatchError(RuntimeError):
    pass


class PersistentFault(DispatchError):
    """The same error on `FAULT_ROWS` different shards in a row, none finished in between (a full
    disk, an unreachable store): retrying every row would only burn GPU time on outputs that
    cannot be written. A store that did not answer (`StoreTimeout`) counts after
    `FAULT_ROWS_STALLED`: each of its failures took the store's whole timeout (20 s), and four
    in a row took the job 80 s before it could even begin to stop."""


FAULT_ROWS = 4   # distinct failing shards (or rows) with one cause and no success in between
FAULT_ROWS_STALLED = 2   # the same, for a store that did not answer in time


def fault_cause(shard: Shard, error: str) -> str:
    """`error` as a cause that shards share: its first line with the shard's own ids masked (as
    `results.error_cause` does for a row), so the same store error naming each row's file counts
    as one cause."""
    for it in shard.items:
        error = error_cause({"id": it.id, "error": error})
    return error


class NoRoom(PersistentFault):
    """No worker ready or starting, work left, and no place for one within `gpu_wait_s`."""


DRAIN_MARGIN_S = 30.0   # a draining node's busy worker is stopped this long before its deadline
IDLE_STOP_S = 5.0       # a ready worker without work once nothing is queued: stopped after this
WAIT_LINE_S = 15.0      # while waiting for room: a line this often
# A worker lost without its node reported dead: no new worker on that node for this long, the
# bound within which Ray reports a node whose raylet died (its health checks: 5 x 3 s + margin)
SUSPECT_S = 30.0


class TaskError(Exception):
    """An exception raised by our code inside a worker, which lives on. `str()` is its cause,
    `Type: message` of the worker-side exception (see `cause`)."""


class WorkerLost(Exception):
    """The worker is gone (its process or node died, or it was killed). `str()` says how."""


class NodeLost(WorkerLost):
    """The worker is gone with its node (the node died, was preempted or drained): not the
    worker's fault."""


class Cluster(Protocol):
    """An elastic pool's room (`runner.driver.cluster.RayCluster`; simulated in runner.bench.simulate)."""

    def poll(self) -> Any:
        """A `runner.driver.cluster.View`: `places` (a node id per worker that could start now),
        `draining` (node id -> deadline, epoch s, 0: none), `dead` (node ids), `text()`."""

    def want(self, n: int) -> None:
        """Room for `n` workers in all, running ones included (the autoscaler's floor)."""

    def exclude(self, node: str | None, why: str) -> None:
        """Place no more workers on `node`'s kind (a worker found its GPU too small)."""


class Pool(Protocol):
    """Every call the driver makes on its workers (the dispatcher, the start-up display, the
    summary's metrics, the stop). Handles and futures are opaque; futures are hashable, and a
    worker runs its calls in the order they were made. `size`: the workers the job runs."""

    size: int

    def start(self, rank: int) -> tuple[Any, Any]:
        """Create the worker of slot `rank` and begin its warm-up: (handle, future of the
        warm-up's ready info)."""

    def canary(self, worker: Any, seq: int) -> Any:
        """Turn `seq` of this worker: its canary (`WorkerContract.canary`): future of the
        verdict (`runner.serve.canary.compare`'s dict, with `s`, `rank`, `device`)."""

    def submit(self, worker: Any, seq: int, items: list[Item]) -> tuple[Any, Any]:
        """Shard number `seq` of this worker (`start_shard`, `finish_shard`): (future done when
        its GPU work is, future of its rows once written)."""

    def phases(self, worker: Any, since: int) -> Any:
        """Future of the worker's start-up phases from the `since`-th on (answered while it warms
        up)."""

    def metrics(self, worker: Any) -> Any:
        """Future of the worker's metrics (`Worker.metrics`)."""

    def progress(self, worker: Any) -> Any:
        """Future of the seconds since the worker's last model call finished (`Worker.progress`;
        asked only by the watchdog, of a worker silent past its bound)."""

    def wait(self, futures: list, timeout: float) -> list:
        """The futures of `futures` that are done (at least one), or [] once `timeout` seconds
        passed with none done."""

    def result(self, future: Any) -> Any:
        """The value of a done future; raises `TaskError` or `WorkerLost`."""

    def kill(self, worker: Any) -> None:
        """Stop the worker for good (no restart behind the dispatcher's back). Never raises."""

    def stop(self, workers: list, timeout_s: float) -> int:
        """Kill `workers` and return once each is gone (no file of theirs can land after), or
        after `timeout_s`: the number still running then."""

    def close(self) -> None:
        """The job is done with the pool (its workers stopped): nothing of it may print after
        the job's last lines (Ray: errors of calls never read, workers' log lines)."""


def _few_ids(rows: list[dict], n: int = 5) -> str:
    ids = [r["id"] for r in rows]
    return ", ".join(ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def cause(e: BaseException) -> str:
    """`Type: message` of the exception raised in the worker (Ray's wrapper holds it as `cause`),
    first line, for logs and the summary; Ray's own error text for what has no cause (a lost
    actor or node)."""
    c = getattr(e, "cause", None)
    c = c if isinstance(c, BaseException) else e
    text = f"{type(c).__name__}: {c}".strip()
    return (text.splitlines() or [type(c).__name__])[0][:500]


@dataclass(eq=False)                 # hashed by identity: a replacement is another slot
class Slot:
    rank: int
    actor: Any                       # the Pool's worker handle (a Ray actor under RayPool)
    warm_ref: Any                    # future of its warm-up
    started: float
    state: str = "starting"          # starting | ready | dead
    restarts: int = 0
    running: list = field(default_factory=list)   # finish futures in submission order
    next_seq: int = 0                                 # the next shard number for this actor
    ready_info: dict | None = None
    last_error: str | None = None
    # canaries (the module docstring): epochs are counted in canaries asked of this actor
    epoch: int = 0                   # the epoch of the shards it is handed now
    good: int = 0                    # epochs before this one passed their canary
    since: int = 0                   # items handed to it since its last canary (or since ready)
    canary_at: float = 0.0           # when it was last asked for one (or became ready)
    checking: bool = False           # a canary of it is in flight
    made: dict = field(default_factory=dict)   # epoch -> ok rows it returned, not yet verified
    pace: Pace | None = None         # its progress clock once ready (`runner.driver.watchdog`)
    node: str | None = None          # the node it was placed on (elastic), or its ready info's
    draining: float | None = None    # its node's drain deadline (epoch s, 0: none) once noticed
    idle_from: float | None = None   # ready without work since (the clock's seconds)
    ready_at: float | None = None    # when it became ready (the clock's seconds)


class Dispatcher:
    """The rules of the module docstring over a `Pool`, for `n_workers` slots; `clock` (seconds:
    start-up timeouts, `Slot.started`) may be a fake one in tests. `run()` once."""

    def __init__(self, pool: Pool, n_workers: int, shards: list[Shard],
                 on_rows: Callable[[list[dict]], None],
                 inflight: int = 2, max_retries: int = 2, max_restarts: int = 3,
                 max_deaths: int = 2, start_timeout_s: float = 900.0,
                 on_ready: Callable[[Slot], None] | None = None,
                 slots: list[Slot] | None = None, on_tick: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, canary_every: int = 0,
                 canary_every_s: float | None = None,
                 on_canary_failed: Callable[[Slot, dict, list[dict], list[str]], None] | None = None,
                 later: list[Shard] = (), takes_later: Callable[[Slot], bool] = lambda s: False,
                 hang_timeout_s: float = 0.0, batch_size: int = 1,
                 on_hung: Callable[[Slot, dict], None] | None = None,
                 cluster: Cluster | None = None, max_workers: int | None = None,
                 gpu_wait_s: float = 600.0, scale_in: bool = True,
                 on_stop: Callable[[Slot, str], None] | None = None,
                 on_lost: Callable[[dict], None] | None = None,
                 wall: Callable[[], float] = time.time):
        self.pool, self.n_workers, self.rows_to = pool, n_workers, on_rows
        # elastic (the module docstring): the room, the bounds, what is said and recorded
        self.cluster, self.max_workers, self.gpu_wait_s = cluster, max_workers, gpu_wait_s
        self.scale_in, self.on_stop, self.on_lost, self.wall = scale_in, on_stop, on_lost, wall
        self.view = None                        # the cluster's last View
        self.next_look = 0.0                    # the clock's time of the next look at it
        self.next_rank = n_workers              # ranks of new elastic workers
        self.retired = 0                        # slots given up for their own deaths
        self.waiting_since: float | None = None  # no worker ready or starting since
        self.next_wait_line = 0.0
        self.losses: list[dict] = []            # every worker lost: cause, charged, rows back
        self.served: dict[int, float] = {}      # rank -> seconds its workers served (restarts)
        self.idle_s = 0.0                       # worker-seconds ready without work
        # charged deaths on a node still alive in the view: a node's death is reported after its
        # workers' (Ray's health checks): seen dead later, they are the node's, not charged
        self.charged_on: dict[str, list[dict]] = {}
        self.loss_of: dict[int, dict] = {}      # death number -> its line of `losses`
        self.owed: list[Slot] = []              # dead slots to replace on the next place (elastic)
        self.suspect: dict[str, float] = {}     # node -> no worker placed there until then
        # shards only some workers should take, once `shards` are handed out (module docstring)
        self.later, self.takes_later = deque(later), takes_later
        self.inflight, self.max_retries, self.max_restarts = inflight, max_retries, max_restarts
        self.max_deaths = max_deaths
        self.canary_every, self.canary_every_s = canary_every, canary_every_s
        self.canary_on = canary_every > 0 or canary_every_s is not None
        self.on_canary_failed = on_canary_failed
        self.canaries = 0                       # canaries that passed
        self.watchdog, self.on_hung = Watchdog(hang_timeout_s, batch_size), on_hung
        self.next_hang_check = 0.0              # the clock's time of the next look (once a second)
        self.start_timeout_s, self.on_ready, self.on_tick = start_timeout_s, on_ready, on_tick
        self.clock = clock
        self.slots = [] if slots is None else slots     # the caller's list, kept current
        self.queue = deque(shards)
        # a split shard's index: past every index given, `later`'s too (else it would be taken
        # for a later shard's: its attempts, its suspicion)
        self.next_index = max((s.index for s in (*shards, *later)), default=-1) + 1
        # a shard's finish future (or a canary's) -> (slot, shard or None for a canary, epoch)
        self.futures: dict[Any, tuple[Slot, Shard | None, int]] = {}
        # Kept as they change, so that a loop iteration costs O(what happened), not O(slots):
        self.warming: dict[Any, Slot] = {}     # warm-up future -> its starting slot
        self.hungry: dict[Slot, None] = {}     # ready slots with room for another shard
        self.attempts: dict[int, int] = {}      # shard index -> raised attempts charged
        self.deaths: dict[str, list[int]] = {}  # row id -> the deaths (numbers) it was in flight at
        self.death_of: dict[int, tuple[int, str]] = {}  # death number -> (its slot's rank, cause)
        self.unresolved: dict[int, set[str]] = {}   # death -> rows in flight at it, fate unknown
        self.charged: dict[int, int] = {}       # rank -> its deaths known not to be a row's
        self.suspects: set[int] = set()         # shard indices that run isolated
        self.streak: dict[str, set] = {}        # cause -> shards failed of it since a success
        self.startup_errors: dict[str, int] = {}   # start-up exceptions seen, by cause
        self.submitted = 0                      # shards handed to workers, retries and splits too

    def run(self) -> list[Slot]:
        """Until every shard is done (its rows to `on_rows`); returns the slots."""
        if self.cluster is None:
            for rank in range(self.n_workers):
                self.slots.append(self._start(rank))
        else:
            self.next_rank = 0
            self._elastic()
        while self.queue or self.futures or self.later and self._later_taken():
            self._check_alive()
            ready = self.pool.wait(list(self.futures) + list(self.warming), timeout=1.0)
            if self.on_tick:                 # about once a second: start-up phases, progress lines
                self.on_tick()
            self._time_out(ready)
            self._check_hung()
            for f in ready:
                if f in self.warming:
                    self.on_warm(self.warming[f])
                elif f in self.futures:      # (not retired meanwhile with its lost worker)
                    self.on_done(f)
            self._elastic()                  # after the losses just read: their nodes known
            # every path that retires a shard or readies a slot marks it hungry: refill those
            for s in sorted(self.hungry, key=lambda s: s.rank) if self.queue or self.later else ():
                self.fill(s)
        for s in list(self.warming.values()):   # replacements nobody needs any more
            self.pool.kill(s.actor)
            s.state = "dead"
        self.warming.clear()
        now = self.clock()
        for s in self.slots:                    # the idle time of those that served to the end
            self._busy(s, now)
        if self.cluster is not None:
            self.cluster.want(0)                # no more demand: the autoscaler may shrink
        return self.slots

    def _start(self, rank: int, restarts: int = 0, node: str | None = None) -> Slot:
        actor, warm = self.pool.start(rank) if node is None else self.pool.start(rank, node)
        slot = Slot(rank=rank, actor=actor, warm_ref=warm, started=self.clock(), restarts=restarts,
                    node=node)
        self.warming[warm] = slot
        return slot

    # -- the elastic pool (the module docstring) ---------------------------------------------------

    def _elastic(self) -> None:
        """Once a second: node losses and drains, the request for room, new workers, the tail."""
        now = self.clock()
        if self.cluster is None or now < self.next_look:
            return
        self.next_look = now + 1.0
        v = self.view = self.cluster.poll()
        for node in [n for n in self.charged_on if n in v.dead]:
            self._uncharge(self.charged_on.pop(node))
        for s in [s for s in self.slots if s.state != "dead"]:
            node = self._node(s)
            if node in v.dead:
                self.lose(s, f"its node {node} died (Ray reports the node dead)", node_lost=True)
            elif node in v.draining:
                self._drain(s, v.draining[node])
        live = [s for s in self.slots if s.state != "dead"]
        target = self._target(live)
        self.cluster.want(target)
        now = self.clock()
        places = [p for p in v.places if self.suspect.get(p, 0) <= now]
        for s in live:                  # placed, maybe not yet seen in the view's free GPUs
            if s.state == "starting" and s.node in places:
                places.remove(s.node)
        while len(live) < target and places:
            if self.owed:                        # a replacement after a death of its own
                dead = self.owed.pop(0)
                slot = self._start(dead.rank, dead.restarts + 1, node=places.pop(0))
                self.slots[self.slots.index(dead)] = slot
            else:
                slot = self._start(self.next_rank, node=places.pop(0))
                self.next_rank += 1
                self.slots.append(slot)
            live.append(slot)
        if self.scale_in and not self.queue and not self.later:
            for s in [s for s in live if s.state == "ready" and not s.running and s.idle_from is
                      not None and now - s.idle_from >= IDLE_STOP_S]:
                self._stop(s, "idle: nothing left to hand it")

    def _uncharge(self, losses: list[dict]) -> None:
        """Deaths on a node that turned out dead: the node's, not their slots' (uncharged) nor
        their rows' (unpinned: no row fails for a node's death)."""
        for loss in {id(x): x for x in losses}.values():
            rank, death = loss["rank"], loss["death"]
            if loss["charged"]:
                self.charged[rank] = max(0, self.charged.get(rank, 0) - 1)
            self.unresolved.pop(death, None)
            for seen in self.deaths.values():
                if death in seen:
                    seen.remove(death)
            loss.update(kind="node lost", charged=False)
            if loss.pop("retired", False):
                self.retired -= 1
            log.info("worker %d: its death was its node's (the node is dead now): not charged",
                     rank)

    def _target(self, live: list[Slot]) -> int:
        """The workers the work left can keep busy, within the pool's bounds (0: no work)."""
        if not (self.queue or self.futures or self.later):
            return 0
        busy = sum(1 for s in live if s.running or s.state == "starting")
        useful = busy + len(self.queue) + len(self.later)
        cap = self.max_workers
        if cap is None:       # what the autoscaler can grow to; not known: twice what is there
            v = self.view
            cap = v.max_gpus if v is not None and v.max_gpus else max(
                self.n_workers, 2 * (v.gpus if v is not None else 0) + 1)
        cap -= self.retired
        return max(0, min(cap, max(self.n_workers - self.retired, useful)))

    def _node(self, slot: Slot) -> str | None:
        return slot.node or (slot.ready_info or {}).get("node_id")

    def _drain(self, slot: Slot, deadline: float) -> None:
        """`slot`'s node is draining: no new shards; stopped when it holds nothing, or
        `DRAIN_MARGIN_S` before the deadline with its shards requeued."""
        left = deadline - self.wall() if deadline else None
        if slot.draining is None:
            slot.draining = deadline
            self.hungry.pop(slot, None)
            log.warning("worker %d: its node %s is draining (%s): it takes no new shards",
                        slot.rank, self._node(slot),
                        f"deadline in {left:.0f} s" if left is not None else "no deadline")
        if slot.state == "starting" or left is not None and left <= DRAIN_MARGIN_S:
            self.lose(slot, f"its node {self._node(slot)} was draining (preemption notice): "
                            f"stopped before the deadline, its shards requeued", node_lost=True)
        elif not slot.running:
            self._stop(slot, "its node is draining")

    def _stop(self, slot: Slot, why: str) -> None:
        """Stop a worker the pool no longer needs (a drained node, the tail): not a loss."""
        if self.on_stop:
            self.on_stop(slot, why)
        log.info("worker %d: stopped (%s)", slot.rank, why)
        self._busy(slot, self.clock())
        self._served(slot)
        slot.state = "dead"
        slot.last_error = f"stopped: {why}"
        self.hungry.pop(slot, None)
        self.pool.kill(slot.actor)

    def _busy(self, slot: Slot, now: float) -> None:
        """`slot` has work again (or is gone): its idle time so far counted."""
        if slot.idle_from is not None:
            self.idle_s += max(0.0, now - slot.idle_from)
            slot.idle_from = None

    def _served(self, slot: Slot) -> None:
        if slot.ready_at is not None:
            self.served[slot.rank] = self.served.get(slot.rank, 0.0) + self.clock() - slot.ready_at
            slot.ready_at = None

    def _budget(self, rank: int) -> float:
        """Deaths of its own a slot may be replaced after: per hour it served, at least once."""
        return self.max_restarts * max(1.0, self.served.get(rank, 0.0) / 3600.0)

    def _waiting(self) -> bool:
        """Elastic, work left, no worker ready or starting: waiting for room, `gpu_wait_s` at most
        (then `NoRoom`); a line every `WAIT_LINE_S`. False once a worker is starting or ready."""
        if any(s.state != "dead" for s in self.slots):
            self.waiting_since = None
            return False
        target = self._target([])
        if self.cluster is None or target == 0:
            return False
        now = self.clock()
        if self.waiting_since is None:
            self.waiting_since, self.next_wait_line = now, now
        waited = now - self.waiting_since
        room = self.view.text() if self.view is not None else "not read yet"
        if waited > self.gpu_wait_s:
            raise NoRoom(f"no worker could start in {self.gpu_wait_s:.0f} s (ray.gpu_wait_s): "
                         f"waited for {target} GPU{'s' * (target != 1)} of a type that holds "
                         f"the model; the cluster has {room}. Fix: add GPU nodes (or a GPU node "
                         f"type to the autoscaler: docs/cloud.md), raise ray.gpu_wait_s, or run "
                         f"on CPU (model.device=cpu). Finished outputs are kept: rerun the same "
                         f"command to resume.")
        if now >= self.next_wait_line:
            self.next_wait_line = now + WAIT_LINE_S
            log.info("waiting for GPUs: 0 of %d, %.0f s of ray.gpu_wait_s=%.0f; cluster has %s",
                     target, waited, self.gpu_wait_s, room)
        return True

    def _later_taken(self) -> bool:
        """A slot that takes the `later` shards is ready, or one may be (starting): else they are
        left (O(slots), only once every other shard is done)."""
        return any(s.state == "starting" or s.state == "ready" and self.takes_later(s)
                   for s in self.slots)

    def _next_queue(self, slot: Slot) -> deque:
        """The queue `slot` takes from: the shards, then the `later` ones if it takes those."""
        return self.queue or (self.later if self.takes_later(slot) else self.queue)

    def _check_alive(self) -> None:
        """No slot ready or starting: stop rather than wait for nothing (elastic: wait for room,
        `gpu_wait_s` at most)."""
        if any(s.state != "dead" for s in self.slots) or self._waiting():
            return
        errors = "; ".join(f"worker {s.rank}: {(s.last_error or '?').splitlines()[0][:300]}"
                           for s in self.slots)
        raise DispatchError(f"every worker is gone and none could be restarted ({errors}); "
                            f"{plural(len(self.queue), 'shard')} not run. Finished outputs are kept: "
                            f"rerun the same command to resume.")

    def _time_out(self, ready: list) -> None:
        """Give up slots not ready in time: a restart waiting for resources that left with a lost
        node would wait forever in Ray."""
        now = self.clock()
        for s in list(self.warming.values()):
            if now - s.started > self.start_timeout_s and s.warm_ref not in ready:
                self.lose(s, f"not ready after {self.start_timeout_s:.0f} s "
                             f"(ray.worker_start_timeout_s): the cluster may lack the resources "
                             f"for it")

    def fill(self, slot: Slot) -> None:
        """Up to `inflight` shards (and canaries) on a ready slot; a suspect runs alone."""
        while slot.state == "ready" and slot.draining is None and len(slot.running) < self.inflight:
            if self._canary_due(slot):
                self._ask_canary(slot)
                continue
            queue = self._next_queue(slot)
            if not queue or slot.running and (queue[0].index in self.suspects or any(
                    self._suspect(f) for f in slot.running)):
                break
            shard = queue.popleft()
            if not slot.running:             # its idle time is no silence: the clock starts now
                self.watchdog.begin(slot.pace, self.clock())
                self._busy(slot, self.clock())
            _, finished = self.pool.submit(slot.actor, slot.next_seq, shard.items)
            slot.next_seq += 1
            slot.since += len(shard.items)
            self.submitted += 1
            slot.running.append(finished)
            self.futures[finished] = (slot, shard, slot.epoch)
        if slot.state == "ready" and slot.draining is None and len(slot.running) < self.inflight:
            self.hungry[slot] = None
        else:
            self.hungry.pop(slot, None)

    def on_warm(self, slot: Slot) -> None:
        """A warm-up ended: the slot serves, or it is lost."""
        if slot.state != "starting":
            return
        self.warming.pop(slot.warm_ref, None)
        try:
            slot.ready_info = self.pool.result(slot.warm_ref)
        except (TaskError, WorkerLost) as e:
            error = f"start-up failed: {e}"
            if isinstance(e, TaskError) and str(e).startswith("GpuTooSmall:") and self.cluster:
                # the GPU type cannot hold the model: no worker there again, no death of its own
                self.cluster.exclude(self._node(slot), str(e).split(": ", 1)[-1][:300])
                self.lose(slot, error, node_lost=True, kind="GPU too small")
                return
            if isinstance(e, TaskError):
                # our start-up code raised: deterministic, so one retry (its cause shown), never a
                # third identical attempt. A lost worker restarts as usual.
                self.startup_errors[error] = self.startup_errors.get(error, 0) + 1
                if self.startup_errors[error] > 1:
                    log.error("worker %d: %s (the same error as before: not retried)",
                              slot.rank, error)
            self.lose(slot, error, restart=self.startup_errors.get(error, 0) <= 1,
                      node_lost=self._node_gone(slot, e))
            return
        slot.state, slot.canary_at = "ready", self.clock()
        slot.ready_at = slot.idle_from = self.clock()
        slot.pace = Pace(since=self.clock())
        if self.on_ready:
            self.on_ready(slot)
        self.fill(slot)

    def on_done(self, finished) -> None:
        """A shard's rows are in, or it raised (retried), or its worker is lost."""
        slot, shard, epoch = self.futures[finished]
        if shard is None:
            return self._on_canary(finished)
        try:
            rows = self.pool.result(finished)
        except WorkerLost as e:
            self.lose(slot, str(e), node_lost=self._node_gone(slot, e))
            return
        except TaskError as e:
            self._retire(finished, measure=False)     # progress, but not its pace: it raised
            self._count_fault(shard, str(e))
            self.retry(shard, str(e))
            return
        # rows failed without a model call (a missing image) took no model time: counted as
        # work done they made the pace look fast and a legitimate long call hung (issue 75)
        made = {r["id"] for r in rows if r["status"] == "ok"}
        self._retire(finished, made=[it for it in shard.items if it.id in made])
        self._input_faults(rows)
        self.streak.clear()
        if self.canary_on and epoch >= slot.good:     # (a canary after it passed: verified)
            slot.made.setdefault(epoch, []).extend(r for r in rows if r["status"] == "ok")
        self._rows(rows)

    def _input_faults(self, rows: list[dict]) -> None:
        """Rows whose input's store did not answer the worker (`images.INPUT_FAULT`): the store's
        fault, not theirs. The shard's other rows are recorded, those stay pending (not
        recorded: a rerun runs them), and the job stops: `PersistentFault` naming the store."""
        faults = [r for r in rows if (r.get("error") or "").startswith(INPUT_FAULT)]
        if not faults:
            return
        self._rows([r for r in rows if not (r.get("error") or "").startswith(INPUT_FAULT)])
        cause = faults[0]["error"][len(INPUT_FAULT):].splitlines()[0]
        raise PersistentFault(
            f"{cause}: a worker could not read its input there (rows {_few_ids(faults)}); "
            f"rows not generated stay pending. Finished outputs are kept: once the store "
            f"answers, rerun the same command to resume.")

    def _retire(self, finished, measure: bool = True, made: list[Item] | None = None) -> None:
        """A shard (or canary) of `slot` came back: off its running list, and progress on its
        clock (`measure`: a shard's time taken into its pace, as the work of `made`, the items
        it made an output of: None, all of the shard's; none, not measured)."""
        slot, shard, _ = self.futures.pop(finished)
        slot.running.remove(finished)
        if not slot.running and slot.idle_from is None:
            slot.idle_from = self.clock()
        if slot.pace is not None:
            made = shard.items if made is None and shard is not None else made
            work = units(made) if measure and made else None
            self.watchdog.done(slot.pace, work, self.clock())
        if slot.state == "ready":
            self.hungry[slot] = None

    def _check_hung(self) -> None:
        """Once a second: a ready worker silent past its bound (`runner.driver.watchdog`) is hung. O(slots)
        a second, not per loop iteration."""
        now = self.clock()
        if not self.watchdog.on or now < self.next_hang_check:
            return
        self.next_hang_check = now + 1.0
        for slot in [s for s in self.slots if s.state == "ready" and s.running]:
            head = self.futures[slot.running[0]][1]      # what it works on: the oldest it holds
            pace = slot.pace
            if head is not None and head is not pace.head:   # (a canary: the last shard's calls)
                pace.call, pace.head = self.watchdog.call_units(head.items), head
            bound = self.watchdog.bound(pace, pace.call)
            if now - pace.since <= bound:
                continue
            if pace.asked is None:                       # silent in a long shard: ask it first
                pace.asked, pace.asked_at = self.pool.progress(slot.actor), now
            elif self._answered(slot, now) and now - pace.since <= bound:
                continue                                 # a call finished since: not hung
            elif pace.asked is None or now - pace.asked_at > ASK_S:
                self._hung(slot, head, now - pace.since, bound, pace.call)

    def _answered(self, slot: Slot, now: float) -> bool:
        """Whether `slot`'s worker has answered the watchdog's question (`Pool.progress`: seconds
        since its last call finished); its answer moves its progress clock. A worker lost
        meanwhile is noticed through its shards."""
        pace = slot.pace
        if not self.pool.wait([pace.asked], timeout=0):
            return False
        try:
            pace.since = max(pace.since, now - float(self.pool.result(pace.asked)))
        except (TaskError, WorkerLost):
            pass
        pace.asked = None
        return True

    def _hung(self, slot: Slot, head: Shard | None, silent: float, bound: float,
              call: float) -> None:
        """Stop a hung worker (`Pool.kill`: its process killed, whatever it is stuck in) and
        replace it. Only the shard it was on is blamed, as for a death (`run.max_row_deaths`); the
        shards queued behind it go back as they were. The error's first line is the cause rows
        share (the bound, no figure of this worker); the next names the worker, host and GPU."""
        info = slot.ready_info or {}
        dev = info.get("device") or {"host": info.get("host")}
        ids = [it.id for it in head.items] if head is not None else []
        what = "generating it" if head is not None else "running its canary"
        error = (f"no progress for {bound:.0f} s while {what}\nworker {slot.rank} "
                 f"({canary.where(dev)}) was stopped after {silent:.0f} s without progress; the "
                 f"bound: {self.watchdog.explain(slot.pace, call)}")
        log.error("worker %d (%s) is hung: no progress for %.0f s (bound %.0f s) on %s; stopping "
                  "and replacing it", slot.rank, canary.where(dev), silent, bound,
                  ", ".join(ids[:5]) + (" ..." if len(ids) > 5 else "") if ids else "its canary")
        if self.on_hung:
            self.on_hung(slot, dict(device=dev, silent_s=round(silent, 1), bound_s=round(bound, 1),
                                    ids=ids[:10], rows=len(ids)))
        self.lose(slot, error, blame=head is not None, pin=head)

    def _count_fault(self, shard: Shard, error: str) -> None:
        """PersistentFault once `FAULT_ROWS` distinct shards failed of one cause (`fault_cause`)
        since a success; `FAULT_ROWS_STALLED` for a store that did not answer."""
        failed = self.streak.setdefault(fault_cause(shard, error), set())
        failed.add(shard.index)
        if len(failed) >= (FAULT_ROWS_STALLED if error.startswith(f"{StoreTimeout.__name__}:")
                           else FAULT_ROWS):
            raise PersistentFault(
                f"the same error on {len(failed)} shards in a row, nothing written since: "
                f"{error.splitlines()[0]}. Finished outputs are kept: fix the cause (disk space, "
                f"storage access) and rerun the same command to resume.")

    def retry(self, shard: Shard, error: str) -> None:
        """`shard` raised: one more failed attempt, after which a single row over `max_retries` is
        recorded failed; else requeued at the front as a suspect (a shard of several rows split)."""
        n = self.attempts.get(shard.index, 0) + 1
        items = shard.items
        if len(items) > 1:
            log.warning("shard %s[%d:%d] failed (%s); retrying its %d rows one by one",
                        shard.file, shard.start, shard.stop, error.splitlines()[0][:200], len(items))
            self._requeue_alone(items, n)
        elif n > self.max_retries:
            log.error("giving up on %s after %d attempts: %s", [i.id for i in items], n,
                      error.splitlines()[0][:300])
            self._rows([failed_row(it, f"failed {n} times: {error}") for it in items])
        elif items:
            self.attempts[shard.index] = n
            self.suspects.add(shard.index)
            self.queue.appendleft(shard)

    def _requeue_alone(self, items, attempts: int) -> None:
        """`items` back at the front of the queue, in order, each a shard of its own that runs
        isolated, with `attempts` raised attempts charged."""
        singles = [Shard(self.next_index + k, (it,)) for k, it in enumerate(items)]
        self.next_index += len(singles)
        for s in singles:
            self.attempts[s.index] = attempts
            self.suspects.add(s.index)
        self.queue.extendleft(reversed(singles))

    def _node_gone(self, slot: Slot, e: Exception) -> bool:
        """A lost worker went with its node: `NodeLost`, or its node dead or draining in the
        cluster's last view (the death may be reported before the view shows it: looked again)."""
        if isinstance(e, NodeLost):
            return True
        if self.cluster is None or self._node(slot) is None:
            return False
        v = self.view = self.cluster.poll()
        return self._node(slot) in v.dead or self._node(slot) in v.draining

    def lose(self, slot: Slot, error: str, restart: bool = True, blame: bool = True,
             pin: Shard | None = None, node_lost: bool = False, kind: str | None = None) -> None:
        """The slot's worker is gone: keep what it finished, count the death for the rows it held
        (`_died_with`; not `blame`: they go back as they were; `pin`: only that shard's rows,
        the others go back as they were), restart it if its budget of deaths not pinned on a row
        allows. `node_lost`: gone with its node (module docstring): nothing blamed or charged,
        and an elastic pool starts a new worker where there is room instead."""
        if slot.state == "dead":
            return
        if node_lost:
            blame, restart = False, self.cluster is None
        self._busy(slot, self.clock())
        self._served(slot)
        slot.state, slot.last_error = "dead", error
        self.warming.pop(slot.warm_ref, None)
        self.hungry.pop(slot, None)
        held = []
        for f in slot.running:
            _, shard, _ = self.futures.pop(f)
            if shard is None:                # a canary: no row of the job
                continue
            rows = self._value(f)
            if rows is not None:
                self._rows(rows)             # finished before the worker died
            else:
                held.append(shard)           # generating, or its files being written
        slot.running = []
        self.pool.kill(slot.actor)
        death = len(self.death_of) + 1
        self.death_of[death] = (slot.rank, error)
        ids = [it.id for s in held for it in s.items]
        blamed = [s for s in held if blame and (pin is None or s is pin)]
        self.queue.extendleft(reversed([s for s in held if s not in blamed]))
        pinned = [it.id for s in blamed for it in s.items]
        if node_lost:                        # the node's doing: no one's budget
            pass
        elif pinned:                         # pinned on them until each is seen to be innocent
            self.unresolved[death] = set(pinned)
            self._died_with(blamed, death)
        else:
            self._charge(death)
        charged = self.charged.get(slot.rank, 0)
        loss = self._record_loss(slot, error, kind or ("node lost" if node_lost else "worker's own"),
                                 len(ids), not node_lost and not pinned)
        loss["death"] = death
        self.loss_of[death] = loss
        if self.cluster is not None and loss["node"] and not node_lost:
            # charged, or pinned on its rows: either may turn out to be the node's (`_uncharge`)
            self.suspect[loss["node"]] = self.clock() + SUSPECT_S
            self.charged_on.setdefault(loss["node"], []).append(loss)
        what = "; ".join(line[:200] for line in error.splitlines()[:2]) + (
            f"; in flight: {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}" if ids else "")
        budget = self._budget(slot.rank)
        if restart and charged <= budget and (self.queue or self.futures or self.later):
            log.warning("worker %d lost (%s); starting a replacement (deaths of its own: %d of "
                        "%g: ray.max_worker_restarts=%d per hour served)", slot.rank, what,
                        charged, budget, self.max_restarts)
            if self.cluster is None:
                self.slots[self.slots.index(slot)] = self._start(slot.rank, slot.restarts + 1)
            else:                                # on the next place that fits (`_elastic`)
                self.owed.append(slot)
        elif node_lost:
            log.warning("worker %d lost with its node (%s): not charged%s", slot.rank, what,
                        "; a new worker starts where there is room" if self.cluster else "")
        else:
            if self.queue or self.futures or self.later:
                self.retired += 1            # its budget used (or a start-up that fails alike)
                loss["retired"] = True
            log.warning("worker %d lost (%s); not restarted", slot.rank, what)

    def _record_loss(self, slot: Slot, error: str, kind: str, rows: int, charged: bool) -> dict:
        """One line of `losses` (and `on_lost`): who, where, why, what went back, if charged."""
        info = slot.ready_info or {}
        dev = info.get("device") or {}
        loss = dict(rank=slot.rank, node=self._node(slot), gpu=dev.get("gpu") or dev.get("name"),
                    kind=kind, cause=(error.splitlines() or ["?"])[0][:300], rows_back=rows,
                    charged=charged, at=round(self.clock(), 1))
        self.losses.append(loss)
        if self.on_lost:
            self.on_lost(loss)
        return loss

    def _died_with(self, shards: list[Shard], death: int) -> None:
        """Every row of `shards` was in flight at `death`. A row at `max_deaths` is recorded failed
        and each death it was in flight at is pinned on it (no longer charged to its slot); the
        others go back to the front of the queue, alone, so that their next death is theirs."""
        back, failed = [], []
        for shard in shards:
            for it in shard.items:
                seen = self.deaths.setdefault(it.id, [])
                seen.append(death)
                (failed if len(seen) >= self.max_deaths else back).append((it, shard.index))
        for it, _ in failed:                 # its deaths are its own: none counts as a restart
            for d in self.deaths[it.id]:
                self.unresolved.pop(d, None)
        if failed:
            rows = [failed_row(it, self._death_message(it)) for it, _ in failed]
            for r in rows:
                log.error("giving up on row %s: %s", r["id"], r["error"].replace("\n", "; "))
            self._rows(rows)
        for it, index in reversed(back):
            self._requeue_alone([it], self.attempts.get(index, 0))

    def _rows(self, rows: list[dict]) -> None:
        """Rows to the caller. A row that was in flight at deaths and came back (ok, or failed
        of its own error) did not cause them: a death none of whose rows caused it counts
        against its slot's restarts."""
        for r in rows:
            for d in self.deaths.get(r["id"], ()):
                left = self.unresolved.get(d)
                if left is not None:
                    left.discard(r["id"])
                    if not left:
                        del self.unresolved[d]
                        self._charge(d)
        self.rows_to(rows)

    def _charge(self, death: int) -> None:
        rank = self.death_of[death][0]
        self.charged[rank] = self.charged.get(rank, 0) + 1
        loss = self.loss_of.get(death)
        if loss is not None:                 # a death first pinned on rows, found to be its own
            loss["charged"] = True
            if self.cluster is not None and loss["node"]:
                self.charged_on.setdefault(loss["node"], []).append(loss)

    def _death_message(self, it: Item) -> str:
        """A row failed for its deaths: the cause first (its first line is what the summary
        groups by: no id, no input in it), then the row and its input."""
        deaths = self.deaths[it.id]
        errors = [self.death_of[d][1].splitlines() or ["?"] for d in deaths]
        last = errors[-1]
        verb = "hung" if last[0].startswith("no progress") else "killed"
        text = (f"{verb} its worker {plural(len(deaths), 'time')} (run.max_row_deaths={self.max_deaths}): "
                f"{last[0]}\nrow {it.id!r} ({it.source}): prompt {_short(it.prompt)!r}")
        if it.image is not None:
            text += f", image {it.image!r}"
        earlier = list(dict.fromkeys(e[0] for e in errors[:-1] if e[0] != last[0]))
        return text + "".join(f"\n{line}" for line in last[1:]) + "".join(
            f"\nan earlier death: {e}" for e in earlier)

    # -- canaries (the module docstring) --------------------------------------------------------

    def _suspect(self, f) -> bool:
        shard = self.futures[f][1]
        return shard is not None and shard.index in self.suspects

    def _canary_due(self, slot: Slot) -> bool:
        """A ready slot with work to do was handed `canary_every` items, or has had
        `canary_every_s` seconds, since its last canary (or since ready)."""
        if not self.canary_on or slot.checking or not slot.since or not self._next_queue(slot):
            return False
        return 0 < self.canary_every <= slot.since or (
            self.canary_every_s is not None
            and self.clock() - slot.canary_at >= self.canary_every_s)

    def _ask_canary(self, slot: Slot) -> None:
        future = self.pool.canary(slot.actor, slot.next_seq)
        slot.next_seq += 1
        slot.running.append(future)
        self.futures[future] = (slot, None, slot.epoch)      # it closes the epoch of its shards
        slot.epoch += 1
        slot.since, slot.canary_at, slot.checking = 0, self.clock(), True

    def _on_canary(self, future) -> None:
        """A canary's verdict: the epochs up to its own verified, or the worker stopped."""
        slot, _, epoch = self.futures[future]
        slot.checking = False
        try:
            verdict = self.pool.result(future)
        except WorkerLost as e:
            self.lose(slot, str(e), node_lost=self._node_gone(slot, e))
            return
        except TaskError as e:               # it could not run: nothing is known either way
            self._retire(future)
            log.warning("worker %d: its canary raised (%s); its outputs since its last good canary "
                        "stay unverified", slot.rank, str(e).splitlines()[0][:200])
            return
        self._retire(future)
        if verdict.get("ok"):
            self.canaries += 1
            slot.good = epoch + 1
            for e in [e for e in slot.made if e <= epoch]:
                del slot.made[e]
            return
        self._canary_failed(slot, verdict)

    def _canary_failed(self, slot: Slot, verdict: dict) -> None:
        """Every ok row the worker made since its last good canary is suspect: those it returned
        (recorded again by `on_canary_failed`) and those done by now; the rest of its shards go
        back to the queue as they were; the worker is stopped (a restart reloads the weights)."""
        earlier = [r for e in sorted(slot.made) for r in slot.made[e]]
        dev = verdict.get("device") or {}
        why = canary.describe(verdict)
        error = (f"suspect: worker {slot.rank} ({canary.where(dev)}) failed its canary ({why}) "
                 f"after making this output, since its last good canary; a rerun regenerates it")
        done = []
        for f in [f for f in slot.running if self.futures[f][1] is not None]:
            epoch = self.futures[f][2]
            rows = self._value(f)
            if rows is not None:       # done by now: suspect, unless a canary after it passed
                self._retire(f)
                done += [dict(r, status="suspect", error=error)
                         if r["status"] == "ok" and epoch >= slot.good else r for r in rows]
        slot.made.clear()
        marked = [dict(r, status="suspect", error=error) for r in earlier]
        if self.on_canary_failed:
            self.on_canary_failed(slot, verdict, marked, [r["id"] for r in marked + done
                                                          if r["status"] == "suspect"])
        self._rows(done)
        self.lose(slot, f"its canary failed ({why}) on {canary.where(dev)}", blame=False)

    def _value(self, future) -> Any:
        """The value of a finished future, or None (still running, or failed)."""
        if not self.pool.wait([future], timeout=0):
            return None
        try:
            return self.pool.result(future)
        except (TaskError, WorkerLost):
            return None

