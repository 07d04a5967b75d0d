"""A worker process killed from outside, under the real CLI on Ray (tiny model, a CPU worker), and the
helpers the other CLI tests share. Faults are injected from outside the runner
(tests/faults/sitecustomize.py) or by killing processes. The job's failure and resume rules
themselves are tested without Ray, in seconds: test_jobrun.py."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from conftest import GUARD_S, fault_env, fill_disk, memory_cgroup, ray_workers_of, tmpfs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.e2e
IDS = [f"p{i:02d}" for i in range(12)]


@pytest.fixture
def job(tmp_path, write_prompts):
    prompts = write_prompts({"prompt": [f"prompt number {i}" for i in range(len(IDS))], "id": IDS})
    out = tmp_path / "out"
    return dict(args=["job=demo_image", f"prompts.path={prompts}", f"output.dir={out}",
                      "job.name=j", "generation.height=64", "generation.width=64",
                      "generation.num_inference_steps=2", "run.shard_size=3", "run.batch_size=1",
                      "output.results_every_s=0", "ray.cpu_workers=1"],
                dir=out / "j")


def cli(args, faults="", wait=True, **env):
    e = {**fault_env(faults), **env}
    # SIGINT back to its default in the child: a test run started in the background (`... &`)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all.
    p = subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=ROOT, env=e, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if not wait:
        p.env = e            # for ray_workers_of
        return p
    out, err = finish_within(p, GUARD_S, "the job")
    return p.returncode, out, err


def finish_within(p: subprocess.Popen, timeout_s: float, what: str) -> tuple[str, str]:
    """`p.communicate()` within `timeout_s`: past it the run (a session of its own: the driver
    and what it started) is killed and the test fails naming `what`, the guard and the run's
    last lines, so a feature that is broken fails its test instead of hanging it (and leaves no
    job running into the next tests)."""
    try:
        return p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:           # not started in a session of its own
            p.kill()
        out, err = p.communicate()
        pytest.fail(f"{what} did not end within its guard of {timeout_s:.0f} s; killed. Its last "
                    f"output:\n{out[-1500:]}\n{err[-3000:]}", pytrace=False)


def rows(job_dir):
    return pq.read_table(os.path.join(job_dir, "results.parquet")).to_pylist()


def assert_complete(job_dir, failed=()):
    table = rows(job_dir)
    assert sorted(r["id"] for r in table) == IDS                 # every prompt exactly once
    for r in table:
        assert r["status"] == ("failed" if r["id"] in failed else "ok"), r
    media = sorted(os.listdir(os.path.join(job_dir, "media")))
    assert media == [f"{i}.png" for i in IDS if i not in failed]  # no partial or temp files
    leftovers = [f for _, _, fs in os.walk(job_dir) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []
    return table


def record_rows(job_dir):
    """Every row of the job's record (runner/driver/results.py: one records/*.jsonl object per shard,
    compacted at the end of a run), in write order."""
    d = os.path.join(job_dir, "records")
    names = sorted(os.listdir(d)) if os.path.isdir(d) else []
    # a `.tmp-*.jsonl` is a record still being written (renamed when complete): not yet a row
    return [json.loads(line) for n in names if n.endswith(".jsonl") and not n.startswith(".tmp-")
            for line in open(os.path.join(d, n))]


def wait_for_journal(job_dir, n, timeout=GUARD_S, proc: subprocess.Popen | None = None):
    """Until the record holds n rows; fails at once if `proc` (the job) ended before."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if len(record_rows(job_dir)) >= n:
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (exit {proc.returncode}) before its record held "
                                 f"{n} rows:\n{err[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"the record never reached {n} rows in {timeout:.0f} s")


def test_worker_process_killed_from_outside(job):
    p = cli(job["args"], faults="slow:0.4", wait=False)
    wait_for_journal(job["dir"], 2, proc=p)
    pids = ray_workers_of(p.env)
    assert pids, "no worker process found"
    os.kill(pids[0], signal.SIGKILL)
    out, err = finish_within(p, GUARD_S, "the job whose worker was killed")
    assert p.returncode == 0, err[-3000:]
    assert_complete(job["dir"])


def three_rows(write_prompts, tmp_path, poison: str, *extra):
    """good1, <poison>, good2 on one CPU worker, shards of 1 (the order they run in)."""
    ids = ["good1", poison, "good2"]
    p = write_prompts({"prompt": ["a red fox", "the row that kills", "a city at night"], "id": ids})
    out = tmp_path / "out"
    return ["job=demo_image", f"prompts.path={p}", f"output.dir={out}", "job.name=j",
            "generation.height=64", "generation.width=64", "generation.num_inference_steps=2",
            "run.shard_size=1", "run.batch_size=1", "output.results_every_s=0",
            "ray.cpu_workers=1", *extra], out / "j", p


def assert_failed_alone(job_dir, poison: str, prompts: str, cause: str):
    """Every row but `poison` ok with its file; `poison` failed at its second death, its error
    naming the cause (first line: what the summary groups by), then its id and input."""
    table = {r["id"]: r for r in rows(job_dir)}
    assert {i: r["status"] for i, r in table.items()} == {
        "good1": "ok", poison: "failed", "good2": "ok"}
    assert sorted(os.listdir(os.path.join(job_dir, "media"))) == ["good1.png", "good2.png"]
    first, second, *_ = table[poison]["error"].splitlines()
    assert first.startswith(f"killed its worker 2 times (run.max_row_deaths=2): {cause}"), first
    assert second == f"row '{poison}' ({prompts}:1): prompt 'the row that kills'"
    summary = json.load(open(os.path.join(job_dir, "summary.json")))
    assert (summary["ok"], summary["failed"], summary["worker_restarts"]) == (2, 1, 2)
    assert f"1 x {first[:60]}" in open(os.path.join(job_dir, "summary.txt")).read()
    return table[poison]["error"]


def test_a_row_that_kills_its_one_worker_fails_alone_and_the_job_goes_on(tmp_path, write_prompts):
    """Issue 47: one worker, shards of 1, a row whose worker process dies (SIGKILL) each time it
    takes it: the job ended with exit 2, "every worker is gone", after 4 deaths and never ran
    the third row. Now: the row is failed at its second death, the job goes on: exit 1."""
    args, job_dir, prompts = three_rows(write_prompts, tmp_path, "poison",
                                        "ray.max_worker_restarts=1")
    t0 = time.time()
    code, out, err = cli(args, faults="kill:poison")
    assert code == 1, err[-4000:]
    assert_failed_alone(job_dir, "poison", prompts, "the worker process ended without an error "
                                                    "of its own: killed (SIGKILL")
    assert "every worker is gone" not in err
    print(f"3 rows, 3 worker starts: {time.time() - t0:.0f} s")


# run.hang_timeout_s of the hung-row test: each of its 2 hangs waits this long, twice per worker
# count (15 s before: 20 s of waiting for nothing more). Its items take well under 1 s; a false
# hang needs one call 10x that on a loaded 2-core machine, and the row's error states the bound.
HANG_S = 10


def hang_guard_s(baseline_s: float) -> float:
    """The hung-row job's guard once its first rows are recorded, `baseline_s` after its start
    (the driver's start, a worker's start-up and model load, 3 rows: this machine's speed now,
    measured in the same run). Left: 2 hangs of HANG_S (looked at once a second), 2 replacement
    workers (each a start-up, within a baseline), the other rows and the job's end (a third
    baseline), 60 s of slack. With the watchdog off the job never ends: the test fails at this
    guard (minutes), where it waited GUARD_S (15 minutes) and left the job running."""
    return 3 * baseline_s + 2 * (HANG_S + 1) + 60


@pytest.mark.parametrize("workers", [1, 2])
def test_a_hung_row_ends_the_job_by_itself_and_a_rerun_retries_it(job, workers):
    """Issue 60: a row whose generate call never returns (tests/faults: `hang`) hung a 2-worker
    job for 7 minutes, until it was killed from outside. Now, with run.hang_timeout_s=HANG_S (the
    ceiling; the measured bound is higher on this machine's tiny items only through the 60 s
    floor), its worker is declared hung after HANG_S without progress, killed and replaced; the
    row runs alone, hangs again, and is failed at its second hang naming the cause. The job ends
    by itself, exit 1, every other row ok, no worker process of the job left; a rerun retries
    the row (and only it). Bound: 2 hangs of HANG_S, 3 worker start-ups and 12 tiny items, held
    by the guard `hang_guard_s` (from this run's own start-up: a fixed 240 s was the machine's
    speed)."""
    args = [a for a in job["args"] if not a.startswith("ray.cpu_workers")] + [
        f"ray.cpu_workers={workers}", f"run.hang_timeout_s={HANG_S}"]
    t0 = time.time()
    p = cli(args, faults="hang:p04", wait=False)
    try:
        wait_for_journal(job["dir"], 3, proc=p)     # the first shard: the job's start measured
    except AssertionError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        raise
    guard = hang_guard_s(time.time() - t0)
    out, err = finish_within(p, guard, f"the job with a hung row (hang:p04, run.hang_timeout_s="
                                       f"{HANG_S})")
    assert p.returncode == 1, err[-4000:]
    table = assert_complete(job["dir"], failed={"p04"})
    error = {r["id"]: r["error"] for r in table}["p04"]
    assert error.startswith(f"hung its worker 2 times (run.max_row_deaths=2): no progress for "
                            f"{HANG_S} s while generating it\nrow 'p04' ("), error
    stopped = re.search(r"was stopped after (\d+) s without progress", error)
    assert stopped and HANG_S <= int(stopped.group(1)) < HANG_S + 10, error    # at the bound
    assert f"run.hang_timeout_s={HANG_S}" in error
    summary = json.load(open(os.path.join(job["dir"], "summary.json")))
    assert len(summary["hangs"]) == 2 and summary["hangs"][-1]["ids"] == ["p04"]
    assert summary["hangs"][-1]["device"]["host"] and summary["hangs"][-1]["device"]["pid"]
    assert "HUNG: worker " in open(os.path.join(job["dir"], "summary.txt")).read()
    assert "is hung: no progress for" in err and "giving up on row p04" in err
    deadline = time.time() + 30                    # the killed workers' processes: gone
    while ray_workers_of(p.env) and time.time() < deadline:
        time.sleep(0.5)
    assert ray_workers_of(p.env) == []
    code, out, err = cli(args)
    assert code == 0, err[-4000:]
    assert_complete(job["dir"])
    assert json.load(open(os.path.join(job["dir"], "summary.json")))["resumed"] == 11


def test_a_row_that_runs_its_worker_out_of_memory_fails_naming_it(tmp_path, write_prompts):
    """The same with a real out-of-memory kill: the worker process joins a memory cgroup of its
    own (768 MiB; the driver and Ray stay outside) and the row allocates past it, so the kernel's
    out-of-memory killer ends it. Ray says of that only what it says of any SIGKILL; the worker's
    cgroup counted the kill, which names it: "out of memory"."""
    args, job_dir, prompts = three_rows(write_prompts, tmp_path, "hungry")
    with memory_cgroup(768 << 20) as cgroup:
        code, out, err = cli(args, faults=f"cgroup:{cgroup},oom:hungry")
        assert code == 1, err[-4000:]
        error = assert_failed_alone(job_dir, "hungry", prompts, "out of memory: the kernel's "
                                                               "out-of-memory killer ended the worker")
        assert f"memory cgroup {cgroup}, limit 0.75 GiB: oom_kill 1 -> 2" in error   # 2nd death
        assert "out of memory" in err and "giving up on row hungry" in err


def test_a_worker_whose_outputs_change_is_caught_by_its_canary_and_a_rerun_redoes_them(job):
    """The real CLI on Ray, one worker, shards of 2, a canary every 4 items; the worker process
    starts computing wrong after its 6th item (tests/faults: `drift`, its canaries too). Its
    canary after p00-p03 passes; the one after p04-p07 fails: those outputs (and any made after
    it that came back by then) are recorded suspect, naming the worker and its device; it is
    replaced, and its replacement (which computes right) does the rest: exit 1. A rerun
    regenerates exactly the suspect outputs."""
    args = [a for a in job["args"] if not a.startswith("run.shard_size")] + [
        "run.shard_size=2", "run.canary_every_items=4"]
    code, out, err = cli(args, faults="drift:6")
    assert code == 1, err[-4000:]
    table = {r["id"]: r for r in rows(job["dir"])}
    suspect = sorted(i for i, r in table.items() if r["status"] == "suspect")
    assert suspect[:4] == ["p04", "p05", "p06", "p07"] and set(suspect) <= set(IDS[4:10])
    assert all(table[i]["status"] == "ok" for i in IDS if i not in suspect)
    error = table["p05"]["error"]
    assert error.startswith("suspect: worker 0 (host ") and "failed its canary (bit for bit: " in error
    summary = json.load(open(os.path.join(job["dir"], "summary.json")))
    assert summary["suspect"] == len(suspect) and summary["worker_restarts"] == 1
    (failure,) = summary["canary_failures"]
    assert failure["device"]["pid"] and failure["suspect_ids"] == suspect
    assert "SUSPECT: worker 0 (host " in open(os.path.join(job["dir"], "summary.txt")).read()
    media = os.path.join(job["dir"], "media")
    before = {n: os.stat(os.path.join(media, n)).st_mtime_ns for n in os.listdir(media)}
    code, out, err = cli(args)
    assert code == 0, err[-4000:]
    assert_complete(job["dir"])
    after = {n: os.stat(os.path.join(media, n)).st_mtime_ns for n in os.listdir(media)}
    assert sorted(n[:-4] for n in after if after[n] != before[n]) == suspect    # exactly those
    assert json.load(open(os.path.join(job["dir"], "summary.json")))["resumed"] == 12 - len(suspect)


def test_a_disk_filling_mid_job_is_exit_3_with_the_error_last(tmp_path, write_prompts):
    """A real full disk (a tmpfs, filled once 2 rows are recorded) under two workers: the same
    ENOSPC on every shard stops the job (exit 3), and the runner's `error:` line is the last thing
    printed (issue 37 D5: Ray's "Unhandled error ... WorkerActor.finish_shard()" for the shards
    in flight, with their tracebacks, printed after it). Two workers and fast items: shards are
    in flight and failing when the job stops, which is what printed them."""
    ids = [f"f{i:02d}" for i in range(60)]
    p = write_prompts({"prompt": [f"prompt {i}" for i in range(60)], "id": ids})
    out = tmp_path / "small"
    out.mkdir()
    with tmpfs(out, "2m"):
        args = ["job=demo_image", f"prompts.path={p}", f"output.dir={out}", "job.name=j",
                "generation.height=64", "generation.width=64", "generation.num_inference_steps=2",
                "run.shard_size=2", "run.batch_size=1", "ray.cpu_workers=2"]
        proc = cli(args, faults="slow:0.02", wait=False)
        wait_for_journal(out / "j", 2, proc=proc)
        fill_disk(out, "filler")
        stdout, err = finish_within(proc, GUARD_S, "the job on a full disk")
    assert proc.returncode == 3, err[-4000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "No space left on device" in lines[-1], err[-4000:]
    assert "Unhandled error" not in err and "Traceback" not in err, err[-4000:]
    # the summary, printed though it could not be written, says what is missing
    assert "\nnot written: " in stdout and "summary.txt" in stdout.split("not written: ")[1]


# Moved to test_jobrun.py (the same rules on a simulated pool, without Ray; a Ray error's cause and
# kind: test_dispatch.py's test_ray_pool_maps_ray_errors): a worker crash mid-job, poison prompts
# and a NaN output (the NaN check itself: test_worker.py), a worker killed while writing, every
# worker gone, a rerun that skips done work / a config change refused / overwrite, Ctrl-C, hostile
# ids and empty prompts, a full disk's error (the worker's write error: test_worker.py), a repeated
# warm-up error, a store failing as the run ends. A driver SIGKILL and resume: test_s3_jobs.py and
# test_gcs_jobs.py (the local lock's stale-pid takeover: test_record.py).
