"""Fault injection for the failure tests, from outside the runner's code.

Tests that set RUNNER_FAULTS also put this directory first on PYTHONPATH (`tests/conftest.py`'s
`fault_env`), so every Python process of the job, the driver and Ray's worker processes alike,
imports this module at start-up. It changes nothing until `runner.serve.worker` is imported, then wraps
two of that module's functions. Faults, comma-separated:
    nan:<id>          the output of <id> is NaN (on the device, before the finiteness check)
    slow:<seconds>    sleep before each pipeline call (warm-up excluded)
    wait_ready        no item is generated until every worker of the job (`ray.num_workers` or
                      `ray.cpu_workers` in its config.yaml) has warmed up: each leaves a marker,
                      named by its job directory, in RUNNER_FAULT_DIR; waits 900 s at most. So
                      every worker serves, however slowly the machine starts them.
    kill:<id>         the worker process sends itself SIGKILL when it is about to generate <id>
                      (a row that kills its worker every time)
    hang:<id>         the generate call of <id> never returns (it waits on an event nobody sets):
                      a hung kernel or a stuck subprocess, the worker alive and silent
    oom:<id>          the worker allocates memory, 32 MiB at a time, every page touched, when it is
                      about to generate <id>, until the kernel kills it (4 GiB at most, then
                      MemoryError): with `cgroup`, the out-of-memory killer's kill
    cgroup:<dir>      the worker process joins the cgroup <dir> (writes its pid to cgroup.procs)
                      before it builds its model: a memory limit that is the worker's alone
    slow_warmup:<s>   the job's first worker to reach its warm-up call sleeps <s> seconds before
                      it (a marker in RUNNER_FAULT_DIR): a worker slow to warm up, whose start-up
                      the others should not wait for
    drift:<n>         a GPU that starts computing wrong: once a worker process has generated
                      more than n items, every output it makes (its canaries too:
                      `runner.serve.canary`) is brightened by 0.2. Only the first worker of the job to get there (a marker
                      in RUNNER_FAULT_DIR): its replacement computes right.
Other worker deaths, raising rows and warm-up errors are the simulated pool's
(tests/test_jobrun.py); the CLI tests also kill real processes from outside.
"""

import hashlib
import importlib.abc
import importlib.util
import os
import signal
import sys
import threading
import time

FAULTS = [f.partition(":")[::2] for f in os.environ.get("RUNNER_FAULTS", "").split(",") if f]
_JOB_DIR = []    # the worker's job directory, from its first `resolve` call (Worker.__init__)


_GENERATED = [0]      # items this process generated (not warm-up or canary items)


def _generate_with_faults(generate):
    def wrapped(pipe, family, items, *args, **kwargs):
        if items[0].file not in ("warmup", "canary"):
            for kind, arg in FAULTS:
                if kind == "wait_ready":
                    _wait_for_every_worker(timeout_s=900)
                if kind == "slow":
                    time.sleep(float(arg))
            for it in items:
                if ("kill", it.id) in FAULTS:
                    os.kill(os.getpid(), signal.SIGKILL)
                if ("hang", it.id) in FAULTS:
                    threading.Event().wait()
                if ("oom", it.id) in FAULTS:
                    _eat_memory(limit=4 << 30)
        if items[0].file == "warmup":
            for kind, arg in FAULTS:
                if kind == "slow_warmup" and _first_of_the_job("slow-warmup"):
                    time.sleep(float(arg))
        out = generate(pipe, family, items, *args, **kwargs)
        if items[0].file == "warmup" and _JOB_DIR and "RUNNER_FAULT_DIR" in os.environ:
            open(os.path.join(os.environ["RUNNER_FAULT_DIR"], f"{_ready_prefix()}{os.getpid()}"), "w").close()
        for k, it in enumerate(items):
            if ("nan", it.id) in FAULTS:
                out[k] = float("nan")
        if items[0].file not in ("warmup", "canary"):
            _GENERATED[0] += len(items)
        drift = [int(arg) for kind, arg in FAULTS if kind == "drift"]
        if drift and _drifting(drift[0]):
            out = (out + 0.2).clamp(0, 1) if hasattr(out, "clamp") else (out + 0.2).clip(0, 1)
        return out
    return wrapped


def _eat_memory(limit: int) -> None:
    held, chunk = [], 32 << 20
    while len(held) * chunk < limit:
        block = bytearray(chunk)
        block[::4096] = b"x" * len(range(0, chunk, 4096))     # every page resident
        held.append(block)
    raise MemoryError(f"allocated {limit} bytes and was not killed")


_DRIFT = []   # [True]: this process is the one that computes wrong


def _drifting(n: int) -> bool:
    """Whether this call's output is wrong: the process made more than `n` items (this call's
    own counted), and it is the job's one drifting worker."""
    if _GENERATED[0] <= n:
        return False
    if not _DRIFT:
        try:
            os.close(os.open(os.path.join(os.environ["RUNNER_FAULT_DIR"], "drift"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            _DRIFT.append(True)
        except FileExistsError:
            _DRIFT.append(False)
    return _DRIFT[0]


_FIRST: dict[str, bool] = {}   # marker name -> whether this process made it


def _first_of_the_job(name: str) -> bool:
    """Whether this process is the job's first to get here (asked again: the same answer)."""
    if name not in _FIRST:
        marker = os.path.join(os.environ["RUNNER_FAULT_DIR"], f"{name}-{_ready_prefix()}")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            _FIRST[name] = True
        except FileExistsError:
            _FIRST[name] = False
    return _FIRST[name]


def _ready_prefix() -> str:
    return "ready-" + hashlib.sha1(_JOB_DIR[0].encode()).hexdigest()[:12] + "-"


def _wait_for_every_worker(timeout_s: float) -> None:
    from omegaconf import OmegaConf
    from runner.io.storage import resolve
    ray_cfg = OmegaConf.create(resolve(_JOB_DIR[0]).read_text("config.yaml")).ray
    n = ray_cfg.num_workers or ray_cfg.cpu_workers
    end = time.monotonic() + timeout_s
    folder, prefix = os.environ["RUNNER_FAULT_DIR"], _ready_prefix()
    while time.monotonic() < end:
        if sum(f.startswith(prefix) for f in os.listdir(folder)) >= n:
            return
        time.sleep(0.1)


def _resolve_noting_the_job_dir(resolve):
    def wrapped(uri, *args, **kwargs):
        if not _JOB_DIR:
            _JOB_DIR.append(str(uri))
        return resolve(uri, *args, **kwargs)
    return wrapped


def _patch(worker):
    # Module functions only: Ray ships an actor class's methods from the driver by value, so a
    # patched method would run the driver's copy.
    for kind, arg in FAULTS:
        if kind == "cgroup":
            with open(os.path.join(arg, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    worker.generate = _generate_with_faults(worker.generate)
    worker.resolve = _resolve_noting_the_job_dir(worker.resolve)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "runner.serve.worker":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec


if FAULTS:
    sys.meta_path.insert(0, _PatchOnImport())
