"""The job record cannot go stale (issue 15): outputs count as done only when made from exactly the
current row's parameters and the job's output settings; lossy compile modes are refused on a
lossless job; one driver per job directory; SIGTERM is handled like Ctrl-C; bad values are exit 2
before Ray. Fast tests run in-process without Ray or models; the `e2e` one runs the real CLI on Ray
with the tiny demo model (helpers shared with test_faults.py): a second driver and a real SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from runner.driver import lock
from runner.config import ConfigError, load_config
from runner.driver.checks import JobError
from runner.driver.job import run
from runner.io.prompts import Item, PromptError
from runner.driver.results import Results, lossy
from test_faults import ROOT, cli, finish_within, record_rows, rows, wait_for_journal
from conftest import GUARD_S, full_disk


@pytest.fixture
def no_models_no_ray(monkeypatch):
    """Fail loudly if a test reaches model building or Ray."""
    import ray
    import runner.serve.models as models

    def boom(*a, **k):
        raise AssertionError("reached model building / Ray")
    monkeypatch.setattr(models, "build_pipeline", boom)
    monkeypatch.setattr(ray, "init", boom)


def base_args(prompts, out, *extra):
    return ["job=demo_image", f"prompts.path={prompts}", f"output.dir={out}", "job.name=j",
            "generation.height=64", "generation.width=64", "generation.num_inference_steps=2",
            "ray.cpu_workers=1", "output.results_every_s=0", *extra]


# ---------------------------------------------------------------------------------------------
# Fast: no Ray, no model.

def item(id, prompt="a cat", seed=0, file="p.parquet", row=0, height=64):
    return Item(id=id, prompt=prompt, negative_prompt="", seed=seed, height=height, width=64,
                num_frames=None, num_inference_steps=2, guidance_scale=4.5, file=file, row=row)


def test_plan_compares_each_row_with_what_its_output_was_made_from(tmp_path):
    (tmp_path / "media").mkdir()
    r = Results(str(tmp_path), settings="s1")
    old = [item("a"), item("b", row=1), item("c", row=2), item("d", row=3), item("e", row=4)]
    for it in old:
        (tmp_path / "media" / f"{it.id}.png").write_bytes(b"x")
    r.add([{**it.params(), "status": "ok", "output": f"media/{it.id}.png"} for it in old])
    r2 = Results(str(tmp_path), settings="s1").load()
    now = [item("a", file="q.parquet", row=7),      # moved to another file/row: still done
           item("b", prompt="a dog", row=1),        # edited under the same id
           item("c", seed=1, row=2), item("d", height=128, row=3),
           item("f", row=5)]                        # new; "e" is no longer in the input
    plan = r2.plan(now)
    assert plan.done == {"a"}
    assert [i.id for i in plan.changed] == ["b", "c", "d"]
    assert plan.changed_by_file() == "3 in p.parquet"
    assert plan.gone == ["e"]
    # other output settings (model, dtype, fps, lossy compile): nothing is done
    assert Results(str(tmp_path), settings="s2").load().plan(now).done == set()


@pytest.mark.parametrize("mode,is_lossy", [("none", False), ("O2", False), ("cudagraphs:cache-all", False),
                                          ("O3", True), ("O3:benchmark", True), ("cudagraphs:O3", True),
                                          ("low-precision", True)])
def test_lossy_comes_from_the_compiler(mode, is_lossy):
    assert lossy(mode) is is_lossy


def _previous_run(tmp_path, prompts, *extra):
    """A job directory as a finished run leaves it (config.yaml + journal), without running it."""
    job_dir = tmp_path / "out" / "j"
    (job_dir / "media").mkdir(parents=True)
    cfg = load_config(base_args(prompts, tmp_path / "out", *extra))
    (job_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (job_dir / "journal.jsonl").write_text("")
    return job_dir


@pytest.mark.parametrize("mode", ["O3:benchmark", "cudagraphs:O3", "low-precision"])
def test_lossy_mode_combinations_refused_on_a_lossless_job(tmp_path, write_prompts, no_models_no_ray, mode):
    p = write_prompts({"prompt": ["a"]})
    job_dir = _previous_run(tmp_path, p, "compile.mode=none")
    with pytest.raises(JobError) as e:
        run(base_args(p, tmp_path / "out", f"compile.mode={mode}"))
    # the key the user changed, with both values, not the fingerprint's derived flag
    assert f"compile.mode: 'none' -> '{mode}' (lossless -> lossy)" in str(e.value)
    assert "lossy: False" not in str(e.value) and "output.overwrite=true" in str(e.value)
    assert "mode: none" in (job_dir / "config.yaml").read_text()      # not rewritten
    assert not (job_dir / lock.LOCK).exists()                          # lock released
    # a lossless mode is fine (dry run: no Ray)
    assert run(base_args(p, tmp_path / "out", "compile.mode=O2", "run.dry_run=true"))["to_run"] == 1


@pytest.mark.parametrize("out,needle", [("/proc/foo", "output.dir: cannot create or write"),
                                        ("{tmp}/f/sub/dir", "output.dir: .*exists and is a file"),
                                        ("{tmp}/f", "output.dir: .*exists and is a file")])
def test_unusable_output_dir_is_a_clear_error(tmp_path, write_prompts, no_models_no_ray, out, needle):
    (tmp_path / "f").write_text("a file")
    p = write_prompts({"prompt": ["a"]})
    with pytest.raises(JobError, match=needle):
        run(["job=demo_image", f"prompts.path={p}", f"output.dir={out.format(tmp=tmp_path)}"])


def test_cache_dir_of_unknown_scheme_and_empty_job_name_are_refused(tmp_path, write_prompts,
                                                                     no_models_no_ray):
    p = write_prompts({"prompt": ["a"]})
    with pytest.raises(ConfigError, match=r"compile.cache_dir='ftp://b/c': .*scheme 'ftp'.*s3://"):
        run(["job=demo_image", f"prompts.path={p}", f"output.dir={tmp_path}", "compile.cache_dir=ftp://b/c",
             "compile.mode=cache-all"])
    assert not os.path.exists(os.path.join(ROOT, "ftp:"))
    with pytest.raises(ConfigError, match=r"job.name is empty.*job.name=NAME"):
        run(["job=demo_image", f"prompts.path={p}", f"output.dir={tmp_path}", "job.name="])
    assert os.listdir(tmp_path) == ["prompts.parquet"]


def test_integer_prompt_column_is_refused(tmp_path, write_prompts, no_models_no_ray):
    p = write_prompts({"prompt": [1, 2]})
    with pytest.raises(PromptError, match=r"prompts.parquet: column 'prompt' has type int64; it must be text"):
        run(["job=demo_image", f"prompts.path={p}", f"output.dir={tmp_path}/out"])


def test_every_bad_row_is_reported_at_once(tmp_path, write_prompts, no_models_no_ray):
    prompts = [None if i % 5 == 0 else f"p{i}" for i in range(50)]     # 10 empty
    widths = [72 if i % 5 in (1, 2) else 64 for i in range(50)]        # 20 bad sizes
    p = write_prompts({"prompt": prompts, "width": widths})
    with pytest.raises(PromptError) as e:
        run(["job=demo_image", f"prompts.path={p}", f"output.dir={tmp_path}/out"])
    msg = str(e.value)
    assert msg.startswith("30 bad prompt rows or files (the first 20 below)")
    assert "prompts.parquet:0: prompt is null or empty" in msg
    assert "prompts.parquet:1: width=72 must be a positive multiple of 16" in msg
    assert len(msg.splitlines()) == 21


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, write_prompts, no_models_no_ray, capsys):
    p = write_prompts({"prompt": ["a", "b", "c"]})
    plan = run(base_args(p, tmp_path / "out", "run.dry_run=true", "run.shard_size=2"))
    assert plan["to_run"] == 3 and plan["done"] == 0 and plan["shards"] == 2 and plan["failed"] == 0
    assert "3 to run (0 changed)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_lock_names_its_holder_and_stale_locks_are_taken_over(tmp_path):
    path = lock.acquire(str(tmp_path))
    holder = json.load(open(path))
    assert holder["pid"] == os.getpid() and holder["host"] and holder["started"]
    assert lock.holder(str(tmp_path)) == holder                      # what a dry run reports
    with pytest.raises(lock.LockedError, match=rf"in use by another driver \(pid {os.getpid()} on host .*remove .*\.lock"):
        lock.acquire(str(tmp_path))
    lock.release(path)
    assert not os.path.exists(path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(path, "w") as f:                                     # a SIGKILLed driver's lock
        json.dump({**holder, "pid": dead.pid}, f)
    assert lock.holder(str(tmp_path)) is None
    with lock.job_lock(str(tmp_path)):
        assert json.load(open(path))["pid"] == os.getpid()
    assert not os.path.exists(path)


def test_bad_output_dir_is_exit_2(tmp_path, write_prompts, capsys):
    from runner.driver.job import main
    p = write_prompts({"prompt": ["a"]})
    assert main(["job=demo_image", f"prompts.path={p}", "output.dir=/proc/foo"]) == 2
    assert "error: output.dir" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# End to end: the real CLI on a local Ray, tiny model, 64x64, 2 steps.

def journal_lines(job_dir):
    return len(record_rows(job_dir))


# Edited rows regenerated, dropped ids reported, through two runs and a dry run: test_jobrun.py.


@pytest.mark.e2e
def test_a_second_driver_is_refused_and_sigterm_stops_like_ctrl_c_with_exit_143(tmp_path, write_prompts):
    """One running job, two checks: a second driver on its job directory exits 2 naming the
    holder (and leaves the lock alone); SIGTERM then stops the first like Ctrl-C, exit 143."""
    ids = [f"c{i:02d}" for i in range(12)]
    p = write_prompts({"prompt": [f"prompt {i}" for i in range(12)], "id": ids})
    args = base_args(p, tmp_path / "out", "run.shard_size=3", "ray.cpu_workers=2")
    job_dir = tmp_path / "out" / "j"
    proc = cli(args, faults="slow:2", wait=False)
    t0 = time.time()
    while not (job_dir / ".lock").exists():      # taken before Ray starts: the second driver
        assert time.time() - t0 < GUARD_S and proc.poll() is None, "the first driver never took the lock"
        time.sleep(0.2)                          # runs while the first one warms up
    rc, out, err = cli(args)
    assert rc == 2, err[-3000:]
    assert f"in use by another driver (pid {proc.pid} on host" in err and "remove" in err
    assert (job_dir / ".lock").exists() and proc.poll() is None
    wait_for_journal(job_dir, 2, proc=proc)
    os.kill(proc.pid, signal.SIGTERM)
    # a stop is the workers killed and the summary written: seconds; a stop never acted on fails
    # here, not at GUARD_S
    out, err = finish_within(proc, 300, "the job stopped by SIGTERM")
    assert proc.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM)" in err
    summary = json.load(open(job_dir / "summary.json"))
    assert summary["interrupted"] and 2 <= summary["ok"] < 12
    assert summary["workers"] >= 1                                        # the workers that served
    metrics = os.listdir(job_dir / "metrics")
    assert len(metrics) == summary["workers"] and all(m.startswith("worker-") for m in metrics)
    assert len(rows(job_dir)) == summary["ok"]
    assert not (job_dir / ".lock").exists()
    # no file lands after the summary: the workers were stopped before it was written
    time.sleep(4)                          # longer than a slow:2 call plus its write
    media = [f for f in os.scandir(job_dir / "media") if f.name.endswith(".png")]
    assert len(media) >= summary["ok"]
    done = os.stat(job_dir / "summary.json").st_mtime
    assert [f.name for f in media if f.stat().st_mtime > done] == []


def test_a_full_disk_at_the_start_is_exit_2_naming_it(tmp_path, write_prompts, capsys):
    """A rerun onto a full disk: writing config.yaml fails with ENOSPC before any work (a real
    tmpfs, filled), and the job exits 2 naming the file and the error (no worker started)."""
    from runner.driver.job import main
    p = write_prompts({"prompt": ["a", "b"]})
    out = tmp_path / "full"
    out.mkdir()
    with full_disk(out, "64k"):
        status = main(base_args(p, out), start_pool=lambda *a: pytest.fail("a worker started"))
    err = capsys.readouterr().err
    assert status == 2, err[-3000:]
    assert "No space left on device" in err


class SlowRay:
    """`ray` whose init fails `fails` times as Ray's own 30 s raylet wait does on a loaded machine."""
    def __init__(self, fails: int, error: str = "The current node timed out during startup."):
        self.fails, self.error, self.inits, self.shutdowns = fails, error, 0, 0

    def init(self, **kwargs):
        self.inits += 1
        if self.inits <= self.fails:
            raise Exception(self.error)

    def shutdown(self):
        self.shutdowns += 1


def test_a_local_ray_slow_to_start_is_started_again_then_named():
    from runner.driver.raypool import RayStartError, start_local_ray
    ray = SlowRay(fails=2)
    start_local_ray(ray, num_cpus=2)
    assert ray.inits == 3 and ray.shutdowns == 2
    ray = SlowRay(fails=3)
    with pytest.raises(RayStartError, match=r"did not start, 3 times .*timed out during startup.*ray\.address"):
        start_local_ray(ray, num_cpus=2)
    ray = SlowRay(fails=1, error="some other failure")        # not retried: raised as it is
    with pytest.raises(Exception, match="some other failure"):
        start_local_ray(ray, num_cpus=2)
    assert ray.inits == 1


@pytest.fixture(params=["local", "s3"])
def job_store(request, tmp_path):
    from runner.io.storage import resolve
    if request.param == "local":
        return resolve(tmp_path / "job")
    return resolve(f"s3://{request.getfixturevalue('s3_bucket')}/job")


def test_a_changed_rows_old_output_is_removed_before_it_runs_and_the_record_says_so(job_store):
    """Issue 37 D3: an edited row whose regeneration failed kept the old media/<id>.png, made
    from the old inputs, while the record said failed."""
    from runner.io.outputs import failed_row
    r = Results(job_store, settings="s1")
    old = [item("a"), item("b", row=1), item("c", row=2), item("d", row=3)]
    for it in old:
        job_store.write_bytes_atomic(f"media/{it.id}.png", b"old " + it.id.encode())
    job_store.write_bytes_atomic("media/bb.png", b"another id")       # a prefix of no changed id
    r.add([{**it.params(), "status": "ok", "output": f"media/{it.id}.png"} for it in old])
    job_store.delete("media/d.png")                                   # d: changed, no file left
    now = [item("a"), item("b", prompt="a dog", row=1), item("c", seed=5, row=2),
           item("d", seed=5, row=3)]
    r = Results(job_store, settings="s1").load()
    plan = r.plan(now)
    assert [i.id for i in plan.changed] == ["b", "c", "d"] and plan.stale == {
        "b": ["media/b.png"], "c": ["media/c.png"]}
    assert r.retire(plan) == ["b", "c"]
    assert sorted(job_store.list("media")) == ["a.png", "bb.png"]     # a unchanged: kept
    again = Results(job_store, settings="s1").load()                  # the record says so
    b = again.rows["b"]
    assert b["status"] == "changed" and b["output"] is None and b["prompt"] == "a dog"
    assert "inputs changed (prompt) since media/b.png was made" in b["error"]
    assert "(seed)" in again.rows["c"]["error"] and again.rows["d"]["status"] == "ok"
    plan = again.plan(now)                 # still to run; nothing left to retire
    assert plan.done == {"a"} and [i.id for i in plan.changed] == ["d"] and plan.stale == {}
    # b's regeneration fails: no file under its name, the record says failed
    again.add([failed_row(now[1], "RuntimeError: boom")])
    assert not job_store.exists("media/b.png")
    assert Results(job_store, settings="s1").load().rows["b"]["status"] == "failed"


def test_failures_group_by_cause_with_their_ids():
    """Issue 37 D2: 400 rows failing alike printed 400 lines, the id inside each message."""
    from runner.driver.results import format_errors, group_errors
    rows = [{"id": f"m{i:04d}", "status": "failed",
             "error": f"FloatingPointError: non-finite values in the output of 'm{i:04d}'"}
            for i in range(400)]                                       # a record of an older run
    rows += [{"id": "x1", "status": "failed", "error": "FloatingPointError: non-finite values "
                                                       "(NaN or inf) in the output"},
             {"id": "ok1", "status": "ok", "error": None},
             {"id": "p-1", "status": "failed", "error": "OSError: [Errno 28] No space left on "
                                                        "device: '/j/media/.tmp-1a2b3c4d-p-1.png'"},
             {"id": "p-2", "status": "failed", "error": "\nOSError: [Errno 28] No space left on "
                                                        "device: '/j/media/.tmp-99887766-p-2.png'\n"
                                                        "Traceback ..."},
             {"id": "28", "status": "failed", "error": "OSError: [Errno 28] disk"},   # digits: kept
             {"id": "m", "status": "failed", "error": "ValueError: <object at 0x7f12abcd9900> m0001"}]
    groups = group_errors(rows)
    assert [(c, len(ids)) for c, ids in groups] == [
        ("FloatingPointError: non-finite values in the output of '<id>'", 400),
        ("OSError: [Errno 28] No space left on device: '<path>'", 2),     # the file: masked
        ("FloatingPointError: non-finite values (NaN or inf) in the output", 1),
        ("OSError: [Errno 28] disk", 1),
        ("ValueError: <object at 0x...> m0001", 1)]      # "m" is not inside "m0001"
    assert groups[0][1][:3] == ["m0000", "m0001", "m0002"] and groups[1][1] == ["p-1", "p-2"]
    lines = format_errors(groups, max_ids=3)
    assert lines[0] == ("400 x FloatingPointError: non-finite values in the output of '<id>': "
                        "m0000, m0001, m0002, ... (397 more)")
    assert lines[1].endswith(": p-1, p-2") and len(lines) == 5


def test_failures_naming_files_group_as_one_cause():
    """Issue 47: 38 rows whose images were missing printed 38 lines `1 x ImageError: ... not
    found`: the path in each message made each cause its own. Paths, URIs (the store kept) and a
    prompts file's rows are masked; words with a "/" that are not paths are not."""
    from runner.driver.results import error_cause, format_errors, group_errors
    rows = [{"id": f"IMG_{i:04d}", "status": "failed",
             "error": f"ImageError: image /data/cat/photos/{'ab'[i % 2]}/IMG_{i:04d}.jpg: not found"}
            for i in range(30)]
    rows += [{"id": f"r{i}", "status": "failed",      # relative paths, file:// (as others write)
              "error": f"ImageError: image {p}: not found"}
             for i, p in enumerate(["photos/IMG_9000.jpg", "photos/x/IMG_9001.jpeg",
                                    "/IMG_9002.jpg", "/data/other place.png"])]
    rows += [{"id": f"s{i}", "status": "failed",
              "error": f"ImageError: image s3://imgs/photos/IMG_{i}.jpg: not found"} for i in range(4)]
    rows += [{"id": "u", "status": "failed",
              "error": "ImageError: image file:///data/u.png: a directory, not a regular file"},
             {"id": "q1", "status": "failed", "error": "failed 2 times: p.parquet:12: image: boom"},
             {"id": "q2", "status": "failed", "error": "failed 2 times: q.parquet:7: image: boom"}]
    groups = dict(group_errors(rows))
    assert len(groups["ImageError: image <path>: not found"]) == 33
    assert "ImageError: image <path> place.png: not found" in groups     # a space ends a name
    assert len(groups["ImageError: image s3://imgs/<path>: not found"]) == 4   # the store kept
    assert "ImageError: image file:///<path>: a directory, not a regular file" in groups
    assert groups["failed 2 times: <path>:<row>: image: boom"] == ["q1", "q2"]
    line = format_errors(group_errors(rows), max_ids=3)[0]
    assert line == "33 x ImageError: image <path>: not found: IMG_0000, IMG_0001, IMG_0002, ... (30 more)"
    for text in ("OSError: I/O error and/or 3 MiB/s at 1.5/2.0", "KeyError: 'a.b'",
                 "RuntimeError: 12:30:00 at http://127.0.0.1:5000"):
        assert error_cause({"id": "x", "error": text}) == text
