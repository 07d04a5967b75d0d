"""report.html: rendered in headless Chromium after a real CPU job (e2e), and its parts without Ray.

Chromium is Debian's `chromium` package (`.ci/run` installs it); without it the e2e tests fail
saying so, they do not skip."""
import logging
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import imageio.v3 as iio
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import GUARD_S, fault_env, full_disk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = ["red-fox", "cat-window", "broken", "river"]


def job_args(tmp_path, job):
    """4 prompts, of which `broken` fails (its output is not finite)."""
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": IDS, "seed": [1, 2, 3, 4],
                             "prompt": ["a red fox in fresh snow at dawn", "a cat at a window",
                                        "this one fails " * 20, "a river through a forest"]}), prompts)
    return [f"job={job}", f"prompts.path={prompts}", f"output.dir={tmp_path}", "job.name=j",
            "ray.cpu_workers=1", "generation.height=64", "generation.width=64",
            "generation.num_inference_steps=2"]


def run_job(tmp_path, job, *args, faults="nan:broken"):
    """The real CLI on Ray (tests/faults makes `broken`'s output NaN): exit 1, one item failed."""
    r = subprocess.run([sys.executable, "-m", "runner", *job_args(tmp_path, job), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S,
                       env=fault_env(faults))
    assert r.returncode == 1, f"runner ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert "report.html not written" not in r.stderr, r.stderr[-5000:]
    return tmp_path / "j", r


def chromium(page, tmp_path, *flags) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium not found: install Debian's `chromium` package "
                    "(apt-get install -y chromium; .ci/run does it)")
    # Own profile directory: Chromium instances of parallel test runs must not share one.
    r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1200,1600",
                        *flags, page.as_uri()], capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


class Dom(HTMLParser):
    """Gallery entries (figure.item) and images of the DOM Chromium dumps."""

    def __init__(self, html):
        super().__init__()
        self.items, self.imgs, self.links = [], [], []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure" and "item" in (a.get("class") or "").split():
            self.items.append(a)
        if tag == "img":
            self.imgs.append(a.get("src"))
        if tag == "a":
            self.links.append(a.get("href"))


def render(job_dir, tmp_path):
    """Screenshot (must not be blank) and the DOM, as Chromium sees the page."""
    page = job_dir / "report.html"
    shot = tmp_path / "report.png"
    chromium(page, tmp_path, f"--screenshot={shot}")
    pixels = iio.imread(shot)
    assert pixels.shape[:2] == (1600, 1200) and pixels[..., :3].std() > 20, "blank screenshot"
    return Dom(chromium(page, tmp_path, "--dump-dom").stdout)


def check_page(job_dir, dom):
    assert sorted(i["id"] for i in dom.items) == sorted(f"item-{i}" for i in IDS)   # one per output
    failed = [i for i in dom.items if "failed" in i["class"]]
    assert [i["id"] for i in failed] == ["item-broken"]
    for plot in ("report/throughput.png", "report/workers.png"):
        assert plot in dom.imgs and (job_dir / plot).stat().st_size > 1000
    for src in dom.imgs:                                      # nothing on the page is missing
        assert (job_dir / src).is_file(), src
    html = (job_dir / "report.html").read_text()
    assert "FloatingPointError" in html and "Resolved config" in html and "seed 2" in html


def test_image_job_report_renders_in_chromium(tmp_path, capsys):
    """The job on a simulated pool (its media: small real PNGs; `broken` a failed row), the report
    rewritten after every shard while it runs (results_every_s=0), then rendered by Chromium. The
    video job's report, from the real CLI: test_e2e.py."""
    from test_jobrun import Cluster
    broken = "fail:FloatingPointError: non-finite values in the output of 'broken'"
    c = Cluster(lambda it: broken if it.id == "broken" else "ok")
    assert c.main(job_args(tmp_path, "demo_image") + ["output.results_every_s=0"]) == 1
    assert "report.html not written" not in capsys.readouterr().err
    job_dir = tmp_path / "j"
    dom = render(job_dir, tmp_path)
    check_page(job_dir, dom)
    for i in ("red-fox", "cat-window", "river"):
        assert f"report/thumbs/{i}.jpg" in dom.imgs and f"media/{i}.png" in dom.links


def check_video_previews(job_dir, dom) -> None:
    from PIL import Image
    for i in ("red-fox", "cat-window", "river"):
        preview = next(s for s in dom.imgs if s.startswith(f"report/thumbs/{i}."))
        assert preview.endswith((".webp", ".gif")) and f"media/{i}.mp4" in dom.links
        with Image.open(job_dir / preview) as im:
            assert im.n_frames == 4                           # the tiny Latte's 4 frames


def fake_rows(n, failed=()):
    return [{"id": f"p{k:05d}", "prompt": f"prompt {k}", "seed": k, "height": 64, "width": 64,
             "num_frames": None, "status": "failed" if k in failed else "ok",
             "error": "RuntimeError: boom" if k in failed else None,
             "output": None if k in failed else f"media/p{k:05d}.png", "e2e_s": 0.5}
            for k in range(n)]


def test_large_job_gallery_shows_first_last_and_failures(tmp_path):
    from runner.driver.report import sample_gallery, write_report
    rows = fake_rows(50_000, failed={7, 25_000, 49_999})
    shown, hidden = sample_gallery(rows, 200)
    ids = [r["id"] for r in shown]
    assert ids[:100] == [f"p{k:05d}" for k in range(100)] and ids[-1] == "p49999"
    assert "p25000" in ids and len(shown) == 201 and hidden == 50_000 - 201
    assert sample_gallery(rows[:150], 200) == (rows[:150], 0)
    # the page itself: 201 entries (their media files are absent: no thumbnail, no crash)
    write_report(str(tmp_path), rows, {"job": "big", "items": 60_000}, timeline=[(1.0, 10, 0), (2.0, 30, 1)])
    page = Dom((tmp_path / "report.html").read_text())
    assert len(page.items) == 201 and "report/throughput.png" in page.imgs
    text = (tmp_path / "report.html").read_text()
    assert "49799 of 50000 outputs not shown" in text and "running" in text
    write_report(str(tmp_path), rows[:3], {"job": "big", "items": 3})      # timeline kept
    assert "report/throughput.png" in Dom((tmp_path / "report.html").read_text()).imgs


def test_thumbnails_made_once_and_within_the_budget(tmp_path):
    from runner.io.outputs import write_png
    from runner.driver.report import write_report
    rows = fake_rows(3)
    (tmp_path / "media").mkdir()
    for r in rows:
        write_png(tmp_path / r["output"], np.random.default_rng(0).random((300, 200, 3)))
    write_report(str(tmp_path), rows, thumb_budget_s=-1)     # out of time: none made yet
    assert (tmp_path / "report.html").read_text().count("preview pending") == 3
    write_report(str(tmp_path), rows)
    thumb = tmp_path / "report" / "thumbs" / "p00000.jpg"
    assert iio.imread(thumb).shape == (256, 171, 3)            # longest side THUMB px
    os.utime(thumb, (1e9 + 10, 1e9 + 10))
    os.utime(tmp_path / "media" / "p00000.png", (1e9, 1e9))
    write_report(str(tmp_path), rows)                        # up to date: not made again
    assert thumb.stat().st_mtime == 1e9 + 10 and "preview pending" not in (tmp_path / "report.html").read_text()


def test_worker_breakdown_takes_any_reported_parts():
    from runner.driver.report import time_breakdown
    assert time_breakdown({"time_s": {"denoise": 3.0, "decode": 1, "wait": 0.0, "x": "n/a"},
                           "model_load_s": 9}) == {"denoise": 3.0, "decode": 1.0}
    parts = time_breakdown({"model_load_s": 2.0, "warmup_s": 1.0, "busy_s": 6.0, "denoise_s": 4.0,
                            "busy_fraction": 0.5})
    assert parts == {"model load": 2.0, "warm-up": 1.0, "denoise": 4.0, "other work": 2.0, "idle": 6.0}


def test_a_failing_report_does_not_fail_the_job(monkeypatch, caplog):
    import runner.driver.report
    from runner.driver.job import _report

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(runner.driver.report, "write_report", broken)
    with caplog.at_level(logging.WARNING, logger="runner"):
        _report("/nonexistent", [], {})
    assert "report.html not written: OSError: disk full" in caplog.text


@pytest.mark.parametrize("timeline,startup_s", [
    ([(3.0, 2, 0)], 3.5),                   # a one-shard job: every row arrives at one moment
    ([(3.0, 2, 0)], None),
    ([(2.0, 1, 0), (2.0, 2, 1)], 2.0),
    ([(0.0, 1, 0)], None),
])
def test_short_jobs_draw_their_plot_without_library_warnings(tmp_path, timeline, startup_s):
    """A one-shard job's plot made matplotlib warn on the user's terminal ("Attempting to set
    identical low and high xlims"): the axis is never of zero width."""
    import warnings
    from runner.driver.report import throughput_plot
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = throughput_plot(timeline, {"startup_s": startup_s}, str(tmp_path / "t.png"))
    assert iio.imread(path).std() > 0


def test_thumbnails_on_a_full_disk_are_one_warning_and_the_page_is_written(tmp_path, caplog):
    """A disk filling at the report stage printed one "no thumbnail" line per output (93)."""
    from runner.io.outputs import write_png
    from runner.driver.report import write_report
    rows = fake_rows(30)
    (tmp_path / "media").mkdir()                   # write_png writes straight to its path
    for r in rows:
        write_png(tmp_path / r["output"], np.random.default_rng(0).random((300, 200, 3)))
    thumbs = tmp_path / "report" / "thumbs"
    thumbs.mkdir(parents=True)
    with full_disk(thumbs), caplog.at_level(logging.WARNING, logger="runner"):   # no thumbnail fits
        write_report(str(tmp_path), rows)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["report: no thumbnail of 30 outputs (media/p00000.png: the disk is full; "
                     "not tried for the rest)"]
    assert (tmp_path / "report.html").read_text().count("preview pending") == 30
