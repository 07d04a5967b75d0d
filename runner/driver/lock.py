"""One driver per job directory.

Contract: `job_lock(job_dir)` is a context manager that creates `<job_dir>/.lock` (O_EXCL, so only
one driver can) holding JSON {host, pid, started}, and removes it on exit, whatever the exit path
(exception, Ctrl-C, SIGTERM turned into an exception; `atexit` as a last resort); one that cannot
be removed (its directory turned read-only) is named in a warning, never raised. A lock whose
holder is gone (same host, pid not alive) is stale and taken over. Otherwise `LockedError` says
who holds it and what to do: wait for that driver, stop it, or, if it is gone (its host died),
remove the file. A SIGKILLed driver leaves its lock behind; the next run on the same host finds
its pid dead and takes over.

On an object store (`s3://`, `gs://` output.dir) there is no exclusive create: the lock is an
object holding the same JSON plus `heartbeat` (unix seconds), which a thread of the holder rewrites
every `HEARTBEAT_S`. A lock whose heartbeat is older than `STALE_S` (its driver died, on any host)
is stale and taken over. Removing it at the end takes at most `RELEASE_S` (`release_s`): a
store that does not answer leaves the lock behind, named in a warning, for the next run to take
over once stale (the release goes on in the background meanwhile). This is best effort: two drivers starting within the same second can both
see no lock and both write one; each then reads the lock back after a short pause and only the one
whose write is there proceeds, which narrows the race to near-simultaneous writes but does not
close it (S3 has no compare-and-swap in the API pyarrow speaks). Do not start two drivers on one
job directory on purpose.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid

from ..io.storage import Store, resolve

LOCK = ".lock"
HEARTBEAT_S = 15.0      # object stores: how often the holder rewrites its lock
STALE_S = 120.0         # object stores: a lock not rewritten for this long is stale
RELEASE_S = 15.0        # object stores: removing the lock at the end gives up after this long
DAMAGED_S = 2.0         # a local lock unreadable this long names no driver: it is damaged


class LockedError(RuntimeError):
    pass

log = logging.getLogger("runner")


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


def _damaged(path: str, holder: dict) -> bool:
    """A lock file that has been unreadable (empty, zero-filled: a power loss after its create,
    before its synced write reached the disk) for `DAMAGED_S`: no driver is named in it, and a
    driver writes its lock within milliseconds of creating it. Taken over, said in one line; it
    was "in use by another driver" with no driver to wait for (issue 60)."""
    if holder:
        return False
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    if age < DAMAGED_S:                          # being written now, perhaps: read it again
        time.sleep(DAMAGED_S - age)
        holder.update(_read(path) or {})
        return not holder and _damaged(path, holder)
    log.warning("%s names no driver (empty or damaged, %.0f s old): taken over", path, age)
    return True


def _try_create(path: str, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:             # a full disk: no half-written lock left, the cause named
        with contextlib.suppress(OSError):
            os.remove(path)
        raise LockedError(f"cannot write the lock file {path} ({e.strerror or e}); free space or "
                          f"fix access to output.dir, then rerun") from e
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
        if _stale(holder) or _damaged(path, holder):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        break
    raise _locked(job_dir, path, holder)


def holder(job_dir: "str | Store") -> dict | None:
    """Who holds the lock of `job_dir` now (None if nobody, or only a stale lock)."""
    store = job_dir if isinstance(job_dir, Store) else resolve(job_dir)
    if store.local:
        h = _read(store.path(LOCK))
        return None if h is None or _stale(h) else h
    h = _read_remote(store)
    return None if h is None or _stale_remote(h) else h


def release(path: str) -> None:
    """Remove the lock if it is still ours (a driver never removes another driver's lock). Never
    raises: a lock that cannot be removed (its directory turned read-only mid-job) is named in a
    warning, and the job's own outcome, or its error, is what the driver reports (issue 75: the
    remove's EROFS replaced a job's exit 3 with a traceback)."""
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove the lock %s (%s: %s); the next run on host %s takes "
                        "it over once this driver has ended (elsewhere, remove it by hand)",
                        path, type(e).__name__, e.strerror or e, socket.gethostname())


# -- object stores ---------------------------------------------------------------------------
def _read_remote(store: Store) -> dict | None:
    text = store.read_text(LOCK)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {}


def _stale_remote(h: dict) -> bool:
    return _stale(h) or time.time() - float(h.get("heartbeat") or 0) > STALE_S


def _acquire_remote(store: Store) -> dict:
    me = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "heartbeat": time.time()}
    h = _read_remote(store)
    if h is None or _stale_remote(h):
        store.write_text(LOCK, json.dumps(me))
        time.sleep(0.5)                    # a driver that wrote at the same moment: last writer wins
        h = _read_remote(store)
        if h and h.get("token") == me["token"]:
            return me
    raise _locked(store.uri(), store.uri(LOCK), h)


@contextlib.contextmanager
def _remote_lock(store: Store, release_s=None):
    me = _acquire_remote(store)
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):       # a missed beat; the next one retries
                store.write_text(LOCK, json.dumps({**me, "heartbeat": time.time()}))

    t = threading.Thread(target=beat, name="lock-heartbeat", daemon=True)
    t.start()
    try:
        yield store.uri(LOCK)
    finally:
        stop.set()
        budget = release_s() if callable(release_s) else release_s
        _release_remote(store, me["token"], t, RELEASE_S if budget is None else max(0.0, budget))


def _release_remote(store: Store, token: str, heartbeat: threading.Thread, timeout_s: float) -> None:
    """Delete the lock if it is still ours, within `timeout_s` in all; never raises (the job's own
    outcome, or its error, is what counts). First the heartbeat must have stopped: a beat still
    in flight would put the lock back after the delete. Past `timeout_s` (the store does not
    answer) a warning names the lock and what happens to it; the release goes on in the
    background, so a store that answers again before the process ends still gets it removed."""
    done = threading.Event()
    failed: list[BaseException] = []

    def release():
        try:
            heartbeat.join()
            h = _read_remote(store)
            if h and h.get("token") == token:
                store.delete(LOCK)
        except BaseException as e:
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=release, name="lock-release", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("could not remove the lock %s: the store did not answer within %.0f s; the "
                    "next run takes it over once its heartbeat is %.0f s old (or remove it by hand)",
                    store.uri(LOCK), timeout_s, STALE_S)
    elif failed:
        e = failed[0]
        log.warning("could not remove the lock %s (%s: %s); the next run takes it over once its "
                    "heartbeat is %.0f s old (or remove it by hand)", store.uri(LOCK),
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", STALE_S)


def _locked(job_dir: str, path: str, holder: dict | None) -> LockedError:
    who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
           if holder else "an unreadable lock file")
    return LockedError(
        f"{job_dir} is in use by another driver ({who}; lock file {path}). Wait for it to finish "
        f"or stop it, or use another job.name/output.dir. If that driver is gone (its host died), "
        f"remove {path} and rerun.")


@contextlib.contextmanager
def job_lock(job_dir: "str | Store", release_s=None):
    """`release_s`: on an object store, how long removing the lock may take at the end, in
    seconds, or a function returning it when the end comes (what is left of a stop deadline);
    default `RELEASE_S`. Past it a warning names the lock. A local lock is one `os.remove`."""
    store = job_dir if isinstance(job_dir, Store) else resolve(job_dir)
    if not store.local:
        with _remote_lock(store, release_s) as path:
            yield path
        return
    path = acquire(store.base)
    atexit.register(release, path)
    try:
        yield path
    finally:
        # once tried here, not again at exit: a lock that could not be removed is said once
        atexit.unregister(release)
        release(path)
