"""The driver's view of an elastic Ray cluster: where a GPU worker can be placed now, which nodes
are draining or gone, how many GPUs the cluster can grow to, and the driver's request to Ray's
autoscaler.

Contract:
- `view(nodes, free, draining, max_gpus, fits)` (pure: tested without Ray) reads Ray's node table
  (`ray.nodes()` entries), each node's free resources, the draining nodes (node id -> deadline in
  epoch ms, 0: none) and the autoscaler's GPU maximum into a `View`: its `places` hold one node id
  per worker that could start now (a free GPU and a free CPU on a live node that is not draining,
  of a GPU type that `fits`), `draining` the deadlines (epoch s, 0: none), `dead` the nodes gone.
- `RayCluster(need_gib, cpus)` is that view over the live cluster (`poll()`, at most once a
  second by the dispatcher), `want(n)` asks the autoscaler for room for `n` GPU workers in all
  (`ray.autoscaler.sdk.request_resources`: pending demand that it scales up for, and lowers again
  so that idle nodes can go), and `exclude(node, why)` stops placing on a GPU type a worker found
  too small (said once per type). A GPU type's memory comes from `GPU_GIB` (Ray's
  `accelerator_type:<T>` names); a type not listed is tried: the worker checks its own GPU
  (`models.check_gpu_memory`) and its `GpuTooSmall` start-up error excludes the type.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("runner")

# GPU memory (GiB, as CUDA reports it: about the marketed GB) of Ray's accelerator type names
# (ray.util.accelerators). "A100" alone is 40 or 80 GB: not listed, the worker checks itself.
GPU_GIB = {"B200": 178.0, "H200": 139.8, "H100": 79.1, "H20": 95.0, "GH200": 94.5,
           "A100-80G": 79.1, "A100-40G": 39.4, "L40S": 44.4, "L40": 44.4, "A40": 44.4,
           "A10G": 22.0, "A10": 22.0, "L4": 22.0, "T4": 14.6, "V100": 15.8, "P100": 15.9,
           "RTX": 22.0}
ACCELERATOR = "accelerator_type:"


def gpu_type(resources: dict) -> str | None:
    """A node's GPU type from its `accelerator_type:<T>` resource (None: not advertised)."""
    return next((k[len(ACCELERATOR):] for k in resources if k.startswith(ACCELERATOR)), None)


def type_fits(kind: str | None, need_gib: float | None) -> bool:
    """Whether a GPU type can hold a worker needing `need_gib`: unknown types may (tried)."""
    have = GPU_GIB.get(kind or "")
    return need_gib is None or have is None or have >= need_gib


@dataclass(frozen=True)
class View:
    places: list[str]                    # a node id per worker that could start now
    draining: dict[str, float]           # node id -> deadline (epoch s; 0: none given)
    dead: set[str]                       # nodes Ray reports dead
    gpus: int                            # GPUs of live nodes
    free: int                            # of them free
    max_gpus: int | None                 # what the autoscaler can grow to (None: not known)
    types: dict[str, str | None] = field(default_factory=dict)   # live node id -> GPU type
    unfit: dict[str, int] = field(default_factory=dict)          # too-small GPU type -> its GPUs

    def text(self) -> str:
        """The cluster in one clause: "2 GPUs (1 free) on 2 nodes, 1 draining; can grow to 8"."""
        nodes = sum(1 for t in self.types)
        out = f"{self.gpus} GPU{'s' * (self.gpus != 1)} ({self.free} free) on {nodes} node" \
              f"{'s' * (nodes != 1)}"
        if self.draining:
            out += f", {len(self.draining)} draining"
        if self.unfit:
            out += ", too small: " + ", ".join(f"{n} x {t}" for t, n in self.unfit.items())
        grow = ("its autoscaler's limit is not known" if self.max_gpus is None
                else f"can grow to {self.max_gpus} GPUs")
        return f"{out}; {grow}"


def view(nodes: list[dict], free: dict[str, dict], draining_ms: dict[str, int],
         max_gpus: int | None, fits: Callable[[str, str | None], bool], cpus: float = 1.0) -> View:
    """The `View` of Ray's node table (module docstring); `fits(node_id, gpu_type)`."""
    places, dead, types, unfit = [], set(), {}, {}
    gpus = n_free = 0
    draining = {n: ms / 1000.0 for n, ms in draining_ms.items()}
    for node in nodes:
        nid, res = node.get("NodeID"), node.get("Resources") or {}
        if not node.get("Alive", node.get("alive", False)):
            dead.add(nid)
            continue
        total = int(res.get("GPU", 0))
        if not total:
            continue
        kind = gpu_type(res)
        types[nid] = kind
        avail = free.get(nid, {})
        gpus += total
        n_free += int(avail.get("GPU", 0))
        if not fits(nid, kind):
            unfit[kind or nid] = unfit.get(kind or nid, 0) + total
            continue
        if nid in draining:
            continue
        room = min(int(avail.get("GPU", 0)), math.floor(avail.get("CPU", 0) / cpus) if cpus else 1 << 30)
        places += [nid] * max(0, room)
    return View(places, draining, dead, gpus, n_free, max_gpus, types, unfit)


class RayCluster:
    """`view` over the live Ray cluster for workers of `cpus` CPUs and one GPU each, needing
    `need_gib` of GPU memory (None: any GPU)."""

    def __init__(self, need_gib: float | None, cpus: float = 1.0):
        self.need_gib, self.cpus = need_gib, cpus
        self.excluded: dict[str, str] = {}   # GPU type (or node id, untyped) -> why
        self.said: set[str] = set()          # types named once already
        self.types: dict[str, str | None] = {}
        self.asked = -1

    def fits(self, node_id: str, kind: str | None) -> bool:
        key = kind or node_id
        if key in self.excluded:
            return False
        if type_fits(kind, self.need_gib):
            return True
        self.excluded[key] = (f"its {GPU_GIB[kind]:.0f} GiB GPUs are too small for a worker "
                              f"needing about {self.need_gib:.0f} GiB")
        return False

    def exclude(self, node_id: str | None, why: str) -> None:
        """No more workers on `node_id`'s GPU type (the node itself when it has none)."""
        kind = self.types.get(node_id or "")
        key = kind or node_id or "?"
        self.excluded.setdefault(key, why)

    def poll(self) -> View:
        import ray
        from ray._private import state
        try:
            draining = state.state.get_draining_nodes()
        except Exception:                       # a Ray without the call: none known
            draining = {}
        v = view(ray.nodes(), state.available_resources_per_node(), draining,
                 self.max_gpus(), self.fits, self.cpus)
        self.types.update(v.types)
        for key, why in self.excluded.items():
            if key not in self.said:
                self.said.add(key)
                what = f"GPU type {key}" if key in v.unfit or key in v.types.values() else (
                    f"node {key[:12]}" if key not in GPU_GIB else f"GPU type {key}")
                log.warning("%s: no worker placed there (%s)", what, why)
        return v

    @staticmethod
    def max_gpus() -> int | None:
        """The GPUs the autoscaler can grow the cluster to (its node types' max), if it says."""
        from ray._private import state
        try:
            m = state.state.get_max_resources_from_cluster_config()
        except Exception:
            return None
        if not m or not m.get("GPU"):
            return None
        return int(m["GPU"])

    def want(self, n: int) -> None:
        """Room for `n` GPU workers in all (running ones included): the autoscaler's floor."""
        if n == self.asked:
            return
        from ray.autoscaler.sdk import request_resources
        try:
            request_resources(bundles=[{"GPU": 1, "CPU": self.cpus}] * n)
            self.asked = n
        except Exception as e:                  # no autoscaler, or a client that cannot ask
            if self.asked != -2:
                log.info("could not ask the autoscaler for GPUs (%s): using the nodes there are",
                         str(e).splitlines()[0][:200])
            self.asked = -2
