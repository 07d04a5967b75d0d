"""Was a dead worker killed for memory by the kernel? (No Ray, no torch: the worker and the driver.)

The kernel's out-of-memory killer ends a process with SIGKILL, and Ray reports that like any other
kill or crash: `ActorDiedError` "Worker exit type: SYSTEM_ERROR ... connection error code 2. End of
file. Some common causes include: (1) the process was killed by the OOM killer ..." (Ray 2.60,
measured). The kernel counts its kills: per memory cgroup (`oom_kill N` in cgroup v2's
`memory.events`, v1's `memory.oom_control`; the victim's cgroup counts it whether the cgroup's own
limit or the machine ran out) and per machine (`/proc/vmstat`). So a worker notes where its count
is, and its value, when it becomes ready (`baseline`, part of its ready info); when it dies, the
driver reads the count again if it runs on the same machine (`killed`): a higher count names the
kill. On another node nothing is read, and the cause stays what Ray says. Ray's own memory monitor,
which kills before the kernel does where it sees the limit, is named by Ray itself
(`ray.exceptions.OutOfMemoryError`: `runner.driver.raypool.lost_cause`).

A higher count says that the kernel ended a process of the worker's cgroup (or, without one, of
the machine) since the worker started, not which: the worker is the one that died, and Ray makes
its workers the kernel's first choice (`oom_score_adj` 1000).
"""

from __future__ import annotations

import os
import socket

CGROUP_ROOT = "/sys/fs/cgroup"


def _read_count(path: str) -> int | None:
    """`oom_kill N` in a cgroup's memory.events / memory.oom_control or /proc/vmstat."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _cgroup_files() -> list[tuple[str, str]]:
    """(count file, limit file) of this process's memory cgroup, the v1 memory controller's first
    (a hybrid machine mounts v1 controllers beside a v2 tree without memory), else v2's."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if "memory" in controllers.split(","):
            d = os.path.join(CGROUP_ROOT, "memory", path)
            found.insert(0, (f"{d}/memory.oom_control", f"{d}/memory.limit_in_bytes"))
        elif controllers == "":
            for root in (CGROUP_ROOT, os.path.join(CGROUP_ROOT, "unified")):
                d = os.path.join(root, path)
                found.append((f"{d}/memory.events", f"{d}/memory.max"))
    return found


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < 2**60 else None   # "max" / v1's 2**63


def baseline() -> dict | None:
    """Worker side, when it becomes ready: where its out-of-memory kills are counted and the count
    now; None where nothing counts them (not Linux)."""
    for counter, limit in _cgroup_files() + [("/proc/vmstat", "")]:
        n = _read_count(counter)
        if n is not None:
            return dict(host=socket.gethostname(), boot_id=_boot_id(), counter=counter,
                        oom_kills=n, limit_bytes=_limit(limit) if limit else None)
    return None


def killed(base: dict | None) -> str | None:
    """Driver side, once the worker of `base` died of a kill: what says that the kernel's
    out-of-memory killer did it, or None (no more kills counted, or another machine: unknown)."""
    if not base or base.get("host") != socket.gethostname() or base.get("boot_id") != _boot_id():
        return None
    n = _read_count(base["counter"])
    if n is None or n <= base["oom_kills"]:
        return None
    where = ("the machine" if base["counter"] == "/proc/vmstat" else
             f"memory cgroup {os.path.dirname(base['counter'])}")
    limit = f", limit {base['limit_bytes'] / 2**30:.2f} GiB" if base.get("limit_bytes") else ""
    return f"{where}{limit}: oom_kill {base['oom_kills']} -> {n}"
