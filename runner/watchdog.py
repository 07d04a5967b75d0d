"""How long a worker may go without progress before the dispatcher declares it hung.

A generate call that never returns (a hung CUDA kernel, a stuck encoder subprocess, a read with no
timeout) leaves its worker alive and silent: Ray reports nothing, and without a bound the job
waits forever (issue 60: `6/8 items ... ETA 2 min` for 7 minutes). Progress is what the driver
sees: a worker becoming ready, a shard's rows (or a canary's verdict) coming back. The bound for
the work a worker holds now is

    min(ceiling, max(floor, FACTOR x expected))

where `expected` is the worker's own recent seconds per unit of work (an exponential average over
the shards it returned; the job's average while it has returned none) times the units of the shard
it is on. A unit is a pixel of one frame at one step (`units`): a row twice the size or steps is
expected to take twice as long, so a legitimately large row is not taken for a hang. Before any
shard of the job came back, the bound is the ceiling (the first call of a shape may be slow). The
floor keeps a short measured time (0.1 s images) from turning a hiccup (a slow store write, a
garbage collection) into a kill; the ceiling (`run.hang_timeout_s`) is the user's: no worker goes
silent longer than it. This module is plain arithmetic: the dispatcher owns the clock and the
slots.
"""

from __future__ import annotations

from dataclasses import dataclass

FACTOR = 10.0      # a worker is hung past 10x its expected time for the work it holds
FLOOR_S = 60.0     # ... and never before 60 s without progress
EMA = 0.3          # weight of the newest shard in a worker's average seconds per unit


def units(items) -> float:
    """The work of `items`: pixels x frames x steps (the denoiser's cost grows with each)."""
    return float(sum(it.height * it.width * (it.num_frames or 1) * it.num_inference_steps
                     for it in items)) or 1.0


@dataclass
class Pace:
    """A worker's progress clock: when it last made progress, and its measured seconds per unit."""
    since: float
    s_per_unit: float | None = None
    largest: float = 0.0           # the most units of a shard it was handed (a canary's estimate)


class Watchdog:
    """The bound of the module docstring. `ceiling_s` 0: never hung."""

    def __init__(self, ceiling_s: float, factor: float = FACTOR, floor_s: float = FLOOR_S):
        self.ceiling_s, self.factor, self.floor_s = ceiling_s, factor, floor_s
        self.job_s_per_unit: float | None = None      # every worker's shards, averaged

    @property
    def on(self) -> bool:
        return self.ceiling_s > 0

    def done(self, pace: Pace, work: float, now: float) -> None:
        """A shard of `work` units came back at `now`: the worker's (and the job's) average, and
        its progress clock, move on."""
        sample = max(0.0, now - pace.since) / work
        pace.s_per_unit = _ema(pace.s_per_unit, sample)
        self.job_s_per_unit = _ema(self.job_s_per_unit, sample)
        pace.since = now

    def bound(self, pace: Pace, work: float | None) -> float:
        """Seconds without progress after which the worker holding `work` units (None: a canary,
        sized as its largest shard) is hung."""
        rate = pace.s_per_unit if pace.s_per_unit is not None else self.job_s_per_unit
        if rate is None:
            return self.ceiling_s
        expected = rate * (pace.largest if work is None else work)
        return min(self.ceiling_s, max(self.floor_s, self.factor * expected))

    def explain(self, pace: Pace, work: float | None) -> str:
        """How `bound` was reached, for the log and the failed row's particulars."""
        rate = pace.s_per_unit if pace.s_per_unit is not None else self.job_s_per_unit
        if rate is None:
            return (f"no shard of the job had come back yet: the ceiling, "
                    f"run.hang_timeout_s={self.ceiling_s:g}")
        expected = rate * (pace.largest if work is None else work)
        return (f"{self.factor:g} x the {expected:.1f} s expected for this work at the "
                f"{'worker' if pace.s_per_unit is not None else 'job'}'s measured rate, at least "
                f"{self.floor_s:g} s, at most run.hang_timeout_s={self.ceiling_s:g}")


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
