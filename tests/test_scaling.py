"""`python -m runner.bench.scaling` end to end on CPU: one real job per worker count, table, JSON, plots."""
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import GUARD_S, fault_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.e2e


def session_ray() -> list[str]:
    """The session's Ray cluster for the bench's jobs (a job option, as a user may pass one): each
    job's own local Ray costs ~15 CPU-s to start on the 2-core CI machine; the bench's default, its
    own local Ray per run, is what RUNNER_TEST_RAY=local tests."""
    return [f"ray.address={os.environ['RAY_ADDRESS']}"] if os.environ.get("RAY_ADDRESS") else []


def test_weak_scaling_runs_each_worker_count_with_its_own_prompts(tmp_path):
    # 1+2: both jobs at once (on a GPU machine, each on its own GPUs)
    out = tmp_path / "scaling"
    r = subprocess.run([sys.executable, "-m", "runner.bench.scaling", "job=demo_image", "workers=1+2",
                        "prompts_per_worker=3", f"out={out}", "ray.cpu_workers=2", "model.device=cpu",
                        *session_ray()],
                       cwd=ROOT,
                       capture_output=True, text=True, timeout=GUARD_S,
                       env=fault_env("wait_ready"))   # every worker of each job serves
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.load(open(out / "scaling.json"))["rows"]
    assert [(x["workers"], x["prompts"], x["ok"], x["alongside"]) for x in rows] == [
        (1, 3, 3, [2]), (2, 6, 6, [1])]
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] > 0
    # the whole span, start-up included: the job's length and its rate against N x one worker's
    assert rows[0]["span_efficiency"] == 1.0 and rows[1]["span_efficiency"] > 0
    for x in rows:
        assert x["span_s"] >= x["generate_s"] > 0 and x["span_s"] >= x["first_ready_s"]
        assert x["span_items_per_s"] == pytest.approx(x["ok"] / x["span_s"])
        assert x["span_items_per_s"] <= x["items_per_s"]
        # NVML utilisation per rank: null off a GPU
        assert x["gpu_util"] == [None] * x["workers"] and len(x["worker_it_s"]) == x["workers"]
        # the driver's CPU per shard handed out (demo_image's shards: 2 rows)
        assert x["shards"] >= -(-x["prompts"] // 2)
        assert x["driver_cpu_s"] > 0 and x["driver_cpu_s_per_shard"] == pytest.approx(
            x["driver_cpu_s"] / x["shards"])
        assert 0 <= x["serve_cpu_s_per_shard"] <= x["driver_cpu_s_per_shard"]
        assert (x["compiled"], x["loaded"]) == (0, 0)   # demo_image runs eager: neither
    assert rows[0]["ready_ratio"] == 1.0 and all(x["base_workers"] == 1 for x in rows)
    # (the 2-worker run's ready_ratio needs both workers ready before its last item: timing-bound)
    assert rows[1].get("ready_ratio") is None or rows[1]["ready_ratio"] > 0
    # each run is a complete job of its own, on its own prompt file
    assert pq.read_table(out / "w2" / "results.parquet").num_rows == 6
    assert len(os.listdir(out / "w2" / "metrics")) == 2
    svg = (out / "scaling.svg").read_text()            # matplotlib: axis ticks and a legend
    assert "<svg" in svg and 'id="xtick_1"' in svg and 'id="legend_1"' in svg
    assert (out / "scaling.png").read_bytes().startswith(b"\x89PNG")
    bars = (out / "scaling.txt").read_text().splitlines()[1:]
    assert [b.split()[0] for b in bars] == ["1", "1", "2", "2"] and all("|" in b for b in bars)
    # replot: the table and plots again from scaling.json, without running anything
    (out / "scaling.txt").unlink()
    r2 = subprocess.run([sys.executable, "-m", "runner.bench.scaling", f"replot={out}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert r2.returncode == 0 and (out / "scaling.txt").exists() and "steady_efficiency" in r2.stdout
    header = [l for l in r.stdout.splitlines() if l.startswith("workers ")][-1]
    assert "efficiency" in header and "warmup_with_cache_s" in header
    for col in ("span_s", "span_items_per_s", "span_efficiency", "gpu_util", "shards",
                "driver_cpu_s_per_shard", "serve_cpu_s_per_shard"):
        assert col in header.split()


def test_prompt_list_must_match_worker_counts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "runner.bench.scaling", "job=demo_image", "workers=1,2,4",
                        "prompts=8,16", f"out={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "one per worker count [1, 2, 4]" in r.stderr


def test_worker_groups_get_disjoint_gpus(monkeypatch):
    import torch
    from runner.bench.scaling import _gpu_slices, _plan
    assert _plan("1,2,4") == [[1], [2], [4]] and _plan("1+2+4,8") == [[1, 2, 4], [8]]
    with pytest.raises(SystemExit, match="worker counts"):
        _plan("1,two")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _gpu_slices([1, 2, 4]) == ["0", "1,2", "3,4,5,6"]
    assert _gpu_slices([8]) == [None] and _gpu_slices([1, 2], cpu=True) == [None, None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2,3")   # slices of what we may use
    assert _gpu_slices([1, 2, 4]) == ["4", "5,6", "7,0,1,2"]
    with pytest.raises(SystemExit, match="needs 12 GPUs, this machine has 8"):
        _gpu_slices([4, 8])


def test_plots_survive_runs_without_throughput(tmp_path):
    from runner.bench.scaling import _summarize
    rows = [dict(workers=1, items_per_s=None, steady_items_per_s=None, all_ready_s=None),
            dict(workers=2, items_per_s=0.0, steady_items_per_s=None, all_ready_s=5.0)]
    _summarize(rows, [], str(tmp_path))          # every item failed: nothing to divide by
    assert (tmp_path / "scaling.svg").exists() and (tmp_path / "scaling.png").exists()
    assert "efficiency" not in rows[1]
    rows[0].update(items_per_s=1.0, all_ready_s=4.0, span_items_per_s=0.5)
    rows[1].update(items_per_s=1.5, span_items_per_s=0.6)
    _summarize(rows, [], str(tmp_path))
    assert rows[1]["efficiency"] == 0.75 and rows[1]["ready_ratio"] == 1.25
    assert rows[1]["span_efficiency"] == pytest.approx(0.6)


def test_a_scaling_json_from_before_the_span_gets_it_from_its_parts():
    from runner.bench.scaling import _backfill_span
    old = {"workers": 2, "ok": 8, "first_ready_s": 3.0, "generate_s": 1.0}
    _backfill_span(old)
    assert old["span_s"] == 4.0 and old["span_items_per_s"] == 2.0
