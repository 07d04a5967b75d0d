"""What the driver shows while a job runs: each worker's start-up phases, then the progress.

Contract:
- `PhasePrinter(pool).poll(slots)` logs each starting worker's start-up phases as they happen:
  "starting, then loading model" when its actor is made (an actor answers no call before its
  `__init__`, the model load, returns), then what the worker's `phases()` reports during `warmup()`
  (compiling, warming up from the compile cache, ...), which a threaded actor answers while it warms
  up. The driver polls from its wait loop (dispatch wakes every second); a poll never blocks: one
  call per worker is in flight at a time, and one `pool.wait` looks at all of them. It reaches the
  workers only through the job's `dispatch.Pool` (no Ray here). A phase that goes on is said again
  with its seconds so far ("worker 0: compiling and warming up, 45 s"): 15 s into it, then every
  15 s up to a minute, then every minute (an O3 compile would otherwise show nothing for minutes).
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
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("runner")


@dataclass(eq=False)
class Watched:
    """A starting worker whose phases are shown: its pending `phases()` call (None once one
    failed: nothing more to show) and how many phases were logged."""
    worker: Any
    rank: int
    call: Any = None
    seen: int = 0
    phase: str = "starting, then loading model"
    since: float = 0.0           # when the driver saw `phase` begin (monotonic)
    told: float = 0.0            # when it last said it


def _next_line_after(running_s: float) -> float:
    """Seconds into a phase at which it is said again, given it was last said `running_s` in."""
    step = 15.0 if running_s < 60 else 60.0
    return (running_s // step + 1) * step


class PhasePrinter:
    """Driver side, over the job's `dispatch.Pool`: `poll(slots)` logs the phases the starting
    slots' workers reported since the last poll; `poll(slots, flush=slot)` waits (up to 5 s) for
    that slot's last ones."""

    def __init__(self, pool, every_s: float = 0.5):
        self.pool, self.every_s, self.last = pool, every_s, 0.0
        self.watched: dict[int, Watched] = {}        # by rank

    def poll(self, slots, flush=None) -> None:
        if flush is not None:
            self._flush(flush)
            return
        if time.monotonic() - self.last < self.every_s:
            return
        self.last = time.monotonic()
        watched = [self._watch(s) for s in slots if s.state == "starting"]
        calls = [w.call for w in watched if w.call is not None]
        done = set(self.pool.wait(calls, timeout=0)) if calls else set()  # one wait for them all
        for w in watched:
            if w.call in done:
                self._read(w)
            self._still(w)
        if len(self.watched) > len(watched):     # slots no longer starting: nothing more to show
            self.watched = {w.rank: w for w in watched}

    def _flush(self, slot) -> None:
        """`slot`'s warm-up has returned: its last phases (at most 2 x 5 s of the dispatch loop; a
        threaded actor answers at once). The call in flight may have been answered before the
        last phases were recorded: one more call after it, which sees them all (the call it leaves
        in flight is never read)."""
        w = self._watch(slot)
        for _ in range(2):
            if w.call is None or not self.pool.wait([w.call], timeout=5):
                break
            self._read(w)
        self.watched.pop(slot.rank, None)

    def _watch(self, slot) -> Watched:
        w = self.watched.get(slot.rank)
        if w is None or w.worker is not slot.actor:          # a new worker (or its replacement)
            # its process may still wait for a node's resources: its own phases start at warm-up
            log.info("worker %d: starting, then loading model", slot.rank)
            now = time.monotonic()
            w = self.watched[slot.rank] = Watched(slot.actor, slot.rank, since=now, told=now)
            self._ask(w)
        return w

    def _ask(self, w: Watched) -> None:
        try:
            w.call = self.pool.phases(w.worker, w.seen)
        except Exception:
            w.call = None

    def _read(self, w: Watched) -> None:
        """A done phases() call: log what it brought, ask for the next ones."""
        try:
            events = self.pool.result(w.call)
        except Exception:            # a display, never a reason to fail the job; the slot's
            w.call = None            # own error reaches the dispatcher through its warm-up
            return
        for phase, _ in events:
            log.info("worker %d: %s", w.rank, phase)
            w.phase, w.since = phase, time.monotonic()
            w.told = w.since
        w.seen += len(events)
        self._ask(w)


    def _still(self, w: Watched) -> None:
        """`w`'s phase said again, with its seconds so far, when a line is due."""
        now = time.monotonic()
        if now - w.since >= _next_line_after(w.told - w.since):
            w.told = now
            log.info("worker %d: %s, %s", w.rank, w.phase, _duration(now - w.since))


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
