"""The dispatcher's rules (runner/dispatch.py) on an in-memory pool: no Ray, no model, a fake clock.

`FakePool` plays workers that run their calls in the order they were made; each step runs the oldest
pending call of any worker, so every run is deterministic. Its script, by row id (`n`: the first n
times, None: every time):
    raises={id: n}        the shard holding `id` raises in the worker (TaskError; the worker lives)
    dies={id: n}          its worker dies while generating the shard holding `id`
    dies_writing={id: n}  its worker dies while writing that shard's files (its GPU work done)
    dies_after={id: n}    its worker dies right after that shard's rows are in
    warmups={rank: [...]} the outcomes of that slot's warm-ups in turn (then "ok"): "ok", "hang",
                          "lost", or the text of an exception it raises
    error                 what a raising shard raises: a text, or a function of its row ids
The clock moves only when no call can make progress: `timeout` seconds per wait, as a real wait.
"""

import inspect
import itertools
import logging
import re
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from runner.dispatch import (FAULT_ROWS, FAULT_ROWS_STALLED, DispatchError, Dispatcher,
                             PersistentFault, TaskError, WorkerLost)
from runner.prompts import Item, plan_shards

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
                 error=BAD_ROW):
        faults = dict(raises=raises, dies=dies, dies_writing=dies_writing, dies_after=dies_after)
        self.script = {k: dict(v or {}) for k, v in faults.items()}
        self.warmups = {rank: list(plans) for rank, plans in (warmups or {}).items()}
        self.error, self.now = error, 0.0
        self.workers, self.started, self.killed = [], [], []   # ranks started and killed, in turn
        self.subs, self.runs, self.errors = [], [], 0   # runs: the Subs generated, in turn

    # -- the Pool interface ------------------------------------------------------------------

    def start(self, rank):
        w = FakeWorker(rank)
        self.workers.append(w)
        self.started.append(rank)
        plans = self.warmups.get(rank)
        warm = Future(w, "warm", plan=plans.pop(0) if plans else "ok")
        w.calls.append(warm)
        return w, warm

    def submit(self, w, seq, items):
        busy = [s for s in self.subs if s.worker is w and not s.over]
        sub = Sub(tuple(it.id for it in items), w, beside=busy.copy(), depth=len(busy) + 1)
        for s in busy:
            s.beside.append(sub)
        self.subs.append(sub)
        calls = [Future(w, "start", sub), Future(w, "finish", sub)]
        w.calls += calls
        return tuple(calls)

    def wait(self, futures, timeout):
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
        {"warm": self._warm, "start": self._start, "finish": self._finish}[f.kind](f)
        return True

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

def test_an_ambiguous_death_charges_nobody_and_reruns_both_shards_alone():
    """The worker dies with two shards unfinished: either may be the cause, so neither is charged.
    Their rows rerun alone, and the next death (p01 again) is charged to p01 only: one attempt."""
    job = Job(FakePool(dies={"p01": None}), n=6, workers=1, shard_size=3, inflight=2,
              max_retries=0, max_restarts=5)
    job.run()
    assert job.status() == ok_but(6, "p01")
    assert job.rows["p01"][0]["error"] == f"failed 1 times: {DIED}"
    first, *after = job.pool.runs
    assert first.ids == ids(0, 1, 2) and [s.ids for s in first.beside] == [ids(3, 4, 5)]
    assert [s.ids for s in after] == [ids(i) for i in range(6)] and not any(s.beside for s in after)
    assert set(job.d.attempts.values()) == {0}   # the six queued uncharged (p01's 1 failed it)


def test_a_death_with_one_shard_unfinished_charges_it():
    job = Job(FakePool(dies={"p00": None}), n=1, workers=1, shard_size=1, max_retries=1,
              max_restarts=5)
    job.run()
    assert job.status() == {"p00": "failed"}
    assert job.rows["p00"][0]["error"] == f"failed 2 times: {DIED}"
    assert generated(job.pool) == [ids(0), ids(0)] and job.pool.started == [0, 0]   # no work left


def test_a_poison_row_that_kills_its_worker_is_isolated_and_recorded_failed():
    job = Job(FakePool(dies={"p07": None}), n=12, workers=2, shard_size=3, max_retries=2,
              max_restarts=10)
    job.run()
    assert job.status() == ok_but(12, "p07")
    assert job.rows["p07"][0]["error"] == f"failed 3 times: {DIED}"
    first, *later = [s for s in job.pool.runs if "p07" in s.ids]
    assert len(first.ids) == 3 and all(s.ids == ids(7) and not s.beside for s in later)


def test_a_death_while_writing_requeues_the_shard_as_it_was():
    job = Job(FakePool(dies_writing={"p01": 1}), n=6, workers=1, shard_size=3, inflight=1)
    job.run()
    assert job.status() == ok_but(6)
    assert generated(job.pool) == [ids(0, 1, 2), ids(0, 1, 2), ids(3, 4, 5)]   # not split
    assert job.d.attempts == {} and job.d.suspects == set()


def test_rows_that_finished_before_a_death_are_kept():
    """The worker dies just after p00-p02's rows are in; the death is seen first."""
    job = Job(FakePool(dies_after={"p02": 1}), n=6, workers=1, shard_size=3, inflight=2)
    job.run()
    assert job.status() == ok_but(6)
    assert generated(job.pool) == [ids(0, 1, 2), ids(3), ids(4), ids(5)]   # p03-p05 never started


def test_restarts_are_limited_per_slot():
    slots = []
    job = Job(FakePool(dies={"p00": None}), n=3, workers=1, shard_size=1, max_retries=100,
              max_restarts=2, slots=slots)
    with pytest.raises(DispatchError, match=r"every worker is gone and none could be restarted "
                                            r"\(worker 0: actor died \(exit 70\)\); 3 shards"):
        job.run()
    assert job.pool.started == [0, 0, 0] and [s.restarts for s in slots] == [2]
    assert job.rows == {}


def test_all_workers_gone_is_an_error_naming_each():
    job = Job(FakePool(dies={"p00": None}), n=4, workers=2, shard_size=1, max_retries=100,
              max_restarts=1)
    died = re.escape(DIED)
    with pytest.raises(DispatchError, match=rf"worker 0: {died}; worker 1: {died}\); 1 shards"):
        job.run()
    assert sorted(job.pool.started) == [0, 0, 1, 1]
    assert job.status() == {"p01": "ok", "p02": "ok", "p03": "ok"}   # what finished is kept


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


# -- the boundaries -------------------------------------------------------------------------------

def test_the_worker_implements_the_contract():
    """The actor's methods as the driver calls them (RayPool, runner.job): names, parameters and
    types match the Protocol."""
    from runner.actor import WorkerActor
    from runner.worker import Worker, WorkerContract
    names = [n for n in vars(WorkerContract) if not n.startswith("_")]
    assert sorted(names) == ["finish_shard", "metrics", "phases", "start_shard", "warmup"]
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
        from runner import job
        j = split(load_config(["job=demo_image", "compile.mode=O3", "output.dir={tmp_path}"]))
        assert "cudagraphs" in j["compile"].options.flags
        limits = job.constraints(j["model"])
        job.worker_config(j, limits, on_gpu=False)
        import ray
        from runner.actor import WorkerActor
        ray.remote(WorkerActor)
        print(sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules))
    """
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


def test_ray_pool_maps_ray_errors(monkeypatch):
    """RayPool on a stand-in for Ray: our code's exception is a TaskError showing its cause; a
    lost actor, even where Ray's class for it subclasses RayTaskError, is a WorkerLost."""
    from runner import raypool

    class RayError(Exception):
        pass

    class RayTaskError(RayError):
        def __init__(self, cause):
            super().__init__("a long Ray traceback")
            self.cause = cause

    class RayActorError(RayTaskError):
        def __init__(self, text):
            RayError.__init__(self, text)
    raised = []

    def get(ref):
        raise raised.pop()
    monkeypatch.setattr(raypool, "ray", SimpleNamespace(get=get, exceptions=SimpleNamespace(
        RayError=RayError, RayTaskError=RayTaskError, RayActorError=RayActorError)))
    pool = raypool.RayPool(make_actor=None, size=1)
    raised.append(RayTaskError(OSError("No space left on device\nmore lines")))
    with pytest.raises(TaskError, match=r"^OSError: No space left on device$"):
        pool.result(None)
    raised.append(RayActorError("The actor died unexpectedly"))
    with pytest.raises(WorkerLost, match="^RayActorError: The actor died unexpectedly$"):
        pool.result(None)


def test_ray_pool_wait_returns_every_finished_future_at_once(monkeypatch):
    """Under load one dispatch-loop iteration takes every finished shard, not one per wait."""
    from runner import raypool
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
    source (only runner/raypool.py does), nor when imported."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for name in ("dispatch", "job", "progress", "summary"):
        tree = ast.parse((root / "runner" / f"{name}.py").read_text())
        mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        mods += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in mods if m.split(".")[0] == "ray"], name
    code = ("import sys, runner.dispatch, runner.job, runner.progress; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_shards_split_get_fresh_indices():
    """Split rows are new shards (their own attempts and suspicion), numbered after the plan's."""
    job = Job(FakePool(raises={"p01": 1}), n=3, workers=1, shard_size=3)
    job.run()
    assert job.d.next_index == 4 and sorted(job.d.suspects) == [1, 2, 3]
