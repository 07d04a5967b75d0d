"""Image-to-video rows (`runner.io.images`, the `image` column of `runner.io.prompts`): the driver's
checks (exit 2 naming file:row), where an image is read from, the fit to the row's size, and the
content hash that decides what a rerun regenerates. Fast: no model, no Ray (an S3 test talks to the
session's moto server)."""
import hashlib
import io
import logging
import os
import signal
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from runner.io import images
from runner.config import GenerationDefaults
from runner.io.prompts import Constraints, PromptError, check_prompts
from runner.driver.results import Results
from runner.io.storage import resolve
from conftest import free_port

GEN = GenerationDefaults(seed=3, height=64, width=64, num_frames=5, num_inference_steps=2,
                         guidance_scale=5.0)
REQUIRED = Constraints(size_factor=16, frame_step=4, image="required")
OPTIONAL = Constraints(size_factor=16, frame_step=4, image="optional")
TEXT = Constraints(size_factor=16, frame_step=4)


def png(path, color=(200, 30, 30), size=(96, 48)) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return str(path)


def write(tmp_path, columns: dict, name="p.parquet") -> str:
    path = tmp_path / name
    pq.write_table(pa.table(columns), path)
    return str(path)


def check(path, limits=REQUIRED):
    return check_prompts((path,), GEN, limits, "error")


def test_paths_are_located_relative_to_their_parquet_file_and_bytes_are_hashed(tmp_path, monkeypatch):
    # where cells point, not whether they exist (an s3:// one on no server here: the lookups'
    # own tests are below)
    monkeypatch.setattr(images, "check_sample", lambda *a: None)
    png(tmp_path / "imgs" / "a.png")
    absolute = png(tmp_path / "elsewhere" / "b.png")
    data = (tmp_path / "imgs" / "a.png").read_bytes()
    p = write(tmp_path, {"prompt": ["x", "y", "z", "w"],
                         "image": ["imgs/a.png", absolute, "s3://bucket/k/c.png", None]})
    items = check(p, OPTIONAL)[2]
    assert [it.image for it in items] == [str(tmp_path / "imgs" / "a.png"), absolute,
                                          "s3://bucket/k/c.png", None]
    assert all(it.image_sha256 is None for it in items)      # known once a worker reads them
    b = write(tmp_path, {"prompt": ["x"], "image": pa.array([data], pa.binary())}, "bytes.parquet")
    it = check(b)[2][0]
    sha = hashlib.sha256(data).hexdigest()
    assert (it.image, it.image_sha256, it.image_bytes) == (f"bytes:{sha}", sha, data)
    assert "image_bytes" not in it.params()                 # a row never carries the bytes


@pytest.mark.parametrize("column, limits, needle", [
    ({"image": [1, 2]}, REQUIRED, "column 'image' has type int64"),
    ({"image": ["a.png", "https://example.com/b.png"]}, REQUIRED,
     "p.parquet:1: image 'https://example.com/b.png': scheme 'https' is not read here"),
    ({"image": ["a.png", None]}, REQUIRED, "p.parquet:1: image is empty"),
    ({}, REQUIRED, "no 'image' column"),
    ({"image": ["a.png", None]}, TEXT, "names 1 images, but this model takes text only (no image)"),
])
def test_bad_image_cells_are_exit_2_naming_file_and_row(tmp_path, column, limits, needle):
    png(tmp_path / "a.png")
    p = write(tmp_path, {"prompt": ["x", "y"], **column})
    with pytest.raises(PromptError) as e:
        check(p, limits)
    assert needle in str(e.value)


def test_an_all_null_image_column_is_fine_for_a_text_model(tmp_path):
    p = write(tmp_path, {"prompt": ["x"], "image": pa.array([None], pa.string())})
    assert check(p, TEXT)[2][0].image is None


def test_a_sample_of_images_is_looked_up_before_the_job(tmp_path, caplog):
    png(tmp_path / "there.png")
    p = write(tmp_path, {"prompt": ["x", "y"], "image": ["there.png", "gone.png"]})
    with caplog.at_level(logging.WARNING, logger="runner"):
        items = check(p)[2]                      # one missing among found ones: that row fails later
    assert len(items) == 2 and "p.parquet:1: image" in caplog.text and "gone.png" in caplog.text
    wrong = write(tmp_path, {"prompt": ["x", "y"], "image": ["img/there.png", "img/gone.png"]}, "q.parquet")
    with pytest.raises(PromptError, match=r"none of the 2 images looked up can be read(.|\n)*q.parquet:0: image \S*: not found"):
        check(wrong)                             # none found: a wrong base path, exit 2


def test_fit_covers_the_rows_size_and_crops_the_center(tmp_path):
    # 96x48 image: left third blue, middle third green, right third red; fitted into 32x32 the
    # cover scale is 32/48 (height): 64x32, cropped to its middle 32 columns, green at 5..27
    img = np.zeros((48, 96, 3), np.uint8)
    img[:, :32, 2], img[:, 32:64, 1], img[:, 64:, 0] = 255, 255, 255
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    out = np.asarray(images.fit(buf.getvalue(), 32, 32))
    assert out.shape == (32, 32, 3)
    assert out[:, 8:24, 1].min() > 200 and out[:, 8:24][..., [0, 2]].max() < 60
    tall = np.asarray(images.fit(buf.getvalue(), 48, 96))     # portrait row from a landscape image
    assert tall.shape == (96, 48, 3)


def test_unusable_images_raise_naming_the_image_and_why(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png")
    item = check(write(tmp_path, {"prompt": ["x", "y"], "image": ["bad.png", "nope.png"]}))[2]
    with pytest.raises(images.ImageError, match=r"bad.png: not a decodable image"):
        images.load(item[0])
    with pytest.raises(images.ImageError, match=r"nope.png: not found"):
        images.load(item[1])


def test_rerun_plan_regenerates_an_edited_image_only(tmp_path):
    """What resume compares (`Results.plan`): the recorded hash of the bytes a worker read against
    the image's current content, hashed on the driver for rows with a record."""
    for name in "abc":
        png(tmp_path / f"{name}.png", color=(10 * ord(name) % 255, 0, 0))
    p = write(tmp_path, {"id": list("abc"), "prompt": ["x", "y", "z"],
                         "image": ["a.png", "b.png", "c.png"]})
    items = check(p)[2]
    res = Results(str(tmp_path / "job"), settings="s")
    rows = []
    for it in items:                           # as a worker records them: the hash it read
        data, sha = images.read(it)
        (tmp_path / "job" / "media").mkdir(parents=True, exist_ok=True)
        (tmp_path / "job" / "media" / f"{it.id}.mp4").write_bytes(b"x")
        rows.append({**it.params(), "image_sha256": sha, "status": "ok", "output": f"media/{it.id}.mp4"})
    res.add(rows)
    res = Results(str(tmp_path / "job"), settings="s").load()
    again = images.fill_hashes(check(p)[2], res.rows)
    assert res.plan(again).done == {"a", "b", "c"}
    png(tmp_path / "b.png", color=(0, 255, 0))                  # edited in place: same path
    os.rename(tmp_path / "c.png", tmp_path / "c2.png")          # moved, same content
    p2 = write(tmp_path, {"id": list("abc"), "prompt": ["x", "y", "z"],
                          "image": ["a.png", "b.png", "c2.png"]})
    plan = res.plan(images.fill_hashes(check(p2)[2], res.rows))
    assert plan.done == {"a", "c"} and [it.id for it in plan.changed] == ["b"]
    os.remove(tmp_path / "a.png")                               # gone: redone, and fails there
    plan = res.plan(images.fill_hashes(check(p2)[2], res.rows))
    assert sorted(it.id for it in plan.changed) == ["a", "b"]


def test_images_on_s3_are_located_checked_and_read(s3_bucket, tmp_path):
    store = resolve(f"s3://{s3_bucket}/in")
    store.write_file_atomic("imgs/a.png", png(tmp_path / "a.png"))
    store.write_file_atomic("p.parquet", write(tmp_path, {"prompt": ["x", "y"],
                                                          "image": ["imgs/a.png", "imgs/gone.png"]}))
    items = check_prompts((f"s3://{s3_bucket}/in/p.parquet",), GEN, REQUIRED, "error")[2]
    assert items[0].image == f"s3://{s3_bucket}/in/imgs/a.png"   # relative to the Parquet object
    data, sha = images.read(items[0])
    assert sha == hashlib.sha256((tmp_path / "a.png").read_bytes()).hexdigest()
    assert images.load(items[0])[0].size == (64, 64)
    with pytest.raises(images.ImageError, match="gone.png: not found"):
        images.read(items[1])


# ---------------------------------------------------------------------------------------------
# Issue 47: each unusable image said as what it is, before anything is read into memory; a store
# that does not answer is the store's fault (exit 3), not missing images (exit 2).

def special_files(tmp_path) -> dict:
    """Real files of each kind a row may name: {kind: path}, and a good image."""
    os.makedirs(tmp_path / "a_dir.png")
    os.symlink("loop.png", tmp_path / "loop.png")                  # points at itself
    os.mkfifo(tmp_path / "fifo.png")                               # a read would wait for a writer
    with open(tmp_path / "big.png", "wb") as f:                    # sparse: no disk, no memory
        f.truncate(images.MAX_BYTES + 1)
    return {"good": png(tmp_path / "good.png"), "directory": str(tmp_path / "a_dir.png"),
            "loop": str(tmp_path / "loop.png"), "zero": "/dev/zero", "fifo": str(tmp_path / "fifo.png"),
            "big": str(tmp_path / "big.png"), "missing": str(tmp_path / "gone.png")}


CAUSES = {"directory": "a directory, not a regular file: not read",
          "loop": "a symlink loop (too many levels of symbolic links)",
          "zero": "a character device, not a regular file: not read",
          "fifo": "a FIFO (named pipe), not a regular file: not read",
          "big": "larger than prompts.max_image_mib (64 MiB): not read; shrink it or raise the "
                 "setting\nits size: 64.0 MiB (67108865 bytes)",
          "missing": "not found"}


def test_each_unusable_local_image_has_its_own_cause_at_the_check_and_the_read(tmp_path, caplog):
    files = special_files(tmp_path)
    p = write(tmp_path, {"id": list(files), "prompt": list(files), "image": list(files.values())})
    with caplog.at_level(logging.WARNING, logger="runner"):
        items = check(p)[2]                                        # the good one: the job runs
    for k, (kind, path) in enumerate(files.items()):
        if kind != "good":
            line = (f"1 of the {len(files)} images looked up: {CAUSES[kind].splitlines()[0]} (their "
                    f"rows will fail): {p}:{k}: image {path}")
            assert line in caplog.text, (kind, caplog.text)
    assert "good.png" not in caplog.text
    t0 = time.monotonic()
    for it in items[1:]:                                           # the worker's read
        with pytest.raises(images.ImageError) as e:
            images.read(it)
        assert str(e.value) == f"image {it.image}: {CAUSES[it.id]}"
    # nothing waited (a store's or a stalled mount's wait is LOOKUP_S), nothing big read
    # (/dev/zero never ends): a bound on what is done, not on the machine's speed (it was 5 s)
    assert time.monotonic() - t0 < images.LOOKUP_S / 2
    assert images.read(items[0])[1] == hashlib.sha256(open(files["good"], "rb").read()).hexdigest()
    # the bound is a setting: the good image (a few hundred bytes) over a bound of 100 bytes
    with pytest.raises(images.ImageError, match=r"good.png: larger than prompts.max_image_mib"):
        images.read(items[0], max_bytes=100)
    # a rerun's hashes read nothing unusable either: None, so those rows are redone (and fail)
    rows = {it.id: {} for it in items}
    hashes = {it.id: it.image_sha256 for it in images.fill_hashes(items, rows)}
    assert hashes["good"] and all(hashes[k] is None for k in CAUSES)


def test_when_no_image_can_be_read_each_cause_is_named_exit_2(tmp_path):
    files = special_files(tmp_path)
    del files["good"]
    p = write(tmp_path, {"id": list(files), "prompt": list(files), "image": list(files.values())})
    with pytest.raises(PromptError) as e:
        check(p)
    text = str(e.value)
    assert text.startswith("none of the 6 images looked up can be read (of 6 named)")
    for k, kind in enumerate(list(files)[:5]):                     # the first 5 are listed
        assert f"p.parquet:{k}: image {files[kind]}: {CAUSES[kind].splitlines()[0]}\n" in text
    assert "exists" not in text and "does not exist" not in text


def test_on_s3_a_prefix_is_a_directory_and_a_large_object_is_refused_unread(s3_bucket, tmp_path):
    store = resolve(f"s3://{s3_bucket}/in")
    store.write_file_atomic("imgs/a.png", png(tmp_path / "a.png"))
    store.write_bytes_atomic("imgs/sub/b.png", b"x")
    p = write(tmp_path, {"id": ["a", "prefix", "gone"], "prompt": ["x", "y", "z"],
                         "image": [f"s3://{s3_bucket}/in/imgs/{k}" for k in ("a.png", "sub", "gone.png")]})
    items = check(p)[2]
    with pytest.raises(images.ImageError, match=r"imgs/sub: a directory \(a prefix of other objects\)"):
        images.read(items[1])
    with pytest.raises(images.ImageError, match=r"imgs/gone.png: not found$"):
        images.read(items[2])
    with pytest.raises(images.ImageError, match=r"imgs/a.png: larger than prompts.max_image_mib"):
        images.read(items[0], max_bytes=10)
    causes = images._look_up_all([it.image for it in items], max_bytes=10)
    assert [c.splitlines()[0] if c else c for c in causes.values()] == [
        "larger than prompts.max_image_mib (10 bytes): not read; shrink it or raise the setting",
        "a directory (a prefix of other objects), not an object: not read", "not found"]


@pytest.mark.parametrize("endpoint, why", [
    ("closed", "refused the connection (nothing listens at its address)"),
    ("http://no-such-host.invalid:9000", "has a host name that does not resolve (DNS)")])
def test_an_unreachable_image_store_is_named_not_the_images(tmp_path, monkeypatch, endpoint, why):
    """A refused connection or a name that does not resolve: the store is said to be the cause
    (`StoreUnreachable`, exit 3 from the CLI), not "none of the images exists"."""
    if endpoint == "closed":
        endpoint = f"http://127.0.0.1:{free_port()}"               # a port nothing listens on
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                 "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    p = write(tmp_path, {"prompt": ["x", "y"], "image": ["s3://imgs/a.png", "s3://imgs/b.png"]})
    t0 = time.monotonic()
    with pytest.raises(images.StoreUnreachable) as e:
        check(p)
    assert time.monotonic() - t0 < images.LOOKUP_S + 5
    assert str(e.value).startswith(f"the image store s3://imgs: {why} (looked up 2 of the job's "
                                   f"images there, e.g. {p}:0: s3://imgs/a.png)")


def test_a_frozen_image_store_at_the_check_is_exit_3_naming_it_within_30_s(tmp_path, monkeypatch,
                                                                           capsys, caplog):
    """Issue 47: images on an S3 server frozen with SIGSTOP (connections accepted, no answer)
    were "none of the 2 images looked up exists", exit 2 after 12 s, silent meanwhile. Now: a
    line after 2 s saying what the job waits for, then exit 3 naming the store, within 30 s; no
    worker is started."""
    from s3server import moto_server
    from runner.driver import job
    monkeypatch.setattr(job, "STOPS", [])
    with moto_server() as server:          # its own server: freezing the session's would stall others
        server.create_bucket("frozen")
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        store = resolve("s3://frozen/imgs")
        for name in ("a.png", "b.png"):
            store.write_file_atomic(name, png(tmp_path / name))
        p = write(tmp_path, {"prompt": ["x", "y"], "image": ["s3://frozen/imgs/a.png",
                                                             "s3://frozen/imgs/b.png"]})
        args = ["job=wan_i2v_batch", "model.source=tiny", f"prompts.path={p}",
                f"output.dir={tmp_path / 'out'}", "job.name=j", "generation.height=64",
                "generation.width=48", "generation.num_frames=5"]

        def no_pool(*a):
            raise AssertionError("a worker was started")
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with caplog.at_level(logging.INFO, logger="runner"):
                rc = job.main(args, start_pool=no_pool)
            took = time.monotonic() - t0
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    err = capsys.readouterr().err
    assert rc == 3 and took <= 30, (rc, took, err[-2000:])
    assert "waiting for s3://frozen to answer the lookup of the job's images (up to 20 s)" in caplog.text
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the image store s3://frozen: did not answer in time"), err[-2000:]
    assert "exist" not in err


def test_ctrl_c_during_the_input_check_ends_the_job_at_once(tmp_path, monkeypatch, capsys, caplog):
    """Issue 75: Ctrl-C during the input check was only recorded, for a dispatch loop that had not
    begun: the checks ran on to their end first (6.4 s; a frozen image store's lookup: its whole
    LOOKUP_S). Nothing is held or written before the job's lock, so a stop there ends the job at
    once: SIGINT while the driver waits on a frozen store's lookup is exit 130 saying nothing ran,
    long before the lookup's 20 s (a signal reaches a waiting main thread in milliseconds,
    whatever the load: the bound is the wait it would otherwise have taken, not a speed)."""
    import threading
    from s3server import moto_server
    from runner.driver import job
    monkeypatch.setattr(job, "STOPS", [])
    monkeypatch.setattr(job, "EXIT_AT_ONCE", [])
    waiting, sent = threading.Event(), []

    class OnWait(logging.Handler):      # the driver says it waits for the store: Ctrl-C then
        def emit(self, record):
            if "to answer the lookup of the job's images" in record.getMessage():
                waiting.set()

    def ctrl_c():
        if waiting.wait(120):
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
    with moto_server() as server:          # its own server: freezing the session's would stall others
        server.create_bucket("frozen")
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        store = resolve("s3://frozen/imgs")
        store.write_file_atomic("a.png", png(tmp_path / "a.png"))
        p = write(tmp_path, {"prompt": ["x"], "image": ["s3://frozen/imgs/a.png"]})
        args = ["job=wan_i2v_batch", "model.source=tiny", f"prompts.path={p}",
                f"output.dir={tmp_path / 'out'}", "job.name=j", "generation.height=64",
                "generation.width=48", "generation.num_frames=5"]

        def no_pool(*a):
            raise AssertionError("a worker was started")
        handler = OnWait()
        logging.getLogger("runner").addHandler(handler)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            threading.Thread(target=ctrl_c, daemon=True).start()
            with caplog.at_level(logging.INFO, logger="runner"):
                rc = job.main(args, start_pool=no_pool)
            took = time.monotonic() - sent[0]
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
            logging.getLogger("runner").removeHandler(handler)
    err = capsys.readouterr().err
    print(f"Ctrl-C to the end of main: {took:.2f} s")
    assert rc == 130 and took < images.LOOKUP_S / 4, (rc, took, err[-2000:])
    assert err.strip().splitlines()[-1] == ("interrupted: the input was being checked: nothing "
                                            "ran; rerun the same command to resume"), err[-2000:]
    assert job.EXIT_AT_ONCE          # the lookup's thread is left: the process must not wait for it
    assert not (tmp_path / "out" / "j" / ".lock").exists()
