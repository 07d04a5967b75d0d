"""Hands shards to workers and survives their failures.

Contract of `dispatch(...)`:
- Each worker slot holds at most `inflight` shards; when one finishes, the slot takes the next from
  the queue (dynamic, not a static split). A shard travels with its validated items as two calls
  on the (threaded) actor: `start_shard(seq, items)`, done when its GPU work is, and
  `finish_shard(seq)`, its rows once written; `seq` numbers the slot's shards so the worker runs
  them in order while it writes one shard and generates the next. Rows go to `on_rows` as each
  shard finishes.
- A worker that dies (process killed, node lost, CUDA error: any Ray error that is not an exception
  raised inside the worker's methods) loses only its unfinished shards: they go back to the front
  of the queue. The slot gets a new actor (at most `max_restarts` times per slot), which warms up
  like the first.
- Which shard killed a worker: the one whose GPU work had not finished (`start_shard` had not
  returned). If there was exactly one, or a shard raised, it is charged one attempt. If several
  were unfinished (the last reply may not have reached the driver), the death is ambiguous: none is
  charged. Either way the unfinished shards come back as suspects: split into single rows and run
  isolated (alone on their worker), so the next death is attributed exactly. Shards that were only
  being written are requeued as they were. A failing
  shard of several rows is split into single rows, so one poison prompt cannot take its neighbours
  down; a row that fails more than `max_retries` times is recorded as failed and the job goes on.
- A slot whose actor has not become ready within `start_timeout_s` (a restart waiting for resources
  that left with a lost node waits forever in Ray) is given up. When no slot is ready or starting,
  the job stops with `DispatchError` instead of hanging.
- `slots` (optional) is a list the caller owns, filled with the live slots as they change: after an
  interrupt (an exception out of dispatch) the caller still knows which workers served.
- `on_ready(slot)` runs when a slot's actor is ready, `on_tick()` at least once a second.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .prompts import Item, Shard
from .results import failed_row

log = logging.getLogger("runner")


class DispatchError(RuntimeError):
    pass


class PersistentFault(DispatchError):
    """The same error on `FAULT_ROWS` different shards in a row, none finished in between (a full
    disk, an unreachable store): retrying every row would only burn GPU time on outputs that
    cannot be written."""


FAULT_ROWS = 4   # distinct failing shards (or rows) with one cause and no success in between


def _cause(e: BaseException) -> str:
    """`Type: message` of the exception raised in the worker (Ray's wrapper holds it as `cause`),
    first line, for logs and the summary; Ray's own error text for what has no cause (a lost
    actor or node)."""
    c = getattr(e, "cause", None)
    c = c if isinstance(c, BaseException) else e
    text = f"{type(c).__name__}: {c}".strip()
    return (text.splitlines() or [type(c).__name__])[0][:500]


@dataclass
class Slot:
    rank: int
    actor: Any
    warm_ref: Any
    started: float
    state: str = "starting"          # starting | ready | dead
    restarts: int = 0
    running: list = field(default_factory=list)   # finish refs in submission order
    next_seq: int = 0                                 # the next shard number for this actor
    ready_info: dict | None = None
    last_error: str | None = None


def _is_task_error(e: Exception) -> bool:
    """An exception raised by our code inside the actor (the actor lives on)."""
    import ray
    return isinstance(e, ray.exceptions.RayTaskError) and not isinstance(e, ray.exceptions.RayActorError)


def _value(ref):
    """The result of a finished task, or None (still running, or failed)."""
    import ray
    if not ray.wait([ref], timeout=0)[0]:
        return None
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None


def dispatch(make_actor: Callable[[int], Any], n_workers: int, shards: list[Shard],
             items_of: Callable[[Shard], list[Item]], on_rows: Callable[[list[dict]], None],
             inflight: int = 2, max_retries: int = 2, max_restarts: int = 3,
             start_timeout_s: float = 900.0, on_ready: Callable[[Slot], None] | None = None,
             slots: list[Slot] | None = None,
             on_tick: Callable[[], None] | None = None) -> list[Slot]:
    import ray

    queue = deque(shards)
    attempts: dict[int, int] = {}
    next_index = max((s.index for s in shards), default=-1) + 1
    refs: dict[Any, tuple[Slot, Shard, Any]] = {}   # finish ref -> (slot, shard, start ref)

    def start(slot: Slot | None, rank: int) -> Slot:
        actor = make_actor(rank)
        new = Slot(rank=rank, actor=actor, warm_ref=actor.warmup.remote(), started=time.monotonic())
        if slot is not None:
            new.restarts = slot.restarts + 1
        return new

    slots = [] if slots is None else slots
    for k in range(n_workers):
        slots.append(start(None, k))

    suspects: set[int] = set()      # shard indices that run isolated (see the module docstring)
    streak: dict[str, set] = {}     # cause -> shards that failed of it since the last success
    startup_errors: dict[str, int] = {}   # start-up exceptions seen, by cause

    def fill(slot: Slot):
        while slot.state == "ready" and queue and len(slot.running) < inflight:
            if slot.running and (queue[0].index in suspects
                                 or any(refs[r][1].index in suspects for r in slot.running)):
                break
            shard = queue.popleft()
            started = slot.actor.start_shard.remote(slot.next_seq, items_of(shard))
            ref = slot.actor.finish_shard.remote(slot.next_seq)
            slot.next_seq += 1
            slot.running.append(ref)
            refs[ref] = (slot, shard, started)

    def retry(shard: Shard, error: str, count: bool = True):
        """Requeue `shard` at the front as a suspect. `count`: one more failed attempt, after which a
        single row over `max_retries` is recorded failed. A shard of several rows is split."""
        nonlocal next_index
        n = attempts.get(shard.index, 0) + int(count)
        items = items_of(shard)
        if len(items) > 1:
            log.warning("shard %s[%d:%d] failed (%s); retrying its %d rows one by one",
                        shard.file, shard.start, shard.stop, error.splitlines()[0][:200], len(items))
            singles = [Shard(next_index + k, shard.file, it.row, it.row + 1)
                       for k, it in enumerate(items)]
            next_index += len(singles)
            for s in singles:
                attempts[s.index] = n
                suspects.add(s.index)
            queue.extendleft(reversed(singles))
        elif n > max_retries:
            log.error("giving up on %s after %d attempts: %s", [i.id for i in items], n,
                      error.splitlines()[0][:300])
            on_rows([failed_row(it, f"failed {n} times: {error}") for it in items])
        elif items:
            attempts[shard.index] = n
            suspects.add(shard.index)
            queue.appendleft(shard)

    def lose(slot: Slot, error: str, restart: bool = True):
        """The slot's actor is gone: keep what it finished, requeue the rest, restart it if allowed.
        Which shard it died of: see the module docstring."""
        if slot.state == "dead":
            return
        slot.state, slot.last_error = "dead", error
        unfinished, written = [], []
        for ref in slot.running:
            _, shard, started = refs.pop(ref)
            rows = _value(ref)
            if rows is not None:
                on_rows(rows)                # finished before the worker died
            elif _value(started) is None:
                unfinished.append(shard)     # its GPU work had not finished
            else:
                written.append(shard)        # only its files were being written
        queue.extendleft(reversed(written))
        for shard in reversed(unfinished):
            retry(shard, error, count=len(unfinished) == 1)
        slot.running = []
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:
            pass
        if restart and slot.restarts < max_restarts and (queue or refs):
            log.warning("worker %d lost (%s); starting a replacement (%d/%d)", slot.rank,
                        error.splitlines()[0][:200], slot.restarts + 1, max_restarts)
            slots[slots.index(slot)] = start(slot, slot.rank)
        else:
            log.warning("worker %d lost (%s); not restarted", slot.rank, error.splitlines()[0][:200])

    while queue or refs:
        waiting = {s.warm_ref: s for s in slots if s.state == "starting"}
        live = [s for s in slots if s.state != "dead"]
        if not live:
            errors = "; ".join(f"worker {s.rank}: {(s.last_error or '?').splitlines()[0][:300]}"
                               for s in slots)
            raise DispatchError(f"every worker is gone and none could be restarted ({errors}); "
                                f"{len(queue)} shards were not run. Finished outputs are kept: "
                                f"rerun the same command to resume.")
        ready, _ = ray.wait(list(refs) + list(waiting), num_returns=1, timeout=1.0)
        if on_tick:                          # about once a second: start-up phases, progress lines
            on_tick()
        now = time.monotonic()
        for s in [s for s in slots if s.state == "starting" and now - s.started > start_timeout_s]:
            if s.warm_ref not in ready:
                lose(s, f"not ready after {start_timeout_s:.0f} s (ray.worker_start_timeout_s): "
                        f"the cluster may lack the resources for it")
        for ref in ready:
            if ref in waiting:
                slot = waiting[ref]
                if slot.state != "starting":
                    continue
                try:
                    slot.ready_info = ray.get(ref)
                except ray.exceptions.RayError as e:
                    # an exception of our start-up code is deterministic: one retry (with its
                    # cause shown), never a third identical attempt; a lost actor restarts as usual
                    error = f"start-up failed: {_cause(e)}"
                    if _is_task_error(e):
                        startup_errors[error] = startup_errors.get(error, 0) + 1
                        if startup_errors[error] > 1:
                            log.error("worker %d: %s (the same error as before: not retried)",
                                      slot.rank, error)
                    lose(slot, error, restart=startup_errors.get(error, 0) <= 1)
                    continue
                slot.state = "ready"
                if on_ready:
                    on_ready(slot)
                fill(slot)
            elif ref in refs:
                slot, shard, _ = refs[ref]
                try:
                    rows = ray.get(ref)
                except ray.exceptions.RayError as e:
                    if _is_task_error(e):
                        refs.pop(ref)
                        slot.running.remove(ref)
                        cause = _cause(e)
                        failed = streak.setdefault(cause, set())
                        failed.add(shard.index)
                        if len(failed) >= FAULT_ROWS:
                            raise PersistentFault(
                                f"the same error on {len(failed)} shards in a row, nothing written "
                                f"since: {cause}. Finished outputs are kept: fix the cause (disk "
                                f"space, storage access) and rerun the same command to resume.")
                        retry(shard, cause)
                    else:
                        lose(slot, _cause(e))
                    continue
                refs.pop(ref)
                slot.running.remove(ref)
                streak.clear()
                on_rows(rows)
        # every path that retires a shard (done, failed, worker lost) ends here: refill
        for s in slots:
            fill(s)
    for s in slots:
        if s.state == "starting":              # a replacement nobody needs any more
            ray.kill(s.actor, no_restart=True)
            s.state = "dead"
    return slots
