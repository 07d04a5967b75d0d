"""How long a worker may go without progress before the dispatcher declares it hung.

A generate call that never returns (a hung CUDA kernel, a stuck encoder subprocess, a read with no
timeout) leaves its worker alive and silent: Ray reports nothing, and without a bound the job
waits forever (issue 60: `6/8 items ... ETA 2 min` for 7 minutes). Progress is a model call
finishing. The driver sees a shard's rows (or a canary's verdict) come back; a worker silent past
its bound in a long shard is asked (`Pool.progress`: seconds since its last call finished, from a
thread of its own) before it is declared hung. The bound for one call of the work it holds is

    min(ceiling, max(floor, FACTOR x expected))

where `expected` is the worker's own recent seconds per unit of work (an exponential average over
the shards it returned; the job's average while it has returned none) times the units of one
batch of the shard it is on. A unit is a pixel of one frame at one step (`units`): a row twice the
size or steps is expected to take twice as long, so a legitimately large row is not taken for a
hang. Before any shard of the job came back, the bound is the ceiling (the first call of a shape
may be slow). The floor keeps a short measured time (0.1 s images) from turning a hiccup (a slow
store write, a garbage collection) into a kill; the ceiling (`run.hang_timeout_s`) is the user's.
A worker that does not answer the question within `ASK_S` is hung too. This module is plain
arithmetic: the dispatcher owns the clock, the slots and the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FACTOR = 10.0      # a worker is hung past 10x its expected time for a call of the work it holds
FLOOR_S = 60.0     # ... and never before 60 s without progress
EMA = 0.3          # weight of the newest shard in a worker's average seconds per unit
ASK_S = 30.0       # a silent worker that does not say within this long how it is doing is hung


def units(items) -> float:
    """The work of `items`: pixels x frames x steps (the denoiser's cost grows with each)."""
    return float(sum(it.height * it.width * (it.num_frames or 1) * it.num_inference_steps
                     for it in items)) or 1.0


@dataclass
class Pace:
    """A worker's progress clock: when it last made progress (a call finished, as far as the
    driver knows), when the shard it is on began to run, its measured seconds per unit."""
    since: float
    started: float | None = None
    s_per_unit: float | None = None
    call: float = 1.0              # units of one call of the work it was last handed (a canary's)
    head: Any = None               # the shard `call` is of (computed once a shard, not a second)
    asked: Any = None              # the `Pool.progress` future in flight, if any
    asked_at: float = 0.0


class Watchdog:
    """The bound of the module docstring. `ceiling_s` 0: never hung. `batch`: rows per call."""

    def __init__(self, ceiling_s: float, batch: int = 1, factor: float = FACTOR,
                 floor_s: float = FLOOR_S):
        self.ceiling_s, self.batch, self.factor, self.floor_s = ceiling_s, batch, factor, floor_s
        self.job_s_per_unit: float | None = None      # every worker's shards, averaged

    @property
    def on(self) -> bool:
        return self.ceiling_s > 0

    def call_units(self, items) -> float:
        """Units of one call of `items`: the largest of them, batched."""
        return max(units([it]) for it in items) * min(self.batch, len(items)) if items else 1.0

    def begin(self, pace: Pace, now: float) -> None:
        """A shard began to run on an idle worker: its clocks start now."""
        pace.since = pace.started = now

    def done(self, pace: Pace, work: float | None, now: float) -> None:
        """A shard of `work` units (None: not to be measured) came back at `now`: the worker's
        (and the job's) average, and its clocks, move on."""
        if work is not None and pace.started is not None:
            sample = max(0.0, now - pace.started) / work
            pace.s_per_unit = _ema(pace.s_per_unit, sample)
            self.job_s_per_unit = _ema(self.job_s_per_unit, sample)
        pace.since = pace.started = now

    def rate(self, pace: Pace) -> float | None:
        return pace.s_per_unit if pace.s_per_unit is not None else self.job_s_per_unit

    def bound(self, pace: Pace, call: float) -> float:
        """Seconds without progress after which the worker doing calls of `call` units is hung."""
        rate = self.rate(pace)
        if rate is None:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * rate * call))

    def explain(self, pace: Pace, call: float) -> str:
        """How `bound` was reached, for the log and the failed row's particulars."""
        rate = self.rate(pace)
        if rate is None:
            return (f"no shard of the job had come back yet: the ceiling, "
                    f"run.hang_timeout_s={self.ceiling_s:g}")
        return (f"{self.factor:g} x the {rate * call:.1f} s a call of this work is expected to "
                f"take at the {'worker' if pace.s_per_unit is not None else 'job'}'s measured "
                f"rate, at least {self.floor_s:g} s, at most run.hang_timeout_s={self.ceiling_s:g}")


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
