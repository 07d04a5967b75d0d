"""The real CLI (`python -m runner`) as a subprocess, on a real embedded local Ray: the demo video
job with its 2 CPU workers (both must serve); the other jobs with one (each worker process costs
~7 CPU-s to start on the 2-core CI machine)."""
import json
import os
import subprocess
import sys

import imageio_ffmpeg
import pyarrow.parquet as pq
import pytest
from conftest import GUARD_S, fault_env
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "jobs", "prompts", "sample.parquet")
pytestmark = pytest.mark.e2e


def runner(*args, timeout=GUARD_S, faults="wait_ready"):
    # wait_ready (tests/faults): no item is generated before both workers are warm. Tiny models
    # finish 8 prompts sooner than a second worker may start, and every check below expects both
    # workers to have served.
    r = subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env=fault_env(faults))
    assert r.returncode == 0, f"runner failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def check_job_dir(job_dir, ext, n_workers=2):
    ids = pq.read_table(SAMPLE).column("id").to_pylist()
    table = pq.read_table(os.path.join(job_dir, "results.parquet")).to_pylist()
    assert sorted(r["id"] for r in table) == sorted(ids)             # one row per prompt
    assert all(r["status"] == "ok" and r["e2e_s"] > 0 and r["denoise_it_s"] > 0 for r in table)
    assert {r["worker"] for r in table} <= set(range(n_workers))
    assert sorted(os.listdir(os.path.join(job_dir, "media"))) == sorted(f"{i}.{ext}" for i in ids)
    for name in ("config.yaml", "summary.json", "summary.txt"):
        assert os.path.isfile(os.path.join(job_dir, name))
    assert sorted(os.listdir(os.path.join(job_dir, "metrics"))) == [
        f"worker-{k}.json" for k in range(n_workers)]
    metrics = [json.load(open(os.path.join(job_dir, "metrics", f"worker-{k}.json")))
               for k in range(n_workers)]
    assert sum(m["items"] for m in metrics) == len(ids)
    for m in metrics:
        for key in ("model_load_s", "warmup_s", "busy_fraction", "e2e_mean_s", "e2e_p95_s",
                    "steady_it_s", "gpu_ms_per_item", "gpu_util"):
            assert key in m
    summary = json.load(open(os.path.join(job_dir, "summary.json")))
    assert summary["ok"] == len(ids) and summary["failed"] == 0 and summary["workers"] == n_workers
    leftovers = [f for _, _, fs in os.walk(job_dir) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []
    return table


def test_demo_video_writes_playable_mp4s(tmp_path):
    r = runner("job=demo_video", f"output.dir={tmp_path}")
    assert "8/8 ok" in r.stdout
    job_dir = tmp_path / "demo_video"
    table = check_job_dir(job_dir, "mp4")
    assert all(r["num_frames"] == 4 for r in table)
    for row in table:
        reader = imageio_ffmpeg.read_frames(str(job_dir / row["output"]))
        meta = next(reader)
        frames = list(reader)
        assert meta["size"] == (64, 64) and meta["fps"] == 8 and len(frames) == 4
        assert meta["codec"].startswith("h264")
    cfg = OmegaConf.load(job_dir / "config.yaml")              # the resolved config is saved
    assert cfg.model.preset == "latte1" and cfg.generation.num_frames == 4
    # (an item's frames do not depend on its batch-mates: in-process, test_worker.py's
    # test_an_items_output_does_not_depend_on_its_batch_or_shard_mates, without a second job here)


def test_wan_job_tiny_model_writes_mp4s_of_4k_plus_1_frames(tmp_path):
    """The shipped Wan 2.1 job with the tiny model: its family came in as one module (and presets);
    with step reuse (`residual`, its guidance branches as separate calls: tests/test_step_reuse.py)."""
    r = runner("job=wan_batch", "model.source=tiny", f"output.dir={tmp_path}", "generation.height=64",
               "generation.width=48", "generation.num_frames=5", "generation.num_inference_steps=4",
               "step_cache.method=residual", "step_cache.compute_ratio=0.5",
               "ray.cpu_workers=1", "run.shard_size=2", faults="")
    assert "8/8 ok" in r.stdout
    job_dir = tmp_path / "wan_batch"
    m = json.load(open(job_dir / "metrics" / "worker-0.json"))
    assert m["step_cache_reused"] >= 8 * 2       # every video reused a step, in both branches
    for row in check_job_dir(job_dir, "mp4", n_workers=1):
        reader = imageio_ffmpeg.read_frames(str(job_dir / row["output"]))
        meta = next(reader)
        assert meta["size"] == (48, 64) and meta["fps"] == 16 and len(list(reader)) == 5


# The demo image job with command-line overrides (size, batch size, job name) and the outputs
# checked as above: tests/test_ux.py, on the one CLI run that also checks the console.


def test_pretrained_job_from_a_saved_directory(tmp_path):
    from runner.models import ModelSpec, build_pipeline
    build_pipeline(ModelSpec("sd21", source="tiny")).save_pretrained(tmp_path / "sd21-tiny")
    runner("job=sd2_batch", f"model.path={tmp_path / 'sd21-tiny'}", "model.local_files_only=true",
           "model.device=cpu", "generation.height=64", "generation.width=64",
           "generation.num_inference_steps=2", f"output.dir={tmp_path}", "ray.num_workers=1",
           faults="")
    check_job_dir(tmp_path / "sd2_batch", "png", n_workers=1)
