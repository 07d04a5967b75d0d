"""The class the driver wraps in `ray.remote`: `WorkerActor(rank, cfg, broker)` builds a
`runner.serve.worker.Worker` in the actor's own process and forwards the `WorkerContract` calls to it.

Why a second class: the driver needs the actor's class to start it, and `runner.serve.worker` imports
torch and diffusers, which the driver never uses otherwise (~1.3 s of CPU per job, on the machine
that also runs the workers). This module imports no torch; what a worker is handed is
`runner.config.WorkerConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import WorkerConfig
    from ..io.prompts import Item


class WorkerActor:   # a WorkerContract: each call is the Worker's own (runner/serve/worker.py)
    def __init__(self, rank: int, cfg: WorkerConfig, broker=None):
        from .worker import Worker
        # An error here (the model cannot load: `runner.serve.models.ModelLoadError`) is raised again by
        # `warmup`, the driver's first call: a task error, whose cause the driver shows and does
        # not retry twice. Raised from __init__ it killed the actor, and the driver saw a lost
        # worker ("The actor died because of an error raised in its creation task", the cause
        # only in the worker's log), restarted ray.max_worker_restarts times: 4 loads.
        self.worker, self.failed = None, None
        try:
            self.worker = Worker(rank, cfg, broker)
        except Exception as e:
            import traceback
            traceback.clear_frames(e.__traceback__)   # their locals: a half-loaded model's memory
            self.failed = e

    def warmup(self, asked_at: float | None = None) -> dict:
        if self.failed is not None:
            raise self.failed
        return self.worker.warmup(asked_at)

    def start_shard(self, seq: int, items: list[Item]) -> int:
        return self.worker.start_shard(seq, items)

    def finish_shard(self, seq: int) -> list[dict]:
        return self.worker.finish_shard(seq)

    def canary(self, seq: int) -> dict:
        return self.worker.canary(seq)

    def metrics(self) -> dict:
        return self.worker.metrics()

    def phases(self, since: int) -> list[tuple[str, float]]:
        return self.worker.phases(since) if self.worker is not None else []

    def progress(self) -> float:
        return self.worker.progress()
