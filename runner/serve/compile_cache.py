"""The job's shared compile cache: only the first worker pays for compilation.

Contract (used by `Worker.warmup` when the compile mode has `cache-all`):
- `CacheBroker` is a Ray actor owned by the driver for one job. For a cache key (from
  `compiler.cache.cache_key`: versions, GPU, model config, dtype, shapes, mode), the first worker
  to `claim` it compiles; the others `fetch` the artifact it publishes, through the Ray object store,
  so this works across nodes with no shared filesystem. The broker records the artifact's sha256
  when it is published; a fetching worker checks the bytes it got against that digest, and
  `compiler.cache.unpack_and_load` checks the artifact's own header and hash, before anything is
  unpickled.
- The artifact is also written to `compile.cache_dir` (atomically), where the next job's workers
  find it: each reads it there itself, before any claim's wait, so a job after the first has no
  worker waiting for another's warm-up (the claimant that found it also publishes it to the broker
  at once, for workers that cannot read that directory). Artifacts are read only from there or
  from the broker. `compile.cache_dir` may be a local path or an `s3://`/`gs://` URI (`<cache_dir>/<key>.artifact`, one get / one put
  through `runner.io.storage`); Inductor's and Triton's own working caches stay on a local disk
  (`local_dir`): the artifact carries everything a warm start needs.
- A "fetch" worker waits for the claimant's artifact at most half the start-up time it has left
  (`warm_from_shared_cache`'s `time_left_s`: what remains of `ray.worker_start_timeout_s`, after
  which the driver gives a worker up), and then compiles itself in the other half: a claimant
  that hangs or is very slow (never publishes, never says it failed) costs the job that one
  worker, not all of them. Half is the even bet: the waiter gets a claimant's artifact if it
  compiles in up to half that time, and can compile itself if compiling takes up to half.
- Anything wrong (a timeout waiting for the compiling worker, a corrupt or mismatched artifact,
  one that cannot be read: another user's, an I/O error) is logged and the worker compiles
  itself: never a crash, never unverified code.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time

log = logging.getLogger("runner")
# Inductor/Triton working caches when cache_dir is a URI; RUNNER_LOCAL_COMPILE_CACHE moves them (a
# node's larger disk; a test's own directory), and reaches workers like any RUNNER_* variable.
LOCAL_CACHE = "~/.cache/runner/compile-cache"


def local_dir(cache_dir: str) -> str:
    """Where Inductor and Triton keep their working caches for `cache_dir`."""
    from ..io.storage import is_uri
    if not is_uri(cache_dir):
        return cache_dir
    return os.path.expanduser(os.environ.get("RUNNER_LOCAL_COMPILE_CACHE") or LOCAL_CACHE)


def read_artifact(cache_dir: str, key: str) -> bytes | None:
    """The artifact's bytes, or None: missing, or not readable (a store that does not answer;
    locally a file of another user's job made 0600 by an older version, a directory in its
    place, an I/O error), which is logged: the worker compiles, it never fails its warm-up."""
    from compiler import cache as cc
    from ..io.storage import is_uri, resolve
    try:
        if not is_uri(cache_dir):
            return cc.read_artifact(cache_dir, key)
        return resolve(cache_dir).read_bytes(cc.artifact_path("", key).name)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:        # the store unreachable: compile, never crash
        log.warning("compile cache %s not readable (%s: %s); compiling", cache_dir,
                    type(e).__name__, e)
        return None


def write_artifact(cache_dir: str, key: str, blob: bytes) -> None:
    """Best effort, local path or store alike: a worker whose graphs are compiled serves even when
    the artifact cannot be kept (a full disk: the next job compiles again)."""
    from compiler import cache as cc
    from ..io.storage import is_uri, resolve
    try:
        if not is_uri(cache_dir):
            cc.write_artifact(cache_dir, key, blob)
        else:
            resolve(cache_dir).write_bytes_atomic(cc.artifact_path("", key).name, blob)
    except (OSError, ValueError) as e:
        log.warning("compile artifact not saved to %s (%s)", cache_dir, e)


class CacheBroker:
    def __init__(self):
        self.owner: dict[str, int] = {}
        self.blobs: dict[str, bytes | None] = {}
        self.digests: dict[str, str | None] = {}
        self.events: dict[str, asyncio.Event] = {}

    def _event(self, key: str) -> asyncio.Event:
        return self.events.setdefault(key, asyncio.Event())

    async def claim(self, key: str, rank: int) -> str:
        """'compile' for the first worker of a key (and for its replacement), else 'fetch'."""
        if key in self.blobs and self.blobs[key] is not None:
            return "fetch"
        owner = self.owner.setdefault(key, rank)
        return "compile" if owner == rank else "fetch"

    async def publish(self, key: str, blob: bytes | None) -> None:
        """blob None: the compiling worker has nothing to share; the waiters compile themselves."""
        self.blobs[key] = blob
        self.digests[key] = hashlib.sha256(blob).hexdigest() if blob is not None else None
        self._event(key).set()

    async def fetch(self, key: str, timeout_s: float):
        """(blob, digest) once the claimant published (blob None: it has nothing to share), or
        None if it did not within `timeout_s`."""
        try:
            await asyncio.wait_for(self._event(key).wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.blobs[key], self.digests[key]


def warm_from_shared_cache(broker, key: str, rank: int, cache_dir: str, time_left_s: float) -> dict:
    """Before compiling: load a verified artifact if one exists for `key`. Returns the report;
    report["role"] == "compile" means this worker must `publish` after its warm-up call.

    Every worker first reads `cache_dir` itself: in a job whose cache a previous job filled, no
    worker waits for another (the workers' start-ups overlap whole). Only on a miss does a
    "fetch" worker wait for the compiling one to publish through the broker, for half of
    `time_left_s` (the worker's start-up time left as this is called) at most: then it compiles
    itself, in the other half. The claimant that found the artifact in `cache_dir` publishes it
    at once, for workers that cannot read it."""
    import ray
    from compiler import cache as cc

    t_call = time.perf_counter()
    report = {"cache_key": key, "cache_hit": False, "cache_source": None, "cache_wait_s": 0.0}
    role = ray.get(broker.claim.remote(key, rank)) if broker is not None else "compile"
    report["role"] = role
    blob = read_artifact(cache_dir, key)   # a job after the first: every worker, no waiting
    if blob is not None and cc.unpack_and_load(blob, key):
        # nothing for `publish` to write; a claimant shares it now, not after its warm-up:
        # workers that cannot read cache_dir (a local path on another node) wait for the broker
        report.update(cache_hit=True, cache_source="cache_dir", published=True)
        if role == "compile" and broker is not None:
            ray.get(broker.publish.remote(key, blob))
        return report
    if role == "fetch":
        t0 = time.perf_counter()
        wait_s = max(0.0, time_left_s - (t0 - t_call)) / 2
        got = ray.get(broker.fetch.remote(key, wait_s))
        report["cache_wait_s"] = time.perf_counter() - t0
        blob, digest = got or (None, None)
        if got is None:      # why, for the worker's phase (the driver shows it) and its log
            report["fallback"] = (f"the compiling worker's artifact did not come within "
                                  f"{wait_s:.0f} s, half the start-up time left of "
                                  f"ray.worker_start_timeout_s")
        elif blob is None:
            report["fallback"] = "the compiling worker failed: it had no artifact to share"
        elif hashlib.sha256(blob).hexdigest() != digest:
            log.warning("compile artifact for %s does not match the digest the broker recorded; "
                        "compiling", key)
        elif cc.unpack_and_load(blob, key):
            report.update(cache_hit=True, cache_source="broker")
        if "fallback" in report:
            log.warning("compile cache %s: %s; compiling it myself", key, report["fallback"])
    return report


def publish(broker, report: dict, cache_dir: str) -> None:
    """After the compiling worker's warm-up: share what it compiled (or what it loaded)."""
    import ray
    from compiler import cache as cc

    if report.get("published"):       # a hit in cache_dir: already there, and already shared
        return
    key = report["cache_key"]
    blob = cc.pack_artifact(key)
    if blob is not None:
        write_artifact(cache_dir, key, blob)
        report["artifact_bytes"] = len(blob)
    if broker is not None:
        ray.get(broker.publish.remote(key, blob))
