"""What the driver hands a worker: `WorkerConfig` (the only part of the job's config a worker sees)
and `WorkerActor`, the class the driver wraps in `ray.remote`.

Contract: `WorkerActor(rank, cfg, broker)` builds a `runner.worker.Worker` in the actor's own
process and forwards the `WorkerContract` calls to it. Why a second class: the driver needs the
actor's class to start it, and `runner.worker` imports torch and diffusers, which the driver never
uses otherwise (~1.3 s of CPU per job, on the machine that also runs the workers). This module
imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import CompileConfig, GenerationDefaults, ModelSpec, StepCacheSection

if TYPE_CHECKING:
    from .prompts import Constraints, Item


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelSpec
    generation: GenerationDefaults
    limits: Constraints
    on_empty: str
    job_dir: str
    batch_size: int = 1
    warmup_steps: int = 2
    fps: int = 8
    compile: CompileConfig = CompileConfig()
    step_cache: StepCacheSection = StepCacheSection()
    num_threads: int | None = None   # CPU workers: torch threads (avoids oversubscribing cores)
    encode_batch: int = 8            # prompts per text-encoder call (the shard size: one shape)
    cache_wait_s: float = 900.0      # longest wait for the compiling worker's artifact


class WorkerActor:   # a WorkerContract: each call is the Worker's own (runner/worker.py)
    def __init__(self, rank: int, cfg: WorkerConfig, broker=None):
        from .worker import Worker
        self.worker = Worker(rank, cfg, broker)

    def warmup(self) -> dict:
        return self.worker.warmup()

    def start_shard(self, seq: int, items: list[Item]) -> int:
        return self.worker.start_shard(seq, items)

    def finish_shard(self, seq: int) -> list[dict]:
        return self.worker.finish_shard(seq)

    def metrics(self) -> dict:
        return self.worker.metrics()

    def phases(self, since: int) -> list[tuple[str, float]]:
        return self.worker.phases(since)
