"""The elastic pool's rules (runner/driver/dispatch.py with a `Cluster`) on tests/test_dispatch.py's in-memory
pool and a scripted cluster: GPUs that arrive, nodes that die or drain, a GPU type too small, no GPU
at all. No Ray, a fake clock; tests/test_autoscaling_jobs.py runs the same on Ray's own autoscaler.

`FakeCluster`'s script is a list of events, each `(when, what, *args)`: `when` a number of
generated shards (the pool's `runs`) or `("t", seconds)` of the fake clock; `what` "add" (a node
id, its GPUs, its GPU type), "kill" (a node: its workers die with it; `quiet=True`: as Ray reports
a raylet's death, the workers' first, the node's later), "drain" (a node and the seconds to its
deadline)."""

import dataclasses
import logging

import pytest

from runner.driver.cluster import View, type_fits, view
from runner.driver.dispatch import (DRAIN_MARGIN_S, IDLE_STOP_S, Dispatcher, NodeLost, NoRoom,
                             WorkerLost)
from runner.io.prompts import plan_shards
from test_dispatch import FakePool, items as dispatch_items


class ElasticPool(FakePool):
    """FakePool whose workers are placed on the cluster's nodes (`start(rank, node)`) and lost
    with them (a message starting "NODE:" is a `NodeLost`), and whose shards take `shard_s` of
    the fake clock each (the clock moves 1 s a wait while nothing can run)."""

    def __init__(self, cluster, shard_s=2.0, **kw):
        super().__init__(**kw)
        self.cluster, self.node_of, self.shard_s, self.gone = cluster, {}, shard_s, set()
        cluster.pool = self

    def start(self, rank, node=None):
        w, warm = super().start(rank)
        self.node_of[id(w)] = node
        self.cluster.used[node] = self.cluster.used.get(node, 0) + 1
        return w, warm

    def submit(self, w, seq, items):
        start, finish = super().submit(w, seq, items)
        start.not_before = self.now + self.shard_s
        return start, finish

    def result(self, f):
        if f.state == "lost" and str(f.value).startswith("NODE:"):
            raise NodeLost(f.value)
        return super().result(f)

    def _warm(self, f):
        if f.plan == "ok":           # the ready info names its node, as a worker's does
            return self._resolve(f, "ok", {"rank": f.worker.rank,
                                           "node_id": self.node_of[id(f.worker)]})
        return super()._warm(f)

    def _die(self, w, why):
        super()._die(w, why)
        if w not in self.gone:       # its GPU is free again
            self.gone.add(w)
            self.cluster.used[self.node_of.get(id(w))] -= 1

    def _step(self):
        self.cluster.tick()
        heads = [w.calls[0] for w in self.workers if w.calls and w.calls[0].plan != "hang"
                 and getattr(w.calls[0], "not_before", 0) <= self.now]
        if not heads:
            return False
        f = min(heads, key=lambda f: f.n)
        {"warm": self._warm, "start": self._start, "finish": self._finish,
         "canary": self._canary}[f.kind](f)
        return True


class FakeCluster:
    def __init__(self, events=(), nodes=(), max_gpus=None, need_gib=None):
        self.events = sorted(events, key=lambda e: e[0])
        self.nodes = {}                         # id -> dict(gpus, type, alive, drain)
        for n in nodes:
            self.add(*((n,) if isinstance(n, str) else n))
        self.used: dict = {}
        self.max_gpus, self.need_gib = max_gpus, need_gib
        self.wanted, self.excluded, self.pool = [], {}, None

    def tick(self):
        while self.events and self.pool.now >= self.events[0][0]:
            _, what, *args = self.events.pop(0)
            getattr(self, what)(*args)

    def add(self, node, gpus=1, kind="H100"):
        self.nodes[node] = dict(gpus=gpus, type=kind, alive=True, drain=None)

    def kill(self, node, quiet=False):
        """The node vanishes; `quiet`: its workers' deaths come first, as plain losses (a raylet
        SIGKILLed), and Ray reports the node dead at `dead_now`."""
        self.nodes[node]["alive"] = "until reported" if quiet else False
        for w in list(self.pool.workers):
            if self.pool.node_of.get(id(w)) == node and w not in self.pool.gone:
                self.pool._die(w, "the worker process ended" if quiet else f"NODE: {node} died")

    def dead_now(self, node):
        self.nodes[node]["alive"] = False

    def drain(self, node, in_s):
        self.nodes[node]["drain"] = self.pool.now + in_s

    def poll(self):
        rows = [dict(NodeID=n, Alive=d["alive"] is not False,
                     Resources={"GPU": d["gpus"], "CPU": d["gpus"],
                                f"accelerator_type:{d['type']}": 1}) for n, d in self.nodes.items()]
        free = {n: {"GPU": d["gpus"] - self.used.get(n, 0), "CPU": d["gpus"] - self.used.get(n, 0)}
                for n, d in self.nodes.items()}
        draining = {n: int(d["drain"] * 1000) for n, d in self.nodes.items() if d["drain"]}
        return view(rows, free, draining, self.max_gpus,
                    lambda n, t: t not in self.excluded and type_fits(t, self.need_gib))

    def want(self, n):
        if not self.wanted or self.wanted[-1] != n:
            self.wanted.append(n)

    def exclude(self, node, why):
        self.excluded[self.nodes[node]["type"]] = why


def items(n):
    return [dataclasses.replace(it, id=f"r{i:03d}") for i, it in enumerate(dispatch_items(n))]


def run(cluster, n_rows=40, shard=1, min_workers=1, max_workers=None, pool=None, **kw):
    """The dispatcher over `cluster` until done: (dispatcher, pool, rows, stopped workers)."""
    opts = {k: kw.pop(k) for k in ("max_restarts", "gpu_wait_s") if k in kw}
    pool = pool or ElasticPool(cluster, **kw)
    got, stopped = [], []
    d = Dispatcher(pool, min_workers, plan_shards(items(n_rows), shard, set()), got.extend,
                   clock=lambda: pool.now, wall=lambda: pool.now, cluster=cluster,
                   max_workers=max_workers, on_stop=lambda s, why: stopped.append((s.rank, why)),
                   **opts)
    d.run()
    return d, pool, got, stopped


def exactly_once(got, n):
    assert sorted(r["id"] for r in got) == [f"r{i:03d}" for i in range(n)], "every row once"
    assert all(r["status"] == "ok" for r in got)


def node(pool, w):
    return pool.node_of[id(w)]


def test_view_places_free_gpus_of_fitting_live_nodes_not_draining():
    rows = [dict(NodeID="a", Alive=True, Resources={"GPU": 2, "CPU": 4, "accelerator_type:H100": 1}),
            dict(NodeID="b", Alive=True, Resources={"GPU": 1, "CPU": 1, "accelerator_type:T4": 1}),
            dict(NodeID="c", Alive=True, Resources={"GPU": 1, "CPU": 1}),
            dict(NodeID="d", Alive=False, Resources={"GPU": 1}),
            dict(NodeID="e", Alive=True, Resources={"GPU": 4, "CPU": 4, "accelerator_type:A100": 1}),
            dict(NodeID="h", Alive=True, Resources={"CPU": 8})]
    free = {"a": {"GPU": 2, "CPU": 4}, "b": {"GPU": 1, "CPU": 1}, "c": {"GPU": 1, "CPU": 0},
            "e": {"GPU": 4, "CPU": 4}}
    v = view(rows, free, {"e": 5000}, 8, lambda n, t: type_fits(t, 40.0))
    # b's T4 too small; c has no free CPU for the worker; d dead; e draining (A100: 40 or 80 GB,
    # not known: it would be tried)
    assert v.places == ["a", "a"]
    assert v.dead == {"d"} and v.draining == {"e": 5.0} and v.unfit == {"T4": 1}
    assert (v.gpus, v.free) == (8, 8)
    assert "8 GPUs (8 free) on 4 nodes, 1 draining" in v.text() and "can grow to 8" in v.text()


def test_scales_up_from_zero_gpus_to_three_and_asks_for_none_at_the_end():
    c = FakeCluster([(3, "add", "n1"), (4, "add", "n2"), (5, "add", "n3")], max_gpus=3)
    d, pool, got, _ = run(c, n_rows=60)
    exactly_once(got, 60)
    assert sorted(pool.started) == [0, 1, 2]                 # a worker on each GPU that joined
    assert {node(pool, w) for w in pool.workers} == {"n1", "n2", "n3"}
    assert c.wanted[0] == 3 and c.wanted[-1] == 0            # the cluster's 3, then none
    assert {r for s in pool.runs for r in s.ids} and len({s.worker.rank for s in pool.runs}) == 3
    assert not d.losses


def test_asks_for_no_more_than_max_workers_and_starts_no_more():
    c = FakeCluster(nodes=["a", "b", "c", "d"], max_gpus=4)
    d, pool, got, _ = run(c, n_rows=30, max_workers=2)
    exactly_once(got, 30)
    assert len(pool.started) == 2 and max(c.wanted) == 2


def test_a_node_that_joins_mid_job_gets_a_worker_that_serves():
    c = FakeCluster([(20, "add", "late")], nodes=["n1"])
    d, pool, got, _ = run(c, n_rows=40)
    exactly_once(got, 40)
    assert [node(pool, w) for w in pool.workers] == ["n1", "late"]
    assert any(node(pool, s.worker) == "late" for s in pool.runs), "the new worker generated rows"


@pytest.mark.parametrize("quiet", [False, True], ids=["node-reported", "raylet-killed"])
def test_five_preemptions_cost_no_restart_and_no_row(quiet):
    events = []
    for k, (at, victim) in enumerate([(10, "n0"), (20, "n1"), (30, "n2"), (40, "m1"), (50, "m2")]):
        events.append((at, "kill", victim, quiet))
        if quiet:       # Ray's health checks report the node a few seconds after its workers
            events.append((at + 3, "dead_now", victim))
        events.append((at + 2, "add", f"m{k + 1}"))          # the autoscaler replaces it
    c = FakeCluster(events, nodes=["n0", "n1", "n2"])
    d, pool, got, _ = run(c, n_rows=200, max_restarts=1)
    exactly_once(got, 200)
    assert pool.now > 60                                 # the losses were mid-job
    lost = [x for x in d.losses if x["kind"] == "node lost"]
    assert {x["node"] for x in lost} == {"n0", "n1", "n2", "m1", "m2"} and lost == d.losses
    # quiet: a worker may be placed on a node in the seconds before Ray reports it dead (its GPU
    # freed by the first worker's death): it is lost with it, uncharged too
    assert len(lost) == 5 if not quiet else 5 <= len(lost) <= 10
    assert not any(x["charged"] for x in d.losses)
    assert sum(d.charged.values()) == 0 and d.retired == 0
    assert all(x["rows_back"] >= 1 for x in lost)


def test_a_draining_node_gets_no_new_shard_and_its_worker_is_stopped_once_done():
    c = FakeCluster([(6, "drain", "a", DRAIN_MARGIN_S + 60)], nodes=["a", "b"])
    pool = ElasticPool(c)
    subs = []
    real = pool.submit
    pool.submit = lambda w, seq, its: subs.append((pool.now, node(pool, w))) or real(w, seq, its)
    d, pool, got, stopped = run(c, n_rows=40, pool=pool)
    exactly_once(got, 40)
    assert not [t for t, n in subs if n == "a" and t >= 7], "a draining node took a new shard"
    assert any(t >= 7 for t, n in subs if n == "b")
    assert any("draining" in why for _, why in stopped) and not d.losses


def test_a_busy_worker_on_a_draining_node_is_stopped_before_the_deadline():
    c = FakeCluster([(1, "drain", "a", DRAIN_MARGIN_S + 5), (3, "add", "b")], nodes=["a"])
    pool = ElasticPool(c)
    real = pool.submit

    def submit(w, seq, its):                 # the first shard on node a would never end
        start, finish = real(w, seq, its)
        if node(pool, w) == "a" and its[0].id == "r000":
            start.plan = "hang"
        return start, finish
    pool.submit = submit
    d, pool, got, _ = run(c, n_rows=6, pool=pool)
    exactly_once(got, 6)
    loss = next(x for x in d.losses if x["node"] == "a")
    assert "draining" in loss["cause"] and not loss["charged"] and loss["rows_back"] >= 1
    assert 6 <= loss["at"] <= 8     # DRAIN_MARGIN_S before the deadline (36 s), within a poll


def test_no_gpu_at_all_stops_with_no_room_naming_what_it_waited_for(caplog):
    caplog.set_level(logging.INFO, "runner")
    with pytest.raises(NoRoom) as e:
        run(FakeCluster(), n_rows=4, gpu_wait_s=40)
    text = str(e.value)
    assert "in 40 s (ray.gpu_wait_s)" in text and "waited for 1 GPU " in text
    assert "0 GPUs (0 free) on 0 nodes" in text
    lines = [r.getMessage() for r in caplog.records if "waiting for GPUs: 0 of 1" in r.getMessage()]
    assert 2 <= len(lines) <= 4                          # a line every 15 s, not every second


def test_every_node_lost_and_none_coming_stops_with_no_room():
    c = FakeCluster([(10, "kill", "a")], nodes=["a"])
    with pytest.raises(NoRoom, match="waited for 1 GPU"):
        run(c, n_rows=40, gpu_wait_s=30)


def test_a_gpu_type_too_small_gets_no_more_workers():
    c = FakeCluster(nodes=[("small", 2, "T4x"), ("big", 1, "H100")])
    pool = ElasticPool(c)
    real = pool._warm

    def warm(f):                              # a type not known to be small: its workers find out
        if node(pool, f.worker) == "small":
            return pool._resolve(f, "error", "GpuTooSmall: needs about 30 GiB; T4x has 15 GiB")
        return real(f)
    pool._warm = warm
    d, pool, got, _ = run(c, n_rows=20, min_workers=3, pool=pool)
    exactly_once(got, 20)
    on_small = [w for w in pool.workers if node(pool, w) == "small"]
    assert len(on_small) == 2 and "T4x" in c.excluded    # tried once, never again
    assert not any(x["charged"] for x in d.losses) and d.retired == 0
    assert {x["kind"] for x in d.losses} == {"GPU too small"}


def test_a_known_small_type_is_never_tried():
    c = FakeCluster(nodes=[("small", 2, "T4"), ("big", 1, "H100")], need_gib=30.0)
    d, pool, got, _ = run(c, n_rows=10, min_workers=3)
    exactly_once(got, 10)
    assert {node(pool, w) for w in pool.workers} == {"big"}


def test_the_tail_stops_idle_workers_and_counts_their_idle_seconds():
    c = FakeCluster(nodes=["n0", "n1", "n2"])
    pool = ElasticPool(c)
    real_submit, real_wait = pool.submit, pool.wait

    def submit(w, seq, its):                 # the last row takes 30 s: the others go idle
        start, finish = real_submit(w, seq, its)
        if its[0].id == "r006":
            start.not_before = pool.now + 30
        return start, finish
    pool.submit = submit
    d, pool, got, stopped = run(c, n_rows=7, pool=pool)
    exactly_once(got, 7)
    assert len([r for r, why in stopped if why.startswith("idle")]) == 2
    assert 2 * IDLE_STOP_S <= d.idle_s <= 2 * (IDLE_STOP_S + 2)


def test_deaths_of_its_own_are_charged_and_end_its_budget():
    c = FakeCluster(nodes=["n0"])
    d, pool, got, _ = run(c, n_rows=12, max_restarts=1, dies={"r001": 1, "r003": 1, "r005": 1})
    exactly_once(got, 12)             # each row died once, then ran alone: innocent
    own = [x for x in d.losses if x["kind"] == "worker's own"]
    assert len(own) == 3 and sum(x["charged"] for x in own) >= 2
    assert d.retired == 1             # rank 0 used its budget; a new rank finished the job
    assert 1 in pool.started
