"""`runner.bench.simulate`: its simulated pool's accounting (virtual clock, in-process) and the bench
end to end on small numbers (its child processes, table, JSON and plot)."""
import json
import os
import subprocess
import sys

import pytest

from runner.bench.simulate import SimPool, VirtualClock
from runner.prompts import Item

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def items(n, first=0):
    return [Item(id=f"p{i}", prompt="a", negative_prompt="", seed=i, height=64, width=64,
                 num_frames=None, num_inference_steps=2, guidance_scale=4.5, file="f", row=i)
            for i in range(first, first + n)]


def test_the_pool_times_each_worker_and_counts_its_waiting_for_work():
    """A worker ready at 5 s takes 1 s per item: a shard of 2 submitted at 8 s starts then (3 s
    idle), its rows come 0.05 s after its GPU work; one queued behind it starts without a gap."""
    clock = VirtualClock(start=0.0)
    pool = SimPool(1, 1.0, clock, jitter=0.0, startup_s=(5.0, 5.0))
    w, warm = pool.start(0)
    assert pool.wait([warm], timeout=10) == [warm] and clock.now == 5.0
    assert pool.result(warm)["warmup_s"] == 5.0
    clock.sleep(3.0)
    started, finished = pool.submit(w, 0, items(2))
    _, finished2 = pool.submit(w, 1, items(1, first=2))
    assert pool.wait([finished], timeout=10) == [finished] and clock.now == pytest.approx(10.05)
    rows = pool.result(finished)
    assert [(r["id"], r["started_at"], r["e2e_s"]) for r in rows] == [
        ("p0", 8.0, pytest.approx(1.05)), ("p1", 9.0, pytest.approx(1.05))]
    assert pool.wait([started], timeout=0) == [started] and pool.result(started) == 2
    assert pool.wait([finished2], timeout=10) == [finished2] and clock.now == pytest.approx(11.05)
    ready_s, idle_s = pool.worker_seconds()
    assert ready_s == pytest.approx(6.05) and idle_s == pytest.approx(3.05)   # 3 s, then 0.05 s now
    assert (pool.rows_delivered, pool.shards_delivered) == (3, 2)
    pool.kill(w)
    assert pool.submit(w, 2, items(1))[1].state == "pending"        # lost at the next wait
    assert pool.worker_seconds() == (pytest.approx(6.05), pytest.approx(3.05))   # dead: frozen


def test_random_deaths_lose_the_workers_calls_and_are_counted():
    clock = VirtualClock(start=0.0)
    pool = SimPool(4, 1.0, clock, jitter=0.0, startup_s=(1.0, 1.0), deaths_per_min=600.0,
                   shard_size=2, seed=3)
    assert pool.death_p == pytest.approx(600 / 60 * 2 * 1.0 / 4)      # 5 per shard: capped at 1
    w, warm = pool.start(0)
    pool.wait([warm], timeout=5)
    started, finished = pool.submit(w, 0, items(2))
    assert pool.wait([finished], timeout=10) == [finished] and finished.state == "lost"
    assert w.dead_at is not None and started.state == "lost"


@pytest.mark.e2e
def test_the_bench_end_to_end_on_small_numbers(tmp_path):
    """The main point (run 1, snapshot, media, resumed run 2) and one sweep point, each a child
    process of the real job over a SimPool on the real clock: figures, JSON, table and plot."""
    r = subprocess.run([sys.executable, "-m", "runner.bench.simulate", "workers=20", "prompts=4000",
                        "item_s=0.05", "duration_s=3", "settle_s=1", "startup_s=0.5:1",
                        "resume_s=1", "deaths_per_min=0", "sweep=10:4000", "sweep_s=2",
                        f"out={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "simulate.json").read_text())["rows"]
    main, point = rows
    assert (main["workers"], main["prompts"], point["workers"]) == (20, 4000, 10)
    for row in rows:
        assert row["status"] == 143 and 2 < row["window_s"] < 10       # stopped by SIGTERM
        assert 0 < row["items_per_s"] <= row["demand_items_per_s"] * 1.25   # jitter +-20 %
        assert 0 <= row["idle_fraction"] <= 1 and row["cpu_ms_per_item"] > 0
        assert row["plan_s"] > 0 and row["peak_rss_mb"] > 50 and row["record_bytes_per_row"] > 100
        assert row["snapshot_s"] > 0 and row["report_s"] > 0
    assert main["media_files"] == main["record_rows"] > 0 and main["resume_status"] == 143
    assert main["resume_plan_s"] > 0
    assert (tmp_path / "simulate.png").stat().st_size > 10_000
    assert "items_per_s" in r.stdout and "cpu_ms_per_item" in r.stdout       # the table
    assert not [d for d in os.listdir(tmp_path) if d.startswith("job-") and not d.endswith(".log")]
