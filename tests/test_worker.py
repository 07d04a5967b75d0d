import json
import os
import time

import numpy as np
import pytest
import torch

from runner.config import GenerationDefaults
from runner.driver.checks import JobError
from runner.driver.job import run
from runner.serve.models import ModelSpec
from runner.io.outputs import write_mp4, write_png
from runner.io.storage import atomic_path
from runner.io.prompts import Constraints, Item, PromptError
from runner.config import WorkerConfig
from runner.serve.worker import Worker, batches, generate


def make_worker(tmp_path, batch_size=2, preset="pixart_alpha_1024", size=64, video_length=None):
    cfg = WorkerConfig(model=ModelSpec(preset, source="tiny"),
                       generation=GenerationDefaults(height=size, width=size, num_inference_steps=3,
                                                     num_frames=video_length or 16),
                       limits=Constraints(size_factor=16, min_steps=2, video_length=video_length),
                       on_empty="error", job_dir=str(tmp_path / "job"), batch_size=batch_size,
                       warmup_steps=2)
    return Worker(0, cfg)


def items(ids, seeds=None, heights=None, frames=None, size=64):
    return [Item(id=i, prompt=f"a photo of {i}", negative_prompt="", seed=(seeds or {}).get(i, k),
                 height=(heights or {}).get(i, size), width=size, num_frames=frames,
                 num_inference_steps=3, guidance_scale=4.5, file="p.parquet", row=k)
            for k, i in enumerate(ids)]


def test_worker_serves_a_shard_in_batches_of_equal_shape(tmp_path):
    w = make_worker(tmp_path)
    assert w.warmup()["warmup_s"] > 0
    rows = w.run_shard(items("abcde", heights={"c": 128, "e": 128}))
    assert [r["id"] for r in rows] == ["a", "b", "d", "c", "e"]       # grouped by shape
    assert [r["batch_size"] for r in rows] == [2, 2, 1, 2, 2]
    for r in rows:
        assert os.path.isfile(tmp_path / "job" / r["output"]) and r["status"] == "ok"
        assert r["denoise_it_s"] > 0 and r["e2e_s"] > 0 and r["worker"] == 0
    assert sorted(os.listdir(tmp_path / "job" / "media")) == [f"{c}.png" for c in "abcde"]
    m = w.metrics()
    assert m["items"] == 5 and m["batches"] == 3 and m["steps"] == 3 * 2   # steps 2..3 of 3 calls
    assert m["steady_it_s"] > 0 and 0 < m["busy_fraction"] <= 1
    assert m["e2e_p95_s"] >= m["e2e_mean_s"] * 0.5 and m["model_load_s"] > 0


def test_metrics_break_the_serving_time_into_stages(tmp_path):
    w = make_worker(tmp_path, batch_size=1)
    w.warmup()
    w.run_shard(items("abc"))
    m = w.metrics()
    t = m["time_s"]
    assert set(t) == {"text_encode", "denoise", "decode", "to_host", "write", "wait"}
    for stage in ("text_encode", "denoise", "decode", "to_host", "write"):
        assert t[stage] > 0, stage                         # each measured, on CPU by the clock
    assert t["denoise"] > t["to_host"]
    assert m["serving_s"] > 0 and t["wait"] >= 0
    assert m["gpu_ms_per_item"] is None and m["gpu_util"] is None     # no GPU: null, not made up
    assert "gpu_busy_fraction" not in m      # it could not show idle gaps: gone
    json.dumps(m)                                          # what metrics/worker-*.json holds


def _sequential_reference(w, batch, out_dir, fps=8):
    """Today's sequential path, written out by hand: diffusers' float32 numpy output on the host,
    then outputs.to_uint8 inside write_png / write_mp4."""
    with torch.inference_mode():
        x = generate(w.pipe, w.family, batch, "cpu")
    for it, media in zip(batch, x):
        if w.ext == "mp4":
            write_mp4(out_dir / f"{it.id}.mp4", media, fps)
        else:
            write_png(out_dir / f"{it.id}.png", media)


@pytest.mark.parametrize("preset,frames", [("pixart_alpha_1024", None), ("latte1", 4)])
def test_pipelined_outputs_are_byte_identical_to_the_sequential_path(tmp_path, preset, frames):
    w = make_worker(tmp_path, batch_size=2, preset=preset, video_length=frames)
    w.warmup()
    shard1, shard2 = items("abc", seeds={"a": 7, "b": 8, "c": 9}, frames=frames), \
        items("de", seeds={"d": 10, "e": 11}, frames=frames)
    runs = [w.submit(shard1), w.submit(shard2)]            # both in flight, as in a job
    rows = [r for run in runs for r in run.wait_rows()]
    assert [r["status"] for r in rows] == ["ok"] * 5
    ref = tmp_path / "ref"
    ref.mkdir()
    from runner.serve.worker import batches
    # the same batches, one after another (Latte: batch-mates share their token count)
    for batch in batches(shard1, 2, w.text.key) + batches(shard2, 2, w.text.key):
        _sequential_reference(w, batch, ref)
    for it in shard1 + shard2:
        name = f"{it.id}.{w.ext}"
        assert (tmp_path / "job" / "media" / name).read_bytes() == (ref / name).read_bytes(), name


def test_gpu_stage_runs_ahead_of_the_writes(tmp_path, monkeypatch):
    """While batch a's file is being written (slowly), batches b and c are generated."""
    import runner.serve.worker as worker
    w = make_worker(tmp_path, batch_size=1)
    w.warmup()
    events, write, generate_ = [], worker.write_png, worker.generate

    def slow_write(path, media):
        # the worker encodes to a temporary name (Store.atomic_local), then puts it in place
        name = os.path.basename(str(path)).split("-", 2)[-1]
        events.append(("write", name))
        time.sleep(1.0)
        write(path, media)
        events.append(("written", name))

    def logged_generate(pipe, family, batch, *a, **k):
        out = generate_(pipe, family, batch, *a, **k)
        events.append(("generated", batch[0].id + ".png"))
        return out
    monkeypatch.setattr(worker, "write_png", slow_write)
    monkeypatch.setattr(worker, "generate", logged_generate)
    rows = w.run_shard(items("abc"))
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert events.index(("generated", "c.png")) < events.index(("written", "a.png"))
    assert w.metrics()["time_s"]["write"] >= 3.0             # the writes' time is accounted


def test_rerun_writes_the_same_files(tmp_path):
    w = make_worker(tmp_path)
    w.run_shard(items(["cat"], seeds={"cat": 4}))
    first = (tmp_path / "job" / "media" / "cat.png").read_bytes()
    w.run_shard(items(["cat"], seeds={"cat": 4}))
    assert (tmp_path / "job" / "media" / "cat.png").read_bytes() == first
    assert os.listdir(tmp_path / "job" / "media") == ["cat.png"]          # no temp leftovers


def test_start_and_finish_shard_run_in_seq_order_from_any_thread(tmp_path):
    """The Ray entry points: calls may arrive on different threads, out of order; the GPU work
    follows seq."""
    import threading
    w = make_worker(tmp_path, batch_size=1)
    order = []
    submit = w.submit
    w.submit = lambda its: (order.append(its[0].id), submit(its))[1]
    later = threading.Thread(target=w.start_shard, args=(1, items(["second"])))
    later.start()
    time.sleep(0.3)
    assert order == []                                     # seq 1 waits for seq 0
    assert w.start_shard(0, items(["first"])) == 1
    later.join(60)
    assert order == ["first", "second"]
    assert [r["id"] for r in w.finish_shard(1)] == ["second"]
    assert [r["id"] for r in w.finish_shard(0)] == ["first"]


def test_batches_split_by_shape_and_size():
    from runner.io.prompts import Item
    mk = lambda i, h: Item(str(i), "p", "", 0, h, 64, None, 2, 4.5, "t", i)
    groups = batches([mk(0, 64), mk(1, 128), mk(2, 64), mk(3, 64)], 2)
    assert [[i.id for i in b] for b in groups] == [["0", "2"], ["3"], ["1"]]
    # a key splits groups further (Latte: the negative prompt and the token count)
    groups = batches([mk(0, 64), mk(1, 64), mk(2, 64)], 2, key=lambda it: (it.id == "1",))
    assert [[i.id for i in b] for b in groups] == [["0", "2"], ["1"]]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.png"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash mid-write")
    assert os.listdir(tmp_path) == []
    write_png(target, np.zeros((8, 8, 3)))
    assert os.listdir(tmp_path) == ["out.png"]


@pytest.fixture
def no_models_no_ray(monkeypatch):
    """Fail loudly if a test reaches model building or Ray."""
    import ray
    import runner.serve.models as models
    def boom(*a, **k):
        raise AssertionError("reached model building / Ray before rejecting bad input")
    monkeypatch.setattr(models, "build_pipeline", boom)
    monkeypatch.setattr(ray, "init", boom)


@pytest.mark.parametrize("columns,extra,needle", [
    ({"prompt": ["a", None]}, [], "prompt is null or empty"),
    ({"text": ["a"]}, [], "no 'prompt' column"),
    ({"prompt": ["a"], "width": [100]}, [], "width=100 must be a positive multiple of 16"),
    ({"prompt": ["a"]}, ["model.preset=latte1", "generation.num_frames=16"], "exactly 4 frames"),
])
def test_bad_input_rejected_before_any_model_or_ray(tmp_path, write_prompts, no_models_no_ray,
                                                     columns, extra, needle):
    p = write_prompts(columns)
    with pytest.raises(PromptError, match=needle):
        run(["job=demo_image", f"prompts.path={p}", f"output.dir={tmp_path}/out", *extra])
    assert not (tmp_path / "out").exists()          # nothing written either


def test_missing_pretrained_weights_rejected_on_the_driver(tmp_path, write_prompts, no_models_no_ray):
    p = write_prompts({"prompt": ["a"]})
    with pytest.raises(JobError, match=r"cannot find the pretrained model 'PixArt-alpha/PixArt-XL-2-1024-MS'.*model.path=DIR"):
        run(["job=pixart_batch", f"prompts.path={p}", f"output.dir={tmp_path}", "model.local_files_only=true"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="without model_index.json"):
        run(["job=pixart_batch", f"prompts.path={p}", f"output.dir={tmp_path}", f"model.path={tmp_path}/empty"])


def test_unknown_schemes_are_refused_naming_the_key(tmp_path, write_prompts, no_models_no_ray):
    from runner.config import ConfigError
    p = write_prompts({"prompt": ["a"]})
    with pytest.raises(ConfigError, match=r"prompts.path='ftp://h/p.parquet'.*scheme 'ftp'.*s3://bucket"):
        run(["job=demo_image", "prompts.path=ftp://h/p.parquet", f"output.dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"output.dir='ftp://h/out'.*scheme 'ftp'.*gs://bucket"):
        run(["job=demo_image", f"prompts.path={p}", "output.dir=ftp://h/out"])


def test_prompts_and_outputs_on_s3_are_checked_before_ray(s3_bucket, write_prompts, no_models_no_ray):
    from runner.io.storage import resolve
    with pytest.raises(PromptError, match=f"prompts.path 's3://{s3_bucket}/nope.parquet' does not exist"):
        run(["job=demo_image", f"prompts.path=s3://{s3_bucket}/nope.parquet",
             f"output.dir=s3://{s3_bucket}/out"])
    p = write_prompts({"prompt": ["a", "b", "c"]})
    resolve(f"s3://{s3_bucket}/in").write_file_atomic("p.parquet", p)
    for path in (f"s3://{s3_bucket}/in/p.parquet", f"s3://{s3_bucket}/in"):   # a file, a prefix
        summary = run(["job=demo_image", f"prompts.path={path}", f"output.dir=s3://{s3_bucket}/out",
                       "run.dry_run=true"])
        assert summary["to_run"] == 3 and summary["done"] == 0
    assert resolve(f"s3://{s3_bucket}").list() == {"in/p.parquet": os.path.getsize(p)}  # nothing written


def test_output_dir_that_is_a_file(tmp_path, write_prompts, no_models_no_ray):
    p = write_prompts({"prompt": ["a"]})
    (tmp_path / "f").write_text("not a dir")
    with pytest.raises(JobError, match="is a file"):
        run(["job=demo_image", f"prompts.path={p}", f"output.dir={tmp_path}/f"])


def test_cli_exit_code_and_message_for_bad_input(tmp_path):
    import subprocess, sys
    r = subprocess.run([sys.executable, "-m", "runner", "job=demo_image", "generation.stepz=2"],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 2
    assert "error: unknown config key 'generation.stepz'" in r.stderr
    assert "Traceback" not in r.stderr


def test_steady_throughput_counts_in_flight_items_by_their_part_after_all_ready():
    from runner.driver.summary import work_after
    ok = lambda start, e2e: {"status": "ok", "batch_size": 1, "started_at": start, "e2e_s": e2e}
    # pipelined batches overlap (each one's writing with the next one's generation):
    # [4,7] [6,9] [8,11]; from t=7: 0 + 2/3 + 1
    assert work_after([ok(4.0, 3.0), ok(6.0, 3.0), ok(8.0, 3.0)], 7.0) == pytest.approx(5 / 3)
    # two rows of one batch share its run [6,10]: half of each after t=8 -> one item's worth
    assert work_after([ok(6.0, 4.0)] * 2, 8.0) == pytest.approx(1.0)
    # a failed row produced nothing and took no recorded time
    failed = {"status": "failed", "batch_size": 1, "e2e_s": None, "started_at": None}
    assert work_after([ok(8.0, 2.0), failed], 9.0) == pytest.approx(0.5)
    assert work_after([ok(8.0, 2.0)], 0.0) == 1.0


def test_rows_carry_their_batch_start_on_the_epoch_clock(tmp_path):
    w = make_worker(tmp_path)
    w.warmup()
    t0 = time.time()
    rows = w.run_shard(items("ab"))
    assert all(t0 <= r["started_at"] <= time.time() and r["e2e_s"] > 0 for r in rows)


def test_nvml_sampler_averages_utilisation_over_a_window(monkeypatch):
    """The NVML path without a GPU: a stand-in pynvml module reporting 30 % then 90 %."""
    import sys
    import types
    from runner.serve.timing import UtilSampler
    readings = iter([30] * 5 + [90] * 1000)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: ("handle", uuid),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=next(readings)))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="GPU-1234"))
    s = UtilSampler(0, period_s=0.01)
    time.sleep(0.3)
    s.stop()
    t = [t for t, _ in s.samples]
    assert s._handle == ("handle", "GPU-1234")
    assert s.mean(t[0], t[4]) == pytest.approx(0.30)             # fraction, not percent
    assert s.mean(t[5], t[-1]) == pytest.approx(0.90)
    assert s.mean(t[-1] + 1, t[-1] + 2) is None                  # no samples in the window


@pytest.mark.parametrize("preset, frames", [("latte1", 4), ("pixart_alpha_1024", None),
                                            ("wan21_t2v_1_3b", 5)])
def test_an_items_output_does_not_depend_on_its_batch_or_shard_mates(preset, frames):
    """Alone (its text encoded alone) vs in a batch, its text encoded with a whole shard: the same
    frames within 1 level of 255. Latte used to trim a batch's text to the longest prompt's token
    count (up to 63 levels apart); now batch-mates share their token count (runner.serve.text)."""
    from runner.serve.models import build_pipeline
    from runner.io.outputs import to_uint8
    from runner.serve.text import TextCache
    family = ModelSpec(preset).family
    pipe = build_pipeline(ModelSpec(preset, source="tiny"))
    prompts = ["a red cat", "a blue dog", "a small robot walking in the city at night", "a green bird"]
    shard = [Item(id=f"i{k}", prompt=p, negative_prompt="", seed=k, height=64, width=64,
                  num_frames=frames, num_inference_steps=3, guidance_scale=4.5, file="p", row=k)
             for k, p in enumerate(prompts)]
    u8 = lambda x: to_uint8(x.float().movedim(-3, -1).numpy()).astype(int)
    with torch.inference_mode():
        alone = {it.id: u8(generate(pipe, family, [it], "cpu", output_type="pt")[0]) for it in shard}
        text = TextCache.of(pipe, family)
        text.batch = 4
        embeds = text.encode(shard)                  # the shard's prompts in one encoder call
        groups = batches(shard, 2, text.key)
        assert max(len(b) for b in groups) == 2      # some item really had a batch-mate
        for b in groups:
            out = generate(pipe, family, b, "cpu", output_type="pt", embeds=embeds)
            for it, o in zip(b, out):
                assert np.abs(u8(o) - alone[it.id]).max() <= 1, it.id


def test_an_over_long_prompt_is_reported_in_one_short_line(caplog, capfd):
    """diffusers echoes the whole cut-off part of a long prompt; the runner says it once, briefly."""
    from runner.serve.models import build_pipeline
    pipe = build_pipeline(ModelSpec("pixart_alpha_1024", source="tiny"))
    long = " ".join(["a red cat walking in the city at night"] * 40)      # > 120 tokens
    it = Item(id="long1", prompt=long, negative_prompt="", seed=0, height=64, width=64,
              num_frames=None, num_inference_steps=2, guidance_scale=4.5, file="p", row=0)
    with caplog.at_level("WARNING"), torch.inference_mode():
        generate(pipe, ModelSpec("pixart_alpha_1024").family, [it], "cpu", output_type="pt")
    ours = [r.getMessage() for r in caplog.records if "long1" in r.getMessage()]
    assert len(ours) == 1 and "the model reads the first 120" in ours[0] and len(ours[0]) < 200
    printed = capfd.readouterr()
    assert "following part of your input was truncated" not in printed.err + printed.out


def test_a_non_finite_output_fails_its_item_alone_and_a_failed_write_fails_the_shard(tmp_path,
                                                                                    monkeypatch):
    """b's output is NaN (on the device, before the check): b fails, its batch-mates a and c do
    not. A write that fails (a full disk) fails the shard: the driver retries it, and the same
    error on several shards stops the job (test_jobrun.py)."""
    import runner.serve.worker as worker
    w = make_worker(tmp_path, batch_size=3)
    w.warmup()
    generate_ = worker.generate

    def nan_for_b(pipe, family, batch, *a, **k):
        out = generate_(pipe, family, batch, *a, **k)
        for n, it in enumerate(batch):
            if it.id == "b":
                out[n] = float("nan")
        return out
    monkeypatch.setattr(worker, "generate", nan_for_b)
    rows = {r["id"]: r for r in w.run_shard(items("abc"))}
    assert {i: r["status"] for i, r in rows.items()} == {"a": "ok", "b": "failed", "c": "ok"}
    # no id in the message: failures are grouped by cause, the row carries its id
    assert rows["b"]["error"] == "FloatingPointError: non-finite values (NaN or inf) in the output"
    assert rows["a"]["batch_size"] == 3 and not (tmp_path / "job" / "media" / "b.png").exists()

    def full(rel):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(w.store, "atomic_local", full)
    with pytest.raises(OSError, match="No space left on device"):
        w.run_shard(items(["d"]))


def job_worker(args, tmp_path):
    """The worker a shipped job's command line gives (config, prompt checks, worker config), built
    and warmed in this process: the family's path through the job without Ray."""
    from runner.driver import checks, job
    from runner.config import load_config, split
    j = split(load_config([*args, f"output.dir={tmp_path}"]))
    checked = checks.check_input(j)
    w = Worker(0, job.worker_config(j, checked.limits, on_gpu=False))
    w.warmup()
    return w, checked.items, tmp_path / j["name"]


def test_the_wan_job_with_the_tiny_model_writes_mp4s_of_4k_plus_1_frames(tmp_path):
    """The shipped Wan 2.1 job: its family came in as one module (and presets); with step reuse
    (`residual`: its guidance branches as separate calls, tests/test_step_reuse.py)."""
    import imageio_ffmpeg
    w, its, job_dir = job_worker(["job=wan_batch", "model.source=tiny", "generation.height=64",
                                  "generation.width=48", "generation.num_frames=5",
                                  "generation.num_inference_steps=4", "run.shard_size=2",
                                  "step_cache.method=residual", "step_cache.compute_ratio=0.5"],
                                 tmp_path)
    rows = w.run_shard(its[:2])
    assert [r["status"] for r in rows] == ["ok", "ok"] and len(its) == 8
    # both videos reused a step in both guidance branches (the warm-up's reuse comes on top)
    assert w.metrics()["step_cache_reused"] >= 2 * 2
    for row in rows:
        reader = imageio_ffmpeg.read_frames(str(job_dir / row["output"]))
        meta = next(reader)
        assert meta["size"] == (48, 64) and meta["fps"] == 16 and len(list(reader)) == 5


def test_a_pretrained_job_from_a_saved_directory(tmp_path):
    import imageio.v3 as iio
    from runner.serve.models import build_pipeline
    build_pipeline(ModelSpec("sd21", source="tiny")).save_pretrained(tmp_path / "sd21-tiny")
    w, its, job_dir = job_worker(["job=sd2_batch", f"model.path={tmp_path / 'sd21-tiny'}",
                                  "model.local_files_only=true", "model.device=cpu",
                                  "generation.height=64", "generation.width=64",
                                  "generation.num_inference_steps=2"], tmp_path / "out")
    rows = w.run_shard(its[:2])
    assert [r["status"] for r in rows] == ["ok", "ok"] and w.spec.source == "pretrained"
    assert all(iio.imread(job_dir / r["output"]).shape == (64, 64, 3) for r in rows)


def test_the_canary_is_bit_exact_and_catches_a_weight_gone_wrong(tmp_path):
    """The real Worker on a tiny model: its canary batch (made when it became ready) comes out bit
    for bit the same between shards, in turn with them; a weight changed in place (a flipped bit
    in GPU memory would do the same) is caught at the next canary, naming the device."""
    import dataclasses
    cfg = dataclasses.replace(make_worker(tmp_path).cfg, canary=True)
    w = Worker(0, cfg)
    ready = w.warmup()
    assert ready["device"]["host"] and ready["device"]["pid"] == os.getpid()
    assert w._reference.shape == (2, 64, 64, 3) and w.m["canary_ref_s"] > 0   # batch_size rows
    w.start_shard(0, items("ab"))
    ok = w.canary(1)
    assert ok["ok"] and (ok["rule"], ok["max_abs"], ok["differing"]) == ("bit for bit", 0, 0.0)
    assert ok["rank"] == 0 and ok["device"] == ready["device"] and ok["s"] > 0
    assert [r["status"] for r in w.finish_shard(0)] == ["ok", "ok"]
    with torch.no_grad():
        weight = next(p for p in w.pipe.transformer.parameters() if p.dim() == 2)
        weight.view(-1)[:64] *= -1
    bad = w.canary(2)
    assert not bad["ok"] and bad["max_abs"] > 0 and 0 < bad["differing"] <= 1
    m = w.metrics()
    assert m["canaries"] == 2 and m["canary_s"] >= ok["s"] + bad["s"]


def test_a_canary_compares_bit_for_bit_or_within_the_lossy_tolerance():
    from runner.serve.canary import compare, describe
    ref = np.full((1, 8, 8, 3), 100, np.uint8)
    near = ref.copy()
    near[0, 0, 0, 0] = 101                                    # one value off by one: 66.9 dB
    assert compare(ref, ref, True, True, 40)["ok"]
    v = compare(ref, near, True, True, 40)
    assert not v["ok"] and v["max_abs"] == 1 and v["differing"] == pytest.approx(1 / 192)
    assert compare(ref, near, True, False, 40)["ok"]          # lossy: PSNR >= 40 dB
    far = (ref + np.random.default_rng(0).integers(0, 30, ref.shape)).astype(np.uint8)
    v = compare(ref, far, True, False, 40)
    assert not v["ok"] and v["psnr_db"] < 40
    assert describe(v).startswith("PSNR >= 40 dB: ") and "largest by" in describe(v)
    assert not compare(ref, ref, False, True, 40)["ok"]      # not finite: never passes
    assert describe(compare(ref, ref, False, True, 40)) == "bit for bit: non-finite values"


def test_a_compiled_wan_worker_serves_a_second_row_size(tmp_path):
    """Per-row sizes on a compiled Wan worker (O2, its VAE compiled: Wan's `resblock` needs as
    many graphs again for each size): rows of two sizes both ok. Dynamo's limits are put back to
    its defaults first, so that what an earlier test of this process raised them to does not
    hide a limit sized for one resolution (every row of the second size failed with
    FailOnRecompileLimitHit)."""
    from compiler import parse_options
    from runner.config import CompileConfig
    # the defaults, restored after: monkeypatch would `delattr` these on undo, and a torch config
    # module hides a deleted key (every later compile of the process failed: AttributeError)
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        torch._dynamo.reset()
        # O2's compile without its artifact cache (on CPU, cudagraphs is a no-op); the text encoder
        # stays eager (~20 CPU-s less; its graphs do not depend on the row size)
        options = parse_options({"mode": "cudagraphs", "compile_text_encoder": False})
        cfg = WorkerConfig(model=ModelSpec("wan21_t2v_1_3b", source="tiny"),
                           generation=GenerationDefaults(height=64, width=48, num_frames=5,
                                                         num_inference_steps=2, guidance_scale=1.0),
                           limits=Constraints(size_factor=16, frame_step=4), on_empty="error",
                           job_dir=str(tmp_path / "job"), warmup_steps=2,
                           compile=CompileConfig(options=options, mode="cudagraphs"))
        w = Worker(0, cfg)
        w.warmup()                                        # compiles the job's size, 64x48
        assert w.pipe._compile_report["vae_blocks"]["resblock"] > 0
        rows = w.run_shard([Item(id=f"r{h}", prompt="a fox", negative_prompt="", seed=0, height=h,
                                 width=112 - h, num_frames=5, num_inference_steps=2,
                                 guidance_scale=1.0, file="p.parquet", row=k)
                            for k, h in enumerate((64, 48))])
        assert [(r["id"], r["status"], r["error"]) for r in rows] == [
            ("r64", "ok", None), ("r48", "ok", None)]
