"""`pytest -m gpu -n auto --dist loadgroup` over a machine's GPUs (tests/gpu_spread.py), on CPU: a
fake `nvidia-smi` lists three GPUs, and a probe suite (gpu_spread as its only plugin) records what
each test process sees.

What could break: `-n auto` not one worker per GPU; two workers on one GPU, or a worker seeing all
of them; CUDA_VISIBLE_DEVICES narrowed by the caller ignored; the report not naming the GPU; the
longest tests not first."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

PROBE = """
import json, os, time, pytest

@pytest.mark.gpu
@pytest.mark.parametrize("k", range(6))
def test_probe(k):
    time.sleep(0.3)
    with open(os.path.join(os.environ["PROBE_OUT"], f"{k}.json"), "w") as f:
        json.dump([os.environ["PYTEST_XDIST_WORKER"], os.environ["CUDA_VISIBLE_DEVICES"]], f)
    print(f"probe {k}: max abs 0.0{k}")

@pytest.mark.gpu
def test_full_size_compiled_chunked_decode_matches_eager():   # a name gpu_spread.SLOW_FIRST lists
    pass

def test_cpu():
    pass
"""

NVIDIA_SMI = """#!/bin/sh
echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)"
echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)"
echo "GPU 2: NVIDIA H200 (UUID: GPU-cccc)"
"""


@pytest.fixture
def probe(tmp_path):
    """run(*args, **env) -> (completed pytest, {test k: (worker, CUDA_VISIBLE_DEVICES)})."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text(NVIDIA_SMI)
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_probe.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "suite" / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a GPU test\n")

    def run(*args, **env):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        out.mkdir()
        e = {k: v for k, v in os.environ.items()
             if k not in ("CUDA_VISIBLE_DEVICES", "RUNNER_TEST_GPUS") and not k.startswith("PYTEST_")}
        # TMPDIR: the probe suite's own temp files (its pytest's base temp, `pytest-of-*`: the
        # PYTEST_ variables are not passed on) under this test's directory, not the session's
        e.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{e['PATH']}", PROBE_OUT=str(out),
                 TMPDIR=str(tmp_path),
                 PYTHONPATH=os.pathsep.join(p for p in (TESTS, e.get("PYTHONPATH")) if p), **env)
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_spread", "-p", "no:cacheprovider",
                            *args], cwd=tmp_path / "suite", env=e, capture_output=True, text=True,
                           timeout=120)
        seen = {int(p.stem): tuple(json.loads(p.read_text())) for p in out.glob("*.json")}
        return r, seen
    return run


def test_one_process_per_gpu_each_seeing_its_own(probe):
    r, seen = probe("-m", "gpu", "-n", "auto", "--dist", "loadgroup", "-v")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "created: 3/3 workers" in r.stdout and "3 workers [7 items]" in r.stdout   # not test_cpu
    assert len(seen) == 6
    assert {w: g for w, g in seen.values()} == {"gw0": "0", "gw1": "1", "gw2": "2"}
    # the summary names each test's GPU: worker, index and model
    summary = r.stdout.split("gpu tests: the GPU that ran each")[1]
    for k, (w, g) in seen.items():
        name = "NVIDIA H200" if g == "2" else "NVIDIA H100 80GB HBM3"
        assert f"{w} GPU {g} ({name})  passed" in summary
        lines = summary.splitlines()
        (at,) = [i for i, line in enumerate(lines) if line.endswith(f"test_probe[{k}]")]
        assert f"{w} GPU {g}" in lines[at] and lines[at + 1] == f"    probe {k}: max abs 0.0{k}"
    # then where each process's seconds went: its tests (0.3 s each, at least), the rest apart
    times = re.findall(r"^(gw\d) GPU \d \(.*?\): first test at \+([\d.]+) s, last done at \+([\d.]+) s "
                       r"\(session ends \+([\d.]+) s\); tests ([\d.]+) s, between them (-?[\d.]+) s$",
                       summary, re.M)
    assert sorted(t[0] for t in times) == ["gw0", "gw1", "gw2"], summary
    ran = {w: sum(1 for k, (w2, _) in seen.items() if w2 == w) for w in ("gw0", "gw1", "gw2")}
    for w, first, last, end, busy, gaps in times:
        first, last, end, busy, gaps = map(float, (first, last, end, busy, gaps))
        assert 0 < first <= last <= end and busy >= 0.3 * ran[w] and gaps >= -0.01


def test_a_narrowed_cuda_visible_devices_is_kept(probe):
    r, seen = probe("-m", "gpu", "-n", "auto", "--dist", "loadgroup", CUDA_VISIBLE_DEVICES="2,0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "created: 2/2 workers" in r.stdout
    assert {w: g for w, g in seen.values()} == {"gw0": "2", "gw1": "0"}
    assert "gw0 GPU 2 (NVIDIA H200)" in r.stdout


def test_gpu_runs_start_with_the_longest_tests_and_other_runs_keep_their_order(probe):
    r, _ = probe("-m", "gpu", "--collect-only", "-q")
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert ids[0].endswith("test_full_size_compiled_chunked_decode_matches_eager")
    assert len(ids) == 7 and not any(i.endswith("test_cpu") for i in ids)
    r, _ = probe("--collect-only", "-q")
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert ids[0].endswith("test_probe[0]") and ids[-1].endswith("test_cpu")
