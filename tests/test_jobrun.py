"""The job's rules without Ray: `runner.driver.job.main` (config, checks, lock, resume plan, JobRun, record,
snapshots, summary, exit status) over a simulated pool (`runner.bench.simulate.SimPool`) on a
virtual clock, against a real temp-dir job directory. Each run takes well under a second.

What stays with the real CLI on Ray: a worker process killed from outside (test_faults.py), a real
SIGTERM and a second driver (test_record.py), a driver SIGKILL and resume and a store that dies
(S3, GCS), multi-node and `ray job submit`, the demo jobs and their report in Chromium."""
import json
import logging
import os
import re
import signal

import pyarrow.parquet as pq
import pytest

from runner.driver import job
from runner.bench.simulate import SimPool, VirtualClock
from runner.io.storage import resolve

IDS = [f"p{i:02d}" for i in range(12)]


@pytest.fixture(autouse=True)
def stop_signals(monkeypatch):
    """The stop signals `main` records (`job.STOPS`): none at the start of a test, none after."""
    monkeypatch.setattr(job, "STOPS", [])


class Cluster:
    """What `main(start_pool=...)` starts: a SimPool per run, on one virtual clock, its workers
    taking `item_s` per item after `startup_s`, writing each ok output's media file into the job
    directory. `fate(item)` decides an item, `drift` which worker computes wrong (SimPool);
    `generated` lists every item id handed to a worker (up to the one a worker dies of), `pools`
    every pool."""

    def __init__(self, fate=None, warm_fate=None, item_s=1.0, startup_s=(5.0, 5.0), drift=None):
        self.clock, self.fate, self.warm_fate = VirtualClock(), fate, warm_fate
        self.item_s, self.startup_s, self.drift = item_s, startup_s, drift
        self.generated, self.pools = [], []

    def __call__(self, j, limits) -> SimPool:
        pool = SimPool(j["ray"].num_workers or j["ray"].cpu_workers, self.item_s, self.clock,
                       jitter=0.0, startup_s=self.startup_s, fate=self._fate,
                       warm_fate=self.warm_fate, media=resolve(j["output"].job_dir),
                       drift=self.drift)
        self.pools.append(pool)
        return pool

    def _fate(self, item) -> str:
        self.generated.append(item.id)
        return self.fate(item) if self.fate else "ok"

    def main(self, args) -> int:
        """`python -m runner args` in this process (the signal handlers it installs are put back
        after the test: conftest.py)."""
        return job.main(args, start_pool=self, clock=self.clock.time)


@pytest.fixture
def prompts(write_prompts):
    return write_prompts({"prompt": [f"prompt number {i}" for i in range(len(IDS))], "id": IDS})


def job_args(prompts, out, *extra):
    return ["job=demo_image", f"prompts.path={prompts}", f"output.dir={out}", "job.name=j",
            "generation.height=64", "generation.width=64", "generation.num_inference_steps=2",
            "run.shard_size=3", "output.results_every_s=0", "ray.cpu_workers=1", *extra]


def rows(job_dir):
    return pq.read_table(os.path.join(job_dir, "results.parquet")).to_pylist()


def summary(job_dir) -> dict:
    return json.loads((job_dir / "summary.json").read_text())


def record_rows(job_dir):
    d = job_dir / "records"
    return [json.loads(line) for n in sorted(os.listdir(d)) if not n.startswith(".tmp-")
            for line in open(d / n)]


def assert_complete(job_dir, ids=IDS, failed=()):
    """One result row per prompt (ok but `failed`), one media file per ok row, no temp file."""
    table = rows(job_dir)
    assert sorted(r["id"] for r in table) == sorted(ids)
    for r in table:
        assert r["status"] == ("failed" if r["id"] in failed else "ok"), r
    media = sorted(os.listdir(job_dir / "media"))
    assert media == sorted(f"{i}.png" for i in ids if i not in failed)
    assert [f for _, _, fs in os.walk(job_dir) for f in fs if f.startswith(".tmp-")] == []
    return table


def mtimes(job_dir, ids) -> dict:
    return {i: (job_dir / "media" / f"{i}.png").stat().st_mtime_ns for i in ids}


# -- a whole job --------------------------------------------------------------------------------

def test_a_job_records_every_output_once_and_summarizes_timeline_and_steady_rate(prompts, tmp_path,
                                                                                capsys, caplog):
    """Two workers ready at 5 s, 1 s per item, shards of 3: each runs two shards (6 s of work);
    the last rows land at 11.05 s (0.05 s of writing). Every figure follows from that."""
    c = Cluster()
    with caplog.at_level(logging.INFO, logger="runner"):
        assert c.main(job_args(prompts, tmp_path, "ray.cpu_workers=2")) == 0
    d = tmp_path / "j"
    assert_complete(d)
    s = summary(d)
    assert (s["ok"], s["failed"], s["not_run"], s["workers"], s["worker_restarts"]) == (12, 0, 0, 2, 0)
    assert s["startup_s"] == pytest.approx(5.0) and s["all_ready_s"] == pytest.approx(5.0)
    assert s["generate_s"] == pytest.approx(6.05)
    assert s["items_per_s"] == pytest.approx(12 / 6.05)
    assert s["steady_items_per_s"] == pytest.approx(12 / 6.05)     # every item after all ready
    # the whole span, start-up included; the driver's CPU over it and the shards it handed out
    assert s["span_s"] == pytest.approx(11.05)
    assert s["span_items_per_s"] == pytest.approx(12 / 11.05)
    assert s["shards"] == 4 and s["driver_cpu_s"] >= s["driver_startup_cpu_s"] >= 0
    assert s["driver_cpu_s"] > 0
    assert sorted(os.listdir(d / "metrics")) == ["worker-0.json", "worker-1.json"]
    assert [w["items"] for w in s["workers_detail"]] == [6, 6]
    # the report's timeline: one point per shard, counts rising to 12 ok, 0 failed
    timeline = json.loads((d / "report" / "timeline.json").read_text())
    assert len(timeline) == 4 and timeline[-1][1:] == [12, 0]
    assert [p[1] for p in timeline] == [3, 6, 9, 12] and timeline[0][0] == pytest.approx(8.05)
    assert (d / "report.html").is_file() and (d / "report" / "throughput.png").is_file()
    # the record: compacted into one object, one row per id, stamped with the settings
    assert len(os.listdir(d / "records")) == 1 and len(record_rows(d)) == 12
    assert len({r["settings"] for r in record_rows(d)}) == 1
    out = capsys.readouterr().out
    assert "job j: 12/12 ok, 0 failed, 0 not run" in out and "then 1.98 items/s" in out
    assert not (d / ".lock").exists()
    # "ready": one clock, seconds since the job started, in the log and the summary (issue 37:
    # "ready in 19.9 s" vs "worker ready in 12.6 s"), and the legend says which
    assert "worker 0: ready at 5.0 s (5.0 s after it was started)" in caplog.text
    assert "2 workers (0 restarts), first ready at 5.0 s;" in out and "all ready at 5.0 s" in out
    assert 'seconds since the job started' in " ".join((d / "summary.txt").read_text().split())
    assert s["workers_not_ready"] == []


def test_a_worker_dying_mid_job_loses_nothing_and_is_replaced(prompts, tmp_path, caplog):
    died = []

    def fate(item):                        # p04's worker dies the first time only
        if item.id == "p04" and not died:
            died.append(1)
            return "die"
        return "ok"
    c = Cluster(fate)
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(job_args(prompts, tmp_path, "ray.cpu_workers=2")) == 0
    assert_complete(tmp_path / "j")
    s = summary(tmp_path / "j")
    assert s["ok"] == 12 and s["failed"] == 0 and s["worker_restarts"] == 1
    assert "worker 0 lost" in caplog.text or "worker 1 lost" in caplog.text
    assert sorted(w.rank for w in c.pools[0].workers) in ([0, 0, 1], [0, 1, 1])   # one replacement


def test_poison_rows_are_recorded_failed_and_their_neighbours_succeed(prompts, tmp_path):
    """p07 kills its worker every time (run alone after its first death, failed at its second);
    p02's output is not finite (a failed row from a living worker); p09 raises in the worker every
    time: each fails alone."""
    fates = {"p07": "die", "p02": "fail:FloatingPointError: non-finite values in the output of 'p02'",
             "p09": "raise:ValueError: bad row"}
    c = Cluster(lambda it: fates.get(it.id, "ok"))
    assert c.main(job_args(prompts, tmp_path, "ray.cpu_workers=2", "run.max_shard_retries=1",
                           "ray.max_worker_restarts=0")) == 1       # done, some failed
    table = assert_complete(tmp_path / "j", failed={"p07", "p02", "p09"})
    error = {r["id"]: r["error"] for r in table}
    assert error["p07"].startswith("killed its worker 2 times (run.max_row_deaths=2): actor died "
                                   "(simulated)\nrow 'p07' (")
    assert error["p09"] == "failed 2 times: ValueError: bad row"
    assert "non-finite" in error["p02"]
    s = summary(tmp_path / "j")
    assert s["failed"] == 3 and s["ok"] == 9 and s["worker_restarts"] == 2
    assert s["shards"] > 4      # the 4 planned, then the split and retried ones: every hand-out
    text = (tmp_path / "j" / "summary.txt").read_text()
    assert "1 x killed its worker 2 times (run.max_row_deaths=2): actor died (simulated): p07" in text
    # bounded: its shard, then alone once
    assert c.generated.count("p07") == 2 and c.generated.count("p09") <= 3


@pytest.mark.parametrize("workers, shard_size, n", [(1, 1, 3), (2, 3, 12)])
def test_a_row_that_kills_its_worker_every_time_fails_alone_and_the_job_goes_on(
        tmp_path, write_prompts, capsys, caplog, workers, shard_size, n):
    """Issue 47: with one worker and shards of 1, the row's worker died, was restarted, took the
    same row and died again until the restarts were spent: exit 2, "every worker is gone", later
    rows never ran. Now the row is failed at its second death, naming its id, input and the
    cause; every other row (of its shard too) is ok; exit 1; the deaths cost no restart budget
    (ray.max_worker_restarts=1: two restarts happen)."""
    ids = [f"r{i:02d}" for i in range(n)]
    bad = ids[n // 2]
    p = write_prompts({"prompt": [f"prompt {i}" for i in range(n)], "id": ids})
    c = Cluster(lambda it: "die" if it.id == bad else "ok")
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(job_args(p, tmp_path, f"ray.cpu_workers={workers}",
                               f"run.shard_size={shard_size}", "ray.max_worker_restarts=1")) == 1
    d = tmp_path / "j"
    table = assert_complete(d, ids, failed={bad})
    error = {r["id"]: r["error"] for r in table}[bad]
    assert error == (f"killed its worker 2 times (run.max_row_deaths=2): actor died (simulated)\n"
                     f"row '{bad}' ({p}:{n // 2}): prompt 'prompt {n // 2}'")
    assert c.generated.count(bad) == 2
    s = summary(d)
    assert (s["ok"], s["failed"], s["worker_restarts"]) == (n - 1, 1, 2)
    assert f"giving up on row {bad}: killed its worker 2 times" in caplog.text
    out = capsys.readouterr().out
    assert f"1 x killed its worker 2 times (run.max_row_deaths=2): actor died (simulated): {bad}" in out


@pytest.mark.parametrize("workers, ceiling, bound", [(1, 1800, 60), (2, 1800, 60), (1, 20, 20)])
def test_a_hung_row_is_failed_naming_the_cause_and_the_job_ends_by_itself(
        prompts, tmp_path, capsys, caplog, workers, ceiling, bound):
    """Issue 60: p07's generate call never returns (the worker lives, silent). Items take 1 s, so
    a shard of 3 is expected in 3 s: the bound is the floor, 60 s (10 x 3 s is less), or the
    ceiling run.hang_timeout_s when lower. The worker is declared hung at the bound, killed and
    replaced; the shard it was on runs row by row, p07 hangs again and is failed at its second
    hang, naming the cause; every other row is ok; exit 1, within 2 bounds and the start-ups of
    the job's end. The log, summary and report name the worker's host and GPU. A rerun retries
    p07 alone."""
    c = Cluster(lambda it: "hang" if it.id == "p07" else "ok")
    args = job_args(prompts, tmp_path, f"ray.cpu_workers={workers}", f"run.hang_timeout_s={ceiling}")
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(args) == 1
    d = tmp_path / "j"
    table = assert_complete(d, failed={"p07"})
    error = {r["id"]: r["error"] for r in table}["p07"]
    first, second, third = error.splitlines()
    assert first == (f"hung its worker 2 times (run.max_row_deaths=2): no progress for {bound} s "
                     f"while generating it")
    assert second.startswith("row 'p07' (") and third.startswith("worker ")
    silent = int(re.search(r"\(host sim, CPU\) was stopped after (\d+) s without progress; the "
                           r"bound: ", third).group(1))
    assert bound <= silent <= bound + 1                     # looked at once a second
    assert c.generated.count("p07") == 2
    s = summary(d)
    assert (s["ok"], s["failed"]) == (11, 1)
    # each hang replaced its worker; with 2, the second may end with nothing left to replace it for
    assert s["worker_restarts"] == 2 if workers == 1 else s["worker_restarts"] in (1, 2)
    assert [h["bound_s"] for h in s["hangs"]] == [bound, bound]
    assert s["hangs"][-1]["ids"] == ["p07"] and s["hangs"][-1]["device"] == {"host": "sim"}
    assert [w["stopped"] for w in s["workers_detail"]].count("hung") == 2      # in the table
    # bounded: two hangs of `bound` s each, three start-ups (5 s), 11 items at 1 s
    assert s["span_s"] < 2 * (bound + 2) + 3 * 5 + 11 + 5, s["span_s"]
    line = re.compile(rf"HUNG: worker {s['hangs'][-1]['rank']} \(host sim, CPU\) made no progress "
                      rf"for {bound}|{bound + 1} s \(bound {bound} s\) at [\d.]+ s, generating p07; it "
                      rf"was stopped and replaced")
    assert line.search((d / "summary.txt").read_text()) and line.search(capsys.readouterr().out)
    assert "<h2>Hung workers</h2>" in (d / "report.html").read_text()
    assert "(host sim, CPU) is hung: no progress for" in caplog.text
    c.fate, c.generated = None, []
    assert c.main(args) == 0 and c.generated == ["p07"]
    assert_complete(d)


def test_the_bound_follows_the_measured_rate_and_the_work_of_one_call():
    """The bound scales with the worker's measured rate and the size of one call of the work it
    holds (a row of 4x the pixels gets 4x the time; a batch of 2, twice), never under the floor
    nor over the ceiling; before anything came back, the ceiling; a new worker gets the job's."""
    from runner.io.prompts import Item
    from runner.driver.watchdog import Pace, Watchdog, units
    dog = Watchdog(ceiling_s=1000, factor=10, floor_s=60)
    pace = Pace(since=0.0)

    def rows(size, n=1):
        return [Item(id=f"i{k}", prompt="x", negative_prompt="", seed=0, height=size, width=size,
                     num_frames=1, num_inference_steps=10, guidance_scale=4.5, file="f", row=k)
                for k in range(n)]
    assert dog.bound(pace, dog.call_units(rows(64))) == 1000     # nothing measured: the ceiling
    dog.begin(pace, now=0.0)
    dog.done(pace, units(rows(64, 4)), now=20.0)                 # 4 rows in 20 s: 5 s a row
    assert dog.bound(pace, dog.call_units(rows(64, 8))) == 60    # 10 x 5 s = 50: the floor
    assert dog.bound(pace, dog.call_units(rows(128))) == 200     # 4x the pixels: 10 x 20 s
    assert dog.bound(pace, dog.call_units(rows(512))) == 1000    # the ceiling
    assert dog.bound(Pace(since=0.0), dog.call_units(rows(128))) == 200   # the job's rate
    assert Watchdog(1000, batch=2, floor_s=60).call_units(rows(64, 8)) == 2 * units(rows(64))
    assert Watchdog(ceiling_s=0).on is False


def test_a_worker_in_a_shard_longer_than_its_bound_is_asked_and_not_hung(tmp_path, write_prompts,
                                                                          caplog):
    """A shard of 100 rows at 1 s each runs 100 s without coming back, past the 60-s bound of a
    call: the watchdog asks the worker (`Pool.progress`), which finished a call a second ago, so
    it is not hung; the job ends ok with no hang."""
    ids = [f"l{i:03d}" for i in range(200)]
    p = write_prompts({"prompt": [f"p {i}" for i in range(200)], "id": ids})
    c = Cluster()
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(job_args(p, tmp_path, "run.shard_size=100")) == 0
    s = summary(tmp_path / "j")
    assert (s["ok"], s["hangs"], s["worker_restarts"]) == (200, [], 0)
    assert "hung" not in caplog.text


def test_a_worker_that_computes_wrong_is_caught_at_its_next_canary(prompts, tmp_path, capsys,
                                                                    caplog):
    """Issue 47: one worker, shards of 2, a canary every 4 items; its GPU goes wrong after its 6th
    item. Its canary after p00-p03 passes; the one after p04-p07 fails: those 4 outputs (made
    since the last good canary) are recorded suspect, the worker is stopped and replaced (its
    unfinished shard p08-p09 goes back as it was), the rest is done by the replacement. The
    summary, its text and the report name the worker and its GPU; exit 1. A rerun regenerates
    exactly the suspect outputs."""
    c = Cluster(drift={0: 6})
    args = job_args(prompts, tmp_path, "run.shard_size=2", "run.canary_every_items=4")
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(args) == 1
    d = tmp_path / "j"
    suspect = ["p04", "p05", "p06", "p07"]
    table = {r["id"]: r for r in rows(d)}
    assert sorted(i for i, r in table.items() if r["status"] == "suspect") == suspect
    assert all(table[i]["status"] == "ok" for i in IDS if i not in suspect)
    assert all(table[i]["output"] == f"media/{i}.png" for i in suspect)     # kept, in doubt
    error = table["p06"]["error"]
    assert error.startswith("suspect: worker 0 (host sim, GPU 0 simulated) failed its canary "
                            "(bit for bit: 50 % of values differ, largest by 40, PSNR 20.0 dB)")
    s = summary(d)
    assert (s["ok"], s["failed"], s["suspect"], s["not_run"]) == (8, 0, 4, 0)
    assert s["suspect_ids"] == suspect and s["worker_restarts"] == 1 and s["canaries"] == 1
    (failure,) = s["canary_failures"]
    assert failure["rank"] == 0 and failure["suspect_ids"] == suspect
    assert failure["device"]["gpu_index"] == "0" and failure["at_s"] == pytest.approx(15, abs=0.1)
    line = (f"SUSPECT: worker 0 (host sim, GPU 0 simulated) failed its canary at 15.0 s (bit for "
            f"bit: 50 % of values differ, largest by 40, PSNR 20.0 dB); it was stopped, and the 4 "
            f"outputs it made since its last good canary are marked suspect: "
            f"{', '.join(suspect)}; a rerun regenerates them")
    assert line in (d / "summary.txt").read_text() and line in capsys.readouterr().out
    assert "<h2>Suspect outputs</h2>" in (d / "report.html").read_text()
    assert "worker 0 (host sim, GPU 0 simulated) failed its canary" in caplog.text
    # issue 60: the stopped worker has its line in the worker table (and its metrics file), beside
    # its replacement's
    assert [(w["rank"], w["restarts"], w["stopped"]) for w in s["workers_detail"]] == [
        (0, 0, "its canary failed"), (0, 1, None)]
    assert s["workers_detail"][0]["items"] == 8
    assert "its canary failed" in (d / "summary.txt").read_text().split("seconds per stage")[0]
    assert sorted(os.listdir(d / "metrics")) == ["worker-0-stopped-0.json", "worker-0.json"]
    assert c.generated.count("p08") == 2          # handed back as it was, run by the replacement

    c.drift, c.generated = None, []
    kept = mtimes(d, [i for i in IDS if i not in suspect])
    with caplog.at_level(logging.INFO, logger="runner"):
        assert c.main(args) == 0
    assert sorted(c.generated) == suspect          # exactly the suspect outputs, again
    assert_complete(d) and mtimes(d, kept) == kept
    assert "4 outputs suspect (a worker's canary failed after it made them)" in caplog.text


def test_canaries_run_every_k_items_while_there_is_work(tmp_path, write_prompts):
    """24 items on 2 workers in shards of 2, a canary every 4 items a worker was handed, while
    the queue holds more: 12 items each, canaries after 4 and 8 (not after 12: nothing left);
    none fails. Each costs one item's time (1 s) on its worker's GPU."""
    ids = [f"c{i:02d}" for i in range(24)]
    c = Cluster()
    p = write_prompts({"prompt": [f"p {i}" for i in range(24)], "id": ids})
    assert c.main(job_args(p, tmp_path, "ray.cpu_workers=2", "run.shard_size=2",
                           "run.canary_every_items=4")) == 0
    s = summary(tmp_path / "j")
    assert s["canaries"] == 4 and s["canary_failures"] == [] and s["suspect"] == 0
    assert [w.canaries for w in c.pools[0].workers] == [2, 2]
    assert s["canary_s"] == pytest.approx(4.0) and 0 < s["canary_share"] < 0.2


def test_a_persistent_fault_stops_the_job_exit_3_and_a_rerun_does_the_rest(prompts, tmp_path,
                                                                           capsys):
    """The same write error on every shard (a full disk): the job stops after 4 of them instead
    of retrying every row; the summary says why; once the disk has room a rerun finishes."""
    full = "raise:OSError: [Errno 28] No space left on device"
    c = Cluster(lambda it: full)
    assert c.main(job_args(prompts, tmp_path)) == 3
    err = capsys.readouterr().err
    assert "No space left on device" in err and "the same error on 4 shards in a row" in err
    d = tmp_path / "j"
    text = (d / "summary.txt").read_text()
    assert "STOPPED before the end" in text and "No space left on device" in text
    assert summary(d)["aborted"] and not [r for r in record_rows(d) if r["status"] == "ok"]
    assert len(c.generated) < len(IDS) * 2        # stopped early, not every row retried
    c.fate = None                                 # the disk has room again
    assert c.main(job_args(prompts, tmp_path)) == 0
    assert_complete(d)


def test_an_input_store_that_stops_answering_stops_the_job_and_leaves_the_rest_pending(
        prompts, tmp_path, capsys):
    """Issue 60: the store of the rows' images stalls from p05 on; each worker read of it fails
    with the store's fault (`images.INPUT_FAULT`). The job stops at the first such row (exit 3,
    naming the store), records the ok rows of that shard, fails none: every row not made stays
    pending. Once the store answers, a rerun makes exactly the rest."""
    stalled = ("fail:InputStoreFault: the image store s3://imgs: did not answer in time (timed "
               "out), reading s3://imgs/a.png")
    c = Cluster(lambda it: stalled if it.id >= "p05" else "ok")
    assert c.main(job_args(prompts, tmp_path)) == 3
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the image store s3://imgs: did not answer in time"), err[-2000:]
    assert "rows not generated stay pending" in last and "rerun" in last
    d = tmp_path / "j"
    recorded = {r["id"]: r["status"] for r in record_rows(d)}
    assert recorded == {i: "ok" for i in ["p00", "p01", "p02", "p03", "p04"]}   # none failed
    s = summary(d)
    assert (s["ok"], s["failed"], s["not_run"]) == (5, 0, 7) and "s3://imgs" in s["aborted"]
    assert "STOPPED before the end: the image store s3://imgs" in (d / "summary.txt").read_text()
    c.fate, c.generated = None, []                # the store answers again
    assert c.main(job_args(prompts, tmp_path)) == 0
    assert sorted(c.generated) == IDS[5:]          # exactly the rest
    assert_complete(d)


@pytest.mark.parametrize("job_name, column, value, bound", [
    ("demo_image", "height", 16384, "16384x16384 is 256x the work of this model's published setting "
                                    "(1024x1024); a row may ask at most 4x"),
    ("wan_batch", "num_frames", 10000, "480x832 x 10000 frames is 119x the work of this model's "
                                       "published setting (480x832 x 81 frames); a row may ask at "
                                       "most 4x")])
def test_a_row_asking_for_unbounded_work_is_exit_2_before_any_worker(
        tmp_path, write_prompts, capsys, job_name, column, value, bound):
    """Issue 60: a row of 16384x16384 kept a worker busy until it was killed from outside. A
    row's size and frames are bounded by its preset's published setting (4x its latent positions),
    checked with the prompts: exit 2 naming the row, the bound and the fix; no pool started."""
    cols = {"id": ["fine", "huge"], "prompt": ["a fox", "everything at once"], column: [None, value]}
    if column == "height":
        cols["width"] = [None, value]
    p = write_prompts(cols)

    def no_pool(*a):
        raise AssertionError("a worker was started")
    args = [f"job={job_name}", "model.source=tiny", f"prompts.path={p}", f"output.dir={tmp_path}",
            "job.name=j", "generation.num_inference_steps=2"]
    assert job.main(args, start_pool=no_pool) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {p}:1 (id 'huge'): {bound}"), err
    assert "lower height, width" in err and "a larger preset" in err
    assert not (tmp_path / "j").exists()


def test_every_worker_gone_is_exit_2_naming_the_cause(prompts, tmp_path, capsys):
    """p00's worker dies once (p00 is not a poison row: it is done later), then no replacement
    starts (a different start-up error each time): every worker is gone, exit 2."""
    died = []

    def fate(item):
        if item.id == "p00" and not died:
            died.append(1)
            return "die"
        return "ok"
    c = Cluster(fate, warm_fate=lambda rank, attempt: None if attempt == 1 else
                f"RuntimeError: no GPU ({attempt})")
    assert c.main(job_args(prompts, tmp_path, "ray.max_worker_restarts=1")) == 2
    err = capsys.readouterr().err
    assert "every worker is gone and none could be restarted" in err and "rerun" in err
    assert "worker 0: start-up failed: RuntimeError: no GPU (3)" in err
    assert (tmp_path / "j" / "results.parquet").is_file()      # what finished is in the table


def test_a_warmup_error_that_repeats_is_not_retried_again(prompts, tmp_path, capsys, caplog):
    boom = "RuntimeError: injected warm-up failure (boom)"
    c = Cluster(warm_fate=lambda rank, attempt: boom)
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(job_args(prompts, tmp_path, "ray.max_worker_restarts=3")) == 2
    assert f"worker 0: start-up failed: {boom}" in capsys.readouterr().err   # the cause itself
    assert caplog.text.count("starting a replacement") == 1   # one retry, never a third attempt
    assert "the same error as before: not retried" in caplog.text
    assert len(c.pools[0].workers) == 2 and c.generated == []


# -- stopping and resuming ----------------------------------------------------------------------

@pytest.mark.parametrize("signum, status, said", [(signal.SIGINT, 130, "interrupted"),
                                                 (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_stop_signal_writes_the_summary_of_what_was_done_and_a_rerun_resumes(
        prompts, tmp_path, capsys, signum, status, said):
    """A real signal to this process while shards run (Ctrl-C, or SIGTERM as `ray job stop`
    sends): the workers are stopped, finished outputs kept, the summary and metrics written; the
    rerun generates only the rest."""
    sent = []

    def fate(item):
        if item.id == "p07" and not sent:      # handed out once 4 rows are in (shards of 1)
            sent.append(signum)
            # its worker writes its file before the stop, its rows never come back
            (tmp_path / "j" / "media" / "p07.png").write_bytes(b"written after the record")
            os.kill(os.getpid(), signum)       # lands in the handler; the dispatch loop raises
        return "ok"
    c = Cluster(fate)
    args = job_args(prompts, tmp_path, "ray.cpu_workers=2", "run.shard_size=1")
    assert c.main(args) == status
    assert f"{said}: finished outputs and the summary so far are written" in capsys.readouterr().err
    d = tmp_path / "j"
    s = summary(d)
    assert s["interrupted"] and 4 <= s["ok"] < 12 and s["workers"] == 2
    # files without a record are explained (issue 37: 46 ok, media/ held 51 files): p07's, and
    # those of shards whose rows were not read once the stop began
    unrecorded = len(os.listdir(d / "media")) - s["ok"]
    assert s["unrecorded_media"] == unrecorded >= 1
    assert (f"{unrecorded} files in media/ were written after the last record update (the "
            f"workers' item counts include them): a rerun regenerates them"
            ) in (d / "summary.txt").read_text()
    assert len(os.listdir(d / "metrics")) == s["workers"]
    done = [r["id"] for r in rows(d)]
    assert len(done) == s["ok"] and all(r["status"] == "ok" for r in rows(d))
    media = {f.name: f.stat().st_mtime_ns for f in os.scandir(d / "media")}
    assert {f"{i}.png" for i in done} <= set(media)       # what is recorded is there
    assert "p07" not in done and "p07.png" in media
    assert max(media.values()) <= (d / "summary.json").stat().st_mtime_ns   # nothing after it
    assert all(w.dead_at is not None for w in c.pools[0].workers)   # stopped before the summary
    assert not (d / ".lock").exists()

    job.STOPS.clear()                          # a new process, as a rerun is
    c.generated.clear()
    kept = mtimes(d, done)
    assert c.main(args) == 0
    assert_complete(d)
    s = summary(d)
    assert s["resumed"] == len(done) and s["ok"] == 12 and not s["interrupted"]
    assert sorted(c.generated) == sorted(set(IDS) - set(done))         # only the rest
    assert mtimes(d, done) == kept


def test_a_worker_dying_while_writing_leaves_no_partial_output_and_the_rerun_does_the_rest(
        prompts, tmp_path, capsys):
    """Its half-written file stays under a temporary name, which the driver removes; what the
    record holds is complete and not made again by the rerun. p07's worker dies writing it every
    time: failed at its second death, no file under its name."""
    c = Cluster(lambda it: "die_writing" if it.id == "p07" else "ok")
    assert c.main(job_args(prompts, tmp_path, "ray.max_worker_restarts=0")) == 1
    d = tmp_path / "j"
    assert not (d / "media" / "p07.png").exists()
    assert [f for f in os.listdir(d / "media") if f.startswith(".tmp-")] == []   # removed
    done = {r["id"] for r in record_rows(d) if r["status"] == "ok"}
    assert done == set(IDS) - {"p07"}
    assert sorted(os.listdir(d / "media")) == sorted(f"{i}.png" for i in done)
    kept = mtimes(d, done)
    c.fate = None
    c.generated.clear()
    assert c.main(job_args(prompts, tmp_path)) == 0
    assert_complete(d)
    assert summary(d)["resumed"] == len(done) and mtimes(d, done) == kept
    assert c.generated == ["p07"]


def test_a_rerun_skips_done_work_a_config_change_is_refused_overwrite_regenerates(prompts, tmp_path,
                                                                                  capsys):
    c = Cluster()
    assert c.main(job_args(prompts, tmp_path)) == 0
    d = tmp_path / "j"
    kept = mtimes(d, IDS)
    capsys.readouterr()
    assert c.main(job_args(prompts, tmp_path)) == 0
    assert capsys.readouterr().out.startswith("nothing to do: all 12 prompts already done")
    assert len(c.pools) == 1 and mtimes(d, IDS) == kept           # no worker, nothing rewritten
    assert_complete(d)
    assert c.main(job_args(prompts, tmp_path, "generation.num_inference_steps=3")) == 2
    err = capsys.readouterr().err
    assert "generation.num_inference_steps: 2 -> 3" in err and "output.overwrite=true" in err
    c.generated.clear()
    assert c.main(job_args(prompts, tmp_path, "generation.num_inference_steps=3",
                           "output.overwrite=true")) == 0
    assert sorted(c.generated) == IDS
    assert {r["num_inference_steps"] for r in assert_complete(d)} == {3}


def test_edited_rows_are_regenerated_and_dropped_ids_are_reported(tmp_path, write_prompts, capsys,
                                                                   caplog):
    ids = [f"a{i}" for i in range(6)]
    p = write_prompts({"prompt": [f"prompt {i}" for i in range(6)], "id": ids})
    args, d = job_args(p, tmp_path), tmp_path / "j"
    c = Cluster()
    assert c.main(args) == 0
    kept = mtimes(d, ids)
    # same ids: a0 new prompt, a1 new seed, a2 height 128 (column), a3/a4 unchanged but moved,
    # a5 dropped, a6 new
    write_prompts({"id": ["a4", "a3", "a0", "a1", "a2", "a6"],
                   "prompt": ["prompt 4", "prompt 3", "a new prompt", "prompt 1", "prompt 2", "prompt 6"],
                   "seed": [0, 0, 0, 7, 0, 0], "height": [64, 64, 64, 64, 128, 64]})
    capsys.readouterr()
    assert c.main(args + ["run.dry_run=true"]) == 0                   # the plan, nothing run
    out = capsys.readouterr().out
    assert "4 to run (3 changed: 3 in " in out and "2 already done" in out
    assert "1 no longer in the input (kept): a5" in out
    assert len(record_rows(d)) == 6 and len(c.pools) == 1               # compacted: one per id
    c.generated.clear()
    with caplog.at_level(logging.INFO, logger="runner"):
        assert c.main(args) == 0
    assert "3 rows changed since their outputs were made (3 in " in caplog.text
    assert "2 already done" in caplog.text
    assert sorted(c.generated) == ["a0", "a1", "a2", "a6"]
    table = {r["id"]: r for r in rows(d)}
    assert sorted(table) == ["a0", "a1", "a2", "a3", "a4", "a6"]
    assert table["a0"]["prompt"] == "a new prompt" and table["a1"]["seed"] == 7
    assert table["a2"]["height"] == 128
    assert {i: kept[i] for i in ("a3", "a4", "a5")} == mtimes(d, ["a3", "a4", "a5"])  # a5 kept
    new = mtimes(d, ["a0", "a1", "a2"])
    assert all(new[i] != kept[i] for i in new)
    s = summary(d)
    assert s["resumed"] == 2 and s["regenerated"] == 3 and s["ok"] == 6
    assert s["not_in_input"] == 1 and s["not_in_input_ids"] == ["a5"]
    assert "1 output of ids no longer in the input (kept): a5" in (d / "summary.txt").read_text()
    assert len(record_rows(d)) == 6 + 1 and len(os.listdir(d / "records")) == 1   # a5's row kept


def test_hostile_ids_stay_inside_the_output_dir_and_empty_prompts_are_counted(tmp_path,
                                                                              write_prompts, caplog):
    p = write_prompts({"prompt": ["a", "b", "", None], "id": ["../../escape", "/etc/passwd", "e1", "e2"]})
    c = Cluster()
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(["job=demo_image", f"prompts.path={p}", f"output.dir={tmp_path}/o",
                       "prompts.on_empty=skip"]) == 0
    d = tmp_path / "o" / "demo_image"
    assert sorted(os.listdir(d / "media")) == ["_.._escape.png", "_etc_passwd.png"]
    assert sorted(os.listdir(tmp_path)) == ["o", "prompts.parquet"]
    assert "2 rows with an empty prompt skipped" in caplog.text
    s = summary(d)
    assert s["skipped_empty"] == 2 and s["ok"] == 2
    assert "2 rows with an empty prompt skipped" in (d / "summary.txt").read_text()


CASE_IDS = ["Fox", "fox", "p1", "P1", "other"]


def test_ids_differing_only_in_case_on_a_case_insensitive_dir_are_exit_2_before_any_worker(
        tmp_path, write_prompts, capsys):
    """On a filesystem that folds case (a real one: tests/casefold_fs.py), media/Fox.png and
    media/fox.png are one file: run, one output would silently replace the other with both rows
    reported ok. The job refuses to start, naming both ids of each pair, their rows and the fix."""
    from casefold_fs import casefold_mount
    p = write_prompts({"prompt": [f"prompt {i}" for i in CASE_IDS], "id": CASE_IDS})
    with casefold_mount(tmp_path / "backing", tmp_path / "mnt") as mnt:
        (mnt / "Probe").write_text("1")           # the mount really folds case
        assert (mnt / "probe").read_text() == "1" and os.listdir(mnt) == ["Probe"]
        (mnt / "Probe").unlink()
        c = Cluster()
        assert c.main(job_args(p, mnt)) == 2
        assert c.pools == [] and c.generated == []            # no worker started, no model built
        assert os.listdir(mnt / "j") == []                    # the probe left nothing behind
        err = capsys.readouterr().err
        assert "case-insensitive filesystem" in err and "(2 such ids)" in err
        assert f"'Fox' ({p}:0) and 'fox' ({p}:1)" in err
        assert f"'p1' ({p}:2) and 'P1' ({p}:3)" in err
        assert "Rename one id" in err and "case-sensitive directory or an object store" in err
        # a dry run is refused the same way, creating nothing
        assert Cluster().main(job_args(p, mnt / "dry", "run.dry_run=true")) == 2
        assert not (mnt / "dry").exists()


def test_ids_differing_only_in_case_on_a_case_sensitive_dir_are_two_outputs(tmp_path,
                                                                             write_prompts):
    """The same ids where the directory keeps case apart (this machine's tmp_path: the probe says
    so): no error, one output each."""
    from runner.io.storage import case_insensitive
    assert case_insensitive(tmp_path) is False and os.listdir(tmp_path) == []
    p = write_prompts({"prompt": [f"prompt {i}" for i in CASE_IDS], "id": CASE_IDS})
    assert Cluster().main(job_args(p, tmp_path / "out")) == 0
    assert_complete(tmp_path / "out" / "j", ids=CASE_IDS)


def test_a_store_failing_as_the_run_ends_is_exit_3_and_a_rerun_finishes(prompts, tmp_path, capsys):
    """Every output made, then the results table cannot be written (a non-empty directory holds
    its name: a real OSError): exit 3 naming it, no traceback, every finished row recorded; a
    rerun before the fix says so again (exit 3); one after it writes the table without
    generating anything again."""
    d = tmp_path / "j"
    (d / "results.parquet" / "in-the-way").mkdir(parents=True)
    c = Cluster()
    assert c.main(job_args(prompts, tmp_path)) == 3
    err = capsys.readouterr().err
    assert "the results or summary could not be written" in err and "Error" in err
    assert "Traceback" not in err
    assert sorted(r["id"] for r in record_rows(d) if r["status"] == "ok") == IDS
    # a rerun before the fix: nothing to generate, the table still in the way: exit 3 again,
    # naming it (it was a traceback, exit 1), nothing generated
    made = len(c.generated)
    assert c.main(job_args(prompts, tmp_path)) == 3
    err = capsys.readouterr().err
    assert ("error: every prompt is done, but the results could not be written (IsADirectoryError: "
            in err and "rerun the same command to write them" in err and "Traceback" not in err)
    assert len(c.generated) == made
    (d / "results.parquet" / "in-the-way").rmdir()
    (d / "results.parquet").rmdir()
    assert c.main(job_args(prompts, tmp_path)) == 0
    assert f"nothing to do: all {len(IDS)} prompts already done" in capsys.readouterr().out
    assert_complete(d)


@pytest.mark.parametrize("damage", [
    pytest.param(lambda p: p.write_bytes(b""), id="empty"),            # a power loss: not synced
    pytest.param(lambda p: p.write_bytes(b"\0" * 600), id="zero-filled"),
    pytest.param(lambda p: p.write_text("model: {preset: [pixart\n"), id="not-yaml"),
    pytest.param(lambda p: p.write_text("- model\n- compile\n"), id="a-list"),
    pytest.param(lambda p: (p.unlink(), p.mkdir()), id="a-directory"),
])
def test_a_damaged_config_yaml_at_a_rerun_is_exit_2_naming_it_and_the_way_on(
        prompts, tmp_path, capsys, damage, within_60_s):
    """The config.yaml beside the record is what a rerun compares its config with. Damaged (as a
    power loss leaves a file whose write was not synced, or an edit), the rerun ended in a
    traceback (yaml's ReaderError, omegaconf's "Missing key compile"), exit 1. Now exit 2 naming
    the file, why, and the ways on, before any worker; removing it resumes without redoing
    anything done."""
    c = Cluster()
    assert c.main(job_args(prompts, tmp_path)) == 0
    made, conf = len(c.generated), tmp_path / "j" / "config.yaml"
    damage(conf)
    capsys.readouterr()
    assert c.main(job_args(prompts, tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"error: {conf} is damaged or unreadable (" in err and "Traceback" not in err
    assert "remove it to resume" in err and "output.overwrite=true" in err
    assert len(c.pools) == 1 and len(c.generated) == made        # no worker started
    (conf.rmdir if conf.is_dir() else conf.unlink)()
    assert c.main(job_args(prompts, tmp_path)) == 0
    assert f"nothing to do: all {len(IDS)} prompts already done" in capsys.readouterr().out
    assert len(c.generated) == made
    assert_complete(tmp_path / "j")


def test_the_driver_imports_no_torch_and_no_ray_when_its_pool_is_not_rays(prompts, tmp_path):
    """The whole driver path on a pool that is not Ray's: Ray is never imported. Nor torch: the
    driver never needs it (it imported it to resolve `model.device=auto`, which it did not use:
    ~1.5 CPU-s per job, dry runs included, on the machine that also runs the workers)."""
    import subprocess
    import sys
    code = (f"import sys; from runner.driver import job; from runner.bench.simulate import SimPool, VirtualClock\n"
            f"clock = VirtualClock()\n"
            f"pool = lambda j, limits: SimPool(1, 1.0, clock, startup_s=(1, 1))\n"
            f"assert job.main({job_args(prompts, tmp_path)!r}, start_pool=pool, clock=clock.time) == 0\n"
            f"assert 'ray' not in sys.modules, 'ray imported'\n"
            f"assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


# -- issue 37: what the summary says ------------------------------------------------------------

def test_failures_are_grouped_by_cause_with_their_ids(tmp_path, write_prompts, capsys):
    """D2: 400 rows failing alike printed 400 lines, each message naming its own id. Now one line
    per cause with the ids (summary.txt, the terminal's last lines), counts and ids in
    summary.json."""
    ids = [f"m{i:02d}" for i in range(14)]
    p = write_prompts({"prompt": [f"prompt {i}" for i in range(14)], "id": ids})
    nan = "FloatingPointError: non-finite values in the output of '{}'"
    fates = {i: f"fail:{nan.format(i)}" for i in ids[:12]}
    fates["m13"] = "fail:ValueError: something else"
    c = Cluster(lambda it: fates.get(it.id, "ok"))
    assert c.main(job_args(p, tmp_path, "ray.cpu_workers=2")) == 1
    d = tmp_path / "j"
    cause = nan.format("<id>")
    s = summary(d)
    assert (s["ok"], s["failed"], s["not_run"]) == (1, 13, 0)
    assert s["errors"] == {cause: 12, "ValueError: something else": 1}
    assert s["error_ids"] == {cause: ids[:10], "ValueError: something else": ["m13"]}
    text = (d / "summary.txt").read_text()
    listed = f"  12 x {cause}: {', '.join(ids[:10])}, ... (2 more)"
    assert f"failures by cause (a rerun retries them):\n{listed}\n" \
           f"  1 x ValueError: something else: m13\n" in text
    out = capsys.readouterr().out.rstrip("\n").splitlines()
    assert out[-2:] == [listed, "  1 x ValueError: something else: m13"]   # the console's last


def test_a_changed_rows_old_output_never_stays_under_its_name(prompts, tmp_path, write_prompts,
                                                               capsys, caplog):
    """D3: an edited row whose regeneration failed kept the old media/<id>.png made from the old
    inputs while the table said failed. The old outputs of changed rows are removed before any
    shard runs and recorded `changed`: not run when their regeneration never ran (a stop), then
    failed when it fails (a NaN output), never with the old file."""
    c = Cluster()
    args = job_args(prompts, tmp_path, "run.shard_size=1")
    assert c.main(args) == 0
    d = tmp_path / "j"
    edited = [f"prompt number {i}" if i not in (3, 10) else f"edited {i}" for i in range(12)]
    write_prompts({"prompt": edited, "id": IDS})
    capsys.readouterr()
    assert c.main(args + ["run.dry_run=true"]) == 0
    assert "2 old outputs of changed rows would be removed before they run: p03, p10" in \
        capsys.readouterr().out
    assert (d / "media" / "p03.png").exists()                    # a dry run removes nothing

    def stop_at_once(item):                  # the first row handed out: Ctrl-C, nothing comes back
        os.kill(os.getpid(), signal.SIGINT)
        return "fail:never delivered"
    c.fate = stop_at_once
    with caplog.at_level(logging.INFO, logger="runner"):
        assert c.main(args) == 130
    assert "removed the old outputs of 2 changed rows before regenerating them: p03, p10" in caplog.text
    assert not (d / "media" / "p03.png").exists() and not (d / "media" / "p10.png").exists()
    s = summary(d)
    assert (s["ok"], s["failed"], s["not_run"], s["changed_not_run"]) == (10, 0, 2, 2)
    assert s["errors"] == {}
    table = {r["id"]: r for r in rows(d)}
    assert table["p03"]["status"] == "changed" and table["p03"]["prompt"] == "edited 3"
    assert "old outputs were removed, their regeneration did not run" in (d / "summary.txt").read_text()

    job.STOPS.clear()                         # a new process, as a rerun is
    nan = "fail:FloatingPointError: non-finite values (NaN or inf) in the output"
    c.fate = lambda it: nan if it.id == "p03" else "ok"
    assert c.main(args) == 1
    assert not (d / "media" / "p03.png").exists() and (d / "media" / "p10.png").exists()
    table = {r["id"]: r for r in rows(d)}
    assert table["p03"]["status"] == "failed" and table["p10"]["status"] == "ok"
    s = summary(d)
    assert (s["ok"], s["failed"], s["not_run"], s["changed_not_run"]) == (11, 1, 0, 0)
    assert "1 x FloatingPointError: non-finite values (NaN or inf) in the output: p03" in \
        (d / "summary.txt").read_text()


class SlowSecondWorker(Cluster):
    """Worker 1 takes 500 s to start: the 12 items are done by worker 0 long before."""

    def __call__(self, j, limits):
        pool = super().__call__(j, limits)
        start = pool.start

        def start_slow(rank):
            pool.startup_s = (500.0, 500.0) if rank == 1 else self.startup_s
            return start(rank)
        pool.start = start_slow
        return pool


def test_a_worker_not_ready_when_the_job_ends_is_listed_not_lost(prompts, tmp_path):
    """A worker still warming up when the last item finished vanished from the summary and the
    report (issue 37). Now both list it, with how long it had been starting."""
    c = SlowSecondWorker()
    assert c.main(job_args(prompts, tmp_path, "ray.cpu_workers=2")) == 0
    d = tmp_path / "j"
    s = summary(d)
    assert s["workers"] == 1 and [w["rank"] for w in s["workers_detail"]] == [0]
    assert s["workers_not_ready"] == [dict(rank=1, restarts=0, starting_s=pytest.approx(17, abs=0.2),
                                              last_error=None)]
    line = "worker 1: not ready when the job ended (still starting after 17 s; served nothing)"
    assert line in (d / "summary.txt").read_text()
    assert "Not ready when the job ended:</p><ul><li>worker 1: still starting after 17 s; served " \
           "nothing</li>" in (d / "report.html").read_text()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (mounting needs root, as CI runs) and `fill()`, which fills it to ENOSPC;
    `free()` empties what `fill` wrote."""
    from types import SimpleNamespace
    from conftest import fill_disk, tmpfs
    d = tmp_path / "disk"
    d.mkdir()
    with tmpfs(d, "1m"):
        yield SimpleNamespace(path=d, fill=lambda: fill_disk(d, "filler"),
                              free=lambda: (d / "filler").unlink())


def test_a_disk_filling_at_the_report_stage_is_said_last_and_the_exit_stays_0(
        prompts, small_disk, monkeypatch, capsys):
    """The job exited 0 with report.html missing and 93 "no thumbnail" lines (issue 37). Now its
    last line says so; summary.txt too once it can be rewritten; every output is complete, so
    the status stays 0 (the report is made again by `python -m runner.driver.report DIR`)."""
    from runner.driver import report
    real = report.write_report

    def disk_fills_then_report(*args, **kw):      # a real ENOSPC inside the report's writes
        small_disk.fill()
        try:
            return real(*args, **kw)
        finally:
            small_disk.free()                      # summary.txt can take the note after
    monkeypatch.setattr(report, "write_report", disk_fills_then_report)
    c = Cluster()
    # no background snapshot (it draws the report too): the final report is the one that fails
    assert c.main(job_args(prompts, small_disk.path, "output.results_every_s=100000")) == 0
    d = small_disk.path / "j"
    assert_complete(d) and summary(d)["ok"] == 12
    assert not (d / "report.html").exists()
    note = (f"report.html not written (OSError: [Errno 28] No space left on device); every output "
            f"is complete: `python -m runner.driver.report {d}` makes it once the cause is fixed")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1] == f"note: {note}"
    assert (d / "summary.txt").read_text().endswith(f"\nnote: {note}\n")


@pytest.fixture
def within_60_s():
    """A guard against a hang: past 60 s the test process ends, with every thread's traceback
    (faulthandler's timer: it fires whatever thread holds the interpreter)."""
    import faulthandler
    import sys
    faulthandler.dump_traceback_later(60, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_a_record_that_cannot_be_written_mid_job_is_exit_3_and_a_rerun_does_the_rest(
        prompts, small_disk, monkeypatch, capsys, within_60_s):
    """The disk fills between a shard's media files and its record (a real ENOSPC in the
    record's write): the job stops (exit 3) naming the record and the fix, no traceback, no
    temporary file; the record keeps the shard before, whole. Once there is room a rerun keeps
    those 3 outputs and makes the other 9 (the 3 whose record was lost among them: their files
    are rewritten, as the record never said they were done)."""
    from runner.driver import results
    real, calls = results.Results.add, []

    def disk_full_at_the_second_record(self, rows):
        calls.append([r["id"] for r in rows])
        if len(calls) == 2:
            small_disk.fill()
        return real(self, rows)
    monkeypatch.setattr(results.Results, "add", disk_full_at_the_second_record)
    c = Cluster()
    assert c.main(job_args(prompts, small_disk.path)) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1] == ("error: the job's record could not be written (OSError: [Errno 28] No space "
                       "left on device). Finished outputs are kept: fix the storage and rerun the "
                       "same command to resume.")
    assert not [line for line in err if "Traceback" in line]
    d = small_disk.path / "j"
    assert calls[:2] == [IDS[:3], IDS[3:6]]
    assert sorted(r["id"] for r in record_rows(d) if r["status"] == "ok") == IDS[:3]
    assert [f for _, _, fs in os.walk(d) for f in fs if f.startswith(".tmp-")] == []
    small_disk.free()
    monkeypatch.setattr(results.Results, "add", real)
    before = len(c.generated)
    assert c.main(job_args(prompts, small_disk.path)) == 0
    assert sorted(c.generated[before:]) == IDS[3:]
    assert_complete(d)



def test_an_output_dir_turning_read_only_mid_job_is_exit_3_naming_the_lock_left(
        prompts, small_disk, monkeypatch, capsys, caplog, within_60_s):
    """Issue 75: the job directory's filesystem turns read-only mid-job (a real remount, between a
    shard's media files and its record). The stop was right, but removing the lock raised (EROFS)
    over it, and again at exit: two tracebacks and exit 1. Now: exit 3 with the record's error
    last, no traceback, and one warning naming the lock left behind and who takes it over."""
    import subprocess
    from runner.driver import results
    real, calls = results.Results.add, []

    def read_only_at_the_second_record(self, rows):
        calls.append(rows)
        if len(calls) == 2:
            subprocess.run(["mount", "-o", "remount,ro", str(small_disk.path)], check=True)
        return real(self, rows)
    monkeypatch.setattr(results.Results, "add", read_only_at_the_second_record)
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert Cluster().main(job_args(prompts, small_disk.path)) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("error: the job's record could not be written (OSError: [Errno "
                              "30] Read-only file system: "), err[-5:]
    assert err[-1].endswith("Finished outputs are kept: fix the storage and rerun the same "
                            "command to resume."), err[-5:]
    assert not [line for line in err if "Traceback" in line], err
    lock = small_disk.path / "j" / ".lock"
    assert lock.exists()                                   # it could not be removed ...
    assert caplog.text.count(f"could not remove the lock {lock} ") == 1, caplog.text   # ... said once
    assert "Read-only file system" in caplog.text and "takes it over" in caplog.text
    subprocess.run(["mount", "-o", "remount,rw", str(small_disk.path)], check=True)

# -- issue 47: input images ----------------------------------------------------------------------

def reading_fate(item) -> str:
    """A simulated worker that reads its row's image as a worker does (`images.read`, the default
    bound): a row whose image cannot be read fails with that ImageError."""
    from runner.io import images
    try:
        images.read(item)
    except images.ImageError as e:
        return f"fail:ImageError: {e}"
    return "ok"


def i2v_args(p, out, *extra):
    return ["job=wan_i2v_batch", "model.source=tiny", f"prompts.path={p}", f"output.dir={out}",
            "job.name=j", "generation.height=64", "generation.width=48", "generation.num_frames=5",
            "generation.num_inference_steps=2", "output.results_every_s=0", "ray.cpu_workers=2",
            *extra]


def grey_png(path) -> str:
    from PIL import Image
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (80, 60), (128, 128, 128)).save(path)
    return str(path)


def test_missing_images_under_different_paths_are_one_summary_line(tmp_path, write_prompts, capsys,
                                                                   caplog):
    """Issue 47: a 40-row job whose 38 images `photos/IMG_xxxx.jpg` are missing printed 38 lines
    `1 x ImageError: ... not found`. Now one line with the count and the first ids."""
    ids = [f"r{i:02d}" for i in range(40)]
    cells = [f"photos/IMG_{1000 + i}.jpg" for i in range(40)]
    for i in (0, 39):                                               # two images are there
        grey_png(tmp_path / "photos" / f"IMG_{1000 + i}.jpg")
    p = write_prompts({"id": ids, "prompt": [f"p{i}" for i in range(40)], "image": cells})
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert Cluster(reading_fate).main(i2v_args(p, tmp_path)) == 1
    # the driver's check of 16 of them: one line for the missing ones (issue 60: one a line)
    warned = [r.getMessage() for r in caplog.records if "images looked up" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("15 of the 16 images looked up: not found "
                                                     "(their rows will fail): "), warned
    cause = "ImageError: image <path>: not found"
    s = summary(tmp_path / "j")
    assert (s["ok"], s["failed"]) == (2, 38) and s["errors"] == {cause: 38}
    line = f"  38 x {cause}: {', '.join(ids[1:11])}, ... (28 more)"
    assert f"failures by cause (a rerun retries them):\n{line}\n" in (tmp_path / "j" / "summary.txt").read_text()
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1] == line
    assert rows(tmp_path / "j")[1]["error"] == \
        f"ImageError: image {tmp_path / 'photos' / 'IMG_1001.jpg'}: not found"   # the row: in full


def test_rows_whose_image_is_no_image_file_fail_each_with_its_cause(tmp_path, write_prompts, caplog):
    """Issue 47: a directory, a symlink loop, /dev/zero and a file over prompts.max_image_mib
    (here 1 MiB) fail their rows, each with its own cause, named at the driver's check and in
    the summary; the other rows are made; exit 1."""
    os.makedirs(tmp_path / "img" / "dir.png")
    os.symlink("loop.png", tmp_path / "img" / "loop.png")
    with open(tmp_path / "img" / "big.png", "wb") as f:
        f.truncate((1 << 20) + 1)
    cells = {"ok1": grey_png(tmp_path / "img" / "a.png"), "dir": "img/dir.png",
             "loop": "img/loop.png", "zero": "/dev/zero", "big": "img/big.png",
             "ok2": grey_png(tmp_path / "img" / "b.png")}
    p = write_prompts({"id": list(cells), "prompt": list(cells), "image": list(cells.values())})

    def fate(item):         # what the job's workers are told: prompts.max_image_mib=1
        from runner.io import images
        try:
            images.read(item, max_bytes=1 << 20)
        except images.ImageError as e:
            return f"fail:ImageError: {e}"
        return "ok"
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert Cluster(fate).main(i2v_args(p, tmp_path, "prompts.max_image_mib=1")) == 1
    causes = {"dir": "a directory, not a regular file: not read",
              "loop": "a symlink loop (too many levels of symbolic links)",
              "zero": "a character device, not a regular file: not read",
              "big": "larger than prompts.max_image_mib (1 MiB): not read; shrink it or raise the setting"}
    by = {r["id"]: r for r in rows(tmp_path / "j")}
    assert by["ok1"]["status"] == by["ok2"]["status"] == "ok"
    for k, cause in causes.items():
        image = os.path.join(tmp_path, cells[k])                     # relative to the prompts file
        assert by[k]["status"] == "failed" and by[k]["error"].startswith(
            f"ImageError: image {image}: {cause}"), by[k]
        assert f"1 of the 6 images looked up: {cause.splitlines()[0]} (their rows will fail): " \
               f"{p}:{list(cells).index(k)}: image {image}" in caplog.text        # the driver's check
    assert summary(tmp_path / "j")["errors"] == {f"ImageError: image <path>: {c}": 1
                                                 for c in causes.values()}


# -- int8-attention's kernel where some workers cannot run it -----------------------------------

NO_KERNEL = "the INT8/FP8 attention kernel is built for Hopper (sm90); this GPU is sm80"


class Int8Cluster(Cluster):
    """Workers of ranks in `falls_back` cannot run int8-attention's kernel and say so as a real
    worker does (`Worker._record_kernels`): in their ready info, and `int8_attention: false` on
    their rows; the others run it."""

    def __init__(self, falls_back=(), **kw):
        super().__init__(**kw)
        self.falls_back = set(falls_back)

    def __call__(self, j, limits):
        pool = super().__call__(j, limits)
        result = pool.result

        def said(f):
            value, off = result(f), f.worker.rank in self.falls_back
            if isinstance(value, dict) and "warmup_s" in value:          # ready info (or metrics)
                value = {**value, "int8_attention": not off,
                         **({"int8_attention_off": NO_KERNEL} if off else {})}
            elif isinstance(value, list) and value and isinstance(value[0], dict):   # rows
                value = [{**r, "int8_attention": not off} if r["status"] == "ok" else r
                         for r in value]
            return value
        pool.result = said
        return pool


def wan_o3_args(prompts, out, *extra):
    return ["job=wan_batch", "model.source=tiny", f"prompts.path={prompts}", f"output.dir={out}",
            "job.name=j", "generation.height=64", "generation.width=48", "generation.num_frames=5",
            "generation.num_inference_steps=2", "compile.mode=O3", "run.shard_size=3",
            "output.results_every_s=0", "ray.cpu_workers=2", *extra]


def test_outputs_made_without_the_int8_kernel_are_recorded_so_and_remade_where_it_runs(
        prompts, tmp_path, write_prompts, caplog, capsys):
    """A mixed cluster: worker 1 cannot run the kernel. Its outputs are recorded under the job's
    settings without int8_attention, one log line names it and why, and summary.txt says in one
    line how many outputs were made without the kernel. A rerun with nothing else to do starts no
    worker (it would load and compile a model to take nothing where no worker runs the kernel):
    it says so, and how many outputs were made without the kernel, in two lines, and leaves the
    summary; the dry run counts them too. A rerun with work to do on a cluster where a worker
    runs it makes that work and exactly those outputs again, after which every row has the
    settings of what made it, and the remakes count in the rate (not as resumed)."""
    from runner.config import load_config
    from runner.driver.results import fallback_settings_id, settings_id
    args = wan_o3_args(prompts, tmp_path)
    cfg = load_config(args)
    with_kernel, without = settings_id(cfg), fallback_settings_id(cfg)
    assert without is not None and without != with_kernel
    d = tmp_path / "j"

    with caplog.at_level(logging.WARNING, logger="runner"):
        assert Int8Cluster(falls_back={1}).main(args) == 0
    said = [r.getMessage() for r in caplog.records if "int8-attention's kernel" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"worker 1: int8-attention's kernel cannot run "
                                                 f"here ({NO_KERNEL})") and without in said[0]
    table = rows(d)
    by_worker = {w: sorted(r["id"] for r in table if r["worker"] == w) for w in (0, 1)}
    assert by_worker[0] and by_worker[1] and sorted(by_worker[0] + by_worker[1]) == IDS
    for r in table:   # each row: what made it
        assert r["status"] == "ok"
        assert (r["settings"], r["int8_attention"]) == (
            (without, False) if r["worker"] == 1 else (with_kernel, True)), r
    fell_back = by_worker[1]
    line = (f"int8-attention: {len(fell_back)} outputs made without its kernel (worker 1: "
            f"{NO_KERNEL}), recorded under settings {without} (the job's without it); a rerun "
            f"where the kernel runs remakes them")
    assert line in " ".join((d / "summary.txt").read_text().split())   # filled to 100 columns
    assert summary(d)["int8_fallback"]["outputs"] == len(fell_back)

    # nothing else to do: no worker started, on any cluster; the last summary stays
    last = (d / "summary.json").read_text(), (d / "summary.txt").read_text()
    capsys.readouterr()
    c = Int8Cluster(falls_back={1})
    assert c.main(args) == 0 and c.pools == [] and c.generated == []
    again = (f"{len(fell_back)} of them were made without int8-attention's kernel (their workers "
             f"could not run it): a rerun with work to do on a cluster where the kernel runs "
             f"remakes them")
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and said[0].startswith("nothing to do: all 12 prompts already done (")
    assert said[1] == again
    assert ((d / "summary.json").read_text(), (d / "summary.txt").read_text()) == last
    assert job.main(args + ["run.dry_run=true"]) == 0
    assert f"  12 already done\n    {again}\n" in capsys.readouterr().out

    # a row more, on a cluster where worker 0 runs it: that row and exactly the outputs made
    # without the kernel are made, those by worker 0 only
    write_prompts({"prompt": [f"prompt number {i}" for i in range(13)], "id": IDS + ["p12"]})
    c = Int8Cluster(falls_back={1})
    assert c.main(args) == 0
    assert sorted(c.generated) == sorted(fell_back + ["p12"])
    after = {r["id"]: r for r in rows(d)}
    assert sorted(after) == sorted(IDS + ["p12"])
    for r in after.values():
        assert r["status"] == "ok" and r["settings"] == (
            without if r["worker"] == 1 else with_kernel), r
    assert all(after[i]["worker"] == 0 for i in fell_back)
    s = summary(d)
    assert (s["ok"], s["resumed"]) == (13, 12 - len(fell_back))
    assert s["items_per_s"] == pytest.approx((len(fell_back) + 1) / s["generate_s"])
    made_without = [i for i, r in after.items() if r["settings"] == without]    # p12, if worker 1
    assert s["int8_fallback"]["outputs"] == len(made_without)
    assert ("int8-attention: " in (d / "summary.txt").read_text()) == bool(made_without)


def test_a_remake_that_fails_keeps_the_output_made_without_the_kernel(
        prompts, tmp_path, write_prompts, caplog):
    """A rerun (a row more to do) where worker 0 runs the kernel: the remake of one output made
    without it fails (a NaN). That output is done already: its ok row and file stay (the summary
    counts no failure, the job exits 0), one log line names it and why, and it counts as done by
    an earlier run; the remakes that succeeded count as this run's work, in a positive rate."""
    args = wan_o3_args(prompts, tmp_path)
    d = tmp_path / "j"
    assert Int8Cluster(falls_back={1}).main(args) == 0
    before = {r["id"]: r for r in rows(d)}
    fell = sorted(i for i, r in before.items() if r["int8_attention"] is False)
    assert len(fell) > 1
    media = (d / before[fell[0]]["output"]).read_bytes()

    write_prompts({"prompt": [f"prompt number {i}" for i in range(13)], "id": IDS + ["p12"]})
    c = Int8Cluster(falls_back={1}, fate=lambda it: "fail:FloatingPointError: not finite"
                    if it.id == fell[0] else "ok")
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(args) == 0
    assert sorted(c.generated) == sorted(fell + ["p12"])
    after = {r["id"]: r for r in rows(d)}
    assert after[fell[0]] == before[fell[0]]          # the ok row made without the kernel
    assert (d / after[fell[0]]["output"]).read_bytes() == media
    assert all(after[i]["int8_attention"] is True for i in fell[1:])
    said = [r.getMessage() for r in caplog.records if "remaking" in r.getMessage()]
    assert said == [f"remaking {fell[0]} with int8-attention's kernel failed (FloatingPointError: "
                    f"not finite): its output made without the kernel stays"]
    s = summary(d)
    assert (s["ok"], s["failed"], s["resumed"]) == (13, 0, 12 - (len(fell) - 1))
    assert s["items_per_s"] == pytest.approx(len(fell) / s["generate_s"]) and s["items_per_s"] > 0
    assert s["int8_fallback"]["outputs"] >= 1        # fell[0] (and p12 if worker 1 made it)

    # the next rerun with work to do remakes it
    write_prompts({"prompt": [f"prompt number {i}" for i in range(14)],
                   "id": IDS + ["p12", "p13"]})
    c = Int8Cluster(falls_back={1})
    assert c.main(args) == 0 and fell[0] in c.generated
    assert {r["id"]: r for r in rows(d)}[fell[0]]["int8_attention"] is True


# -- Found by review: two lossy compile modes that made different outputs shared one settings id

def _settings(preset: str, mode: str):
    from omegaconf import OmegaConf
    return OmegaConf.create({"model": {"preset": preset, "source": "random", "path": None,
                                       "dtype": "float16", "mask_feature": True},
                             "output": {"fps": 16}, "compile": {"mode": mode},
                             "generation": {"seed": 0}})


@pytest.mark.parametrize("preset, a, b", [
    # Wan: int8-attention alone (SDPA-exact Linears) vs O3 (its Linears in FP8 too)
    ("wan21_t2v_1_3b", "int8-attention", "O3"),
    # PixArt: int8-attention does not apply (eager-equal outputs) vs FP8 Linears
    ("pixart_alpha_1024", "int8-attention", "low-precision"),
])
def test_lossy_modes_that_make_different_outputs_have_different_settings(preset, a, b):
    from runner.driver.results import fallback_settings_id, fingerprint, settings_id
    assert settings_id(_settings(preset, a)) != settings_id(_settings(preset, b))
    assert fingerprint(_settings(preset, a)) != fingerprint(_settings(preset, b))
    # a worker without the kernel under int8-attention alone makes SDPA outputs without FP8
    # Linears: not the outputs of `low-precision` alone
    if preset.startswith("wan"):
        assert fallback_settings_id(_settings(preset, a)) != \
            settings_id(_settings(preset, "low-precision"))


def test_settings_ids_of_existing_directories_are_unchanged():
    """The fix adds a key only where low-precision is off in a lossy mode: every other id stays."""
    from runner.driver.results import settings_id
    o3_no_int8 = "cudagraphs:cache-all:max-optimize:low-precision"
    for preset in ("wan21_t2v_1_3b", "pixart_alpha_1024"):
        for mode in ("none", "O2", "O3", o3_no_int8, "low-precision"):
            assert "low_precision" not in _output(preset, mode), (preset, mode)
    assert settings_id(_settings("pixart_alpha_1024", "O3")) == \
        settings_id(_settings("pixart_alpha_1024", o3_no_int8))


def _output(preset, mode):
    from runner.driver.results import _output_settings
    return _output_settings(_settings(preset, mode))


def test_a_rerun_with_fp8_linears_does_not_skip_outputs_made_without_them(
        prompts, tmp_path, capsys):
    """A Wan job made with compile.mode=int8-attention, rerun into its directory with O3 (FP8
    Linears on top): before the fix the fingerprint and every row's settings matched, so the
    rerun said "nothing to do" and kept 12 outputs made without FP8 as O3's. Now it is refused
    before any worker starts (exit 2), naming the mode change."""
    first = wan_o3_args(prompts, tmp_path, "compile.mode=int8-attention")
    assert Int8Cluster().main(first) == 0
    assert all(r["status"] == "ok" for r in rows(tmp_path / "j"))
    capsys.readouterr()
    c = Int8Cluster()
    assert c.main(wan_o3_args(prompts, tmp_path)) == 2
    assert c.generated == [] and c.pools == []
    err = capsys.readouterr().err
    assert "holds results of a different config" in err and "compile.mode" in err, err


# -- Found by review: a remake whose worker then failed its canary was recorded as the old ok row

class ReorderedInt8Cluster(Int8Cluster):
    """Files take as long to write as an item to generate (`write_s` = `item_s`), so a shard's
    rows and the canary queued behind its GPU work are done at the same moment, and the pool's
    `wait` returns done futures last first: `Pool.wait` promises no order (Ray's does not
    either), and on Ray the canary's verdict can be read while its shard's files are still
    being written. The dispatcher then finds that shard done when the canary fails
    (`Dispatcher._canary_failed`: "rows done by then go to `on_rows` as suspect")."""

    def __call__(self, j, limits):
        pool = super().__call__(j, limits)
        pool.write_s = self.item_s
        wait = pool.wait
        pool.wait = lambda futures, timeout: list(reversed(wait(futures, timeout)))
        return pool


def test_a_remake_made_by_a_worker_that_then_fails_its_canary_is_suspect(
        prompts, tmp_path, write_prompts, caplog):
    """Run 1: every output made without int8-attention's kernel. Run 2 (a row more, one worker
    that runs the kernel, a canary every 4 items): the worker makes p12, then remakes p00-p02
    (their files replaced), then fails its canary. p00-p02 come back through the canary's
    "done by now" path, as suspect rows; `JobRun._kept` took them for failed remakes and dropped
    them, so the record kept the old ok rows (settings without the kernel) for files a worker
    in doubt had just rewritten: reported ok, and skipped by every later rerun."""
    args = wan_o3_args(prompts, tmp_path, "ray.cpu_workers=1")
    d = tmp_path / "j"
    assert Int8Cluster(falls_back={0}).main(args) == 0
    assert all(r["int8_attention"] is False for r in rows(d))

    write_prompts({"prompt": [f"prompt number {i}" for i in range(13)], "id": IDS + ["p12"]})
    c = ReorderedInt8Cluster(drift={0: 1})
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(args + ["run.canary_every_items=4"]) == 1
    assert c.generated[:4] == ["p12", "p00", "p01", "p02"]
    after = {r["id"]: r for r in rows(d)}
    assert [after[i]["status"] for i in ("p12", "p00", "p01", "p02")] == ["suspect"] * 4, \
        {i: after[i]["status"] for i in after}
    assert "remaking p00" not in caplog.text        # not a failed remake: its file was replaced
    # the counts agree with the table: 9 ok (remade by the replacement), 4 suspect, none of the
    # 12 outputs of the earlier run kept as it was (each was remade, 3 of them in doubt)
    s = json.loads((d / "summary.json").read_text())
    assert (s["ok"], s["suspect"], s["resumed"]) == (9, 4, 0), s

    # the next rerun regenerates exactly them
    c = Int8Cluster()
    assert c.main(args) == 0
    assert sorted(c.generated) == ["p00", "p01", "p02", "p12"]
    assert all(r["status"] == "ok" for r in rows(d))


# -- issue 60's smaller items ---------------------------------------------------------------------

def test_a_long_cause_is_whole_in_the_summary_and_a_longer_one_is_cut_at_a_word():
    """The summary's cause line of a row that killed its worker without a word (SIGKILL, the
    out-of-memory killer where its count is not read) ended "(SIGSEGV, a CU": cut at 160
    characters. Now the runner's own causes are whole; a longer one is cut at a word, saying so."""
    from runner.driver.results import CAUSE_LEN, error_cause
    death = ("killed its worker 2 times (run.max_row_deaths=2): the worker process ended without an "
             "error of its own: killed (SIGKILL; the kernel's out-of-memory killer does that too) or "
             "crashed (SIGSEGV, a CUDA error)")
    assert error_cause({"id": "x", "error": death + "\nrow 'x' (p.parquet:3)"}) == death
    long = "RuntimeError: " + " ".join(f"word{i:03d}" for i in range(60))
    cut = error_cause({"id": "x", "error": long})
    assert len(cut) <= CAUSE_LEN and cut.endswith(" ...") and long.startswith(cut[:-4] + " ")


def test_an_empty_or_zero_filled_lock_names_no_driver_and_is_taken_over(prompts, tmp_path, caplog):
    """A `.lock` left empty or zero-filled (a power loss before its write reached the disk) was
    "in use by another driver (an unreadable lock file)": no driver to wait for. One that stays
    unreadable past `lock.DAMAGED_S` is taken over, said in one line."""
    d = tmp_path / "j"
    for content in (b"", b"\0" * 64):
        d.mkdir(exist_ok=True)
        (d / ".lock").write_bytes(content)
        old = os.stat(d / ".lock").st_mtime - 60
        os.utime(d / ".lock", (old, old))
        with caplog.at_level(logging.WARNING, logger="runner"):
            assert Cluster().main(job_args(prompts, tmp_path, "output.overwrite=true")) == 0
        assert "names no driver (empty or damaged, 60 s old): taken over" in caplog.text
        assert not (d / ".lock").exists()
        caplog.clear()


def test_long_ids_that_differ_past_the_cut_stay_two_outputs(tmp_path, write_prompts):
    """Ids were cut to 150 characters without a word, so two long ids differing at the end
    (paths, URLs) were refused as "the same id". Now a long id keeps its first characters and a
    hash of the whole: two outputs, each id at most 150 characters."""
    base = "https://example.com/catalogue/" + "a" * 150
    p = write_prompts({"id": [base + "?v=1", base + "?v=2"], "prompt": ["one", "two"]})
    assert Cluster().main(job_args(p, tmp_path)) == 0
    ids = [r["id"] for r in rows(tmp_path / "j")]
    assert len(set(ids)) == 2 and all(len(i) <= 150 for i in ids), ids
    assert sorted(os.listdir(tmp_path / "j" / "media")) == sorted(f"{i}.png" for i in ids)


def test_hidden_parquet_files_in_a_prompts_directory_are_left_out_in_one_line(tmp_path,
                                                                              write_prompts, caplog):
    """A `._prompts.parquet` (macOS metadata beside each file copied to a foreign disk) refused the
    whole directory (not Parquet). Hidden files are left out, said in one line."""
    write_prompts({"id": IDS, "prompt": [f"prompt {i}" for i in IDS]})
    (tmp_path / "._prompts.parquet").write_bytes(b"\0\5\26\7 Mac OS X        ")
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert Cluster().main(job_args(tmp_path, tmp_path / "out")) == 0
    assert "1 hidden .parquet files left out" in caplog.text and "._prompts.parquet" in caplog.text
    assert len(rows(tmp_path / "out" / "j")) == len(IDS)


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_prompts_path_that_is_a_device_or_a_fifo_is_named_as_such(tmp_path, capsys, kind):
    """prompts.path=/dev/zero or a FIFO was "does not exist"; it is said for what it is, exit 2."""
    path = "/dev/zero" if kind == "device" else str(tmp_path / "fifo.parquet")
    if kind == "fifo":
        os.mkfifo(path)
    assert Cluster().main(job_args(path, tmp_path)) == 2
    err = capsys.readouterr().err
    said = "a character device" if kind == "device" else "a FIFO (named pipe)"
    assert f"error: prompts.path {path!r} is {said}, not a Parquet file or a directory" in err, err
    assert "does not exist" not in err


@pytest.mark.parametrize("name", ["media", "records"])
def test_a_file_where_the_job_keeps_a_directory_is_exit_2_before_any_worker(prompts, tmp_path,
                                                                            capsys, name):
    """A regular file named `media` in the job directory passed the checks, then the job stopped
    with exit 3 after starting Ray, without its summary or report. Now exit 2 before any worker,
    naming it."""
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / name).write_text("not a directory")

    def no_pool(*a):
        raise AssertionError("a worker was started")
    assert job.main(job_args(prompts, tmp_path), start_pool=no_pool) == 2
    err = capsys.readouterr().err
    assert f"is a file, where the job keeps its {name}/ directory; move or remove it" in err, err
