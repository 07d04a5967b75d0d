"""runner.io.storage against a local directory and a real S3 server (moto, tests/s3server.py): the same
behaviour tests on both. No mock of the S3 client: pyarrow's S3 filesystem talks HTTP to the server."""
import io
import os
import pickle
import shutil
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from runner.io.storage import Store, resolve
from s3server import moto_server


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return resolve(tmp_path / "out")
    bucket = request.getfixturevalue("s3_bucket")
    return resolve(f"s3://{bucket}/jobs/{uuid.uuid4().hex[:6]}")


class Counting:
    """Forwards to a real filesystem and counts the calls by method name (a spy, not a mock)."""
    def __init__(self, fs):
        self.fs, self.calls = fs, {}

    def __getattr__(self, name):
        attr = getattr(self.fs, name)
        if not callable(attr):
            return attr
        def call(*a, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **kw)
        return call


def put_many(store: Store, names_sizes: dict, threads: int = 8):
    with ThreadPoolExecutor(threads) as pool:  # pyarrow releases the GIL during requests
        list(pool.map(lambda kv: store.write_bytes_atomic(kv[0], b"x" * kv[1]), names_sizes.items()))


def test_write_read_exists_list_delete(store):
    assert store.list() == {} and not store.exists("a.txt")
    store.write_bytes_atomic("a.txt", b"hello")
    store.write_bytes_atomic("media/b.png", b"\x89PNG....")
    store.write_bytes_atomic("media/deep/c.mp4", b"")
    assert store.read_bytes("a.txt") == b"hello"
    assert store.exists("a.txt") and store.exists("media/b.png")
    assert not store.exists("media")  # a prefix is not a file
    assert store.list() == {"a.txt": 5, "media/b.png": 8, "media/deep/c.mp4": 0}
    assert store.list("media") == {"b.png": 8, "deep/c.mp4": 0}
    assert store.list("nothing-here") == {}

    store.write_bytes_atomic("a.txt", b"replaced")  # overwrite
    assert store.read_bytes("a.txt") == b"replaced"

    store.delete("a.txt")
    store.delete("a.txt")  # idempotent
    assert not store.exists("a.txt")
    assert store.list() == {"media/b.png": 8, "media/deep/c.mp4": 0}
    with pytest.raises(FileNotFoundError):
        store.read_bytes("a.txt")


def test_join_path_and_uri(store):
    sub = store.join("job-1", "media")
    sub.write_bytes_atomic("x.png", b"1")
    assert store.list() == {"job-1/media/x.png": 1}
    assert sub.uri("x.png") == store.uri("job-1/media/x.png")
    assert sub.uri("x.png").startswith("s3://" if store.scheme == "s3" else "/")
    assert store.fs.get_file_info(sub.path("x.png")).size == 1


def test_atomic_local_publishes_only_a_finished_file(store):
    with store.atomic_local("media/a.mp4") as tmp:
        assert tmp.suffix == ".mp4"  # writers pick the format from the suffix
        with open(tmp, "wb") as f:
            f.write(b"frame" * 1000)
        assert not store.exists("media/a.mp4")  # nothing under the final name while writing
    assert store.read_bytes("media/a.mp4") == b"frame" * 1000
    assert store.list() == {"media/a.mp4": 5000}


def test_writer_that_raises_midway_leaves_no_key(store):
    with pytest.raises(RuntimeError, match="encoder died"):
        with store.atomic_local("media/a.mp4") as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half a video")
            raise RuntimeError("encoder died")
    assert not store.exists("media/a.mp4")
    assert store.list() == {}  # no temporary name visible either


def test_write_file_atomic_copies_and_a_missing_source_leaves_no_key(store, tmp_path):
    src = tmp_path / "local.bin"
    src.write_bytes(os.urandom(3000))
    store.write_file_atomic("media/x.bin", src)
    assert store.read_bytes("media/x.bin") == src.read_bytes()
    assert src.exists()  # a copy: the caller's file is its own
    with pytest.raises(FileNotFoundError):
        store.write_file_atomic("media/y.bin", tmp_path / "missing.bin")
    assert store.list() == {"media/x.bin": 3000}


def test_large_file_goes_up_whole(store, tmp_path):
    """12 MB: above Arrow's part threshold, so on S3 a multipart upload, published complete."""
    src = tmp_path / "big.mp4"
    src.write_bytes(os.urandom(12 << 20))
    store.write_file_atomic("media/big.mp4", src)
    assert store.list("media") == {"big.mp4": 12 << 20}
    assert store.read_bytes("media/big.mp4") == src.read_bytes()


def test_local_leftover_temp_file_is_not_listed(tmp_path):
    store = resolve(tmp_path)
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / ".tmp-1234abcd-a.mp4").write_bytes(b"crashed writer")
    (tmp_path / "media" / "b.mp4").write_bytes(b"ok")
    assert store.list() == {"media/b.mp4": 2}


def test_pyarrow_stream_publishes_a_partial_object_on_s3(s3_bucket):
    """Canary for the design: Arrow's S3 output stream completes the upload when closed, even when
    the producer failed half-way. This is why Store never streams a producer into the store."""
    fs = resolve(f"s3://{s3_bucket}").fs
    with pytest.raises(RuntimeError):
        with fs.open_output_stream(f"{s3_bucket}/partial.bin") as f:
            f.write(b"first half")
            raise RuntimeError("producer died")
    with fs.open_input_stream(f"{s3_bucket}/partial.bin") as f:
        assert f.read() == b"first half"  # if this ever fails, Arrow started aborting; still fine


def test_list_of_200_objects_is_one_listing_with_sizes(store):
    """One call for the whole prefix, every size from it: no stat per key. (The count is the
    suite's cost, not the point: on moto each object is a put, ~10 CPU-ms; 1000 were 11 CPU-s.)"""
    sizes = {f"records/shard-{i:05d}.jsonl": i % 37 for i in range(200)}
    put_many(store, sizes)
    store.write_bytes_atomic("other/z.txt", b"zz")  # outside the prefix
    store.fs = Counting(store.fs)
    assert store.list("records") == {k.split("/", 1)[1]: v for k, v in sizes.items()}
    assert store.fs.calls == {"get_file_info": 1}


def test_parquet_read_and_write(store):
    table = pa.table({"id": ["a", "b", "c"], "prompt": ["x", "y", "z"], "seed": [1, 2, 3]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    store.write_bytes_atomic("prompts.parquet", buf.getvalue())
    assert pq.read_table(store.open_input("prompts.parquet")).equals(table)
    assert pq.read_table(store.path("prompts.parquet"), filesystem=store.fs).equals(table)
    # a finished shard's record, read back through a resolved URI as a resumed job would
    store.write_bytes_atomic("records/shard-00000.parquet", buf.getvalue())
    again = resolve(store.uri())
    assert list(again.list("records")) == ["shard-00000.parquet"]
    assert pq.read_table(again.open_input("records/shard-00000.parquet")).column("seed").to_pylist() == [1, 2, 3]


@pytest.mark.parametrize("bad", ["hdfs://cluster/data", "ftp://host/x", "az://container/p", "s3://", "gs:///x", ""])
def test_resolve_rejects_unsupported_locations_naming_them(bad):
    with pytest.raises(ValueError) as e:
        resolve(bad)
    msg = str(e.value)
    assert "s3://bucket" in msg and "gs://bucket" in msg
    if bad:
        assert repr(bad) in msg


def test_resolve_local_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve("out").base == str(tmp_path / "out")
    assert resolve(f"file://{tmp_path}/out").base == str(tmp_path / "out")
    assert resolve(tmp_path / "out").uri("a.png") == f"{tmp_path}/out/a.png"
    assert resolve("~/x").base == os.path.expanduser("~/x")


def test_resolve_s3_and_gs(s3_bucket, monkeypatch):
    s = resolve(f"S3://{s3_bucket}/a/b/")
    assert isinstance(s.fs, pafs.S3FileSystem) and s.base == f"{s3_bucket}/a/b"
    assert s.uri("c.txt") == f"s3://{s3_bucket}/a/b/c.txt"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", os.environ["AWS_ENDPOINT_URL"])  # the S3-only variable
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    resolve(f"s3://{s3_bucket}").write_bytes_atomic("via-s3-specific-var", b"1")
    assert s.fs.get_file_info(f"{s3_bucket}/via-s3-specific-var").size == 1
    g = resolve("gs://some-bucket/prefix")  # constructing it makes no request
    assert isinstance(g.fs, pafs.GcsFileSystem) and g.uri("x") == "gs://some-bucket/prefix/x"


def test_listing_vs_exists(store, capsys):
    """Numbers for the resume design: one listing of N keys vs N `exists` calls. Printed, and only
    loosely asserted (on S3 the listing must win). N is 2k locally, 200 on the moto server: one
    listing request against 200 stats is already ~30x apart (48 ms vs 1.6 s on the loaded 2-core
    VM), and each key costs the suite a put and a stat on moto (1k keys and 10k local files were
    12 s of the test's 16 s there);
    STORAGE_BENCH_KEYS=10000 for the full run (its figures: runner/io/storage.py's docstring)."""
    n = int(os.environ.get("STORAGE_BENCH_KEYS", 2_000 if store.local else 200))
    put_many(store, {f"media/{i:06d}.png": 10 for i in range(n)})
    t = time.perf_counter()
    listed = store.list("media")
    t_list = time.perf_counter() - t
    t = time.perf_counter()
    found = sum(store.exists(f"media/{i:06d}.png") for i in range(n))
    t_exists = time.perf_counter() - t
    assert len(listed) == found == n
    with capsys.disabled():
        print(f"\n[{store.scheme}] {n} keys: one list() {t_list * 1e3:.0f} ms "
              f"({t_list / n * 1e6:.1f} us/key); {n} exists() {t_exists * 1e3:.0f} ms "
              f"({t_exists / n * 1e6:.1f} us/key) -> x{t_exists / t_list:.0f}")
    if not store.local:  # locally both are a stat per file; on an object store a request per key
        assert t_list < t_exists


def test_store_pickles_as_its_uri(store):
    store.write_bytes_atomic("a.txt", b"1")
    again = pickle.loads(pickle.dumps(store.join("x")))
    assert again.uri() == store.uri("x") and type(again.fs) is type(store.fs)
    assert again.fs is not store.fs  # resolved afresh on the receiving side
    again.write_bytes_atomic("b.txt", b"22")
    assert store.list() == {"a.txt": 1, "x/b.txt": 2}


def test_server_that_cannot_start_fails_with_its_log():
    with socket.socket() as taken:  # the port is held, so moto cannot bind it and exits
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match=r"exited with .*its log:"):
            with moto_server(port=taken.getsockname()[1]):
                pass


# ---------------------------------------------------------------------------------------------
# A stalled store (issue 37): a server that accepts connections and never answers (its process
# stopped with SIGSTOP), not one that refuses them. Calls fail in bounded time, naming the store.

@pytest.fixture
def stalled_s3(monkeypatch):
    """A moto server of this test's own (pausing the session's would stall other tests), with a
    bucket and the environment that points runner.io.storage at it; `.pause()` stops the server
    process, `.resume()` continues it (always done at the end, before it is stopped)."""
    import signal
    import types
    with moto_server() as server:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        bucket = f"stall-{uuid.uuid4().hex[:8]}"
        server.create_bucket(bucket)
        try:
            yield types.SimpleNamespace(
                bucket=bucket, pause=lambda: os.kill(server.proc.pid, signal.SIGSTOP),
                resume=lambda: os.kill(server.proc.pid, signal.SIGCONT))
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)


def wait_for(check, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_calls_on_a_stalled_store_fail_in_bounded_time_naming_the_store(stalled_s3, monkeypatch):
    from runner.io import storage
    monkeypatch.setattr(storage, "OP_TIMEOUT_S", 2.0)      # the mechanism, not the production figure
    store = resolve(f"s3://{stalled_s3.bucket}/job")
    store.write_text("records/r1.jsonl", "{}\n")
    stalled_s3.pause()
    calls = {"write": lambda: store.write_text("records/r2.jsonl", "{}\n"),
             "write of another object": lambda: store.write_text("media/x.png", "png"),
             "read": lambda: store.read_bytes("records/r1.jsonl"),
             "stat": lambda: store.exists("records/r1.jsonl"),
             "delete": lambda: store.delete("records/r1.jsonl")}
    first_lines = {}
    for name, call in calls.items():
        t = time.monotonic()
        with pytest.raises(OSError) as e:
            call()
        took = time.monotonic() - t
        assert 1.9 < took < 4.0, (name, took)
        assert isinstance(e.value, storage.StoreTimeout)
        first_lines[name] = str(e.value).splitlines()[0]
        assert f"the store {store.uri()} did not answer" in first_lines[name]
        assert "stalled or unreachable" in first_lines[name]
    # one stall, one cause: the first line does not name the object (the second does)
    assert first_lines["write"] == first_lines["write of another object"]
    # a write is given 1 s per MiB on top: 2 MiB, 4 s
    t = time.monotonic()
    with pytest.raises(storage.StoreTimeout, match=r"no answer after 4 s"):
        store.write_bytes_atomic("media/big.mp4", b"v" * (2 << 20))
    assert 3.9 < time.monotonic() - t < 8.0       # one timeout of 4 s, not two (not a speed)
    # once the store answers again, a write that timed out lands whole (writes are atomic)
    stalled_s3.resume()
    assert wait_for(lambda: store.exists("media/big.mp4"), 60)
    assert store.read_bytes("media/big.mp4") == b"v" * (2 << 20)


UPLOADER = """
import sys
from runner.io.storage import resolve
with resolve(sys.argv[1]).atomic_local("media/a.mp4") as tmp:
    tmp.write_bytes(b"v" * 100_000)
    print("written", flush=True)
"""


def test_an_upload_killed_on_a_stalled_store_leaves_no_temporary_file(stalled_s3, tmp_path):
    """A worker whose upload waits on a stalled store is killed as its job stops (`ray.kill`):
    nothing of the upload stays in its temp folder."""
    import psutil
    import subprocess
    import sys
    temp = tmp_path / "temp"
    temp.mkdir()
    stalled_s3.pause()
    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    p = subprocess.Popen([sys.executable, "-c", UPLOADER, f"s3://{stalled_s3.bucket}/job"],
                         env={**os.environ, "TMPDIR": str(temp)}, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "written\n"
        # the upload is under way once its request is sent: a connection to the stopped server
        assert wait_for(lambda: any(c.raddr and c.raddr.port == port
                                    for c in psutil.Process(p.pid).net_connections()), 60)
        assert p.poll() is None                       # still waiting (20 s before it gives up)
    finally:
        p.kill()
        p.wait()
    assert os.listdir(temp) == []


def test_the_lock_on_a_stalled_store_is_named_and_removed_once_it_answers(stalled_s3, caplog):
    from runner.driver.lock import LOCK, job_lock
    store = resolve(f"s3://{stalled_s3.bucket}/job")
    t = None
    with caplog.at_level("WARNING", logger="runner"):
        with job_lock(store, release_s=lambda: 2.0):   # what is left of a stop deadline
            assert store.exists(LOCK)
            stalled_s3.pause()
            t = time.monotonic()
        took = time.monotonic() - t                     # never raises, never hangs
    assert 1.9 < took < 4.0, took
    warned = [r.getMessage() for r in caplog.records if "could not remove the lock" in r.getMessage()]
    assert len(warned) == 1 and store.uri(LOCK) in warned[0] and "did not answer within 2 s" in warned[0]
    stalled_s3.resume()                                 # the release went on in the background
    assert wait_for(lambda: not store.exists(LOCK), 60)


def test_an_upload_directory_left_by_a_killed_writer_is_removed_by_the_next_upload(s3_bucket):
    """A worker killed while its writer writes an object-store output (a stopping job's
    `ray.kill`, a SIGKILLed driver's workers) leaves its `runner-upload-<pid>-*` directory; the
    next upload on the machine removes it, not those of live processes."""
    import subprocess
    import sys
    import tempfile
    root = tempfile.gettempdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", "import os, tempfile, time; print(tempfile.mkdtemp("
         "prefix=f'runner-upload-{os.getpid()}-'), flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    left = writer.stdout.readline().strip()
    open(os.path.join(left, "o.mp4"), "wb").write(b"half")
    live = tempfile.mkdtemp(prefix=f"runner-upload-{os.getppid()}-", dir=root)   # a live process's
    writer.kill()
    writer.wait()
    try:
        store = resolve(f"s3://{s3_bucket}/jobs/{uuid.uuid4().hex[:6]}")
        with store.atomic_local("a.png") as tmp:
            tmp.write_bytes(b"png")
        assert store.read_bytes("a.png") == b"png"
        assert not os.path.exists(left) and os.path.isdir(live)
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(left, ignore_errors=True)
