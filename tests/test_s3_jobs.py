"""Jobs with prompts and outputs on a real S3-compatible server (moto, tests/s3server.py, on
127.0.0.1): the real CLI, tiny models, 64x64, 2 steps. Nothing is written to a local job directory;
every check reads the bucket through runner.io.storage."""
import contextlib
import json
import os
import signal
import tempfile
import time

import imageio.v3 as iio
import imageio_ffmpeg
import pyarrow.parquet as pq
import pytest
from test_cluster import ENV, ROOT, ray_cluster, submit  # noqa: F401  (ray_cluster is a fixture)
from test_faults import cli, finish_within

from runner.io.storage import resolve
from conftest import GUARD_S

pytestmark = pytest.mark.e2e
SAMPLE = os.path.join(ROOT, "jobs", "prompts", "sample.parquet")


def upload_prompts(bucket: str) -> str:
    uri = f"s3://{bucket}/in/sample.parquet"
    resolve(f"s3://{bucket}/in").write_file_atomic("sample.parquet", SAMPLE)
    return uri


def args(job, prompts, bucket, *extra):
    return [f"job={job}", f"prompts.path={prompts}", f"output.dir=s3://{bucket}/out", "job.name=j",
            "generation.height=64", "generation.width=64", "generation.num_inference_steps=2",
            "ray.cpu_workers=1", *extra]   # one worker: the store is the subject (two: submit test)


def record_rows(store):
    return [json.loads(line) for n in sorted(store.list("records"))
            for line in store.read_bytes(f"records/{n}").splitlines()]


def check_store(store, ids, ext, resumed=None):
    """Exactly one output and one result row per prompt, and the driver's files, all in the store."""
    files = store.list()
    assert sorted(n for n in files if n.startswith("media/")) == sorted(f"media/{i}.{ext}" for i in ids)
    assert all(files[f"media/{i}.{ext}"] > 0 for i in ids)
    table = pq.read_table(store.open_input("results.parquet")).to_pylist()
    assert sorted(r["id"] for r in table) == sorted(ids)                 # one row per prompt
    assert all(r["status"] == "ok" and r["output"] == f"media/{r['id']}.{ext}" for r in table)
    for name in ("config.yaml", "summary.json", "summary.txt", "report.html"):
        assert name in files, name
    assert any(n.startswith("metrics/worker-") for n in files)
    assert any(n.startswith("report/thumbs/") for n in files)          # thumbnails uploaded
    assert ".lock" not in files                                         # released
    records = [n for n in files if n.startswith("records/")]
    assert len(records) == 1 and records[0].endswith("-compact.jsonl")  # compacted at the end
    assert sorted(r["id"] for r in record_rows(store)) == sorted(ids)
    summary = json.loads(store.read_text("summary.json"))
    assert summary["ok"] == len(ids) and summary["failed"] == 0
    if resumed is not None:
        assert summary["resumed"] >= resumed
    return table


# The video job (mp4s through the store); pngs through a store: test_gcs_jobs.py's demo job and
# the SIGKILL + rerun here (each CLI job costs ~25 CPU-s on CI's 2 cores).
@pytest.mark.parametrize("job,ext", [("demo_video", "mp4")])
def test_demo_job_with_prompts_and_outputs_on_s3(s3_bucket, job, ext):
    prompts = upload_prompts(s3_bucket)
    rc, out, err = cli(args(job, prompts, s3_bucket))
    assert rc == 0, err[-4000:]
    ids = pq.read_table(SAMPLE).column("id").to_pylist()
    store = resolve(f"s3://{s3_bucket}/out/j")
    table = check_store(store, ids, ext)
    row = table[0]
    with tempfile.TemporaryDirectory() as d:                            # a complete, decodable file
        local = os.path.join(d, f"x.{ext}")
        open(local, "wb").write(store.read_bytes(row["output"]))
        if ext == "png":
            assert iio.imread(local).shape == (64, 64, 3)
        else:
            reader = imageio_ffmpeg.read_frames(local)
            meta = next(reader)
            assert meta["size"] == (64, 64) and len(list(reader)) == 4
    assert not os.path.exists(os.path.join(ROOT, "s3:")), "a URI was used as a local path"
    # A rerun has nothing to do: one listing, no worker started.
    rc, out, err = cli(args(job, prompts, s3_bucket))
    assert rc == 0 and "nothing to do: all 8 prompts already done" in out, err[-3000:]


def wait_for_records(p, store, n: int) -> None:
    """Until the running job `p` has recorded `n` rows in `store` (fails if it ends first). Every
    0.5 s: a look is a listing and a read per record, ~20 CPU-ms of moto's and this process's (at
    0.2 s, 0.1 of a core for as long as the job starts: 3-6 CPU-s a test on the busy CI box)."""
    t0 = time.time()
    while len(record_rows(store)) < n:
        assert time.time() - t0 < GUARD_S and p.poll() is None, "the job recorded nothing"
        time.sleep(0.5)


def sigkill_then_rerun(scheme: str, bucket: str, write_prompts, check_lock: bool = True) -> None:
    """Prompts in the store, the driver SIGKILLed after 2 rows, the rerun finishes the rest:
    exactly one output and one result row per prompt, every file of the job in the store (S3
    here, GCS in test_gcs_jobs.py)."""
    ids = [f"k{i:02d}" for i in range(8)]
    local = write_prompts({"prompt": [f"prompt {i}" for i in range(8)], "id": ids})
    resolve(f"{scheme}://{bucket}/in").write_file_atomic("p.parquet", local)
    a = ["job=demo_image", f"prompts.path={scheme}://{bucket}/in/p.parquet",
         f"output.dir={scheme}://{bucket}/out", "job.name=j", "generation.height=64",
         "generation.width=64", "generation.num_inference_steps=2", "run.shard_size=2",
         "run.batch_size=1", "output.results_every_s=0", "ray.cpu_workers=1"]
    store = resolve(f"{scheme}://{bucket}/out/j")
    p = cli(a, faults="slow:0.5", wait=False)
    wait_for_records(p, store, 2)
    os.killpg(p.pid, signal.SIGKILL)                     # the driver and its embedded Ray, at once
    p.wait()
    done = {r["id"] for r in record_rows(store)}
    assert 2 <= len(done) < 8
    if check_lock:
        assert ".lock" in store.list()                  # left behind by the killed driver
    time.sleep(2)
    rc, out, err = cli(a)
    assert rc == 0, err[-4000:]
    table = check_store(store, ids, "png", resumed=len(done))
    # a complete, decodable file, read back through the store
    assert iio.imread(store.read_bytes(table[0]["output"]), extension=".png").shape == (64, 64, 3)


def test_driver_sigkill_then_rerun_on_s3(s3_bucket, write_prompts):
    sigkill_then_rerun("s3", s3_bucket, write_prompts)


def test_ray_job_submit_with_outputs_on_s3_and_no_shared_dir(ray_cluster, s3_bucket):
    """The job's processes get the S3 endpoint and credentials through runtime_env env_vars only;
    the output directory is in the bucket, so no node needs a filesystem another can see."""
    prompts = upload_prompts(s3_bucket)
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    env = {k: v for k, v in ENV.items() if not k.startswith("AWS_")}   # not from the shell
    r = submit(ray_cluster["dashboard"], {"env_vars": aws},
               ["job=demo_image", f"prompts.path={prompts}", f"output.dir=s3://{s3_bucket}/out",
                "generation.num_inference_steps=2", "generation.height=64", "generation.width=64",
                "run.shard_size=1"], env=env)
    assert "Job 'raysubmit_" in r.stdout and "succeeded" in r.stdout
    store = resolve(f"s3://{s3_bucket}/out/demo_image")
    table = check_store(store, pq.read_table(SAMPLE).column("id").to_pylist(), "png")
    assert len({row["node_id"] for row in table}) == 2       # both nodes (head and worker node) wrote to S3
    summary = json.loads(store.read_text("summary.json"))   # one worker per GPU-advertising node
    assert summary["workers"] == 2 and len({w["node_id"] for w in summary["workers_detail"]}) == 2
    assert sorted(n for n in store.list() if n.startswith("metrics/")) == [
        "metrics/worker-0.json", "metrics/worker-1.json"]


# compile.cache_dir on S3 (the first job compiles and puts the artifact there, the next warms from
# it): tests/test_compile_job.py's test_second_worker_warms_from_the_first_workers_artifact.


@contextlib.contextmanager
def job_on_its_own_server(write_prompts, monkeypatch, bucket: str, n: int, slow: float,
                          records: int):
    """A demo job of `n` prompts writing to s3://`bucket`/out on its own S3 server (the test may
    kill or pause it). Yields (the running driver process, the server) once the job has recorded
    `records` rows."""
    from s3server import moto_server
    ids = [f"{bucket[0]}{i:02d}" for i in range(n)]
    local = write_prompts({"prompt": [f"prompt {i}" for i in range(n)], "id": ids})
    with moto_server() as server:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        server.create_bucket(bucket)
        a = ["job=demo_image", f"prompts.path={local}", f"output.dir=s3://{bucket}/out", "job.name=j",
             "generation.num_inference_steps=2", "generation.height=64", "generation.width=64",
             "run.shard_size=2", "run.batch_size=1", "ray.cpu_workers=1"]
        p = cli(a, faults=f"slow:{slow}", wait=False)
        wait_for_records(p, resolve(f"s3://{bucket}/out/j"), records)
        yield p, server


@contextlib.contextmanager
def job_on_a_dying_server(write_prompts, monkeypatch, slow: float, records: int):
    """A demo job writing to its own S3 server, which is killed once the job has recorded
    `records` rows. Yields the running driver process, after the kill."""
    with job_on_its_own_server(write_prompts, monkeypatch, "dying", 12, slow, records) as (p, server):
        server.proc.kill()
        yield p


def test_s3_server_killed_mid_job_ends_the_job_naming_the_error(write_prompts, monkeypatch):
    """A store that goes away mid-job (its server killed): the job ends in bounded time with the
    connection error named (exit 3, a persistent fault), never a hang."""
    with job_on_a_dying_server(write_prompts, monkeypatch, slow=0.5, records=2) as p:
        t_kill = time.time()
        out, err = finish_within(p, 2 * 120, "the job whose store died")
        took = time.time() - t_kill
    assert took <= 120, took
    assert p.returncode == 3, err[-4000:]
    # stopped as a persistent fault (the same upload error on several shards, or the record
    # itself unwritable), with the connection error named
    assert "Could not connect to server" in err.split("error:")[-1], err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error: "), err[-3000:]      # nothing of Ray's or the workers' after it


def test_dry_run_against_a_missing_bucket_is_exit_2_like_the_real_run(s3_bucket):
    prompts = upload_prompts(s3_bucket)
    for extra in (["run.dry_run=true"], []):
        rc, out, err = cli(["job=demo_image", f"prompts.path={prompts}",
                            "output.dir=s3://no-such-bucket-here/out", *extra])
        assert rc == 2, (extra, err[-2000:])
        assert "output.dir: cannot write" in err and "no-such-bucket-here" in err


def test_sigterm_while_the_store_is_down_is_still_143(write_prompts, monkeypatch):
    """SIGTERM after the S3 server died: the results upload and the lock release fail, and the
    job still exits 143 with the cause logged, not a traceback with exit 1."""
    with job_on_a_dying_server(write_prompts, monkeypatch, slow=1.0, records=1) as p:
        os.kill(p.pid, signal.SIGTERM)
        out, err = finish_within(p, 2 * 120, "the job SIGTERMed while its store was down")
    assert p.returncode == 143, err[-4000:]
    assert "Traceback" not in err, err[-4000:]


def test_a_stalled_store_ends_the_job_within_120_s_naming_it(write_prompts, monkeypatch):
    """The store stops answering (its server SIGSTOPped: connections accepted, no reply) mid-job,
    at the production timeouts (runner.io.storage.OP_TIMEOUT_S = 20 s): the job stops on it, and its
    end (results, summary, lock) has one deadline, not a timeout each; the exit does not wait for
    the requests left in flight. Measured before: 166 s, the lock left unnamed."""
    with job_on_its_own_server(write_prompts, monkeypatch, "stalling", 40, 0.5, 2) as (p, server):
        os.kill(server.proc.pid, signal.SIGSTOP)
        t_stall = time.time()
        try:
            # the guard: twice the bound asserted (a stall not noticed fails here, not at GUARD_S)
            out, err = finish_within(p, 2 * 120, "the job on a stalled store")
            took = time.time() - t_stall
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    assert p.returncode == 3, err[-4000:]
    assert took <= 120, took
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and "did not answer" in last and "stalled" in last, err[-3000:]
    assert "s3://stalling/out/j" in last                           # the store, named
    assert "\nnot written: " in out                                # the summary says what is missing
    # the lock: released if the store answered in time, else named (it did not: it is stopped)
    assert "could not remove the lock s3://stalling/out/j/.lock" in err, err[-3000:]
