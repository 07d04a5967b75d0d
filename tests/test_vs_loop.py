"""`python -m runner.bench.vs_loop` end to end on CPU: the plain diffusers loops and the job, one table."""
import json
import os
import subprocess
import sys

import pytest
from conftest import GUARD_S
from test_scaling import session_ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.e2e


def test_loops_and_job_on_the_same_prompts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "runner.bench.vs_loop", "job=demo_image", "prompts=3",
                        "modes=none", f"out={tmp_path}", "arms=loop,job", "ray.cpu_workers=1",
                        "generation.height=64", "generation.width=64",
                        "generation.num_inference_steps=2", *session_ray()],
                       cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.load(open(tmp_path / "vs_loop.json"))["rows"]
    assert [(x["arm"], x["mode"], x["items"]) for x in rows] == [("loop", "eager", 3), ("job", "none", 3)]
    assert all(x["items_per_s"] > 0 for x in rows)
    assert rows[0]["call_items_per_s"] >= rows[0]["items_per_s"]     # the write left out
    assert rows[0]["ends_items_per_s"] == rows[0]["items_per_s"] and rows[1]["ends_items_per_s"] > 0
    assert rows[0]["x_loop"] == 1.0 and rows[1]["x_loop"] > 0        # ratios against the loop
    assert rows[1]["time_s"]["denoise"] > 0 and rows[0]["gpu_util"] is None   # CPU: no GPU figures
    assert sorted(os.listdir(tmp_path / "loop")) == ["v00000.png", "v00001.png", "v00002.png"]
    assert "items_per_s" in r.stdout                                   # the table is printed
    # the job's own log relayed as it comes (a bench cut at its limit shows how far it got)
    assert "[job-none] " in r.stderr and "worker 0: ready at" in r.stderr


def test_step_reuse_arm_is_compared_with_its_mode_alone(tmp_path):
    """`modes=O3,O3+residual`: each output of the reuse job against the same id of the O3 job,
    PSNR of the decoded frames, written to the reuse job's metrics."""
    import numpy as np

    from runner.io.outputs import write_mp4
    from runner.bench.vs_loop import compare_outputs
    rng = np.random.default_rng(0)
    frames = (rng.random((4, 32, 32, 3)) * 255).astype(np.uint8)
    noisy = np.clip(frames.astype(int) + rng.integers(-20, 21, frames.shape), 0, 255).astype(np.uint8)
    for job, videos in (("job-O3", {"a": frames, "b": frames}), ("job-O3-residual", {"a": frames, "b": noisy})):
        for vid, f in videos.items():
            os.makedirs(tmp_path / job / "media", exist_ok=True)
            write_mp4(tmp_path / job / "media" / f"{vid}.mp4", f, fps=8)
    res = compare_outputs(str(tmp_path), "O3+residual", "O3")
    per = json.load(open(tmp_path / "job-O3-residual" / "metrics" / "psnr_vs_job-O3.json"))["psnr_db"]
    assert per["a.mp4"] == float("inf") and 10 < per["b.mp4"] < 40       # same frames; perturbed
    assert res["psnr_min_db"] == per["b.mp4"] and res["psnr_ref"] == "O3"


def test_two_lanes_need_two_gpus(tmp_path):
    """`lanes=2` on a machine without two GPUs: a clear error before any model is built."""
    from runner.bench.vs_loop import main
    with pytest.raises(SystemExit, match="lanes=2 needs two GPUs"):
        main(["job=demo_image", "prompts=2", f"out={tmp_path}", "arms=loop,job", "lanes=2"])
    assert not os.path.exists(tmp_path / "loop")


def test_half_the_prompts_carry_an_image_and_bad_images_value_is_named(tmp_path):
    """`images=half` (Wan 2.2 TI2V's text and image rows in one table): every other row has its own
    drawn still; an unknown value is refused before anything is built."""
    import pyarrow.parquet as pq

    from runner.bench.vs_loop import _write_prompts, main
    rows = pq.read_table(_write_prompts(str(tmp_path), 4, images="half")).to_pylist()
    assert [r["image"] for r in rows] == ["images/v00000.png", None, "images/v00002.png", None]
    assert sorted(os.listdir(tmp_path / "images")) == ["v00000.png", "v00002.png"]
    with pytest.raises(SystemExit, match="images='some': one of auto, all, half, none"):
        main(["job=demo_image", "prompts=2", f"out={tmp_path}/x", "images=some"])
    assert not os.path.exists(tmp_path / "x")


def test_a_failing_arm_is_a_row_with_its_error_and_the_next_arm_runs(tmp_path, monkeypatch):
    """A peer arm whose backend will not run (here: the job arm's command fails) leaves a row with
    its error, and the arms after it still run and are compared."""
    from runner.bench import vs_loop
    calls = []

    def fake_loop(job, prompts, out, arm):
        calls.append(arm)
        if arm == "cachedit_sage":
            raise RuntimeError("Sage attention backend is not available")
        return dict(items=len(prompts), items_per_s=2.0, call_items_per_s=2.5, ready_s=1.0)

    monkeypatch.setattr(vs_loop, "run_loop", fake_loop)
    monkeypatch.setattr(vs_loop, "_compare", lambda *a: None)
    rows = vs_loop.main(["job=demo_image", "prompts=2", f"out={tmp_path}", "arms=cachedit_sage,cachedit"])
    assert calls == ["cachedit_sage", "cachedit"]
    assert rows[0]["error"] == "RuntimeError: Sage attention backend is not available"
    assert rows[0]["items"] == 0 and rows[1]["items_per_s"] == 2.0
    assert rows[1]["x_peer_calls"] == 2.0 / 2.5      # against the faster peer's pipe-call rate
    saved = json.load(open(tmp_path / "vs_loop.json"))["rows"]
    assert saved[1]["x_peer_calls"] == rows[1]["x_peer_calls"]


@pytest.mark.parametrize("first_blocks", [0, 1, 2])
def test_the_peer_computes_the_jobs_first_blocks_or_cache_dits_floor(tmp_path, first_blocks):
    """The cachedit arms' DBCache computes the job's `step_cache.first_blocks` leading blocks on
    every step (FnB0, Fn from the resolved job config), and at least the 1 cache-dit accepts: the
    label, the config handed to cache-dit, the rows' `first_blocks` and the note under the table
    say which."""
    from runner.bench import vs_loop
    from runner.config import load_config, split
    job = split(load_config(["job=pixart_batch", "prompts.path=generated",
                             "step_cache.method=residual",
                             f"step_cache.first_blocks={first_blocks}"]))
    sc = job["step_cache"]
    assert sc.first_blocks == first_blocks
    fn = max(1, first_blocks)
    mask = [1, 0, 1, 1]
    kw = vs_loop.peer_cache_config(sc, mask)
    assert kw == dict(Fn_compute_blocks=fn, Bn_compute_blocks=0, num_inference_steps=4,
                      steps_computation_mask=mask, steps_computation_policy="static")
    assert vs_loop.loop_label("cachedit", sc) == f"cache-dit F{fn}B0 + torch.compile"
    assert vs_loop.loop_label("cachedit_sage", sc) == f"cache-dit F{fn}B0 + sage attention + torch.compile"
    assert vs_loop.loop_label("loop", sc) == "eager"
    assert vs_loop.arm_first_blocks("cachedit", sc) == fn
    assert vs_loop.arm_first_blocks("job", sc, "O3+residual") == first_blocks
    assert vs_loop.arm_first_blocks("loop", sc) is None
    rows = [dict(arm="cachedit", first_blocks=fn), dict(arm="job", first_blocks=first_blocks)]
    note = vs_loop.first_blocks_note(rows)
    if first_blocks == 0:       # cache-dit's floor: the peer computes one block more
        assert "computes 1 block(s) more on each reused step" in note, note
    else:
        assert note is None
    try:
        from cache_dit import DBCacheConfig
    except ImportError:
        return
    assert DBCacheConfig(**kw).Fn_compute_blocks == fn      # cache-dit takes it as given


def test_a_job_arm_without_residual_reuse_has_no_first_blocks():
    from runner.bench import vs_loop
    from runner.config import load_config, split
    sc = split(load_config(["job=pixart_batch", "prompts.path=generated"]))["step_cache"]
    assert sc.method != "residual"
    assert vs_loop.arm_first_blocks("job", sc, "O3") is None
    assert vs_loop.arm_first_blocks("job", sc, "O3+residual") == sc.first_blocks
    assert vs_loop.first_blocks_note([dict(arm="cachedit", first_blocks=1),
                                      dict(arm="job", first_blocks=None)]) is None


def test_a_loop_warmed_up_untimed_gives_one_item_a_rate(tmp_path):
    """`loop_warmup=N`: one untimed call at N steps first, then every item counts: one video gives
    a figure (MLPerf's 720P A14B video fits one device call so); without it one item gives none."""
    from runner.bench import vs_loop
    small = ["generation.height=64", "generation.width=64", "generation.num_inference_steps=2"]
    warm, = vs_loop.main(["job=demo_image", "prompts=1", f"out={tmp_path}/w", "arms=loop",
                          "loop_warmup=2", *small])   # PixArt's DPM-Solver: >= 2 steps
    assert warm["items"] == 1 and warm["items_per_s"] > 0 and warm["loop_warmup_steps"] == 2
    assert warm["call_items_per_s"] >= warm["items_per_s"] and warm["ready_s"] > 0
    assert os.listdir(tmp_path / "w" / "loop") == ["v00000.png"]      # the warm-up writes nothing
    cold, = vs_loop.main(["job=demo_image", "prompts=1", f"out={tmp_path}/c", "arms=loop", *small])
    assert cold["items"] == 1 and cold["items_per_s"] is None and cold["loop_warmup_steps"] is None
    with pytest.raises(SystemExit, match="loop_warmup='x'"):
        vs_loop.main(["job=demo_image", f"out={tmp_path}/x", "loop_warmup=x"])
