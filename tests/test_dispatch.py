"""The dispatcher's rules (runner/driver/dispatch.py) on an in-memory pool: no Ray, no model, a fake clock.

`FakePool` plays workers that run their calls in the order they were made; each step runs the oldest
pending call of any worker, so every run is deterministic. Its script, by row id (`n`: the first n
times, None: every time):
    raises={id: n}        the shard holding `id` raises in the worker (TaskError; the worker lives)
    dies={id: n}          its worker dies while generating the shard holding `id`
    dies_writing={id: n}  its worker dies while writing that shard's files (its GPU work done)
    dies_after={id: n}    its worker dies right after that shard's rows are in
    warmups={rank: [...]} the outcomes of that slot's warm-ups in turn (then "ok"): "ok", "hang",
                          "lost", or the text of an exception it raises
    canaries={rank: [...]} the verdicts of that slot's canaries in turn (then "ok"): "ok", "bad"
    error                 what a raising shard raises: a text, or a function of its row ids
    drain                 a wait runs every call that can run before it answers (a busy driver:
                          replies that raced arrive together)
The clock moves only when no call can make progress: `timeout` seconds per wait, as a real wait.
`calls` lists what the workers were asked, in turn: ("shard", ids) or ("canary", rank).
"""

import inspect
import itertools
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from runner.driver.dispatch import (FAULT_ROWS, FAULT_ROWS_STALLED, DispatchError, Dispatcher,
                             PersistentFault, TaskError, WorkerLost)
from runner.io.prompts import Item, Shard, plan_shards

BAD_ROW = "ValueError: bad row"
DIED = "actor died (exit 70)"


@dataclass(eq=False)                       # hashed by identity, as futures are
class Future:
    worker: "FakeWorker"
    kind: str                              # warm | start | finish
    sub: "Sub | None" = None
    plan: str = "ok"                       # a warm-up's scripted outcome
    n: int = field(default_factory=itertools.count().__next__)   # creation order
    state: str = "pending"                 # pending | ok | error | lost
    value: object = None


@dataclass(eq=False)
class Sub:
    """One submitted shard: its row ids and the shards in flight beside it on its worker (then or
    later); `depth`: the shards in flight there when it was submitted, itself included."""
    ids: tuple
    worker: "FakeWorker"
    beside: list = field(default_factory=list)
    depth: int = 1
    over: bool = False


@dataclass(eq=False)
class FakeWorker:
    rank: int
    calls: list = field(default_factory=list)   # pending futures, oldest first


class FakePool:
    def __init__(self, raises=None, dies=None, dies_writing=None, dies_after=None, warmups=None,
                 error=BAD_ROW, canaries=None, drain=False):
        faults = dict(raises=raises, dies=dies, dies_writing=dies_writing, dies_after=dies_after)
        self.script = {k: dict(v or {}) for k, v in faults.items()}
        self.warmups = {rank: list(plans) for rank, plans in (warmups or {}).items()}
        self.error, self.now = error, 0.0
        self.workers, self.started, self.killed = [], [], []   # ranks started and killed, in turn
        self.subs, self.runs, self.errors = [], [], 0   # runs: the Subs generated, in turn
        self.canaries = {rank: list(v) for rank, v in (canaries or {}).items()}
        self.drain, self.calls = drain, []

    # -- the Pool interface ------------------------------------------------------------------

    def start(self, rank):
        w = FakeWorker(rank)
        self.workers.append(w)
        self.started.append(rank)
        plans = self.warmups.get(rank)
        warm = Future(w, "warm", plan=plans.pop(0) if plans else "ok")
        w.calls.append(warm)
        return w, warm

    def canary(self, w, seq):
        plans = self.canaries.get(w.rank)
        f = Future(w, "canary", plan=plans.pop(0) if plans else "ok")
        w.calls.append(f)
        self.calls.append(("canary", w.rank))
        return f

    def submit(self, w, seq, items):
        self.calls.append(("shard", tuple(it.id for it in items)))
        busy = [s for s in self.subs if s.worker is w and not s.over]
        sub = Sub(tuple(it.id for it in items), w, beside=busy.copy(), depth=len(busy) + 1)
        for s in busy:
            s.beside.append(sub)
        self.subs.append(sub)
        calls = [Future(w, "start", sub), Future(w, "finish", sub)]
        w.calls += calls
        return tuple(calls)

    def wait(self, futures, timeout):
        while self.drain and timeout and self._step():
            pass
        while True:
            done = [f for f in futures if f.state != "pending"]
            if done:      # all at once, a death first: as if its news beat the replies it raced
                return sorted(done, key=lambda f: f.state != "lost")
            if timeout == 0 or not self._step():
                self.now += timeout
                assert self.now < 10_000, "the dispatcher waits for nothing"
                return []

    def result(self, f):
        assert f.state != "pending", "the dispatcher reads only done futures"
        if f.state == "error":
            raise TaskError(f.value)
        if f.state == "lost":
            raise WorkerLost(f.value)
        return f.value

    def kill(self, w):
        self.killed.append(w.rank)
        self._die(w, "killed")

    # -- the workers -------------------------------------------------------------------------

    def _step(self) -> bool:
        """Run the oldest call that can run; False if none can (all idle, or hung)."""
        heads = [w.calls[0] for w in self.workers if w.calls and w.calls[0].plan != "hang"]
        if not heads:
            return False
        f = min(heads, key=lambda f: f.n)
        {"warm": self._warm, "start": self._start, "finish": self._finish,
         "canary": self._canary}[f.kind](f)
        return True

    def _canary(self, f):
        bad = f.plan == "bad"
        self._resolve(f, "ok", dict(
            ok=not bad, rule="bit for bit", differing=0.25 if bad else 0.0, max_abs=9 if bad else 0,
            psnr_db=31.5 if bad else float("inf"), s=1.0, rank=f.worker.rank,
            device=dict(host="fake", node_id="n0", pid=7, gpu_index="3", gpu_uuid="GPU-f00d",
                        gpu_name="Fake GPU")))

    def _warm(self, f):
        if f.plan == "lost":
            self._die(f.worker, "node lost")
        elif f.plan != "ok":
            self._resolve(f, "error", f.plan)
        else:
            self._resolve(f, "ok", {"rank": f.worker.rank})

    def _start(self, f):
        self.runs.append(f.sub)
        assert len(self.runs) < 1000, "endless retries"
        if self._fires("dies", f.sub):
            self._die(f.worker, DIED)
        else:
            self._resolve(f, "ok", len(f.sub.ids))

    def _finish(self, f):
        if self._fires("dies_writing", f.sub):
            return self._die(f.worker, "actor died writing its files")
        if self._fires("raises", f.sub):
            self.errors += 1
            self._resolve(f, "error", self.error(f.sub.ids) if callable(self.error) else self.error)
        else:
            self._resolve(f, "ok", [{"id": i, "status": "ok"} for i in f.sub.ids])
        f.sub.over = True
        if self._fires("dies_after", f.sub):
            self._die(f.worker, DIED)

    def _fires(self, fault, sub) -> bool:
        counts = self.script[fault]
        for i in sub.ids:
            if i in counts and (counts[i] is None or counts[i] > 0):
                if counts[i] is not None:
                    counts[i] -= 1
                return True
        return False

    def _resolve(self, f, state, value):
        f.state, f.value = state, value
        f.worker.calls.remove(f)

    def _die(self, w, why):
        for f in w.calls:
            f.state, f.value = "lost", why
            if f.sub:
                f.sub.over = True
        w.calls = []


def items(n):
    return [Item(id=f"p{i:02d}", prompt=f"prompt {i}", negative_prompt="", seed=i, height=64,
                 width=64, num_frames=None, num_inference_steps=2, guidance_scale=4.5,
                 file="p.parquet", row=i) for i in range(n)]


class Job:
    """`n` rows in shards of `shard_size` on `workers` slots of a FakePool; `rows`: id -> every row
    `on_rows` received for it."""

    def __init__(self, pool=None, n=12, workers=2, shard_size=3, **kw):
        self.pool, self.rows, its = pool or FakePool(), {}, items(n)
        self.d = Dispatcher(self.pool, workers, plan_shards(its, shard_size), self.on_rows,
                            clock=lambda: self.pool.now, **kw)

    def on_rows(self, rows):
        for r in rows:
            self.rows.setdefault(r["id"], []).append(r)

    def run(self):
        return self.d.run()

    def status(self) -> dict:
        """id -> status, checking that each row came exactly once."""
        assert all(len(v) == 1 for v in self.rows.values()), self.rows
        return {k: v[0]["status"] for k, v in sorted(self.rows.items())}


def ids(*numbers):
    return tuple(f"p{i:02d}" for i in numbers)


def ok_but(n, *failed):
    """The statuses of rows p00.. p<n-1> all ok but the `failed` ids."""
    return {f"p{i:02d}": "failed" if f"p{i:02d}" in failed else "ok" for i in range(n)}


def generated(pool):
    return [s.ids for s in pool.runs]


# -- normal work ---------------------------------------------------------------------------------

def test_every_row_once_with_inflight_shards_refilled():
    job = Job(n=30, workers=2, shard_size=3, inflight=2)
    slots = job.run()
    assert job.status() == ok_but(30)
    assert sorted(generated(job.pool)) == [ids(i, i + 1, i + 2) for i in range(0, 30, 3)]
    assert max(s.depth for s in job.pool.subs) == 2          # two in flight per slot, no more
    served = [sum(s.worker.rank == k for s in job.pool.subs) for k in (0, 1)]
    assert min(served) > 2                                   # refilled: more than `inflight` each
    assert [s.state for s in slots] == ["ready", "ready"] and job.pool.killed == []


def test_slots_are_filled_live_and_callbacks_run():
    slots, ready, ticks = [], [], []

    def on_ready(slot):
        assert slot in slots                                 # the caller's list is current
        ready.append(slot.rank)
    job = Job(n=4, workers=2, shard_size=2, slots=slots, on_ready=on_ready,
              on_tick=lambda: ticks.append(1))
    assert job.run() is slots and ready == [0, 1] and ticks
    assert [s.ready_info for s in slots] == [{"rank": 0}, {"rank": 1}]


# -- a shard that raises --------------------------------------------------------------------------

def test_a_failing_shard_is_retried_row_by_row(caplog):
    job = Job(FakePool(raises={"p04": 1}), n=12, workers=2, shard_size=3)
    job.run()
    assert job.status() == ok_but(12)
    runs = generated(job.pool)
    assert runs.count(ids(3, 4, 5)) == 1 and all(runs.count(ids(i)) == 1 for i in (3, 4, 5))
    assert all(not s.beside for s in job.pool.subs if len(s.ids) == 1)   # suspects run alone
    assert "retrying its 3 rows one by one" in caplog.text


def test_a_poison_row_is_recorded_failed_after_max_retries_and_its_neighbours_succeed():
    job = Job(FakePool(raises={"p04": None}), n=12, workers=2, shard_size=3, max_retries=2)
    job.run()
    assert job.status() == ok_but(12, "p04")
    assert job.rows["p04"][0]["error"] == f"failed 3 times: {BAD_ROW}"
    assert generated(job.pool).count(ids(4)) == 2            # its shard, then twice alone


def test_the_same_error_on_distinct_shards_is_a_persistent_fault():
    pool = FakePool(raises={f"p{i:02d}": None for i in range(30)}, error="OSError: disk full")
    with pytest.raises(PersistentFault, match=f"the same error on {FAULT_ROWS} shards in a row, "
                                              f"nothing written since: OSError: disk full"):
        Job(pool, n=30, workers=2, shard_size=3).run()
    assert pool.errors == FAULT_ROWS


def test_the_same_error_naming_each_rows_file_is_one_cause():
    """A full disk names the file it could not write: each shard's own ids differ, the cause is
    the same (issue 37: ids inside messages defeated the grouping)."""
    pool = FakePool(raises={f"p{i:02d}": None for i in range(30)},
                    error=lambda ids: f"OSError: [Errno 28] No space left on device: "
                                      f"'/j/media/.tmp-{hash(ids) & 0xffffffff:08x}-{ids[0]}.png'")
    with pytest.raises(PersistentFault, match=r"the same error on 4 shards in a row, nothing "
                                              r"written since: OSError: \[Errno 28\] No space"):
        Job(pool, n=30, workers=2, shard_size=3).run()
    assert pool.errors == FAULT_ROWS


def test_a_store_that_does_not_answer_is_a_persistent_fault_after_two_shards():
    """Each failure of a stalled store took the store's whole timeout: two in a row suffice."""
    stalled = ("StoreTimeout: the store s3://b/j did not answer a write in time (20 s, plus 1 s "
               "per MiB written): it is stalled or unreachable")
    pool = FakePool(raises={f"p{i:02d}": None for i in range(30)}, error=stalled)
    with pytest.raises(PersistentFault, match=f"the same error on {FAULT_ROWS_STALLED} shards in "
                                              f"a row, nothing written since: StoreTimeout: the "
                                              f"store s3://b/j did not answer"):
        Job(pool, n=30, workers=2, shard_size=3).run()
    assert pool.errors == FAULT_ROWS_STALLED


def test_the_same_error_with_successes_in_between_is_no_persistent_fault():
    poison = {"p01": None, "p07": None, "p13": None, "p19": None}
    job = Job(FakePool(raises=poison), n=24, workers=1, shard_size=3, inflight=1, max_retries=1)
    job.run()
    assert job.status() == ok_but(24, *poison)


# -- a worker that dies ---------------------------------------------------------------------------

def poisoned(row: int, deaths: int = 2, cause: str = DIED) -> str:
    """The error of row p<row> failed for its worker deaths (Dispatcher._death_message)."""
    return (f"killed its worker {deaths} times (run.max_row_deaths={deaths}): {cause}\n"
            f"row 'p{row:02d}' (p.parquet:{row}): prompt 'prompt {row}'")


def test_every_row_in_flight_at_a_death_counts_it_and_reruns_alone():
    """The worker dies with two shards in flight: every row of both was in flight, so each counts
    the death and reruns alone; p01's second death is its own (it ran alone): failed, naming the
    cause and its input. The deaths are pinned on p01: no restart is charged."""
    job = Job(FakePool(dies={"p01": None}), n=6, workers=1, shard_size=3, inflight=2,
              max_retries=0, max_restarts=0)
    job.run()
    assert job.status() == ok_but(6, "p01")
    assert job.rows["p01"][0]["error"] == poisoned(1)
    first, *after = job.pool.runs
    assert first.ids == ids(0, 1, 2) and [s.ids for s in first.beside] == [ids(3, 4, 5)]
    assert [s.ids for s in after] == [ids(i) for i in range(6)] and not any(s.beside for s in after)
    assert job.d.deaths == {f"p{i:02d}": [1] for i in range(6)} | {"p01": [1, 2]}
    assert job.pool.started == [0, 0, 0] and job.d.charged == {}     # 2 restarts, both pinned


def test_one_worker_and_a_row_that_kills_it_every_time_the_rest_is_done():
    """Issue 47: one worker, shards of 1, the middle row kills its worker each time. It fails
    alone after `max_deaths` deaths and the job goes on (it ended with "every worker is gone"
    once the restarts were spent): the deaths were that row's."""
    for deaths in (2, 3, 5):
        job = Job(FakePool(dies={"p01": None}), n=3, workers=1, shard_size=1, max_retries=0,
                  max_restarts=1, max_deaths=deaths)
        job.run()
        assert job.status() == ok_but(3, "p01")
        assert job.rows["p01"][0]["error"] == poisoned(1, deaths).replace(
            f"max_row_deaths={deaths}", f"max_row_deaths={deaths}")
        assert generated(job.pool).count(ids(1)) == deaths and job.d.charged == {}


def test_two_workers_a_poison_row_in_a_shard_of_three_fails_alone():
    job = Job(FakePool(dies={"p07": None}), n=12, workers=2, shard_size=3, max_retries=2,
              max_restarts=0)
    job.run()
    assert job.status() == ok_but(12, "p07")
    assert job.rows["p07"][0]["error"] == poisoned(7)
    first, *later = [s for s in job.pool.runs if "p07" in s.ids]
    assert len(first.ids) == 3 and [s.ids for s in later] == [ids(7)] and not later[0].beside


def test_a_death_while_writing_counts_for_the_shards_rows_too():
    """Its GPU work was done, its files being written: its rows were in flight all the same
    (a worker can die of writing a row), so they rerun alone; none fails of one death."""
    job = Job(FakePool(dies_writing={"p01": 1}), n=6, workers=1, shard_size=3, inflight=1)
    job.run()
    assert job.status() == ok_but(6)
    assert generated(job.pool) == [ids(0, 1, 2), ids(0), ids(1), ids(2), ids(3, 4, 5)]
    assert job.d.attempts == {2: 0, 3: 0, 4: 0} and job.d.suspects == {2, 3, 4}


def test_a_death_whose_rows_all_come_back_counts_against_the_restarts():
    """p00's worker dies once; p00, p01 then succeed alone: that death was not theirs, so it is
    charged to the slot (a node lost, a process killed from outside)."""
    job = Job(FakePool(dies={"p00": 1}), n=4, workers=1, shard_size=1, max_restarts=5)
    job.run()
    assert job.status() == ok_but(4) and job.d.charged == {0: 1}


def test_rows_that_finished_before_a_death_are_kept():
    """The worker dies just after p00-p02's rows are in; the death is seen first."""
    job = Job(FakePool(dies_after={"p02": 1}), n=6, workers=1, shard_size=3, inflight=2)
    job.run()
    assert job.status() == ok_but(6)
    assert generated(job.pool) == [ids(0, 1, 2), ids(3), ids(4), ids(5)]   # p03-p05 never started


def test_restarts_are_limited_per_slot():
    """p00's worker dies once (not p00's doing: it succeeds alone later), then every replacement
    is lost while starting: no row in flight, so each death counts; after `max_restarts` of them
    the slot is given up and, with no other, the job ends naming why."""
    slots = []
    pool = FakePool(dies={"p00": 1}, warmups={0: ["ok", "lost", "lost", "lost"]})
    job = Job(pool, n=3, workers=1, shard_size=1, max_restarts=2, slots=slots)
    with pytest.raises(DispatchError, match=r"every worker is gone and none could be restarted "
                                            r"\(worker 0: start-up failed: node lost\); 3 shards"):
        job.run()
    assert job.pool.started == [0, 0, 0, 0] and [s.restarts for s in slots] == [3]
    assert job.rows == {} and job.d.charged == {0: 3}       # p00's death still unresolved


def test_all_workers_gone_is_an_error_naming_each():
    pool = FakePool(warmups={0: ["lost"] * 2, 1: ["ok", "lost", "lost"]}, dies={"p02": 1})
    job = Job(pool, n=4, workers=2, shard_size=1, max_restarts=1)
    with pytest.raises(DispatchError, match=r"worker 0: start-up failed: node lost; worker 1: "
                                            r"start-up failed: node lost\); 2 shards"):
        job.run()
    assert sorted(job.pool.started) == [0, 0, 1, 1, 1]      # 1: p02 killed it, then two lost
    assert job.status() == {"p00": "ok", "p01": "ok"}    # what finished is kept


# -- canaries -------------------------------------------------------------------------------------

def test_canaries_run_in_turn_every_k_items_while_there_is_work():
    """A canary after every 4 items handed to the worker, before its next shard; none after the
    last (nothing more to hand out)."""
    failed = []
    job = Job(FakePool(), n=12, workers=1, shard_size=2, canary_every=4,
              on_canary_failed=lambda *a: failed.append(a))
    job.run()
    assert job.status() == ok_but(12) and failed == []
    shards = [("shard", ids(i, i + 1)) for i in range(0, 12, 2)]
    canary = ("canary", 0)
    assert job.pool.calls == shards[:2] + [canary] + shards[2:4] + [canary] + shards[4:]
    assert job.d.canaries == 2 and list(job.d.slots[0].made) == [2]   # the last 4: unchecked


def test_a_canary_every_t_seconds():
    """canary_every_s: a slot is asked for one once that time passed since its last (the fake
    clock here moves 1 s per reading; no count: canary_every=0)."""
    job = Job(FakePool(), n=12, workers=1, shard_size=2, canary_every_s=0.5)
    clock = iter(range(1000))
    job.d.clock = lambda: float(next(clock))     # one second per reading
    job.run()
    assert job.status() == ok_but(12)
    assert ("canary", 0) in job.pool.calls and job.d.canaries >= 1


def test_no_canary_when_off():
    job = Job(FakePool(), n=12, workers=2, shard_size=2)
    job.run()
    assert job.status() == ok_but(12) and all(c[0] == "shard" for c in job.pool.calls)


def test_a_failed_canary_marks_what_the_worker_made_since_its_last_good_one_suspect(caplog):
    """Canary 1 (after p00-p03) passes, canary 2 (after p04-p07) fails: p04-p07 are given back
    as suspect rows naming the worker and its GPU; p08-p09, handed to it after canary 2 and not
    done, go back to the queue whole (not blamed); the worker is replaced (a death charged to
    the slot) and its replacement does the rest."""
    failed = []
    job = Job(FakePool(canaries={0: ["ok", "bad"]}), n=12, workers=1, shard_size=2,
              canary_every=4, on_canary_failed=lambda *a: failed.append(a))
    job.run()
    assert job.status() == ok_but(12)               # (the caller records the suspect rows again)
    ((slot, verdict, marked, suspect),) = failed
    assert slot.rank == 0 and not verdict["ok"] and suspect == list(ids(4, 5, 6, 7))
    assert [r["id"] for r in marked] == suspect and {r["status"] for r in marked} == {"suspect"}
    assert marked[0]["error"] == (
        "suspect: worker 0 (host fake, node n0, GPU 3 Fake GPU GPU-f00d, pid 7) failed its canary "
        "(bit for bit: 25 % of values differ, largest by 9, PSNR 31.5 dB) after making this "
        "output, since its last good canary; a rerun regenerates it")
    assert job.pool.calls.count(("shard", ids(8, 9))) == 2 and job.d.deaths == {}   # whole, unblamed
    assert job.pool.started == [0, 0] and job.d.charged == {0: 1}
    assert "worker 0 lost (its canary failed (bit for bit: 25 % of values differ" in caplog.text


def test_outputs_done_when_a_canary_fails_are_suspect_too():
    """The driver was busy: the failing canary's verdict and the rows of the shards handed out
    after it (made by the same GPU) arrive together. Those rows come back suspect as well."""
    failed = []
    job = Job(FakePool(canaries={0: ["ok", "bad"]}, drain=True), n=12, workers=1, shard_size=2,
              inflight=4, canary_every=4, on_canary_failed=lambda *a: failed.append(a))
    job.run()
    ((_, _, marked, suspect),) = failed
    assert [r["id"] for r in marked] == list(ids(4, 5, 6, 7))      # returned before: again
    assert suspect == list(ids(*range(4, 12)))
    statuses = {k: [r["status"] for r in v] for k, v in job.rows.items()}
    assert statuses == {i: ["suspect" if i in ids(8, 9, 10, 11) else "ok"] for i in ids(*range(12))}
    assert job.rows["p08"][0]["error"].startswith("suspect: worker 0 (host fake")
    assert job.pool.started == [0]           # nothing left to do: not replaced


# -- start-up -------------------------------------------------------------------------------------

def test_a_startup_error_is_retried_once_never_a_third_time(caplog):
    caplog.set_level(logging.WARNING, "runner")
    oom = "RuntimeError: CUDA out of memory"
    job = Job(FakePool(warmups={0: [oom] * 5}), workers=1, max_restarts=5)
    with pytest.raises(DispatchError, match=f"worker 0: start-up failed: {oom}"):
        job.run()
    assert job.pool.started == [0, 0]
    assert caplog.text.count("starting a replacement") == 1
    assert "the same error as before: not retried" in caplog.text


def test_a_different_startup_error_is_retried():
    job = Job(FakePool(warmups={0: ["OSError: one", "OSError: another"]}), workers=1)
    assert [s.restarts for s in job.run()] == [2] and job.status() == ok_but(12)


def test_a_worker_lost_at_startup_restarts_within_the_budget():
    job = Job(FakePool(warmups={0: ["lost", "lost"]}), workers=1, max_restarts=2)
    assert [s.restarts for s in job.run()] == [2] and job.status() == ok_but(12)
    with pytest.raises(DispatchError, match="worker 0: start-up failed: node lost"):
        Job(FakePool(warmups={0: ["lost"] * 3}), workers=1, max_restarts=2).run()


def test_a_slot_not_ready_in_time_is_given_up_and_replaced(caplog):
    job = Job(FakePool(warmups={0: ["hang"]}), workers=1, start_timeout_s=30)
    assert [s.restarts for s in job.run()] == [1] and job.status() == ok_but(12)
    assert job.pool.killed == [0] and 30 < job.pool.now < 40
    assert "worker 0 lost (not ready after 30 s (ray.worker_start_timeout_s)" in caplog.text


def test_slots_that_never_get_ready_end_the_job():
    pool = FakePool(warmups={0: ["hang"] * 2, 1: ["hang"] * 2})
    with pytest.raises(DispatchError, match="worker 0: not ready after 30 s.*worker 1: not ready"):
        Job(pool, workers=2, start_timeout_s=30, max_restarts=1).run()


def test_a_starting_slot_left_at_the_end_is_killed():
    job = Job(FakePool(warmups={1: ["hang"]}), workers=2)
    assert [s.state for s in job.run()] == ["ready", "dead"]
    assert job.status() == ok_but(12) and job.pool.killed == [1]


# -- the watchdog ---------------------------------------------------------------------------------

class TimedPool(FakePool):
    """A FakePool whose calls take time on its clock: `seconds={id: s}`: the GPU work of a shard
    holding `id` takes `s` seconds (its worker silent meanwhile); `no_call={ids}`: those rows come
    back failed at once without a model call, as a row whose image is missing does. `progress`
    answers at once, as a worker's own thread does: seconds since its last GPU work ended."""

    def __init__(self, seconds=None, no_call=(), **kw):
        super().__init__(**kw)
        self.seconds, self.no_call, self.last_end, self.asked = dict(seconds or {}), set(no_call), {}, 0

    def progress(self, w):
        self.asked += 1
        return Future(w, "progress", state="ok", value=self.now - self.last_end[w])

    def _step(self) -> bool:
        for w in self.workers:                   # a timed call at a worker's head: due from now
            f = w.calls[0] if w.calls else None
            if f is not None and f.kind == "start" and not hasattr(f, "due"):
                f.due = self.now + max((self.seconds.get(i, 0.0) for i in f.sub.ids), default=0.0)
        heads = [w.calls[0] for w in self.workers if w.calls and w.calls[0].plan != "hang"
                 and getattr(w.calls[0], "due", 0.0) <= self.now]
        if not heads:
            return False
        f = min(heads, key=lambda f: f.n)
        {"warm": self._warm, "start": self._start, "finish": self._finish,
         "canary": self._canary}[f.kind](f)
        if f.kind in ("warm", "start"):
            self.last_end[f.worker] = self.now
        if f.kind == "finish" and f.state == "ok":
            f.value = [dict(r, status="failed", error="FileNotFoundError: no such image")
                       if r["id"] in self.no_call else r for r in f.value]
        return True


def test_rows_failed_without_a_model_call_do_not_shorten_the_watchdogs_bound(caplog):
    """Issue 75: the first rows fail without a model call (their images missing), their shards
    back at once. Counted as work done, they made the worker's measured pace ~0 s a unit, its
    bound the 60-s floor, and a legitimate 70-s call was killed twice and its row failed. Those
    rows are no measure of the worker's pace: nothing measured, the bound is the ceiling, and the
    70-s call is neither asked about nor killed."""
    pool = TimedPool(seconds={"p06": 70.0}, no_call=[f"p{i:02d}" for i in range(6)])
    job = Job(pool, n=9, workers=1, shard_size=3, hang_timeout_s=1800)
    job.run()
    assert job.status() == {**{f"p{i:02d}": "failed" for i in range(6)},
                            "p06": "ok", "p07": "ok", "p08": "ok"}
    assert pool.killed == [] and pool.asked == 0 and "is hung" not in caplog.text
    assert pool.now >= 70                        # the call did take its 70 s


def test_a_shard_of_missing_images_and_made_rows_is_measured_by_the_made_ones_only():
    """The same with a shard of one made row (10 s) and two missing images: its pace is 10 s for
    the made row's units, not for three rows' (3.3 s a row: a bound of 60 s, the floor), so the
    next shard's 80-s call is within its bound (10 x 10 s) and not killed."""
    pool = TimedPool(seconds={"p00": 10.0, "p03": 80.0}, no_call=["p01", "p02"])
    job = Job(pool, n=6, workers=1, shard_size=3, hang_timeout_s=1800)
    job.run()
    assert job.status() == ok_but(6, "p01", "p02") and pool.killed == [] and pool.asked == 0
    assert pool.now >= 90


# -- the boundaries -------------------------------------------------------------------------------

def test_the_worker_implements_the_contract():
    """The actor's methods as the driver calls them (RayPool, runner.driver.job): names, parameters and
    types match the Protocol."""
    from runner.serve.actor import WorkerActor
    from runner.serve.worker import Worker, WorkerContract
    names = [n for n in vars(WorkerContract) if not n.startswith("_")]
    assert sorted(names) == ["canary", "finish_shard", "metrics", "phases", "progress",
                             "start_shard", "warmup"]
    for cls in (Worker, WorkerActor):    # the class, and the actor the driver starts around it
        for name in names:
            assert inspect.signature(getattr(cls, name)) == \
                inspect.signature(getattr(WorkerContract, name)), (cls, name)


def test_the_drivers_path_imports_no_torch(tmp_path):
    """The driver's checks and its actor class without torch (the workers import it; ~1.3 s of CPU
    per job otherwise): a fresh process makes a job's worker config and the actor class."""
    from pathlib import Path
    code = f"""if True:
        import sys
        from runner.config import load_config, split
        from runner.driver import checks, job
        j = split(load_config(["job=demo_image", "compile.mode=O3", "output.dir={tmp_path}"]))
        assert "cudagraphs" in j["compile"].options.flags
        limits = checks.constraints(j["model"])
        job.worker_config(j, limits, on_gpu=False)
        import ray
        from runner.serve.actor import WorkerActor
        ray.remote(WorkerActor)
        print(sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules))
    """
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


# Ray 2.60's own texts, measured on this machine (a local Ray; an actor killed by the kernel's
# out-of-memory killer in a memory cgroup of 400 MiB; one killed by Ray's memory monitor with
# RAY_memory_usage_threshold just above the machine's use). SIGKILL by hand, SIGSEGV and
# os._exit(70) read exactly as the OOM killer's kill does.
KILLED = """The actor died unexpectedly before finishing this task.
\tclass_name: WorkerActor
\tactor_id: c579e8d7f8edd815b5bb6a8601000000
\tpid: 6207
\tnamespace: fa1c1667-4232-43b1-a4b5-93efb6a3dcb0
\tip: 192.0.2.2
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit \
detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes \
include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force \
was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error. If \
the process was killed by the kernel OOM killer (verifiable by checking for OOM in dmesg of the \
OOMing node), consider enabling resource isolation via --enable-resource-isolation to prevent node \
deaths by resource contention and significant loss of progress by uninformed kernel OOM killing."""
MONITOR = """1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: \
192.0.2.2, ID: 81e2cb1d9e001b029aeea8edcb74ae4ef31ccbddfe73691acf065f3a) was 1.61GB used / 23.54GB \
limit (0.068452)
OOM kill reason: Memory usage 1721958400B exceeded threshold of 1693526528B (6.7% of 25276514304B limit)
Object store memory usage: [- objects spillable: 0
Ray killed 1 worker(s) based on the killing policy
Considered workers: [
Selected to kill: (Actor(fc6eebf215a8367410365f2301000000): job ID=01000000, lease ID=0000, task \
name=WorkerActor.__init__, required resources={}, pid=7146, actual memory used=0.82GB, worker ID=c4)
]"""


def ray_pool_raising(monkeypatch, raised: list):
    """A RayPool whose `ray.get` raises the next of `raised` (Ray's real exception classes)."""
    import ray
    from runner.driver import raypool

    def get(ref):
        raise raised.pop(0)
    monkeypatch.setattr(ray, "get", get)
    return raypool.RayPool(make_actor=None, size=1)


def actor_died(text: str):
    import ray.exceptions as rx
    e = rx.ActorDiedError()
    e.error_msg, e.actor_id = text, "c579e8d7f8edd815b5bb6a8601000000"
    return e


def test_ray_pool_maps_ray_errors(monkeypatch):
    """Our code's exception is a TaskError showing its cause; a lost actor is a WorkerLost whose
    first line names what it died of without particulars (rows are grouped by it)."""
    import ray.exceptions as rx
    raised = [rx.RayTaskError("start_shard", "a long Ray traceback",
                              OSError("No space left on device\nmore lines")),
              actor_died(KILLED),
              actor_died("The actor died unexpectedly before finishing this task.\n\tpid: 9\n"
                         "\tip: 10.0.0.7\nThe actor is dead because it was killed by `ray.kill`."),
              actor_died("The actor died unexpectedly before finishing this task.\n\tpid: 9\n"
                         "\tip: 10.0.0.7\nThe actor is dead because its worker process has "
                         "died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker exits "
                         "unexpectedly. Worker exits with an exit code 3."),
              rx.RayActorError(error_msg="The actor experienced an error\nmore")]
    pool = ray_pool_raising(monkeypatch, raised)
    with pytest.raises(TaskError, match=r"^OSError: No space left on device$"):
        pool.result(None)
    with pytest.raises(WorkerLost) as lost:
        pool.result(None)
    assert str(lost.value) == (
        "the worker process ended without an error of its own: killed (SIGKILL; the kernel's "
        "out-of-memory killer does that too) or crashed (SIGSEGV, a CUDA error)\n"
        "worker pid 6207 on 192.0.2.2; Ray: SYSTEM_ERROR: Worker unexpectedly exits with a "
        "connection error code 2.")
    with pytest.raises(WorkerLost, match=r"^the worker was killed \(ray.kill\)\nworker pid 9 on "
                                         r"10.0.0.7$"):
        pool.result(None)
    with pytest.raises(WorkerLost, match=r"^the worker process ended: Worker exits unexpectedly."
                                         r"\nworker pid 9 on 10.0.0.7; Ray: SYSTEM_ERROR$"):
        pool.result(None)
    with pytest.raises(WorkerLost, match=r"^RayActorError: The actor experienced an error$"):
        pool.result(None)


def test_a_worker_killed_by_rays_memory_monitor_is_out_of_memory(monkeypatch):
    """Ray's memory monitor raises OutOfMemoryError for every call on the actor it killed (and
    ActorDiedError says NODE_OUT_OF_MEMORY): out of memory, the node's figures on the next line."""
    import ray.exceptions as rx
    oom_died = KILLED.replace("SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a "
                              "connection error code 2.", "NODE_OUT_OF_MEMORY Worker exit detail: "
                              "Task was killed due to the node running low on memory.")
    pool = ray_pool_raising(monkeypatch, [rx.OutOfMemoryError(MONITOR), actor_died(oom_died)])
    first = "out of memory: Ray's memory monitor killed the worker (RAY_memory_usage_threshold)"
    with pytest.raises(WorkerLost) as lost:
        pool.result(None)
    assert str(lost.value) == (f"{first}\nworker pid 7146 on 192.0.2.2; node 192.0.2.2: 1.61GB "
                               f"used / 23.54GB limit")
    with pytest.raises(WorkerLost) as lost:
        pool.result(None)
    assert str(lost.value) == (f"{first}\nworker pid 6207 on 192.0.2.2; Task was killed due to "
                               f"the node running low on memory.")


def test_a_kill_counted_by_the_workers_memory_cgroup_is_out_of_memory(monkeypatch, tmp_path):
    """Ray's text for the kernel's out-of-memory kill is that of any SIGKILL: the worker's ready
    info says where the kernel counts its kills (`oom.baseline`); a count that rose since, read
    on the same machine, names the kill. Another machine's count is not read."""
    import socket
    from runner.serve import oom
    counter = tmp_path / "memory.oom_control"
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    base = dict(host=socket.gethostname(), boot_id=oom._boot_id(), counter=str(counter),
                oom_kills=3, limit_bytes=2**30)
    pool = ray_pool_raising(monkeypatch, [actor_died(KILLED)] * 3)
    pool.memory["c579e8d7f8edd815b5bb6a8601000000"] = base
    with pytest.raises(WorkerLost, match="^the worker process ended without an error of its own"):
        pool.result(None)                                   # no kill counted since it was ready
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    with pytest.raises(WorkerLost) as lost:
        pool.result(None)
    assert str(lost.value) == (f"out of memory: the kernel's out-of-memory killer ended the worker\n"
                               f"worker pid 6207 on 192.0.2.2; memory cgroup {tmp_path}, limit 1.00 "
                               f"GiB: oom_kill 3 -> 4")
    base["host"] = "another-node"
    with pytest.raises(WorkerLost, match="^the worker process ended without an error of its own"):
        pool.result(None)


def test_the_oom_baseline_reads_this_process_counter():
    """On Linux the worker finds a counter of its out-of-memory kills: its memory cgroup's, else
    the machine's, and a kill counted since is read back by `killed`."""
    from runner.serve import oom
    base = oom.baseline()
    if base is None:
        pytest.skip("no out-of-memory kill counter here (not Linux)")
    assert base["oom_kills"] >= 0 and os.path.isfile(base["counter"])
    assert oom.killed(base) is None                      # nothing killed since
    assert oom.killed(dict(base, oom_kills=base["oom_kills"] - 1)).endswith(
        f"oom_kill {base['oom_kills'] - 1} -> {base['oom_kills']}")


def test_ray_pool_wait_returns_every_finished_future_at_once(monkeypatch):
    """Under load one dispatch-loop iteration takes every finished shard, not one per wait."""
    from runner.driver import raypool
    calls = []

    def wait(refs, num_returns, timeout):
        calls.append((num_returns, timeout))
        done = [r for r in refs if r.startswith("done")]
        return done[:num_returns], [r for r in refs if r not in done[:num_returns]]
    monkeypatch.setattr(raypool, "ray", SimpleNamespace(wait=wait))
    pool = raypool.RayPool(make_actor=None, size=1)
    assert pool.wait(["done1", "busy", "done2", "done3"], timeout=1.0) == ["done1", "done2", "done3"]
    assert calls == [(1, 1.0), (4, 0)]
    assert pool.wait(["busy"], timeout=0.5) == []


def test_the_driver_runs_without_ray():
    """The dispatcher, the job and the progress display import no Ray, at any level of the
    source (only runner/driver/raypool.py does), nor when imported."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for name in ("dispatch", "job", "progress", "summary"):
        tree = ast.parse((root / "runner" / "driver" / f"{name}.py").read_text())
        mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        mods += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in mods if m.split(".")[0] == "ray"], name
    code = ("import sys, runner.driver.dispatch, runner.driver.job, runner.driver.progress; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_shards_split_get_fresh_indices():
    """Split rows are new shards (their own attempts and suspicion), numbered after the plan's."""
    job = Job(FakePool(raises={"p01": 1}), n=3, workers=1, shard_size=3)
    job.run()
    assert job.d.next_index == 4 and sorted(job.d.suspects) == [1, 2, 3]



@pytest.mark.parametrize("n_first", [3, 0])
def test_split_shards_are_numbered_past_the_later_ones_too(n_first):
    """Split rows get indices past `later`'s too (the driver numbers those after its shards, from
    0 when it has none): no split row takes a later shard's index, whose one failure then still
    gets its retry (max_retries=1) instead of being charged the split row's attempt."""
    its = items(n_first + 5)
    first, *rest = its[n_first:]
    shards = plan_shards(its[:n_first], 3)
    later = [Shard(len(shards) + k, tuple(g))
             for k, g in enumerate([its[n_first:n_first + 3], *([it] for it in rest[2:])])]
    # the first shard of three (ordinary or later) fails once, split: its rows run alone; each
    # later single row fails once
    pool = FakePool(raises={its[0].id: 1, **{it.id: 1 for it in rest[2:]}})
    rows = {}
    d = Dispatcher(pool, 1, shards, lambda rs: [rows.setdefault(r["id"], []).append(r) for r in rs],
                   clock=lambda: pool.now, later=later, takes_later=lambda s: True, max_retries=1)
    assert d.next_index == len(shards) + len(later)
    d.run()
    assert {i: [r["status"] for r in v] for i, v in rows.items()} == {it.id: ["ok"] for it in its}
    assert generated(pool).count((rest[2].id,)) == 2          # failed once, retried once
