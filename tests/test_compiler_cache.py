"""compiler.cache: keys change with every input; corrupt/truncated/wrong-key artifacts never load."""

import logging
import os
from pathlib import Path

import pytest
import torch

from compiler import cache
from runner.serve.models import ModelSpec, build_pipeline
from conftest import GUARD_S, full_disk

SHAPES = {"height": 64, "width": 64, "batch": 1}


@pytest.fixture(scope="module")
def pipe():
    return build_pipeline(ModelSpec("pixart_alpha_512", source="tiny"))


def test_key_is_stable_and_file_name_safe(pipe):
    k = cache.cache_key(pipe, "O2", SHAPES)
    assert k == cache.cache_key(pipe, {"mode": "O2"}, dict(SHAPES))
    assert cache.artifact_path("/tmp", k).name == f"{k}.artifact"


@pytest.mark.parametrize("field, value", [("torch", "9.9.9"), ("triton", "0.0"), ("cuda", "99.9"),
                                          ("gpu", "NVIDIA H200"), ("arch", "sm_80")])
def test_key_changes_with_environment(pipe, monkeypatch, field, value):
    before = cache.cache_key(pipe, "O2", SHAPES)
    env = cache.environment()
    monkeypatch.setattr(cache, "environment", lambda: {**env, field: value})
    assert cache.cache_key(pipe, "O2", SHAPES) != before


def test_key_changes_with_the_diffusers_version(pipe, monkeypatch):
    """The models' forward code (what Dynamo traces) is diffusers': another version, other graphs.
    A key that stayed the same let a job load the old artifact, report a cache hit, compile every
    graph anyway, and never write the new artifact (a hit in cache_dir is not published again)."""
    import diffusers
    before = cache.cache_key(pipe, "O2", SHAPES)
    monkeypatch.setattr(diffusers, "__version__", "0.0.1")
    assert cache.cache_key(pipe, "O2", SHAPES) != before


def test_key_changes_with_the_compilers_own_code(pipe, monkeypatch, tmp_path):
    """Our transforms decide the graphs too (fused QKV, attention kernels, step reuse): an edit
    to any of the compiler's sources makes another key, as a new torch version does."""
    import shutil
    src = tmp_path / "compiler"
    shutil.copytree(cache.SOURCE, src, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache, "SOURCE", src)
    cache.source_digest.cache_clear()
    before = cache.cache_key(pipe, "O2", SHAPES)
    (src / "transforms.py").write_text((src / "transforms.py").read_text() + "\n# edited\n")
    cache.source_digest.cache_clear()
    try:
        assert cache.cache_key(pipe, "O2", SHAPES) != before
    finally:
        monkeypatch.undo()
        cache.source_digest.cache_clear()


def test_key_changes_with_model_dtype_shapes_mode_and_options(pipe):
    base = cache.cache_key(pipe, "O2", SHAPES)
    keys = {
        cache.cache_key(pipe, "O3", SHAPES),
        cache.cache_key(pipe, {"mode": "O2", "dynamic": True}, SHAPES),
        cache.cache_key(pipe, {"mode": "O2", "options": {"max_fusion_size": 32}}, SHAPES),
        cache.cache_key(pipe, {"mode": "O2", "memory_format": "channels_last"}, SHAPES),
        cache.cache_key(pipe, "O2", {**SHAPES, "height": 128}),
        cache.cache_key(pipe, "O2", {**SHAPES, "batch": 2}),
    }
    assert base not in keys and len(keys) == 6
    other = build_pipeline(ModelSpec("pixart_alpha_512", source="tiny", dtype="bf16"))
    assert cache.cache_key(other, "O2", SHAPES) != base
    latte = build_pipeline(ModelSpec("latte1", source="tiny"))
    assert cache.cache_key(latte, "O2", SHAPES) != base
    pipe.transformer.register_to_config(num_layers=99)  # any config change
    try:
        assert cache.cache_key(pipe, "O2", SHAPES) != base
    finally:
        pipe.transformer.register_to_config(num_layers=2)


def _compile_small_function(act=torch.nn.functional.gelu) -> bytes:
    """A small function compiled on CPU into the configured cache directory: a real
    save_cache_artifacts payload (a cache hit records one too). Another `act`, another graph
    and kernel: none of this process's in-memory caches has it."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def f(x):
        return act(x * 2 + 1).sum(-1)

    f(torch.randn(8, 8))
    blob = cache.pack_artifact("k1")
    assert blob is not None
    return blob


@pytest.fixture(scope="module")
def artifact():
    """A real payload, compiled in the session's compile cache. Module-scoped fixtures run once
    per test process that needs them (pytest -n's worksteal splits this module): a fresh cache
    directory here, as before, built its precompiled header (~6 CPU-s of g++) in 3 processes of a
    run; only the test of that header needs a fresh directory."""
    return _compile_small_function()


def test_precompiled_headers_go_under_the_cache_directory(tmp_path):
    """Inductor's precompiled C++ header of the CPU kernels (~150 MB) goes with the rest of the
    compile, not to `<temp folder>/torchinductor_<user>`, where it was left (issue 47)."""
    from conftest import compile_cache
    cc = cache.configure_cache_dir(tmp_path / "cc")
    try:
        _compile_small_function(torch.nn.functional.silu)   # not the artifact's kernel
    finally:
        cache.configure_cache_dir(compile_cache())  # the session's again, for the other tests
    assert list((cc / "inductor" / "precompiled_headers").glob("*.h.gch"))


@pytest.fixture
def loads(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda b: calls.append(b))
    return calls


def test_artifact_write_on_a_full_disk_is_a_warning_not_a_crash(artifact, tmp_path, caplog):
    """A local compile.cache_dir on a full disk: the compiling worker, whose graphs are compiled and
    warm, logs that the artifact was not saved and serves (as with an s3:// cache_dir); it raised
    ENOSPC out of its warm-up, which lost the worker, and its replacement did the same."""
    from runner.serve import compile_cache
    d = tmp_path / "cc"
    d.mkdir()
    report = {"cache_key": "k1", "role": "compile"}
    with full_disk(d), caplog.at_level(logging.WARNING, logger="runner"):
        compile_cache.publish(None, report, str(d))
        assert sorted(p.name for p in d.iterdir()) == [".filler"]     # no temp file left
    assert "compile artifact not saved" in caplog.text and "No space left" in caplog.text


def test_an_unreadable_artifact_in_cache_dir_is_a_warning_and_the_worker_compiles(tmp_path, caplog):
    """A directory where `<key>.artifact` belongs (a real IsADirectoryError; an I/O error or
    another user's file reads the same): `read_artifact` raised it out of the warm-up of every
    worker of the key, and the job ended with no worker. Now the worker says so and compiles."""
    from runner.serve import compile_cache
    (tmp_path / "k1.artifact").mkdir()
    with caplog.at_level(logging.WARNING, logger="runner"):
        report = compile_cache.warm_from_shared_cache(None, "k1", 0, str(tmp_path), 100.0)
    assert report["role"] == "compile" and report["cache_hit"] is False
    assert f"compile cache {tmp_path} not readable (IsADirectoryError" in caplog.text


def _as_another_user(fn, timeout_s: float = 30.0):
    """fn()'s value as a process of another user than the files' writer computes it: as root, a
    forked child that drops to nobody (65534), ended after `timeout_s`; else this process."""
    import pickle
    import signal
    import time
    if os.geteuid() != 0:
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                       # the child: never returns into pytest
        try:
            os.setgid(65534)
            os.setuid(65534)
            out = ("ok", fn())
        except BaseException as e:
            out = ("raised", f"{type(e).__name__}: {e}")
        os.write(w, pickle.dumps(out))
        os._exit(0)
    os.close(w)
    end = time.monotonic() + timeout_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the other user's process did not end within {timeout_s:.0f} s")
        time.sleep(0.05)
    with os.fdopen(r, "rb") as f:
        status, value = pickle.loads(f.read())
    assert status == "ok", value
    return value


@pytest.fixture
def shared_dir():
    """A cache directory another user can reach (every directory above it traversable by all):
    pytest's tmp_path is under a 0700 directory of this user."""
    import shutil
    import stat
    import tempfile
    d = tempfile.mkdtemp(prefix="runner-shared-cc-", dir=os.environ.get("PYTEST_DEBUG_TEMPROOT"))
    os.chmod(d, 0o755)
    try:
        for up in Path(d).parents:
            if not os.stat(up).st_mode & stat.S_IXOTH:
                pytest.skip(f"{up} is not traversable by other users")
        yield Path(d)
    finally:
        shutil.rmtree(d)


def test_an_artifact_is_readable_by_other_users_and_one_that_is_not_is_compiled_past(shared_dir):
    """A compile.cache_dir that the jobs of several users share: artifacts were written 0600
    (mkstemp's mode), so another user's worker got PermissionError at its warm-up (every one of
    its workers, every job, until the file was removed). Now they are written 0644, and one
    left unreadable by an older version (`k0`) is a warning, then a compile."""
    from runner.serve import compile_cache
    cache.write_artifact(shared_dir, "k1", b"compiled kernels")
    assert (shared_dir / "k1.artifact").stat().st_mode & 0o777 == 0o644
    cache.write_artifact(shared_dir, "k0", b"an older version's")
    os.chmod(shared_dir / "k0.artifact", 0o600 if os.geteuid() == 0 else 0)

    def read_both():
        warned = []
        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())
        logging.getLogger("runner").addHandler(handler)
        try:
            return (compile_cache.read_artifact(str(shared_dir), "k1"),
                    compile_cache.read_artifact(str(shared_dir), "k0"), warned)
        finally:
            logging.getLogger("runner").removeHandler(handler)
    k1, k0, warned = _as_another_user(read_both)
    assert k1 == b"compiled kernels" and k0 is None
    assert [w for w in warned if "not readable (PermissionError" in w], warned


def test_good_artifact_loads(artifact, loads, tmp_path):
    cache.write_artifact(tmp_path, "k1", artifact)
    assert cache.read_artifact(tmp_path, "k1") == artifact
    assert cache.read_artifact(tmp_path, "missing") is None
    assert [p.name for p in tmp_path.iterdir()] == ["k1.artifact"]  # no temp files left
    assert cache.unpack_and_load(artifact, "k1") is True
    assert len(loads) == 1 and loads[0] == cache.verify(artifact, "k1")


def test_real_load_roundtrip(artifact):
    assert cache.unpack_and_load(artifact, "k1") is True


def _flip(b: bytes, i: int) -> bytes:
    return b[:i] + bytes([b[i] ^ 0xFF]) + b[i + 1:]


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:10], "truncated"),
    (lambda b: b"", "truncated"),
    (lambda b: _flip(b, len(b) - 1), "sha256"),
    (lambda b: _flip(b, 0), "magic"),
    (lambda b: b + b"x", "header says"),
    (lambda b: b"not an artifact at all, just bytes" * 4, "magic"),
])
def test_corrupt_artifact_falls_back(artifact, loads, caplog, damage, reason):
    with caplog.at_level(logging.WARNING, logger="compiler.cache"):
        assert cache.unpack_and_load(damage(artifact), "k1") is False
    assert loads == []  # never handed to torch
    assert reason in caplog.text and "compiling instead" in caplog.text


def test_wrong_key_falls_back(artifact, loads, caplog):
    with caplog.at_level(logging.WARNING, logger="compiler.cache"):
        assert cache.unpack_and_load(artifact, "k2") is False
    assert loads == [] and "key mismatch" in caplog.text


def test_not_bytes_and_failing_load_fall_back(artifact, monkeypatch, caplog):
    assert cache.unpack_and_load(None, "k1") is False

    def boom(b):
        raise RuntimeError("incompatible")
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", boom)
    with caplog.at_level(logging.WARNING, logger="compiler.cache"):
        assert cache.unpack_and_load(artifact, "k1") is False
    assert "incompatible" in caplog.text


def test_prewarm_imports_inductor_in_the_background():
    """A fresh interpreter: after prewarm's thread ends, Inductor's modules are loaded, so a warm
    first call does not pay for importing them."""
    import subprocess
    import sys
    code = ("import sys, torch, compiler\n"
            "assert 'torch._inductor.compile_fx' not in sys.modules\n"
            "t = compiler.prewarm(); t.join(300); assert not t.is_alive()\n"
            "assert 'torch._inductor.lowering' in sys.modules and 'torch._inductor.compile_fx' in sys.modules\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD_S)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
