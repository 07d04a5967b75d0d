"""A real autoscaling Ray cluster on this machine for tests: Ray's own autoscaler (the `monitor`
process `ray start --head --autoscaling-config` starts) with Ray's fake multi-node provider, which
starts each worker node it launches as real Ray processes here (a raylet and its agents, with the
node type's resources: fake GPUs, tiny models on CPU), as `ray.cluster_utils.AutoscalingCluster`
does, but isolated from every other Ray on the machine:

    with autoscaling_cluster({"gpu": {"resources": {"CPU": 1, "GPU": 1,
                                                    "accelerator_type:H100": 1},
                                      "node_config": {}, "min_workers": 0, "max_workers": 3}},
                             head_resources={"CPU": 2}) as cluster:
        cluster.request_resources([{"GPU": 1}] * 2)        # from a short-lived driver process
        nodes = cluster.wait_nodes(2, timeout=120)        # alive worker nodes, ids and resources
        cluster.kill_node(nodes[0].node_id)               # a spot VM vanishing (SIGKILL)
        cluster.drain_node(nodes[1].node_id, deadline_s=5)  # a preemption notice, killed at 5 s
        extra = cluster.add_node({"CPU": 1, "GPU": 1})    # a machine a user adds by hand
        run(["python", "-m", "runner", f"ray.address={cluster.address}", ...], env=cluster.env)

Why not AutoscalingCluster itself: its base config (`fake_multi_node/example.yaml`) is not in the
Ray wheel, and its start() and shutdown() run `ray stop --force`, which kills every Ray on the
machine (the session's shared cluster, other tests' under pytest -n). Here: the base config is
written out below (BASE_CONFIG, the upstream example.yaml's fields) and completed by
AutoscalingCluster's own `_generate_config`; the head starts as AutoscalingCluster.start starts it
(RAY_FAKE_CLUSTER=1, AUTOSCALER_UPDATE_INTERVAL_S=1) on free ports, in a temp dir of its own, with
token auth off as in tests/test_cluster.py; the provider's `gcs_address` is the head's GCS (the
provider otherwise starts nodes against port 6379). Shutdown kills this cluster's processes only
(tests/conftest.py `stop_ray`): the fake nodes are started by the monitor process with the head's
temp dir (a non-head `Node` takes the head's), so their raylets' and log monitors' command lines
name it, and their agents are the raylets' children; nodes added by `add_node` name it too.

Autoscaler v1 (the default; what KubeRay runs unless told otherwise). v2 (`autoscaler_v2=True`,
`ray up`'s default from 2.60) cannot run with this wheel: its monitor reads the missing
example.yaml itself, as the fake provider's defaults (`providers._get_default_config`), fails
every round and launches nothing; `start()` says so at once. Idle nodes go after
IDLE_TIMEOUT_MIN (6 s) and a launch asks for every node the demand needs at once
(UPSCALING_SPEED).

Node IPs: Ray turns `--node-ip-address=127.0.0.1` into the machine's own address (`services.
resolve_ip_for_localhost`), for the session's cluster too, so every node of this cluster has that
IP (node ids tell them apart); the GCS listens on all interfaces, so `address` is 127.0.0.1:PORT.

Health checks (HEALTH_CHECKS, the head's --system-config, which every raylet of the cluster takes
from the GCS): a check every 500 ms, 3 failed in a row -> dead. A SIGKILLed raylet refuses the
checks at once, so it is dead ~1.5 s after the kill at most (period x threshold, plus the 500 ms
timeout where it does not refuse); measured 1.1-1.5 s (kill to the GCS's "dead", 4 runs, load
4-10 on the 2 cores). DEAD_WITHIN_S (10 s) is the bound tests assert, with CI's margin. Ray's
defaults (3 s period, 5 failures, 10 s timeout) would take 15 s, by the same arithmetic.

Costs on the 2-core machine (test_costs_of_the_cluster_and_a_node, 2026-12-02, the machine shared
with other agents: load 4-16): starting the cluster 18 CPU-s, 18 s wall at load 4 and 40-50 s at
load 9-16 (GCS, head raylet, the autoscaler, the head's dashboard process and Ray client server,
log monitor, dashboard and runtime-env agents: `ray start` has no flag to skip the agents or the
client server); idle, 0.04 CPU-s a second; a node the autoscaler launches 5.4 CPU-s, 11-12 s wall
from the request (raylet, its log monitor, dashboard and runtime-env agents; no prestarted
workers), plus 1.5 CPU-s for the short-lived driver that asks for it. Share one cluster per
module (scope="module") and `reset()` between tests.

FINDINGS (Ray 2.60, v1, measured with this module; what a driver sees of an actor whose node
goes, `max_restarts=0`):
- (a) node SIGKILLed: `ray.get` of an in-flight call raises `ray.exceptions.ActorDiedError`
  (subclass of RayActorError), `.preempted` False, text "The actor died unexpectedly before
  finishing this task. ... The actor died because its node has died. Node Id: <hex>\n\tthe
  actor's node was terminated unexpectedly: health check failed due to missing too many
  heartbeats"; 1.1 s after the kill, the same moment the GCS marks the node dead. Later calls
  raise the same at once.
- (b) drained with DRAIN_NODE_REASON_PREEMPTION (deadline 4 s), killed at the deadline: nothing
  fails before the kill (the in-flight call runs on through the drain); then the same
  `ActorDiedError` with `.preempted` True and "...the actor's node was preempted: <the drain's
  reason_message>", 1.1 s after the kill. While draining, the driver's
  `ray._private.state.state.get_draining_nodes()` is {node id hex: deadline ms}, and the node is
  still alive in `ray.nodes()`. A drained node with nothing running (no actor, no task) exits at
  once, without waiting for the deadline (dead as AUTOSCALER_DRAIN_PREEMPTED).
- `ray.nodes()` entries of dead nodes carry "DeathReason" (int, `NodeDeathInfo.Reason`:
  2 UNEXPECTED_TERMINATION for a kill, 3 AUTOSCALER_DRAIN_PREEMPTED after a preemption drain, 1
  EXPECTED_TERMINATION for the autoscaler's idle release) and "DeathReasonMessage" ("health check
  failed due to missing too many heartbeats" / the drain's reason_message / "Terminated by
  autoscaler."); `nodes()` here gives the names.
- `ray._private.state.state.get_max_resources_from_cluster_config()` is None here, under v1 and
  (from the code) v2 alike: it reads a ClusterConfig that only a ReportClusterConfig call
  publishes, and nothing in the 2.60 wheel's Python makes one. Once `report_cluster_config()`
  has (as a platform that reports it would): {"GPU": 3, "CPU": 5, ...}, i.e. the sum over node
  types of max_workers x resources (the head counted once).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from conftest import free_ports, stop_ray

RAY = [sys.executable, "-m", "ray.scripts.scripts"]

# The upstream python/ray/autoscaler/_private/fake_multi_node/example.yaml (ray-project/ray), which
# AutoscalingCluster._generate_config reads from the installed package and the wheel lacks: the
# fields it keeps (available_node_types is replaced by the test's, the head type added).
BASE_CONFIG = {
    "cluster_name": "fake_multinode",
    "max_workers": 8,
    "provider": {
        "type": "fake_multinode",
        # the autoscaler matches a launched node to its raylet by node id (the provider sets each
        # node's id, RAY_OVERRIDE_NODE_ID_FOR_TESTING), not by IP: all nodes here share one IP
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    },
    "available_node_types": {},
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}

IDLE_TIMEOUT_MIN = 0.1     # a node idle this long is released (plus one update, 1 s)
UPSCALING_SPEED = 100.0    # launch every node the demand needs at once, not 1 + 100 % a round
# The object store of a fake node, unless its type says otherwise: Ray's default is 30 % of the
# machine's memory (a share of /dev/shm) per node; the tiny models need little.
OBJECT_STORE_BYTES = 100 * 2**20

# A SIGKILLed raylet is found dead by the GCS's health checks: a check every 500 ms, each failing
# after 500 ms without an answer, 3 failed in a row -> dead. Also no prestarted idle workers (each
# a Python process importing Ray, ~1 CPU-s on the 2-core machine) on nodes a test may never use.
HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_timeout_ms": 500,
                 "health_check_failure_threshold": 3}
SYSTEM_CONFIG = {**HEALTH_CHECKS, "enable_worker_prestart": False,
                 "prestart_worker_first_driver": False}
DEAD_WITHIN_S = 10.0       # bound for tests: measured 1.1-1.5 s (module docstring), CI's margin

START_TIMEOUT_S = 180      # `ray start --head`; 42 s seen on the 2-core machine under load
# A node launched or added until alive in the GCS: 11-12 s idle (5.4 CPU-s); a bound against a
# hang, not a speed, so with room for the 2 cores shared with a busy suite
NODE_TIMEOUT_S = 300

# Everything of the test session's environment but its cluster (RAY_ADDRESS): auth off, as one
# cluster's processes must agree on it (Ray 2.60 turns token auth on for local clusters).
ENV = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
       "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

PREEMPTION = "DRAIN_NODE_REASON_PREEMPTION"
IDLE_TERMINATION = "DRAIN_NODE_REASON_IDLE_TERMINATION"


@dataclasses.dataclass
class Node:
    """One node as the GCS reports it."""
    node_id: str                 # hex
    alive: bool
    is_head: bool
    resources: dict              # total resources, e.g. {"CPU": 1.0, "GPU": 1.0, ...}
    node_type: str | None        # the autoscaler's node type (ray.io/node-group label), if any
    death_reason: str | None     # e.g. "UNEXPECTED_TERMINATION", "EXPECTED_TERMINATION"
    death_message: str | None
    draining: bool               # the GCS reports it as draining (DrainNode accepted)


class ClusterError(RuntimeError):
    """A wait that ran out, or an operation the cluster refused; says which and what it saw."""


class AutoscalingRay:
    """One autoscaling cluster (see the module docstring). `start()` once, `shutdown()` always
    (the `autoscaling_cluster` context manager does both). Not thread-safe beyond the deadline
    kills `drain_node` schedules."""

    def __init__(self, worker_node_types: dict, head_resources: dict | None = None,
                 autoscaler_v2: bool = False, system_config: dict | None = None,
                 env: dict | None = None, **config_kwargs):
        """`worker_node_types`: the autoscaler's available_node_types for workers (resources may
        name CPU, GPU, object_store_memory and custom resources; min_workers / max_workers).
        `head_resources`: the head's (default 2 CPUs, no GPU). `config_kwargs` go into the cluster
        config (e.g. idle_timeout_minutes). `system_config` adds to SYSTEM_CONFIG; `env` to ENV
        for the head's processes (the autoscaler and the nodes it starts inherit it)."""
        from ray.cluster_utils import AutoscalingCluster
        types = copy.deepcopy(worker_node_types)
        for t in types.values():
            t.setdefault("node_config", {})
            t["resources"].setdefault("object_store_memory", OBJECT_STORE_BYTES)
        self.head_resources = dict(head_resources or {"CPU": 2})
        self.autoscaler_v2 = autoscaler_v2
        kwargs = {"idle_timeout_minutes": IDLE_TIMEOUT_MIN, "upscaling_speed": UPSCALING_SPEED,
                  **config_kwargs}
        # AutoscalingCluster's own config generation (the head type, v2's provider settings),
        # fed BASE_CONFIG instead of the file the wheel lacks
        self.config = _generate_config(AutoscalingCluster, self.head_resources, types,
                                       autoscaler_v2, **kwargs)
        self.system_config = {**SYSTEM_CONFIG, **(system_config or {})}
        self._extra_env = dict(env or {})
        self.env_head: dict = {}   # the head's processes' environment (add_node's base)
        self.temp_dir: str | None = None
        self.gcs_port: int | None = None
        self._gcs = None
        self._added = 0
        self._timers: list[threading.Timer] = []

    # -- what a job needs ------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address for `ray.init` / `ray.address=`: 127.0.0.1:PORT."""
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def env(self) -> dict:
        """Environment for a CLI run (`python -m runner ray.address=...`) or a driver against this
        cluster: the session's without its RAY_ADDRESS, auth off. RAY_ADDRESS is this cluster's,
        so a driver that calls `ray.init()` with no address finds it too."""
        return {**ENV, "RAY_ADDRESS": self.address}

    # -- life cycle ------------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT_S) -> "AutoscalingRay":
        """Starts the head (and so the autoscaler); returns once `ray start` has, i.e. the GCS and
        the head's raylet are up. A port taken between picking and binding it: again on fresh
        ports (3 tries). Raises ClusterError with `ray start`'s output, or at once for v2 where
        the wheel lacks example.yaml (v2's monitor reads it as the fake provider's defaults,
        `providers._get_default_config`, and launches nothing without it)."""
        if self.autoscaler_v2 and not os.path.exists(_example_yaml()):
            raise ClusterError(f"autoscaler v2 needs {_example_yaml()}, which this Ray wheel "
                               f"lacks; use v1 (autoscaler_v2=False)")
        for attempt in range(3):
            self.temp_dir = tempfile.mkdtemp(prefix="ras-", dir="/tmp")  # short: socket paths
            port, client, agent, metrics, env_agent, as_metrics = free_ports(6)
            self.gcs_port = port
            config = copy.deepcopy(self.config)
            config["provider"]["gcs_address"] = self.address
            config_file = os.path.join(self.temp_dir, "autoscaling.json")
            with open(config_file, "w") as f:
                json.dump(config, f)
            env = {**ENV, "TMPDIR": self.temp_dir, "RAY_FAKE_CLUSTER": "1",
                   "AUTOSCALER_UPDATE_INTERVAL_S": "1",
                   # the autoscaler's Prometheus port (default 44217: any other autoscaler's)
                   "AUTOSCALER_METRIC_PORT": str(as_metrics), **self._extra_env}
            if self.autoscaler_v2:   # as AutoscalingCluster.start sets them
                from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
                env.update(RAY_enable_autoscaler_v2="1", RAY_CLOUD_INSTANCE_ID=FAKE_HEAD_NODE_ID,
                           RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID)
            res = dict(self.head_resources)
            cmd = [*RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                   f"--temp-dir={self.temp_dir}", f"--autoscaling-config={config_file}",
                   f"--num-cpus={res.pop('CPU', 0)}", f"--num-gpus={res.pop('GPU', 0)}",
                   f"--object-store-memory={res.pop('object_store_memory', OBJECT_STORE_BYTES)}",
                   "--include-dashboard=false", "--disable-usage-stats",
                   f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
                   f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
                   "--system-config=" + json.dumps(self.system_config, separators=(",", ":"))]
            if res:
                cmd.append("--resources=" + json.dumps(res))
            try:
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
                out = r.stdout[-3000:] + r.stderr[-3000:]
                ok = r.returncode == 0
            except subprocess.TimeoutExpired as e:
                out = f"`ray start --head` ran over {timeout} s: {e.stdout!r} {e.stderr!r}"
                ok = False
            if ok:
                self.env_head = env
                return self
            self._stop_processes()
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            if attempt == 2 or "port" not in out.lower():
                raise ClusterError(f"the autoscaling cluster did not start:\n{out}")
        raise AssertionError("unreachable")

    def shutdown(self) -> None:
        """Kills every process of this cluster (the head's, the autoscaler's, the nodes it
        launched, those `add_node` added; nothing of any other Ray) and removes its temp dir.
        Raises ClusterError naming any process still there after two sweeps."""
        for t in self._timers:
            t.cancel()
        self._gcs = None
        if self.temp_dir is None:
            return
        try:
            self._stop_processes()
            left = self.processes()
            if left:
                self._stop_processes()
                left = self.processes()
            if left:
                raise ClusterError(f"processes of the cluster in {self.temp_dir} outlived its "
                                   f"shutdown: {[p[:200] for p in left]}")
        finally:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _stop_processes(self) -> None:
        # The autoscaler first: it starts nodes, and a node it starts while the rest are being
        # killed would be missed by one sweep.
        import psutil
        monitors = [p for p in psutil.process_iter(["cmdline"])
                    if self._ours(p.info["cmdline"]) and any(
                        a.endswith(("autoscaler/_private/monitor.py", "autoscaler/v2/monitor.py"))
                        for a in p.info["cmdline"] or [])]
        for p in monitors:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(monitors, timeout=30)
        stop_ray(self.temp_dir, self.gcs_port)

    def _ours(self, cmdline) -> bool:
        return any(self.temp_dir in a for a in cmdline or [])

    def processes(self) -> list[str]:
        """`pid cmdline` of every live process of this cluster (named by its temp dir or GCS port,
        as `stop_ray` finds them), for a test's check that nothing is left."""
        import psutil
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            cmd = p.info["cmdline"] or []
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if self._ours(cmd) or any(a.startswith("--address=") and a.endswith(f":{self.gcs_port}")
                                      for a in cmd):
                found.append(f"{p.pid} {' '.join(cmd)}")
        return found

    # -- the GCS's view ---------------------------------------------------------------------

    def gcs(self):
        """A GCS client of this process (no driver, no `ray.init`: the test process may be
        another cluster's driver)."""
        if self._gcs is None:
            from ray._raylet import GcsClient
            self._gcs = GcsClient(address=self.address)
        return self._gcs

    def nodes(self, alive: bool | None = True) -> list[Node]:
        """The cluster's nodes, the head first: alive ones (default), dead ones (False) or all
        (None)."""
        from ray.core.generated import gcs_pb2
        info = self.gcs().get_all_node_info(timeout=10)
        draining = set(self.draining_nodes())
        out = []
        for nid, n in info.items():
            hex_id = nid.hex()
            is_alive = n.state == gcs_pb2.GcsNodeInfo.ALIVE
            if alive is not None and is_alive != alive:
                continue
            death = n.death_info if n.HasField("death_info") else None
            out.append(Node(
                node_id=hex_id, alive=is_alive, is_head=n.is_head_node,
                resources=dict(n.resources_total), node_type=_node_type(n),
                draining=hex_id in draining,
                death_reason=death.DESCRIPTOR.fields_by_name["reason"].enum_type
                .values_by_number[death.reason].name if death else None,
                death_message=death.reason_message if death else None))
        out.sort(key=lambda x: (not x.is_head, x.node_id))
        return out

    def worker_nodes(self) -> list[Node]:
        """The alive nodes other than the head."""
        return [n for n in self.nodes() if not n.is_head]

    def wait_nodes(self, n: int, timeout: float = NODE_TIMEOUT_S,
                   resource: str | None = None) -> list[Node]:
        """Waits until exactly `n` worker nodes are alive (of those with `resource`, if given):
        up (a launch) or down (idle release, a kill). Returns them; ClusterError on timeout,
        naming what there was."""
        end = time.monotonic() + timeout
        while True:
            nodes = [x for x in self.worker_nodes()
                     if resource is None or x.resources.get(resource)]
            if len(nodes) == n:
                return nodes
            if time.monotonic() > end:
                raise ClusterError(f"waited {timeout} s for {n} alive worker nodes"
                                   f"{f' with {resource}' if resource else ''}; there are "
                                   f"{len(nodes)}: {[x.node_id[-8:] for x in nodes]}; "
                                   f"autoscaler: {self.autoscaler_log_tail()}")
            time.sleep(0.25)

    def wait_dead(self, node_id: str, timeout: float = DEAD_WITHIN_S) -> Node:
        """Waits until the GCS reports `node_id` dead; returns its entry (with the death reason).
        ClusterError on timeout."""
        end = time.monotonic() + timeout
        while True:
            dead = [x for x in self.nodes(alive=False) if x.node_id == node_id]
            if dead:
                return dead[0]
            if time.monotonic() > end:
                raise ClusterError(f"node {node_id} not reported dead within {timeout} s")
            time.sleep(0.1)

    def draining_nodes(self) -> dict[str, int]:
        """{node id hex: drain deadline in ms since the epoch (0: none)} of the nodes the GCS
        reports as draining (what `ray._private.state.state.get_draining_nodes()` returns to a
        driver)."""
        return {(k.hex() if hasattr(k, "hex") else k): v
                for k, v in self.gcs().get_draining_nodes().items()}

    def max_resources_from_cluster_config(self) -> dict | None:
        """`ray._private.state.state.get_max_resources_from_cluster_config()` as a driver of this
        cluster gets it (read in a short-lived driver process)."""
        return self.run_driver(
            "import ray, json\n"
            "print(json.dumps(ray._private.state.state.get_max_resources_from_cluster_config()))")

    def report_cluster_config(self) -> None:
        """Publishes the cluster config to the GCS (ReportClusterConfig: the node types' resources
        and max_workers; the head as one node), which `get_max_resources_from_cluster_config()`
        reads (the sum over types of max_count x resources). Neither
        autoscaler of the 2.60 wheel reports it (no Python caller of `report_cluster_config`), so
        without this a driver gets None; this is the case of a platform that does report it."""
        from ray.core.generated import autoscaler_pb2
        groups = [autoscaler_pb2.NodeGroupConfig(
            name=name, resources={k: int(v) for k, v in t["resources"].items()},
            # the head: always one (its type's max_workers is 0, which the max would skip)
            min_count=1 if head else t.get("min_workers", 0),
            max_count=1 if head else t.get("max_workers", 0))
            for name, t in self.config["available_node_types"].items()
            for head in [name == self.config["head_node_type"]]]
        config = autoscaler_pb2.ClusterConfig(node_group_configs=groups)
        self.gcs().report_cluster_config(config.SerializeToString())

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) spent so far by this cluster's live processes and the
        children they have reaped: for measuring what the cluster costs (processes that have
        exited unreaped, e.g. `ray start`'s own, are not counted: add the caller's
        RUSAGE_CHILDREN)."""
        import psutil
        procs = {}
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if self._ours(cmd) or any(a.startswith("--address=") and
                                      a.endswith(f":{self.gcs_port}") for a in cmd):
                with contextlib.suppress(psutil.Error):
                    procs.update((q.pid, q) for q in [p, *p.children(recursive=True)])
        total = 0.0
        for q in procs.values():
            with contextlib.suppress(psutil.Error):
                t = q.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        return total

    def autoscaler_log_tail(self, n: int = 15) -> str:
        """The last lines of the autoscaler's log (monitor.log and .err), for failure messages."""
        logs = os.path.join(self.temp_dir or "", "session_latest", "logs")
        lines = []
        for name in ("monitor.log", "monitor.err"):
            with contextlib.suppress(OSError), open(os.path.join(logs, name)) as f:
                lines += f.readlines()[-n:]
        return "".join(lines[-n:])

    # -- acting on the cluster --------------------------------------------------------------

    def run_driver(self, code: str, timeout: float = 120):
        """Runs `code` in a fresh driver process connected to this cluster (`ray.init` first;
        `ray.shutdown` after), returns the JSON its last stdout line holds (None if none).
        ClusterError with its output if it fails or runs over `timeout`."""
        script = (f"import ray\nray.init(address={self.address!r}, log_to_driver=False)\n"
                  f"{code}\nray.shutdown()\n")
        try:
            r = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ClusterError(f"driver ran over {timeout} s: {e.stderr!r}") from None
        if r.returncode != 0:
            raise ClusterError(f"driver failed ({r.returncode}):\n{r.stdout[-2000:]}\n"
                               f"{r.stderr[-3000:]}")
        last = r.stdout.strip().splitlines()[-1:] or ["null"]
        return json.loads(last[0])

    def request_resources(self, bundles: list[dict]) -> None:
        """`ray.autoscaler.sdk.request_resources(bundles=...)` from a short-lived driver process:
        the autoscaler keeps the request after the driver has gone, until the next one
        (`[]` withdraws it, and the nodes it kept go once idle)."""
        self.run_driver("from ray.autoscaler.sdk import request_resources\n"
                        f"request_resources(bundles={bundles!r})")

    def kill_node(self, node_id: str, timeout: float = 30) -> None:
        """SIGKILLs a worker node's raylet and its processes (agents, workers: a spot VM
        vanishing), returning once they are gone. The GCS then finds it dead within DEAD_WITHIN_S
        (`wait_dead`). Its log monitor (a sibling started by the autoscaler, not the raylet's
        child) goes when the autoscaler terminates the dead node, or at shutdown. Raises
        ClusterError for the head or a node with no raylet here."""
        import psutil
        if self._is_head(node_id):
            raise ClusterError(f"node {node_id} is the head")
        raylets = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if (cmd and cmd[0].endswith("/raylet") and self._ours(cmd)
                    and f"--node_id={node_id}" in cmd):
                raylets.append(p)
        if not raylets:
            raise ClusterError(f"no raylet of node {node_id} in this cluster")
        procs = list(raylets)
        for p in raylets:
            with contextlib.suppress(psutil.Error):
                procs += p.children(recursive=True)
        for p in procs:   # children after their raylet would do too: all in one go, no orphan runs
            with contextlib.suppress(psutil.Error):
                p.kill()
        alive = _wait_gone(procs, timeout)
        if alive:
            raise ClusterError(f"node {node_id}: processes outlived SIGKILL: {alive}")

    @contextlib.contextmanager
    def paused_autoscaler(self):
        """The autoscaler stopped (SIGSTOP) for the block, resumed (SIGCONT) after: no node is
        launched or released meanwhile, whatever is asked (a cloud out of capacity)."""
        import psutil
        monitors = [p for p in psutil.process_iter(["cmdline"])
                    if self._ours(p.info["cmdline"]) and any(
                        a.endswith(("autoscaler/_private/monitor.py", "autoscaler/v2/monitor.py"))
                        for a in p.info["cmdline"] or [])]
        if not monitors:
            raise ClusterError("no autoscaler process of this cluster to pause")
        for p in monitors:
            p.suspend()
        try:
            yield
        finally:
            for p in monitors:
                with contextlib.suppress(psutil.Error):
                    p.resume()

    def _is_head(self, node_id: str) -> bool:
        return any(n.is_head and n.node_id == node_id for n in self.nodes(alive=None))

    def drain_node(self, node_id: str, deadline_s: float, reason: str = PREEMPTION,
                   message: str = "preempted by the test's cloud", kill_at_deadline: bool = True
                   ) -> int:
        """The notice a cloud's node watcher gives before taking a node: GCS DrainNode with
        `reason` (autoscaler_pb2.DrainNodeReason name) and a deadline `deadline_s` from now, as
        `ray drain-node` sends it. Returns the deadline (ms since the epoch) the GCS now reports
        for it in `draining_nodes()`. Ray does not kill the node at the deadline (the caller's
        job, says `ray drain-node`): with `kill_at_deadline`, `kill_node` runs then, in a thread,
        as the cloud would. Raises ClusterError if the GCS rejects the drain."""
        from ray.core.generated import autoscaler_pb2
        if self._is_head(node_id):
            raise ClusterError(f"node {node_id} is the head")
        deadline_ms = time.time_ns() // 1_000_000 + int(deadline_s * 1000)
        accepted, why = self.gcs().drain_node(
            node_id, autoscaler_pb2.DrainNodeReason.Value(reason), message, deadline_ms)
        if not accepted:
            raise ClusterError(f"the GCS rejected draining {node_id}: {why}")
        if kill_at_deadline:
            t = threading.Timer(max(0.0, deadline_ms / 1000 - time.time()),
                                self._kill_quietly, (node_id,))
            t.daemon = True
            t.start()
            self._timers.append(t)
        return deadline_ms

    def _kill_quietly(self, node_id: str) -> None:
        with contextlib.suppress(ClusterError):   # gone already (released, killed): as a cloud
            self.kill_node(node_id)

    def add_node(self, resources: dict, timeout: float = NODE_TIMEOUT_S) -> Node:
        """A worker node started by hand, not by the autoscaler (`ray start --address`, as a user
        adding a machine would), with `resources` (CPU, GPU, object_store_memory and custom
        ones). Returns it once the GCS reports it alive; shut down with the cluster. Its node id
        is set (RAY_OVERRIDE_NODE_ID_FOR_TESTING, as the fake provider sets its nodes') to
        eeee...NNNNN, apart from the autoscaler's ffff...NNNNN."""
        self._added += 1
        node_id = "e" * 51 + str(self._added).zfill(5)
        res = dict(resources)
        agent, metrics, env_agent = free_ports(3)
        cmd = [*RAY, "start", f"--address={self.address}", "--node-ip-address=127.0.0.1",
               f"--temp-dir={self.temp_dir}", f"--num-cpus={res.pop('CPU', 1)}",
               f"--num-gpus={res.pop('GPU', 0)}",
               f"--object-store-memory={res.pop('object_store_memory', OBJECT_STORE_BYTES)}",
               f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}",
               f"--runtime-env-agent-port={env_agent}", "--disable-usage-stats"]
        if res:
            cmd.append("--resources=" + json.dumps(res))
        env = {**self.env_head, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id,
               "RAY_CLOUD_INSTANCE_ID": node_id}
        env.pop("RAY_ADDRESS", None)
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"`ray start --address` ran over {timeout} s") from None
        if r.returncode != 0:
            raise ClusterError(f"add_node failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        end = time.monotonic() + timeout
        while True:
            found = [n for n in self.worker_nodes() if n.node_id == node_id]
            if found:
                return found[0]
            if time.monotonic() > end:
                raise ClusterError(f"added node {node_id} not alive within {timeout} s")
            time.sleep(0.25)

    def autoscaler_status(self) -> dict:
        """The v1 autoscaler's last report (what `ray status` prints: the GCS's internal KV
        `__autoscaling_status`, written every update): "time", "autoscaler_report" (pending
        launches and nodes) and "load_metrics_report" (resource demand); {} before the first."""
        raw = self.gcs().internal_kv_get(b"__autoscaling_status", None, timeout=10)
        return json.loads(raw) if raw else {}

    def unsettled(self, since: float) -> list[str]:
        """What keeps the cluster from being back at rest ([] if nothing): alive worker nodes, no
        autoscaler report made after `since` (time.time()), or in the last one a launch pending,
        a node pending, or resource demand (a killed job's actors, until the GCS drops them, or
        a request: each would have the autoscaler launch a node after a test thought it gone)."""
        out = [f"worker node {n.node_id[-8:]} alive" for n in self.worker_nodes()]
        st = self.autoscaler_status()
        if st.get("time", 0) <= since:
            return out + ["no autoscaler report since the reset began"]
        ar, lm = st.get("autoscaler_report") or {}, st.get("load_metrics_report") or {}
        if any((ar.get("pending_launches") or {}).values()):
            out.append(f"launches pending: {ar['pending_launches']}")
        if ar.get("pending_nodes"):
            out.append(f"nodes pending: {ar['pending_nodes']}")
        for key in ("resource_demand", "pg_demand", "request_demand"):
            if lm.get(key):
                out.append(f"{key}: {lm[key]}")
        return out

    def reset(self, timeout: float = NODE_TIMEOUT_S) -> None:
        """Back to no worker nodes, for the next test on a shared cluster: the resource request
        withdrawn, nodes added by hand killed, the autoscaler's released once idle, and an
        autoscaler report with nothing pending or asked for. (The last because a test that failed
        with its job's actors pending left a node the autoscaler launched after the reset had
        seen none: the next test found 2 GPUs, 2026-12-03.) ClusterError naming what is left."""
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        since = time.time()
        self.request_resources([])
        end = time.monotonic() + timeout
        killed: set[str] = set()    # a killed node stays alive in the GCS ~1.5 s (more under load)
        while True:
            for n in self.worker_nodes():
                if n.node_id.startswith("e" * 51) and n.node_id not in killed:
                    self.kill_node(n.node_id)
                    killed.add(n.node_id)
            left = self.unsettled(since)
            if not left:
                return
            if time.monotonic() > end:
                raise ClusterError(f"not back to rest within {timeout} s: {'; '.join(left)}; "
                                   f"autoscaler: {self.autoscaler_log_tail()}")
            time.sleep(0.5)


def _generate_config(cls, head_resources, worker_node_types, autoscaler_v2, **kwargs) -> dict:
    """AutoscalingCluster._generate_config, its read of example.yaml answered with BASE_CONFIG:
    `open` and `yaml` replaced in ray.cluster_utils' own namespace only, for the call."""
    import types
    from unittest import mock
    import ray.cluster_utils
    fake_yaml = types.SimpleNamespace(safe_load=lambda _f: copy.deepcopy(BASE_CONFIG))
    with mock.patch.object(ray.cluster_utils, "open", create=True,
                           new=lambda *a, **k: contextlib.nullcontext()), \
            mock.patch.object(ray.cluster_utils, "yaml", new=fake_yaml):
        return cls._generate_config(None, dict(head_resources), worker_node_types,
                                    autoscaler_v2=autoscaler_v2, **kwargs)


@contextlib.contextmanager
def autoscaling_cluster(worker_node_types: dict, head_resources: dict | None = None, **kwargs):
    """Starts an AutoscalingRay (arguments as its constructor's), yields it, always shuts it
    down. For a module-scoped fixture:

        @pytest.fixture(scope="module")
        def cluster():
            with autoscaling_cluster(GPU_NODES) as c:
                yield c
    """
    cluster = AutoscalingRay(worker_node_types, head_resources, **kwargs)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.shutdown()


def _example_yaml() -> str:
    import ray
    return os.path.join(os.path.dirname(ray.__file__),
                        "autoscaler/_private/fake_multi_node/example.yaml")


@contextlib.contextmanager
def time_guard(seconds: float, what: str = "test"):
    """Fails the block with TimeoutError after `seconds` (SIGALRM: the main thread only, as
    pytest runs tests): a guard against a hang, on top of the bounded waits. Yields `rearm(s)`,
    which sets the guard to `s` from now (a bound derived once the test has measured something,
    e.g. its job's first worker start-up)."""
    import signal
    bound = [seconds]

    def expire(signum, frame):
        raise TimeoutError(f"{what} ran over its {bound[0]:.0f} s guard")

    def rearm(s: float) -> None:
        bound[0] = s
        signal.setitimer(signal.ITIMER_REAL, s)
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield rearm
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _node_type(n) -> str | None:
    """The autoscaler's node type of a GCS node entry (the node's RAY_NODE_TYPE_NAME, which the
    fake provider sets), None for the head and nodes added by hand."""
    return n.node_type_name or None



def _wait_gone(procs, timeout: float) -> list:
    """Waits until each of `procs` has exited; returns those still running after `timeout`. A
    zombie counts as gone: a fake node's raylet is the autoscaler's child, which reaps it only when
    it terminates the node (psutil.wait_procs would wait for that)."""
    import psutil
    end = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.05)
