"""The class the driver wraps in `ray.remote`: `WorkerActor(rank, cfg, broker)` builds a
`runner.worker.Worker` in the actor's own process and forwards the `WorkerContract` calls to it.

Why a second class: the driver needs the actor's class to start it, and `runner.worker` imports
torch and diffusers, which the driver never uses otherwise (~1.3 s of CPU per job, on the machine
that also runs the workers). This module imports no torch; what a worker is handed is
`runner.config.WorkerConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import WorkerConfig
    from .prompts import Item


class WorkerActor:   # a WorkerContract: each call is the Worker's own (runner/worker.py)
    def __init__(self, rank: int, cfg: WorkerConfig, broker=None):
        from .worker import Worker
        self.worker = Worker(rank, cfg, broker)

    def warmup(self, asked_at: float | None = None) -> dict:
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
        return self.worker.phases(since)
