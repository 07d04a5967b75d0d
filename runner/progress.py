"""What the driver shows while a job runs: each worker's start-up phases, then the progress.

Contract:
- `StatusBoard` is a tiny Ray actor (num_cpus=0) owned by the driver. Workers report their start-up
  phases to it fire-and-forget (`board.set.remote(rank, phase, seconds)`: loading model, compiling,
  warming up, ready); the driver cannot ask a worker itself, since an actor runs one call at a time
  and the worker is busy in `__init__`/`warmup()`. `PhasePrinter` polls the board from the driver's
  wait loop (dispatch wakes every second) and logs one line per new phase.
- `Progress` counts finished items. It starts at the first worker's ready, so its rate and ETA count
  generation, not start-up (the same clock as the summary's items/s). On a terminal it is a tqdm
  bar; otherwise (a log file, `ray job logs`) a plain line every `every_s` seconds and one at the end,
  instead of tqdm's `\\r` updates that a file keeps as one very long line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

log = logging.getLogger("runner")


class StatusBoard:
    def __init__(self):
        self.events: list[tuple[int, str, float]] = []

    def set(self, rank: int, phase: str, seconds: float) -> None:
        self.events.append((rank, phase, seconds))

    def since(self, n: int) -> list[tuple[int, str, float]]:
        return self.events[n:]


class PhasePrinter:
    """Driver side of the board: `poll()` logs the phases reported since the last poll."""

    def __init__(self, board, every_s: float = 0.5):
        self.board, self.seen, self.every_s, self.last = board, 0, every_s, 0.0

    def poll(self, force: bool = False) -> None:
        """At most every `every_s` (the wait loop may spin faster while shards stream in)."""
        import ray
        if not force and time.monotonic() - self.last < self.every_s:
            return
        self.last = time.monotonic()
        try:
            events = ray.get(self.board.since.remote(self.seen), timeout=5)
        except Exception:                # a display, never a reason to fail the job
            return
        self.seen += len(events)
        for rank, phase, seconds in events:
            if phase == "ready":
                log.info("worker %d: ready in %.1f s", rank, seconds)
            else:
                log.info("worker %d: %s", rank, phase)


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


class Progress:
    def __init__(self, total: int, every_s: float = 10.0, stream=None):
        self.total, self.every_s = total, every_s
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done, self.t0, self.last, self.bar = 0, None, 0.0, None

    def start(self) -> None:
        """The first worker is ready: the clock starts now (again calls are no-ops)."""
        if self.t0 is not None:
            return
        self.t0 = self.last = time.monotonic()
        if self.tty:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, initial=self.done, unit="item", desc="generating",
                            smoothing=0.1, file=self.stream)

    def logging(self):
        """Context for the run: on a terminal, log lines print above the bar instead of through it."""
        if not self.tty:
            return contextlib.nullcontext()
        from tqdm.contrib.logging import logging_redirect_tqdm
        return logging_redirect_tqdm()

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        self.tick()

    def tick(self) -> None:
        """Called often (every row and every second): a plain line when one is due."""
        if self.bar is None and self.t0 is not None and time.monotonic() - self.last >= self.every_s:
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.t0 is not None:
            self._line()

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = _duration((self.total - self.done) / rate) if rate > 0 else "?"
        return (f"generating: {self.done}/{self.total} items, {rate:.3g} items/s, "
                f"{_duration(elapsed)} elapsed, ETA {eta}")

    def _line(self) -> None:
        self.last = time.monotonic()
        print(self.line(), file=self.stream, flush=True)
