"""What the driver's own streams do beyond printing: colour codes kept off files, and the summary's
legend shown on a terminal once.

Contract:
- `plain_off_terminal()`: from then on, what is written to `sys.stdout` / `sys.stderr` when it is
  not a terminal (a log file, `ray job logs`, a pipe) has its ANSI escape sequences removed. Ray
  colours the prefix of every worker line it forwards ("(WorkerActor pid=...)"), and libraries'
  messages may carry their own; a file keeps them as raw bytes. Terminals are left alone.
- `legend_due(legend, stream)`: whether the summary printed on `stream` should carry the
  table's legend: on a terminal the first time this user sees this legend (a state file under
  the user's cache directory holds the legend's hash: a changed legend is shown again), never
  off a terminal (summary.txt always carries it). A state file that cannot be read or written
  shows the legend: never a reason to fail a job.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")   # CSI sequences, 2-byte escapes


class PlainStream:
    """A text stream that writes through to `raw` with ANSI escape sequences removed."""

    def __init__(self, raw):
        self.raw = raw

    def write(self, s: str) -> int:
        self.raw.write(ANSI.sub("", s))
        return len(s)

    def __getattr__(self, name):      # flush, fileno, isatty, encoding, ...: the raw stream's
        return getattr(self.raw, name)


def plain_off_terminal() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, PlainStream) and not _isatty(stream):
            setattr(sys, name, PlainStream(stream))
    # Ray's own switch for its prefixes' colours (read per line it forwards); the stream
    # wrapper removes the rest
    if not _isatty(sys.stderr):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):       # closed, or not a real stream
        return False


def state_dir() -> Path:
    """The runner's state under the user's cache directory (XDG's, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "runner"


def legend_due(legend: str, stream) -> bool:
    if not _isatty(stream):
        return False
    mark = state_dir() / "legend-seen"
    digest = hashlib.sha256(legend.encode()).hexdigest()[:16]
    try:
        if mark.read_text().strip() == digest:
            return False
    except OSError:
        pass
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(digest + "\n")
    except OSError:
        pass
    return True
