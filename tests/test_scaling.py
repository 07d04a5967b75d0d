"""`python -m runner.scaling` end to end on CPU: one real job per worker count, table, JSON, plot."""
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.e2e


def test_weak_scaling_runs_each_worker_count_with_its_own_prompts(tmp_path):
    out = tmp_path / "scaling"
    r = subprocess.run([sys.executable, "-m", "runner.scaling", "job=demo_image", "workers=1,2",
                        "prompts_per_worker=3", f"out={out}", "ray.cpu_workers=2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=400,
                       env={**os.environ, "RUNNER_FAULTS": "slow:0.5"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.load(open(out / "scaling.json"))["rows"]
    assert [(x["workers"], x["prompts"], x["ok"]) for x in rows] == [(1, 3, 3), (2, 6, 6)]
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] > 0
    # each run is a complete job of its own, on its own prompt file
    assert pq.read_table(out / "w2" / "results.parquet").num_rows == 6
    assert len(os.listdir(out / "w2" / "metrics")) == 2
    svg = (out / "scaling.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<circle") == 2
    header = [l for l in r.stdout.splitlines() if l.startswith("workers ")][-1]
    assert "efficiency" in header and "warmup_with_cache_s" in header


def test_prompt_list_must_match_worker_counts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "runner.scaling", "job=demo_image", "workers=1,2,4",
                        "prompts=8,16", f"out={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "one per worker count [1, 2, 4]" in r.stderr
