"""One filesystem layer for a local directory, `s3://bucket/prefix` and `gs://bucket/prefix`.

    store = resolve("s3://bucket/jobs").join("my-job")      # or "gs://...", "/data/out", "file:///..."
    store.write_bytes_atomic("records/shard-00042.parquet", data)
    with store.atomic_local("media/abc.mp4") as tmp:        # for writers that need a local file
        encode_video(frames, tmp)
    done = store.list("records")                            # {"shard-00042.parquet": 1234, ...}
    table = pq.read_table(store.open_input("prompts.parquet"))

Contract
- `resolve(value)` takes a local path (relative, absolute, `~`, `file://`), `s3://bucket[/prefix]` or
  `gs://bucket[/prefix]`; anything else is a ValueError naming the value and these forms. A Store is
  a `pyarrow.fs.FileSystem` (`.fs`) plus a base path (`.base`); `store.path(rel)` is the path to hand
  to pyarrow APIs (`pq.read_table(store.path(rel), filesystem=store.fs)`), `store.uri(rel)` the URI
  for messages. Relative names always use "/". `uri_of(value)` is `resolve(value).uri()` without
  opening a filesystem.
- Credentials and endpoints come from the standard environment, nothing from the job config:
  S3: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN`, profiles, instance roles (the
  AWS SDK's chain), `AWS_REGION`/`AWS_DEFAULT_REGION`, and `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`
  for S3-compatible stores (MinIO, SeaweedFS, moto). The pyarrow we ship (26) does not read
  `AWS_ENDPOINT_URL` itself, so we pass it as `endpoint_override`/`scheme` (path-style addressing
  follows). GCS: Google's application default credentials; `STORAGE_EMULATOR_HOST` for an emulator.
  A Store pickles as its URI (Ray workers resolve it again), so each process uses its own
  environment's credentials.
- Writes are atomic per name: a reader sees the whole object or none, never a partial one.
  Local: a `.tmp-*` file in the same directory, then `os.replace` (`atomic_path`, the one local
  atomic write of the runner: report files and benches use it too). Object stores: the whole payload is
  in hand (bytes, or a finished local file, memory-mapped) before the output stream opens, and goes
  out in one `write` + `close`: one PutObject (`allow_delayed_open`; without it Arrow spends three
  requests on a multipart upload even for 1 byte), or for payloads above Arrow's part threshold
  (a few MB) one multipart upload, which S3 publishes only when Arrow completes it, and Arrow
  completes it only after every part succeeded. We never stream a producer straight
  into `fs.open_output_stream`: Arrow's S3 stream *completes* the upload when it is closed or garbage
  collected, so a writer that raises half-way would publish half an object (tests/test_storage.py
  keeps a canary for this). A crash leaves at most a local `.tmp-*` file, which `list` ignores.
- `list(prefix)` is one recursive listing (`get_file_info(FileSelector)`; pyarrow 26 pages through
  ListObjectsV2 without a delimiter, 1000 keys a request however deep the names) returning
  {name relative to prefix: size} for files only.
  `exists(rel)` is true for a file (object), not for a "directory" prefix.
- Object stores have no directories, append or rename; nothing here needs them.
- A store that stops answering (a stalled server, a network partition: connections accepted or
  dropped, no reply) is an error in bounded time, never a hang. On `s3://` and `gs://` each call
  on one object (`exists`, `read_bytes`, `write_*`, `delete`) raises `StoreTimeout` (an
  `OSError`) after `OP_TIMEOUT_S` seconds, plus one second per `MIN_WRITE_RATE` bytes written;
  its first line names the store, not the object, so that the same stall reads as the same cause
  on every row (the object is on the second line). The call itself cannot be cancelled: it goes
  on in a daemon thread until the client's own timeouts end it (S3: `S3_*_TIMEOUT_S`, 3
  attempts, ~30 s for a write; GCS: pyarrow exposes no per-request timeout, a stalled request
  ends after ~2 minutes, `retry_time_limit` bounds the retries). Until then it also holds up the
  process's exit: pyarrow's `atexit` S3 finalization waits for requests in flight (measured: 33 s
  after a stalled write). A write that lands after its timeout is a complete object (writes are
  atomic): a record or media file that a rerun finds, never a partial one. `list` and
  `delete_prefix` are not bounded (they run for as long as there are keys, one request per 1000)
  and are only called when a job starts. `unreachable(e)` tells an error of the store as a whole
  (no answer, connection refused, a name that does not resolve) from one about an object.
- `info(rel)` is one stat (type: file, "directory" (a prefix of other objects), not found; size);
  `read_bytes(rel, max_bytes)` refuses a larger object (`TooLarge`) before reading any of it.

Design note: the job record on a store that cannot append or rename (as integrated: results.py's
records are per finished shard, named `records/<run>-<seq>.jsonl` rather than by shard key, so a
replanned shard of a resumed run never replaces rows of an earlier record; see results.py)
- Media: `media/<id>.<ext>`, one atomic put per file (encode in memory or to a local temp file, then
  `write_bytes_atomic`/`atomic_local`). A retried prompt overwrites the same key; last writer wins.
- Record: when a shard finishes (all its media written), its result rows go to ONE small object,
  `records/<shard-key>.parquet`, written last: the record is the shard's commit point, so a record
  implies its media exist. The shard key is deterministic (e.g. its first row index, zero-padded), so
  a retried or duplicated shard rewrites the same key rather than adding a row twice.
- Resume: one `list("records")` finds the finished shards (read their rows, in parallel if many);
  one `list("media")` finds media a crashed shard wrote before its record, with sizes (a zero-byte
  object is not a result). No per-row `exists`: a listing returns 1000 keys a request, a stat costs a
  request per key. Measured against moto on 127.0.0.1 (2 cores, `test_listing_vs_exists` with
  STORAGE_BENCH_KEYS=10000): 10k keys listed in 2.3 s, 10k `exists` 23 s; on a real store each stat
  is a network round trip (~10-50 ms), so a million rows would be hours of stats vs ~1000 listings.
- End: compact every record into `results.parquet` with one put. A crash mid-compaction leaves no or a
  complete `results.parquet`, and the records are still there to compact again; the records may be
  deleted once `results.parquet` exists (its existence then means "done").
- compile.cache_dir on a store: Inductor/Triton want a local directory, so a worker would copy the
  cache prefix down once at start (one `list`, then gets) and put back entries it created
  (`write_file_atomic`); entries are content-addressed, so concurrent writers agree.
- Not covered by tests: GCS against a server (there is no GCS emulator on PyPI; the code path is
  pyarrow's GcsFileSystem with default credentials, or STORAGE_EMULATOR_HOST). fsspec is not needed:
  pyarrow.fs covers local, S3 and GCS with the same calls.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

FORMS = "a local path, file:///path, s3://bucket[/prefix] or gs://bucket[/prefix]"
TMP_PREFIX = ".tmp-"  # local temporary files; hidden from list()
OP_TIMEOUT_S = 20.0          # object stores: one call on one object, at most (see the docstring)
MIN_WRITE_RATE = 1 << 20     # bytes/s a write is given on top of OP_TIMEOUT_S (100 MB: +100 s)
# The S3 client's own limits, per attempt (3 attempts): a connection not made in this time, a
# request that moves no byte for this long (curl's low-speed limit: it applies on Linux too,
# whatever pyarrow's docstring says). 3 s is the AWS SDK's request default; its connect default,
# 1 s, fails an attempt on a single lost SYN. Against a stalled server (moto under SIGSTOP) a
# read then fails after ~11 s and a small write after ~30 s (5 s each: 17 s and 34 s).
S3_CONNECT_TIMEOUT_S = 3.0
S3_REQUEST_TIMEOUT_S = 3.0


def call_within(limit: float | None, name: str, fn, *args) -> tuple[bool, object]:
    """`fn(*args)` on a daemon thread named `name`, waited for up to `limit` seconds (None: no
    limit). (True, its value) when it returned, its exception raised in the caller's thread; (False,
    None) when it was still running: a call on a stalled store cannot be cancelled, so it is left
    to finish (or not) on its own."""
    box: dict = {}
    done = threading.Event()

    def call():
        try:
            box["value"] = fn(*args)
        except BaseException as e:      # handed to the caller's thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=call, name=name, daemon=True).start()
    if not done.wait(limit):
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box.get("value")


class StoreTimeout(TimeoutError):       # TimeoutError is an OSError: handled as a store failure
    pass


class TooLarge(ValueError):
    """An object over the size a reader accepts (`Store.read_bytes(rel, max_bytes)`); none of its
    bytes were read."""

    def __init__(self, size: int, max_bytes: int):
        super().__init__(f"{size} bytes, over the {max_bytes} accepted")
        self.size, self.max_bytes = size, max_bytes


# What the clients say when no request reached the store at all (curl's messages: the S3 client's
# and the GCS client's transport), in the words we report. Anything else is about one object.
_UNREACHABLE = (
    (("timeout was reached", "timed out"), "did not answer in time (timed out)"),
    (("could not connect", "couldn't connect", "connection refused"),
     "refused the connection (nothing listens at its address)"),
    (("could not resolve", "couldn't resolve"), "has a host name that does not resolve (DNS)"),
)


def unreachable(e: BaseException) -> str | None:
    """Why the store as a whole could not be reached, if that is what `e` says (a `StoreTimeout`, a
    timeout, a refused connection, a name that does not resolve); None for an error about one
    object (missing, access denied) or anything else. Measured against moto: a stalled server
    (SIGSTOP) fails a stat after ~10 s with curl's code 28, a closed port at once with code 7, an
    unresolvable endpoint with code 6."""
    if isinstance(e, StoreTimeout):
        return "did not answer in time (timed out)"
    text = str(e).lower()
    for needles, why in _UNREACHABLE:
        if any(n in text for n in needles):
            return why
    return None


class Store:
    """A filesystem (`fs`) and a base path in it (`base`, no trailing "/"); `scheme` is "file",
    "s3" or "gs"."""

    def __init__(self, fs: pafs.FileSystem, base: str, scheme: str):
        self.fs, self.base, self.scheme = fs, base.rstrip("/") or "/", scheme

    @property
    def local(self) -> bool:
        return self.scheme == "file"

    def __repr__(self):
        return f"Store({self.uri()})"

    def __reduce__(self):
        # Pickled (e.g. shipped to a Ray worker) as its URI: the receiving process resolves it again
        # with its own environment's credentials and endpoint.
        return resolve, (self.uri(),)

    def path(self, rel: str = "") -> str:
        rel = rel.strip("/")
        return f"{self.base.rstrip('/')}/{rel}" if rel else self.base

    def uri(self, rel: str = "") -> str:
        return self.path(rel) if self.local else f"{self.scheme}://{self.path(rel)}"

    def _bounded(self, what: str, rel: str, fn, *args, nbytes: int = 0):
        """`fn(*args)`, or `StoreTimeout` once it has run past its limit (object stores only;
        see the module docstring)."""
        if self.local:
            return fn(*args)
        limit = OP_TIMEOUT_S + nbytes / MIN_WRITE_RATE
        finished, value = call_within(limit, f"store-{what}", fn, *args)
        if not finished:
            raise StoreTimeout(
                f"the store {self.uri()} did not answer a {what} in time ({OP_TIMEOUT_S:.0f} s, plus "
                f"1 s per MiB written): it is stalled or unreachable\n"
                f"{what} of {self.uri(rel)}: no answer after {limit:.0f} s")
        return value

    def join(self, *parts: str) -> "Store":
        """The Store rooted at base/parts (e.g. the job's directory under output.dir)."""
        return Store(self.fs, self.path("/".join(p.strip("/") for p in parts if p)), self.scheme)

    # -- reads -------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self.info(rel).type == pafs.FileType.File

    def info(self, rel: str) -> pafs.FileInfo:
        """What is at rel: its type (`pafs.FileType`: File, Directory (a prefix of other objects),
        NotFound) and size, in one request."""
        return self._bounded("stat", rel, self.fs.get_file_info, self.path(rel))

    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes; with `max_bytes`, `TooLarge` for a larger object, its size known
        before any byte of it is read (the request that opens it says it)."""
        def read():
            if max_bytes is None:
                with self.fs.open_input_stream(self.path(rel)) as f:
                    return f.read()
            with self.fs.open_input_file(self.path(rel)) as f:
                if f.size() > max_bytes:
                    raise TooLarge(f.size(), max_bytes)
                return f.read()
        return self._bounded("read", rel, read)

    def read_text(self, rel: str) -> str | None:
        """The file's text, or None if it does not exist."""
        try:
            return self.read_bytes(rel).decode()
        except FileNotFoundError:
            return None

    def open_input(self, rel: str):
        """A random-access file, as pyarrow.parquet needs: `pq.read_table(store.open_input(rel))`."""
        return self.fs.open_input_file(self.path(rel))

    def list(self, prefix: str = "") -> dict[str, int]:
        """{name relative to prefix: size} for every file under prefix, recursively, in one listing.
        A missing prefix lists as {}."""
        root = self.path(prefix)
        infos = self.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        cut = len(root.rstrip("/")) + 1
        return {i.path[cut:]: i.size for i in infos
                if i.type == pafs.FileType.File and not i.base_name.startswith(TMP_PREFIX)}

    # -- writes ------------------------------------------------------------------------------
    def write_bytes_atomic(self, rel: str, data: bytes | memoryview | pa.Buffer) -> None:
        path = self.path(rel)
        if self.local:
            with atomic_path(path) as tmp:
                with open(tmp, "wb") as f:
                    f.write(data)
            return
        def put():
            # The payload is complete before the stream opens: one write, one close (docstring).
            stream = self.fs.open_output_stream(path)
            try:
                stream.write(data)
            finally:
                stream.close()
        size = data.size if isinstance(data, pa.Buffer) else memoryview(data).nbytes
        self._bounded("write", rel, put, nbytes=size)

    def write_file_atomic(self, rel: str, local_path: str | os.PathLike) -> None:
        """Copies a finished local file to rel atomically (local stores: copy + rename)."""
        if self.local:
            with atomic_path(self.path(rel)) as tmp:
                shutil.copyfile(local_path, tmp)
            return
        with pa.memory_map(os.fspath(local_path)) as src:  # zero-copy: no second copy in memory
            self.write_bytes_atomic(rel, src.read_buffer())

    @contextlib.contextmanager
    def atomic_local(self, rel: str):
        """Yields a local temporary path (a `Path`, same suffix as rel, so writers pick the format);
        its content lands at rel only if the block finishes. Local stores: renamed in place, no
        copy. Object stores: the file is in a `runner-upload-*` temporary directory, removed
        once the file is memory-mapped, before the upload starts: an upload on a stalled store
        outlives its call (`StoreTimeout` cannot cancel it), and its process may end meanwhile
        without cleaning up (a stopping job's workers are killed, `ray.kill`; a driver ends at
        once, `job.EXIT_AT_ONCE`). A process killed while its writer writes leaves the directory:
        it is named with the pid, and the next `atomic_local` on the machine removes those of
        dead processes (`_upload_dir`)."""
        if self.local:
            with atomic_path(self.path(rel)) as tmp:
                yield tmp
            return
        d = _upload_dir()
        try:
            tmp = Path(d) / os.path.basename(rel)
            yield tmp
            with pa.memory_map(os.fspath(tmp)) as src:   # the mapping outlives the file's name
                shutil.rmtree(d)
                self.write_bytes_atomic(rel, src.read_buffer())
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes_atomic(rel, text.encode())

    def delete_prefix(self, rel: str) -> None:
        """Deletes everything under rel (a "directory"); a missing one is not an error."""
        self.fs.delete_dir_contents(self.path(rel), missing_dir_ok=True)

    def delete(self, rel: str) -> None:
        """Deletes a file; a missing one is not an error (cleanup is idempotent)."""
        try:
            self._bounded("delete", rel, self.fs.delete_file, self.path(rel))
        except FileNotFoundError:
            pass


UPLOAD_PREFIX = "runner-upload-"


def _upload_dir() -> str:
    """A new `runner-upload-<pid>-*` directory in the temp folder, after removing those whose
    process is gone: one killed while its writer wrote (SIGKILL, `ray.kill`) cannot remove its own."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(UPLOAD_PREFIX):].split("-", 1)[0]
            if name.startswith(UPLOAD_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{UPLOAD_PREFIX}{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's: alive
        pass
    return True


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """The one local atomic write: yields a `.tmp-*` path next to `path` (a `Path`, same suffix,
    so writers pick the right format; parent directories created), renamed onto `path` only if
    the block finishes, removed otherwise. Readers see the whole file or none; a crash leaves at
    most the `.tmp-*` file (`list` hides it; `results.remove_temp_files` deletes it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def case_insensitive(directory: str | os.PathLike) -> bool:
    """Whether the local `directory` (existing, writable) folds case in file names, as macOS
    APFS/HFS+ do by default, and FAT/exFAT, SMB and some FUSE mounts: there `media/Fox.png` and
    `media/fox.png` are one file. Probed, not guessed from the OS (a Linux host can mount such a
    filesystem, a Mac a case-sensitive volume): a uniquely named file with mixed case is created
    (`.tmp-Case-*`: hidden from `list`, removed by `remove_temp_files` after a crash), its
    case-swapped name looked up, and the file removed. Object stores are case-sensitive."""
    fd, path = tempfile.mkstemp(prefix=f"{TMP_PREFIX}Case-", dir=directory)
    os.close(fd)
    try:
        head, name = os.path.split(path)
        return os.path.exists(os.path.join(head, name.swapcase()))
    finally:
        os.unlink(path)


def check(value: str | os.PathLike) -> str:
    """The location's scheme ("file", "s3", "gs"), without touching any filesystem; ValueError
    (naming the value and the accepted forms) otherwise. For config checks before anything runs."""
    text = os.fspath(value)
    if not text:
        raise ValueError(f"empty storage location; expected {FORMS}")
    if "://" not in text:
        return "file"
    scheme, rest = text.split("://", 1)
    scheme = scheme.lower()
    if scheme not in ("file", "s3", "gs"):
        raise ValueError(f"unsupported storage location {text!r}: scheme {scheme!r}; expected {FORMS}")
    if scheme != "file" and not rest.split("/", 1)[0]:
        raise ValueError(f"storage location {text!r} names no bucket; expected {FORMS}")
    return scheme


def check_or(value: str, error: type, key: str) -> str:
    """`check(value)`, raising `error` naming the config key instead of ValueError."""
    try:
        return check(value)
    except ValueError as e:
        raise error(f"{key}={value!r}: {e}") from e


def is_uri(value: str | os.PathLike) -> bool:
    """An object-store location (s3://, gs://), as opposed to a local path or file://."""
    return check(value) != "file"


def resolve(value: str | os.PathLike) -> Store:
    """A local path, file:// URI, s3:// or gs:// URI -> Store (see the module docstring)."""
    scheme, base = _location(value)
    if scheme == "file":
        return Store(pafs.LocalFileSystem(), base, "file")
    fs = _s3(base.split("/", 1)[0]) if scheme == "s3" else _gcs()
    return Store(fs, base, scheme)


def uri_of(value: str | os.PathLike) -> str:
    """`resolve(value).uri()` without opening a filesystem (an S3 one may ask for the bucket's
    region): what a process that resolves it again is handed."""
    scheme, base = _location(value)
    return Store(None, base, scheme).uri()


def _location(value: str | os.PathLike) -> tuple[str, str]:
    """(scheme, base path) of a storage location; a ValueError naming what is wrong with it."""
    text = os.fspath(value)
    if "://" not in text:
        if not text:
            raise ValueError(f"empty storage location; expected {FORMS}")
        return "file", os.path.abspath(os.path.expanduser(text))
    scheme, rest = text.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        return "file", os.path.abspath(urlsplit(text).path or "/")
    if scheme not in ("s3", "gs"):
        raise ValueError(f"unsupported storage location {text!r}: scheme {scheme!r}; expected {FORMS}")
    if not rest.split("/", 1)[0]:
        raise ValueError(f"storage location {text!r} names no bucket; expected {FORMS}")
    return scheme, rest.strip("/")


def _s3(bucket: str) -> pafs.S3FileSystem:
    kw = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        u = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        kw.update(endpoint_override=u.netloc, scheme=u.scheme)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kw["region"] = region
    elif not endpoint:
        kw["region"] = pafs.resolve_s3_region(bucket)  # AWS itself: the bucket's region (one request)
    # allow_delayed_open: a small object is one PutObject instead of a three-request multipart upload
    return pafs.S3FileSystem(allow_delayed_open=True, connect_timeout=S3_CONNECT_TIMEOUT_S,
                             request_timeout=S3_REQUEST_TIMEOUT_S, **kw)


def _gcs() -> pafs.GcsFileSystem:
    # Retries of a failed request stop after OP_TIMEOUT_S: with the default, a call to a stalled
    # server (SIGSTOP of the emulator) had not ended after 150 s; with it, ~120 s (one attempt).
    kw = dict(retry_time_limit=datetime.timedelta(seconds=OP_TIMEOUT_S))
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")  # the variable Google's clients honour
    if emulator:
        u = urlsplit(emulator if "://" in emulator else f"http://{emulator}")
        return pafs.GcsFileSystem(anonymous=True, endpoint_override=u.netloc, scheme=u.scheme, **kw)
    return pafs.GcsFileSystem(**kw)
