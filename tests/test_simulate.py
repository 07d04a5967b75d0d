"""`runner.bench.simulate`: its simulated pool's accounting (virtual clock, in-process), its
simulated elastic cluster and an elastic run against the fixed pool (the real job, in-process),
and the bench end to end on small numbers (its child processes, table, JSON and plot)."""
import json
import os
import subprocess
import sys

import pytest

from runner.driver import job
from runner.bench.simulate import SimCluster, SimPool, VirtualClock, elastic_run, write_prompts
from runner.driver.dispatch import NodeLost
from runner.io.prompts import Item

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


def test_the_simulated_cluster_places_workers_and_loses_them_with_their_nodes():
    """Two 1-GPU nodes arriving at 5 and 10 s: a place each once there; a preempted node's worker
    fails with NodeLost and the view reports the node dead; its replacement comes `replace_s`
    later only while the driver still wants the GPUs."""
    clock = VirtualClock(start=0.0)
    pool = SimPool(1, 1.0, clock, jitter=0.0, startup_s=(1.0, 1.0))
    c = SimCluster(pool, 2, arrive_s=10.0, replace_s=20.0)
    assert c.poll().places == []
    pool.wait([], timeout=5.0)
    (node,) = c.poll().places
    w, warm = pool.start(0, node)
    assert pool.wait([warm], timeout=5) == [warm] and pool.result(warm)["node_id"] == node
    assert c.poll().places == [] and c.poll().gpus == 1
    c.want(2)
    c._kill(c.nodes[node], clock.now, "preempted")
    _, finished = pool.submit(w, 0, items(1))
    assert pool.wait([finished], timeout=1) == [finished]
    with pytest.raises(NodeLost):
        pool.result(finished)
    assert node in c.poll().dead and c.workers_lost == 1
    pool.wait([], timeout=30.0)                     # the second node at 10 s, the new one at 26 s
    assert len(c.poll().places) == 2 and c.replaced == 1


def test_an_elastic_run_loses_no_row_and_stays_near_the_fixed_pool(tmp_path, monkeypatch):
    """The acceptance point on small numbers (the record runs 1,000 GPUs and 1M rows): 50 GPUs
    arriving over 60 s, each node preempted at 600 % an hour (half drained for 60 s first), 20k
    rows on the virtual clock, the real job: every row exactly once, no preempted worker's loss
    charged, the span within 10 % of the fixed pool with the same arrival."""
    monkeypatch.setattr(job, "STOPS", [])
    write_prompts(str(tmp_path / "p.parquet"), 20_000)
    o = dict(gpus="50", gpus_per_node="1", prompts="20000", item_s="0.5", arrive_s="60",
             preempt_per_h="6", drain_fraction="0.5", drain_s="60", replace_s="30",
             startup_s="10:40", jitter="0.2", shard_size="8", seed="0",
             prompts_file=str(tmp_path / "p.parquet"))
    el = elastic_run({**o, "job_dir": str(tmp_path / "el")}, "elastic")
    fixed = elastic_run({**o, "job_dir": str(tmp_path / "fixed")}, "fixed")
    for r in (el, fixed):
        assert r["status"] == 0 and r["rows_ok"] == r["rows_in_results"] == 20_000
        assert r["rows_lost"] == 0 and r["rows_duplicated"] == 0
    assert el["kills"] >= 2 and el["drains"] >= 2 and el["workers_lost_with_nodes"] >= 2
    assert el["losses"] == el["losses_node"] >= el["workers_lost_with_nodes"]
    assert el["losses_charged"] == el["preempted_charged"] == 0 and el["rows_back"] > 0
    assert el["replaced"] >= 1 and el["workers_started"] > 50
    assert fixed["workers_started"] == 50 and fixed["losses"] == 0
    assert el["span_s"] <= 1.10 * fixed["span_s"]


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
