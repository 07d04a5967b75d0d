"""Failure and resume behaviour of the real CLI on Ray (tiny models, CPU workers).
Faults are injected from outside the runner (tests/faults/sitecustomize.py) or by killing processes."""
import json
import os
import signal
import subprocess
import sys
import time

import imageio.v3 as iio
import pyarrow.parquet as pq
import pytest
from conftest import GUARD_S, fault_env, ray_workers_of

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
# One CPU worker unless the test is about several (each worker process costs ~7 CPU-s to start on
# the 2-core CI machine); the dispatcher's multi-worker rules have unit tests in test_dispatch.py.
TWO_WORKERS = "ray.cpu_workers=2"


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
    out, err = p.communicate(timeout=GUARD_S)
    return p.returncode, out, err


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
    """Every row of the job's record (runner/results.py: one records/*.jsonl object per shard,
    compacted at the end of a run), in write order."""
    d = os.path.join(job_dir, "records")
    names = sorted(os.listdir(d)) if os.path.isdir(d) else []
    # a `.tmp-*.jsonl` is a record still being written (renamed when complete): not yet a row
    return [json.loads(line) for n in names if n.endswith(".jsonl") and not n.startswith(".tmp-")
            for line in open(os.path.join(d, n))]


def wait_for_journal(job_dir, n, timeout=GUARD_S):
    """Until the record holds n rows."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if len(record_rows(job_dir)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"the record never reached {n} rows")


def test_worker_crash_mid_job_loses_nothing(job):
    rc, out, err = cli(job["args"] + [TWO_WORKERS], faults="crash_once:p04")
    assert rc == 0, err[-3000:]
    assert_complete(job["dir"])
    summary = json.load(open(job["dir"] / "summary.json"))
    assert summary["ok"] == 12 and summary["failed"] == 0
    assert summary["worker_restarts"] == 1           # one replacement started
    assert "worker 0 lost" in err or "worker 1 lost" in err


def test_worker_process_killed_from_outside(job):
    p = cli(job["args"], faults="slow:0.4", wait=False)
    wait_for_journal(job["dir"], 2)
    pids = ray_workers_of(p.env)
    assert pids, "no worker process found"
    os.kill(pids[0], signal.SIGKILL)
    out, err = p.communicate(timeout=GUARD_S)
    assert p.returncode == 0, err[-3000:]
    assert_complete(job["dir"])


def test_poison_prompt_is_retried_then_recorded_failed_and_a_nan_output_fails_only_its_item(job):
    """Two workers, batches of 3: p07 kills its worker every time (retried row by row, then given
    up); p02's output is NaN, which fails p02 alone, not its batch-mates p00 and p01."""
    rc, out, err = cli(job["args"] + [TWO_WORKERS, "run.max_shard_retries=1", "run.batch_size=3"],
                       faults="crash:p07,nan:p02")
    assert rc == 1                                   # the job completes, reporting the failures
    table = assert_complete(job["dir"], failed={"p07", "p02"})
    error = {r["id"]: r["error"] for r in table}
    assert "failed 2 times" in error["p07"]          # 1 try + 1 retry, then given up
    assert "non-finite" in error["p02"]
    summary = json.load(open(job["dir"] / "summary.json"))
    assert summary["failed"] == 2 and summary["ok"] == 10
    assert "1 x failed 2 times" in open(job["dir"] / "summary.txt").read()


def test_worker_killed_while_writing_leaves_no_partial_output_and_the_rerun_does_the_rest(job):
    rc, out, err = cli(job["args"] + ["ray.cpu_workers=1", "ray.max_worker_restarts=0"],
                       faults="crash_write:p07")
    assert rc == 2 and "every worker is gone" in err, err[-3000:]
    media = job["dir"] / "media"
    assert not (media / "p07.png").exists()                  # never under its final name
    assert [f for f in os.listdir(media) if f.startswith(".tmp-")] == []   # its temp file removed
    done = {r["id"] for r in record_rows(job["dir"])}
    assert "p07" not in done
    for i in done:                                           # what is journalled is complete
        assert iio.imread(media / f"{i}.png").shape == (64, 64, 3)
    mtimes = {i: (media / f"{i}.png").stat().st_mtime_ns for i in done}
    rc, out, err = cli(job["args"])
    assert rc == 0, err[-3000:]
    assert_complete(job["dir"])                              # temp file gone, every prompt once
    assert json.load(open(job["dir"] / "summary.json"))["resumed"] == len(done)
    assert {i: (media / f"{i}.png").stat().st_mtime_ns for i in done} == mtimes   # not redone


def test_every_worker_gone_stops_with_a_clear_error(job):
    rc, out, err = cli(job["args"] + ["ray.cpu_workers=1", "ray.max_worker_restarts=1",
                                      "run.max_shard_retries=9"], faults="crash:p00")
    assert rc == 2
    assert "every worker is gone and none could be restarted" in err and "rerun" in err


def test_driver_sigkill_then_rerun_resumes(job):
    p = cli(job["args"], faults="slow:0.3", wait=False)
    wait_for_journal(job["dir"], 4)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(2)
    rc, out, err = cli(job["args"])
    assert rc == 0, err[-3000:]
    summary = json.load(open(job["dir"] / "summary.json"))
    assert summary["resumed"] >= 4 and summary["ok"] == 12     # skipped what was done
    assert_complete(job["dir"])


def test_rerun_skips_done_work_and_config_change_is_refused(job):
    assert cli(job["args"])[0] == 0
    png = job["dir"] / "media" / "p00.png"
    mtime = png.stat().st_mtime_ns
    rc, out, err = cli(job["args"])
    assert rc == 0 and out.startswith("nothing to do: all 12 prompts already done")
    assert png.stat().st_mtime_ns == mtime
    assert_complete(job["dir"])
    rc, out, err = cli(job["args"] + ["generation.num_inference_steps=3"])
    assert rc == 2 and "generation.num_inference_steps: 2 -> 3" in err and "output.overwrite=true" in err
    rc, out, err = cli(job["args"] + ["generation.num_inference_steps=3", "output.overwrite=true"])
    assert rc == 0 and png.stat().st_mtime_ns != mtime
    assert {r["num_inference_steps"] for r in assert_complete(job["dir"])} == {3}


def test_ctrl_c_stops_cleanly_and_writes_the_summary(job):
    # 2 s before each batch: the interrupt lands while the second round of batches still sleeps,
    # even on a loaded 2-core machine (with 0.5 s the job could finish between poll and kill)
    p = cli(job["args"], faults="slow:2", wait=False)
    wait_for_journal(job["dir"], 2)
    os.kill(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=GUARD_S)
    assert p.returncode == 130, err[-3000:]
    summary = json.load(open(job["dir"] / "summary.json"))
    assert summary["interrupted"] and 2 <= summary["ok"] < 12
    assert summary["workers"] >= 1                   # the workers that served, and their metrics
    assert len(os.listdir(job["dir"] / "metrics")) == summary["workers"]
    done = rows(job["dir"])
    assert len(done) == summary["ok"]
    for r in done:                                   # what is recorded is complete
        assert os.path.getsize(job["dir"] / r["output"]) > 0
    assert [f for _, _, fs in os.walk(job["dir"]) for f in fs if f.startswith(".tmp-")] == []
    # (a rerun resumes from what an interrupted driver recorded: test_driver_sigkill_then_rerun_resumes)


def test_hostile_ids_stay_inside_the_output_dir_and_empty_prompts_are_counted(tmp_path, write_prompts):
    p = write_prompts({"prompt": ["a", "b", "", None], "id": ["../../escape", "/etc/passwd", "e1", "e2"]})
    rc, out, err = cli(["job=demo_image", f"prompts.path={p}", f"output.dir={tmp_path}/o",
                        "generation.num_inference_steps=2", "ray.cpu_workers=1",
                        "prompts.on_empty=skip"])
    assert rc == 0, err[-2000:]
    job_dir = tmp_path / "o" / "demo_image"
    assert sorted(os.listdir(job_dir / "media")) == ["_.._escape.png", "_etc_passwd.png"]
    assert sorted(os.listdir(tmp_path)) == ["o", "prompts.parquet"]
    assert "2 rows with an empty prompt skipped" in err
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["skipped_empty"] == 2 and summary["ok"] == 2
    assert "2 rows with an empty prompt skipped" in (job_dir / "summary.txt").read_text()


@pytest.fixture
def full_disk(job):
    """The job's media/ directory on a 4 kB tmpfs: every media write fails with ENOSPC (a real
    full disk, not a mock), while the job directory itself stays writable."""
    media = job["dir"] / "media"
    media.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(media)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    yield media
    subprocess.run(["umount", str(media)], capture_output=True)


def test_full_disk_stops_the_job_naming_enospc_and_a_rerun_does_the_rest(job, full_disk):
    t0 = time.monotonic()
    rc, out, err = cli(job["args"])
    took = time.monotonic() - t0
    assert rc == 3, err[-3000:]                       # stopped early, not a hang, not "some failed"
    assert took < 120, took                           # Ray start-up + a few failing shards
    assert "No space left on device" in err and "the same error on" in err
    summary = (job["dir"] / "summary.txt").read_text()
    assert "STOPPED before the end" in summary and "No space left on device" in summary
    assert json.loads((job["dir"] / "summary.json").read_text())["aborted"]
    assert not [r for r in record_rows(job["dir"]) if r["status"] == "ok"]   # nothing on disk
    subprocess.run(["umount", str(full_disk)], check=True)
    rc, out, err = cli(job["args"])                   # the disk has room again
    assert rc == 0, err[-3000:]
    assert_complete(job["dir"])


def test_a_warmup_error_that_repeats_is_not_retried_again(job):
    rc, out, err = cli(job["args"] + ["ray.cpu_workers=1", "ray.max_worker_restarts=3"],
                       faults="warmup_error:boom")
    assert rc == 2
    cause = "RuntimeError: injected warm-up failure (boom)"
    assert cause in err                               # the real cause, not Ray's wrapper
    assert err.count("starting a replacement") == 1   # one retry, never a third attempt
    assert "the same error as before: not retried" in err


def test_a_store_failing_as_the_run_ends_is_exit_3_and_a_rerun_finishes(job):
    """Every output made, then the results table cannot be written (a non-empty directory holds
    its name: a real OSError from the filesystem): exit 3 naming it, no traceback, every finished
    row recorded; a rerun after the fix writes the table without generating anything again."""
    (job["dir"] / "results.parquet" / "in-the-way").mkdir(parents=True)
    rc, out, err = cli(job["args"])
    assert rc == 3, err[-3000:]
    assert "Traceback" not in err
    assert "the results or summary could not be written" in err and "Error" in err
    assert sorted(r["id"] for r in record_rows(job["dir"]) if r["status"] == "ok") == IDS
    (job["dir"] / "results.parquet" / "in-the-way").rmdir()
    (job["dir"] / "results.parquet").rmdir()
    rc, out, err = cli(job["args"])
    assert rc == 0, err[-3000:]
    assert f"nothing to do: all {len(IDS)} prompts already done" in out
    assert_complete(job["dir"])
