"""`python -m runner.vs_loop` end to end on CPU: the plain diffusers loops and the job, one table."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.e2e


def test_loops_and_job_on_the_same_prompts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "runner.vs_loop", "job=demo_image", "prompts=3",
                        "modes=none", f"out={tmp_path}", "arms=loop,job", "ray.cpu_workers=1",
                        "generation.height=64", "generation.width=64",
                        "generation.num_inference_steps=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.load(open(tmp_path / "vs_loop.json"))["rows"]
    assert [(x["arm"], x["mode"], x["items"]) for x in rows] == [("loop", "eager", 3), ("job", "none", 3)]
    assert all(x["items_per_s"] > 0 for x in rows)
    assert rows[0]["x_loop"] == 1.0 and rows[1]["x_loop"] > 0        # ratios against the loop
    assert rows[1]["time_s"]["denoise"] > 0 and rows[0]["gpu_util"] is None   # CPU: no GPU figures
    assert sorted(os.listdir(tmp_path / "loop")) == ["v00000.png", "v00001.png", "v00002.png"]
    assert "items_per_s" in r.stdout                                   # the table is printed
