"""The driver's only Ray code: a `dispatch.Pool` of Ray actors, and the connection to Ray.

Contract:
- `RayPool.open(opts, gpu, worker_config, shared_cache, inflight, need_gib)` connects to the
  cluster (`ray.address`, or RAY_ADDRESS, else a new embedded local Ray, quiet: see `connect`) and
  returns the pool. `gpu`: "yes" (the model needs GPUs), "no" (`model.device=cpu`) or "if any" (a
  tiny model: GPU workers where the cluster has or can add GPUs, else CPU ones). GPU workers make
  an elastic pool: `cluster` (a `runner.driver.cluster.RayCluster` for workers needing `need_gib`) and
  `size` (`ray.num_workers`, else `ray.min_workers`, else the GPUs there are, at least 1) for the
  dispatcher, each worker placed on the node the dispatcher picks (`start(rank, node)`: one GPU
  and one CPU there). CPU workers are a fixed pool of `ray.cpu_workers` (`cluster` None). Each is a
  `runner.serve.actor.WorkerActor` built from `worker_config(on_gpu)`, never restarted by Ray itself
  (the dispatcher decides).
  `shared_cache`: a `CacheBroker` actor lets one worker compile and the others load its artifact.
- The Pool calls map one to one onto actor calls (`warmup`, told when it was asked: the worker's
  start-up deadline counts from then; `start_shard` + `finish_shard`,
  `canary`, `phases`, `metrics`, `progress`); `close` disconnects from Ray (quiet); `result` turns Ray's errors into
  `TaskError` (our code raised in the worker: its cause, `Type: message`) or `WorkerLost` (the
  actor or its node is gone: what it died of, `lost_cause`: its first line a cause that deaths
  share, "out of memory: ..." when it was killed for memory, the particulars on the next;
  `NodeLost` when Ray says the node died or was preempted); `stop`
  kills and waits until each actor's process is gone, so nothing it writes lands after the caller
  goes on.
- Only this module (and the worker's side: `runner.serve.worker`, `runner.serve.compile_cache`) imports Ray:
  the job, the dispatcher and the progress display run, and are tested, without it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any, Callable

import ray

from ..serve import oom
from ..config import RayOptions
from .dispatch import NodeLost, TaskError, WorkerLost, cause
from ..io.outputs import plural

log = logging.getLogger("runner")


class RayPool:
    """`Pool` over Ray actors made by `make_actor(rank)` (a `WorkerContract` under `ray.remote`)."""

    def __init__(self, make_actor: Callable[..., Any], size: int, cluster=None):
        self.make_actor, self.size, self.cluster = make_actor, size, cluster
        self.warming: dict[Any, Any] = {}    # warm-up ref -> its actor, until its result is read
        self.memory: dict[str, dict | None] = {}   # actor id -> its `oom.baseline` (ready info)

    @classmethod
    def open(cls, opts: RayOptions, gpu: str, worker_config: Callable[[bool], Any],
             shared_cache: bool, inflight: int, need_gib: float | None = None) -> "RayPool":
        from ..serve.actor import WorkerActor
        from .cluster import RayCluster
        connect(opts)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        on_gpu = gpu == "yes" or gpu == "if any" and bool(gpus or RayCluster.max_gpus())
        broker = None
        if shared_cache:
            from ..serve.compile_cache import CacheBroker
            broker = ray.remote(CacheBroker).options(num_cpus=0, max_concurrency=1000).remote()
        cfg = worker_config(on_gpu)
        # Threaded: a shard's two calls (start_shard, finish_shard) for each of the `inflight`
        # shards, a canary, metrics() or phases(), and progress() (the watchdog's: answered while
        # all the others wait on a hung call); the worker orders the GPU work itself.
        common = dict(max_restarts=0, max_concurrency=2 * inflight + 3)
        if not on_gpu:
            size = opts.num_workers or opts.cpu_workers
            remote = ray.remote(WorkerActor).options(scheduling_strategy="SPREAD",
                                                     num_cpus=opts.cpus_per_worker, **common)
            log.info("starting %s (each loads the model, compiles or loads the compile cache, "
                     "warms up)", plural(size, "CPU worker"))
            return cls(lambda rank, node=None: remote.remote(rank, cfg, broker), size)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        actor_class = ray.remote(WorkerActor)

        def make(rank: int, node: str | None = None):
            where = (NodeAffinitySchedulingStrategy(node, soft=False) if node else "SPREAD")
            return actor_class.options(num_gpus=1, num_cpus=1, scheduling_strategy=where,
                                       **common).remote(rank, cfg, broker)
        size = opts.num_workers or opts.min_workers or max(1, gpus)
        if opts.max_workers is not None:
            size = min(size, opts.max_workers)
        log.info("GPU workers: %s; %d GPU%s in the cluster now (each worker loads the model, "
                 "compiles or loads the compile cache, warms up)",
                 f"{size}, fixed (ray.num_workers)" if opts.num_workers else
                 f"{size} to {opts.max_workers or 'one per GPU the cluster can add'} "
                 f"(ray.min_workers, ray.max_workers)", gpus, "s" * (gpus != 1))
        return cls(make, size, RayCluster(need_gib))

    def start(self, rank: int, node: str | None = None) -> tuple[Any, Any]:
        actor = self.make_actor(rank, node)
        ref = actor.warmup.remote(time.time())   # the start-up deadline counts from now
        self.warming[ref] = actor
        return actor, ref

    def submit(self, actor, seq: int, items: list) -> tuple[Any, Any]:
        return actor.start_shard.remote(seq, items), actor.finish_shard.remote(seq)

    def canary(self, actor, seq: int) -> Any:
        return actor.canary.remote(seq)

    def phases(self, actor, since: int) -> Any:
        return actor.phases.remote(since)

    def metrics(self, actor) -> Any:
        return actor.metrics.remote()

    def progress(self, actor) -> Any:
        return actor.progress.remote()

    def wait(self, futures: list, timeout: float) -> list:
        # One blocking wait for the first, then every other one already done: under load a loop
        # iteration takes all finished shards at once instead of one per `ray.wait`.
        first = ray.wait(futures, num_returns=1, timeout=timeout)[0]
        if not first or len(futures) == 1:
            return first
        return ray.wait(futures, num_returns=len(futures), timeout=0)[0] or first

    def result(self, ref) -> Any:
        errors = ray.exceptions
        actor = self.warming.pop(ref, None)
        try:
            value = ray.get(ref)
        except errors.RayError as e:
            # a RayTaskError wraps our code's exception; a dead actor is no such thing even in the
            # Ray versions where RayActorError subclasses RayTaskError
            if isinstance(e, errors.RayTaskError) and not isinstance(e, errors.RayActorError):
                raise TaskError(cause(e)) from e
            text = lost_cause(e, self.memory.get(getattr(e, "actor_id", None)))
            if getattr(e, "preempted", False) or _NODE_DIED in str(e):
                raise NodeLost(text) from e
            raise WorkerLost(text) from e
        if actor is not None and isinstance(value, dict):      # a warm-up's ready info
            self.memory[actor._actor_id.hex()] = value.get("memory")
        return value

    def kill(self, actor) -> None:
        for ref in [r for r, a in self.warming.items() if a is actor]:
            del self.warming[ref]
        try:
            ray.kill(actor, no_restart=True)
        except Exception:              # already gone: nothing left to stop
            pass

    def stop(self, actors: list, timeout_s: float) -> int:
        """`ray.kill` only asks: a worker mid-write could still put a file. Wait until a call to
        each fails (its process is gone), `timeout_s` at most."""
        for a in actors:
            self.kill(a)
        deadline = time.monotonic() + timeout_s
        alive = list(actors)
        while alive and time.monotonic() < deadline:
            calls = [(a, a.__ray_ready__.remote()) for a in alive]
            alive = []
            for a, ref in calls:
                try:       # an answer, or none in time: the kill has not reached it yet
                    ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    pass
                except Exception:                  # RayActorError: dead, as asked
                    continue
                alive.append(a)
            if alive:
                time.sleep(0.2)
        return len(alive)

    def close(self) -> None:
        """Nothing more from Ray on the terminal once the job's last lines are due (issue 37 D5:
        36-57 lines printed after the runner's `error:` line). Errors of calls nobody will read
        (the shards in flight when the job stopped: "Unhandled error ... finish_shard()") are
        not printed, and the connection is closed now: Ray prints the workers' last log lines,
        and the repeats it held back, when it disconnects, which was at the process's exit."""
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"     # read when such an error is dropped
        ray.shutdown()


# Ray 2.60's texts (measured: a SIGKILL, SIGSEGV and os._exit(70) all read "connection error code
# 2. End of file"; a Python exit "exits with an exit code N"; the memory monitor raises
# OutOfMemoryError "... killed due to the node running low on memory. Memory on the node (...) was
# 1.61GB used / 23.54GB limit ...", and ActorDiedError says NODE_OUT_OF_MEMORY for its other calls).
_EXIT = re.compile(r"Worker exit type: (\w+) Worker exit detail: (.*?\.)(?=\s|$)")
_NODE_MEMORY = re.compile(r"Memory on the node \(IP: ([^,]+),.*?\) was ([^(]*?) \(")
_WHERE = re.compile(r"\tpid: (\d+)\n(?:.*\n)*?\tip: (\S+)")
_NODE_DIED = "its node has died"   # ActorDiedError's text when the actor's node is gone (2.60)
_KILLED_PID = re.compile(r"Selected to kill: .*?\bpid=(\d+)")       # the memory monitor's choice


def lost_cause(e: Exception, memory: dict | None = None) -> str:
    """What a lost worker died of, from Ray's error: a first line that names the cause alone (the
    summary groups rows by it: no pid, address or figure), the particulars on a second. A process
    killed without a word (SIGKILL, a crash) whose memory cgroup counted an out-of-memory kill
    since it became ready (`memory`, its `oom.baseline`; read when it ran on this machine) was
    killed for memory."""
    text = str(e)
    exit_ = _EXIT.search(text)
    where = _WHERE.search(text)
    at = f"worker pid {where.group(1)} on {where.group(2)}" if where else "the worker"
    killed_for_memory = exit_ is not None and exit_.group(1) == "NODE_OUT_OF_MEMORY"
    if isinstance(e, ray.exceptions.OutOfMemoryError) or killed_for_memory:
        node, pid = _NODE_MEMORY.search(text), _KILLED_PID.search(text)
        if pid and node and not where:
            at = f"worker pid {pid.group(1)} on {node.group(1)}"
        detail = f"node {node.group(1)}: {node.group(2)}" if node else (
            exit_.group(2) if exit_ else text.splitlines()[0][:300])
        return (f"out of memory: Ray's memory monitor killed the worker (RAY_memory_usage_threshold)"
                f"\n{at}; {detail}")
    if exit_ and "connection error code" in exit_.group(2):
        counted = oom.killed(memory)
        if counted:
            return (f"out of memory: the kernel's out-of-memory killer ended the worker"
                    f"\n{at}; {counted}")
        return (f"the worker process ended without an error of its own: killed (SIGKILL; the "
                f"kernel's out-of-memory killer does that too) or crashed (SIGSEGV, a CUDA error)"
                f"\n{at}; Ray: {exit_.group(1)}: {exit_.group(2)}")
    if exit_:
        return f"the worker process ended: {exit_.group(2)}\n{at}; Ray: {exit_.group(1)}"
    if "killed by `ray.kill`" in text:
        return f"the worker was killed (ray.kill)\n{at}"
    return cause(e)


class _StartedOffTheMainThread(logging.Filter):
    """Ray's start runs on a thread of its own (`runner.driver.job` watches for Ctrl-C meanwhile), so
    `ray.init` warns that it sets no SIGTERM handler: the job installs its own, the user has
    nothing to do about it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is not the main thread" not in record.getMessage()


def connect(opts: RayOptions) -> None:
    """The cluster at `opts.address` or RAY_ADDRESS, else a new embedded local Ray."""
    if ray.is_initialized():
        return
    ray_worker_log = logging.getLogger("ray._private.worker")
    if not any(isinstance(f, _StartedOffTheMainThread) for f in ray_worker_log.filters):
        ray_worker_log.addFilter(_StartedOffTheMainThread())
    address = opts.address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, logging_level=logging.WARNING)
        return
    # Embedded local Ray, always a new one ("local": never attach to a cluster that `ray start`
    # left running; that takes ray.address=auto), with enough CPU slots for the CPU workers even
    # on a small machine. Quiet: no usage stats, and token auth on, as Ray 2.60 turns it on for a
    # new local cluster, but set explicitly, which is what silences its warning. A value the user
    # set wins; a user's own cluster (the branch above) is untouched.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"        # inherited by every process of the cluster
        try:   # this process read its config at `import ray`: re-read it, as ray.init does
            from ray._raylet import Config
            Config.initialize("")
        except Exception:                             # a Ray without token auth
            pass
    need = (opts.num_workers or opts.cpu_workers) * opts.cpus_per_worker
    log.info("starting a local Ray (ray.address or RAY_ADDRESS: use a cluster instead)")
    start_local_ray(ray, num_cpus=max(os.cpu_count() or 1, need))


class RayStartError(RuntimeError):
    """The local Ray did not start (the message says what to do)."""


def start_local_ray(ray_module, num_cpus: int, attempts: int = 3) -> None:
    """ray.init of a new local Ray. Ray waits a fixed 30 s for its raylet to register, which a
    loaded machine can exceed ("The current node timed out during startup"; seen on 2 cores with
    other jobs starting): `attempts` tries in all, then a `RayStartError` naming it (the job
    exits 2) instead of a traceback."""
    for attempt in range(1, attempts + 1):
        try:
            ray_module.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                            logging_level=logging.WARNING)
            return
        except Exception as e:
            if "timed out during startup" not in str(e):
                raise
            ray_module.shutdown()
            if attempt == attempts:
                raise RayStartError(f"the local Ray did not start, {attempts} times ({e}); the "
                                    f"machine may be overloaded: rerun when it is not, or set "
                                    f"ray.address to a running cluster") from e
            log.warning("the local Ray did not start in time (%s); starting it again (%d of %d)",
                        e, attempt + 1, attempts)
