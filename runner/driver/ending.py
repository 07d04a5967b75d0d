"""The end of a run: its writes to the job's store (results table, record compaction, metrics,
summary, report) and the lock's release, under one deadline once the job stops.

Contract: `Ending()` lives from before the job's lock is taken to the process's exit.
- `begin()` when the run stops (a stop signal, a persistent fault, a store failure at its end):
  from then on every step has what is left of `STOP_S`, in all, not a timeout each.
- `write(what, fn, *args)` runs one step of the end's writes. After the first that fails (an
  `OSError`: a full disk, a store error, or `storage.StoreTimeout`, a store that did not answer),
  or once the deadline has passed, every later step is skipped, and each is named in
  `not_written` with the cause, so the summary printed to the terminal says what is missing.
- `lock_budget()` is the lock's `release_s` (`lock.job_lock`): the time left, once stopping.
- `abandoned`: a call on the store may still be running (a `StoreTimeout` cannot cancel it; a
  snapshot or listing did not finish in time; on an object store (`remote`), any failure: the
  lock's heartbeat and release are requests too). pyarrow's exit waits for S3 requests in
  flight (33 s measured after a stalled write), so then the process ends at once
  (`python -m runner`, see `runner.driver.job.EXIT_AT_ONCE`).

Why one deadline: a stalled store (no answer, not refused) made each step wait for its own
timeout: 20 s for the summary, 20 s per metrics file, 15 s for the lock, 33 s at the exit; a job
whose store stalled ended 147 s later. Now the first step that fails ends the writing, the lock
gets what is left, and the exit does not wait.
"""

from __future__ import annotations

import time

from ..io.storage import StoreTimeout, call_within

STOP_S = 30.0    # a stopping job's end (results, summary, report, lock), in all: Kubernetes'
                 # default grace after SIGTERM, and more than one store timeout (20 s)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


class Ending:
    def __init__(self, remote: bool = False, clock=time.monotonic):
        self.remote, self.clock = remote, clock
        self.deadline: float | None = None     # on `clock`, once stopping
        self.failed: str | None = None         # the first failed step's cause
        self.failed_step: str | None = None
        self.not_written: dict[str, str] = {}  # step -> why it was not done, in order
        self.abandoned = False

    def begin(self, seconds: float = STOP_S) -> None:
        """The run stops now: every later step within `seconds` in all (a second call keeps the
        first deadline)."""
        if self.deadline is None:
            self.deadline = self.clock() + seconds

    @property
    def stopping(self) -> bool:
        return self.deadline is not None

    def left(self, default: float | None = None) -> float | None:
        """Seconds left before the deadline (0 past it); `default` when not stopping."""
        return default if self.deadline is None else max(0.0, self.deadline - self.clock())

    def lock_budget(self) -> float | None:
        """For `job_lock(release_s=...)`: the time left once stopping, else the lock's default."""
        return self.left()

    def saw(self, e: BaseException) -> None:
        """A store error seen outside `write` (the record, a snapshot): a timeout leaves its call
        running, and so may any error of an object store."""
        if isinstance(e, StoreTimeout) or self.remote:
            self.abandoned = True

    def fail(self, step: str, cause: str) -> None:
        """`step` failed of `cause`: it and every later step are not written."""
        if self.failed is None:
            self.failed, self.failed_step = cause, step
            self.begin()                       # what is left (the lock's release) is bounded
        self.abandoned |= self.remote
        self.not_written.setdefault(step, cause)

    def skip(self, step: str) -> bool:
        """Whether `step` is skipped (an earlier step failed, or no time is left); named if so."""
        if self.failed is not None:
            self.not_written.setdefault(step, f"not tried after {self.failed_step} failed")
            return True
        if self.deadline is not None and self.clock() >= self.deadline:
            self.not_written.setdefault(step, f"no time left before the stop's deadline "
                                              f"({STOP_S:.0f} s)")
            return True
        return False

    def write(self, step: str, fn, *args):
        """`fn(*args)` unless skipped (`skip`); its OSError fails the step (`fail`). Returns fn's
        value, or None."""
        if self.skip(step):
            return None
        try:
            return fn(*args)
        except OSError as e:
            self.saw(e)
            self.fail(step, first_line(e))
            return None

    def within(self, step: str, fn, *args):
        """`fn(*args)` as `write` does, also given up (None, named, `abandoned`) once the time
        left runs out: for calls the store does not bound (a listing) and a snapshot in flight."""
        if self.skip(step):
            return None
        try:
            finished, value = call_within(self.left(default=None), f"end-{step}", fn, *args)
        except OSError as e:
            self.saw(e)
            self.fail(step, first_line(e))
            return None
        if not finished:
            self.abandoned = True
            self.fail(step, f"not finished within the stop's deadline ({STOP_S:.0f} s)")
            return None
        return value

    def summary_lines(self) -> list[str]:
        """What the terminal is told after the summary: each step not written, and why."""
        if not self.not_written:
            return []
        steps = list(self.not_written)
        first = steps[0]
        line = f"not written: {first} ({self.not_written[first]})"
        rest = [s for s in steps[1:]]
        if rest:
            line += f"; then skipped: {', '.join(rest)}"
        return [line]
