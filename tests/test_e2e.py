"""The real CLI (`python -m runner`) as a subprocess, on Ray: the demo video job with its 2 CPU
workers (both must serve), its outputs and its report in Chromium. The job's rules are tested
without Ray in test_jobrun.py; each CLI job costs ~15-25 CPU-s on the 2-core CI machine."""
import json
import os

import imageio_ffmpeg
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "jobs", "prompts", "sample.parquet")
pytestmark = pytest.mark.e2e


def check_job_dir(job_dir, ext, n_workers=2, ids=None, failed=()):
    """One row per prompt (ok but `failed`), one media file per ok row, the driver's files, each
    worker's metrics, the summary; no temporary file left."""
    ids = ids or pq.read_table(SAMPLE).column("id").to_pylist()
    table = pq.read_table(os.path.join(job_dir, "results.parquet")).to_pylist()
    assert sorted(r["id"] for r in table) == sorted(ids)             # one row per prompt
    ok = [r for r in table if r["id"] not in failed]
    assert all(r["status"] == "ok" and r["e2e_s"] > 0 and r["denoise_it_s"] > 0 for r in ok)
    assert all(r["status"] == "failed" for r in table if r["id"] in failed)
    assert {r["worker"] for r in table} <= set(range(n_workers))
    assert sorted(os.listdir(os.path.join(job_dir, "media"))) == sorted(f"{r['id']}.{ext}" for r in ok)
    for name in ("config.yaml", "summary.json", "summary.txt"):
        assert os.path.isfile(os.path.join(job_dir, name))
    assert sorted(os.listdir(os.path.join(job_dir, "metrics"))) == [
        f"worker-{k}.json" for k in range(n_workers)]
    metrics = [json.load(open(os.path.join(job_dir, "metrics", f"worker-{k}.json")))
               for k in range(n_workers)]
    assert sum(m["items"] for m in metrics) == len(ok)
    for m in metrics:
        for key in ("model_load_s", "warmup_s", "busy_fraction", "e2e_mean_s", "e2e_p95_s",
                    "steady_it_s", "gpu_ms_per_item", "gpu_util"):
            assert key in m
    summary = json.load(open(os.path.join(job_dir, "summary.json")))
    assert summary["ok"] == len(ok) and summary["failed"] == len(failed)
    assert summary["workers"] == n_workers
    leftovers = [f for _, _, fs in os.walk(job_dir) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []
    return table


def test_demo_video_on_two_workers_writes_playable_mp4s_and_a_report_chromium_renders(tmp_path):
    """The README's demo video job on real Ray with its 2 CPU workers (both serve: wait_ready), on 4
    prompts of which one fails (its output NaN, tests/faults): playable mp4s, the record, each
    worker's metrics, the summary, and report.html with animated previews in headless Chromium."""
    from test_report import IDS, check_page, check_video_previews, render, run_job
    job_dir, r = run_job(tmp_path, "demo_video", "ray.cpu_workers=2", faults="nan:broken,wait_ready")
    assert "3/4 ok" in r.stdout
    table = check_job_dir(job_dir, "mp4", ids=IDS, failed={"broken"})
    assert all(row["num_frames"] == 4 for row in table)
    for row in table:
        if row["status"] != "ok":
            continue
        reader = imageio_ffmpeg.read_frames(str(job_dir / row["output"]))
        meta = next(reader)
        frames = list(reader)
        assert meta["size"] == (64, 64) and meta["fps"] == 8 and len(frames) == 4
        assert meta["codec"].startswith("h264")
    cfg = OmegaConf.load(job_dir / "config.yaml")              # the resolved config is saved
    assert cfg.model.preset == "latte1" and cfg.generation.num_frames == 4
    dom = render(job_dir, tmp_path)
    check_page(job_dir, dom)
    check_video_previews(job_dir, dom)
    # (an item's frames do not depend on its batch-mates: in-process, test_worker.py's
    # test_an_items_output_does_not_depend_on_its_batch_or_shard_mates, without a second job here)


# The demo image job with command-line overrides (size, batch size, job name) and the outputs
# checked as above: tests/test_ux.py, on the one CLI run that also checks the console. The Wan and
# SD 2.1 jobs (a tiny model; a pretrained one from a saved directory): their workers in-process,
# test_worker.py's test_the_wan_job_... and test_a_pretrained_job_from_a_saved_directory.
