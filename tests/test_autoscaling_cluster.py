"""Smoke tests of tests/autoscaling.py: Ray's own autoscaler (v1, fake multi-node provider) on one
module-scoped cluster, each test leaving it with no worker nodes (`reset`) and within its own
guard. What the job tests rely on: the autoscaler launches GPU nodes for a resource request and
releases them once it is withdrawn; a SIGKILLed node is dead within DEAD_WITHIN_S with its cause;
a drain shows in the driver's `get_draining_nodes` with its deadline and the node goes at it, as
preempted; a node added by hand joins; shutdown leaves no process of the cluster."""
import os
import resource
import subprocess
import sys
import time

import pytest

from autoscaling import DEAD_WITHIN_S, IDLE_TIMEOUT_MIN, autoscaling_cluster, time_guard

pytestmark = pytest.mark.e2e

GPU_NODES = {"gpu": {"resources": {"CPU": 1, "GPU": 1, "accelerator_type:H100": 1},
                     "node_config": {}, "min_workers": 0, "max_workers": 3}}
GUARD_S = 300      # per test: a hang guard; the waits inside are bounded tighter


@pytest.fixture(scope="module")
def cluster():
    with time_guard(GUARD_S, "the autoscaling cluster's start"):
        cm = autoscaling_cluster(GPU_NODES, head_resources={"CPU": 2})
        c = cm.__enter__()
    try:
        yield c
    finally:
        cm.__exit__(None, None, None)      # raises if a process of the cluster is left
        assert c.processes() == []


@pytest.fixture
def guarded(cluster):
    with time_guard(GUARD_S):
        yield cluster
        cluster.reset()


def test_a_resource_request_launches_gpu_nodes_and_withdrawing_it_releases_them(guarded):
    c = guarded
    assert c.worker_nodes() == []
    c.request_resources([{"GPU": 1}] * 2)
    nodes = c.wait_nodes(2, timeout=120, resource="GPU")
    assert {n.node_type for n in nodes} == {"gpu"}
    assert all(n.resources["GPU"] == 1 and n.resources["accelerator_type:H100"] == 1
               and n.resources["CPU"] == 1 for n in nodes)
    t0 = time.monotonic()
    c.request_resources([])
    c.wait_nodes(0, timeout=60)
    # released once idle (6 s) and the autoscaler's next round: well under a minute
    assert time.monotonic() - t0 < IDLE_TIMEOUT_MIN * 60 + 30
    dead = [n for n in c.nodes(alive=False) if n.node_id in {x.node_id for x in nodes}]
    # the autoscaler's own words, or the raylet's when its SIGTERM reached it first (under load)
    assert {n.death_reason for n in dead} == {"EXPECTED_TERMINATION"}
    assert {n.death_message for n in dead} <= {"Terminated by autoscaler.", "received SIGTERM"}


def test_max_resources_from_cluster_config_is_none_until_a_config_is_reported(guarded):
    """The figure the driver wants (how many GPUs the cluster can grow to): no autoscaler of the
    2.60 wheel reports the cluster config, so a driver gets None; once reported, the GPU max."""
    assert guarded.max_resources_from_cluster_config() is None
    guarded.report_cluster_config()
    got = guarded.max_resources_from_cluster_config()
    assert got["GPU"] == 3 and got["accelerator_type:H100"] == 3 and got["CPU"] == 2 + 3


HOLDER = """
import ray, sys, time
ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_gpus=1, max_restarts=0)
class Holder:
    def node(self):
        return ray.get_runtime_context().get_node_id()

hs = [Holder.remote() for _ in range(int(sys.argv[2]))]
print(" ".join(ray.get([h.node.remote() for h in hs], timeout=120)), flush=True)
time.sleep(600)
"""


def test_a_killed_node_is_dead_within_the_bound_and_a_drained_one_goes_at_its_deadline(guarded):
    """Two GPU nodes, each busy with an actor of a driver (an idle node that is drained exits at
    once: it has nothing to finish). One SIGKILLed: dead within DEAD_WITHIN_S, unexpectedly; the
    other drained for preemption: draining with its deadline in the driver's view, alive until
    the deadline, then killed and dead as preempted."""
    c = guarded
    c.request_resources([{"GPU": 1}] * 2)
    c.wait_nodes(2, timeout=120, resource="GPU")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, c.address, "2"], env=c.env,
                              stdout=subprocess.PIPE, text=True)
    try:
        busy = holder.stdout.readline().split()
        assert len(set(busy)) == 2, busy
        killed, drained = busy
        t0 = time.monotonic()
        c.kill_node(killed)
        dead = c.wait_dead(killed, timeout=DEAD_WITHIN_S)
        print(f"killed node dead after {time.monotonic() - t0:.1f} s")
        assert dead.death_reason == "UNEXPECTED_TERMINATION"

        deadline_ms = c.drain_node(drained, deadline_s=5)
        seen = c.run_driver("import json\n"
                            "print(json.dumps(ray._private.state.state.get_draining_nodes()))")
        assert seen == {drained: deadline_ms}
        assert [n.draining for n in c.nodes() if n.node_id == drained] == [True]
        gone = c.wait_dead(drained, timeout=5 + DEAD_WITHIN_S + 5)
        assert time.time() * 1000 >= deadline_ms
        assert (gone.death_reason, gone.death_message) == (
            "AUTOSCALER_DRAIN_PREEMPTED", "preempted by the test's cloud")
    finally:
        holder.kill()
        holder.wait(30)
        holder.stdout.close()


def test_a_node_added_by_hand_joins_and_is_the_clusters_to_shut_down(guarded):
    c = guarded
    node = c.add_node({"CPU": 1, "GPU": 1, "accelerator_type:L40S": 1})
    assert node.node_type is None and node.resources["accelerator_type:L40S"] == 1
    assert [n.node_id for n in c.worker_nodes()] == [node.node_id]
    # shutdown finds its processes by the cluster's temp dir (the fixture checks none is left)
    assert any(f"--node_id={node.node_id}" in p for p in c.processes())


@pytest.mark.skipif(not os.environ.get("RUNNER_MEASURE_AUTOSCALING"),
                    reason="a measurement on a cluster of its own (~30 s): "
                           "RUNNER_MEASURE_AUTOSCALING=1 pytest -s to run it")
def test_costs_of_the_cluster_and_a_node():
    """Measures (printed, run with -s): wall and CPU seconds of starting a cluster, of a node the
    autoscaler launches, and of the cluster idling 10 s. Bounds are hang guards, not targets.
    The figures: tests/autoscaling.py's docstring."""
    with time_guard(GUARD_S):
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        with autoscaling_cluster(GPU_NODES, head_resources={"CPU": 2}) as c:
            start_wall = time.monotonic() - t0
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            start_cpu = c.cpu_seconds() + (ru1.ru_utime + ru1.ru_stime
                                           - ru0.ru_utime - ru0.ru_stime)
            idle0 = c.cpu_seconds()
            time.sleep(10)
            idle_cpu = c.cpu_seconds() - idle0
            before = c.cpu_seconds()
            ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t1 = time.monotonic()
            c.request_resources([{"GPU": 1}])
            c.wait_nodes(1, timeout=120)
            node_wall = time.monotonic() - t1
            ru3 = resource.getrusage(resource.RUSAGE_CHILDREN)
            driver_cpu = ru3.ru_utime + ru3.ru_stime - ru2.ru_utime - ru2.ru_stime
            node_cpu = c.cpu_seconds() - before - idle_cpu / 10 * node_wall
        print(f"\ncluster start: {start_wall:.1f} s wall, {start_cpu:.1f} CPU-s; idle 10 s: "
              f"{idle_cpu:.1f} CPU-s; a launched node: {node_wall:.1f} s wall, {node_cpu:.1f} "
              f"CPU-s (+ {driver_cpu:.1f} CPU-s of the requesting driver); load "
              f"{os.getloadavg()[0]:.1f}")
        assert start_wall < 180 and node_wall < 120
