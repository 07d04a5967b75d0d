"""One driver per job directory.

Contract: `job_lock(job_dir)` is a context manager that creates `<job_dir>/.lock` (O_EXCL, so only
one driver can) holding JSON {host, pid, started}, and removes it on exit, whatever the exit path
(exception, Ctrl-C, SIGTERM turned into an exception; `atexit` as a last resort). A lock whose
holder is gone (same host, pid not alive) is stale and taken over. Otherwise `LockedError` says
who holds it and what to do: wait for that driver, stop it, or, if it is gone (its host died),
remove the file. A SIGKILLed driver leaves its lock behind; the next run on the same host finds
its pid dead and takes over.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time

LOCK = ".lock"


class LockedError(RuntimeError):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # exists, owned by someone else
        return True
    return True


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}                    # being written, or damaged


def _stale(holder: dict) -> bool:
    return holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
        and not _alive(holder["pid"])


def _try_create(path: str, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def acquire(job_dir: str) -> str:
    """Take the lock of `job_dir` or raise `LockedError`. Returns the lock's path."""
    path = os.path.join(job_dir, LOCK)
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(3):
        if _try_create(path, me):
            return path
        holder = _read(path)
        if holder is None:                       # released meanwhile
            continue
        if _stale(holder):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        break
    who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
           if holder else "an unreadable lock file")
    raise LockedError(
        f"{job_dir} is in use by another driver ({who}; lock file {path}). Wait for it to finish "
        f"or stop it, or use another job.name/output.dir. If that driver is gone (its host died), "
        f"remove {path} and rerun.")


def holder(job_dir: str) -> dict | None:
    """Who holds the lock of `job_dir` now (None if nobody, or only a stale lock)."""
    h = _read(os.path.join(job_dir, LOCK))
    return None if h is None or _stale(h) else h


def release(path: str) -> None:
    """Remove the lock if it is still ours (a driver never removes another driver's lock)."""
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def job_lock(job_dir: str):
    path = acquire(job_dir)
    atexit.register(release, path)
    try:
        yield path
    finally:
        release(path)
        atexit.unregister(release)
