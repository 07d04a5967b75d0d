"""The suite's temp-folder check (tests/conftest.py, `pytest_sessionfinish`) and what keeps the two
files it found on the GPU machine (issue 61) out of it: `.ses` and `mat-debug-<pid>.log` are
onnxruntime's telemetry (Microsoft's 1DS SDK, started when onnxruntime is imported; diffusers
imports it wherever it loads a pipeline from a checkpoint), which ORT_DISABLE_TELEMETRY=1 stops."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import GUARD_S, _describe, cli_env


def test_the_session_and_a_jobs_ray_workers_have_onnxruntime_telemetry_off(monkeypatch):
    """Set for the session's processes (inherited), and handed to a job's Ray workers on a cluster,
    which are the cluster's processes, not the CLI's children."""
    assert os.environ["ORT_DISABLE_TELEMETRY"] == "1"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    runtime_env = json.loads(cli_env()["RAY_JOB_CONFIG_JSON_ENV_VAR"])["runtime_env"]
    assert runtime_env["env_vars"]["ORT_DISABLE_TELEMETRY"] == "1"


def test_the_check_names_onnxruntime_as_the_maker_of_its_files(tmp_path):
    """The two files as the GPU run left them (benchmarks/data/2026-11-27-startup-scaling-h100x4/
    pixart/finite_check.log): the check's line names their maker; another file's names none."""
    (tmp_path / ".ses").write_bytes(b"1795742542373\nbf5d1cc2-6af3-fd92-70b8-58f8fb48e854\n")
    (tmp_path / "mat-debug-964.log").write_bytes(b"")
    (tmp_path / "mat-debug-x.log").write_bytes(b"")
    (tmp_path / "other.ses").write_bytes(b"")
    for name in (".ses", "mat-debug-964.log"):
        line = _describe(str(tmp_path / name))
        assert line.startswith(f"{name}: ") and "made by onnxruntime's telemetry" in line, line
    assert "51 bytes" in _describe(str(tmp_path / ".ses"))
    for name in ("mat-debug-x.log", "other.ses"):
        assert "made by" not in _describe(str(tmp_path / name))


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None,
                    reason="onnxruntime is not installed here (the GPU machine's image has 1.30.0)")
def test_importing_onnxruntime_in_the_sessions_environment_leaves_nothing_in_tmpdir(tmp_path):
    """Where onnxruntime is installed: imported with the session's environment and a fresh TMPDIR,
    it writes nothing there (without ORT_DISABLE_TELEMETRY, 1.30.0 leaves `.ses` and
    `mat-debug-<pid>.log`; not run here: it would also write under ~/.cache and send events)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    subprocess.run([sys.executable, "-c", "import onnxruntime"], check=True, timeout=GUARD_S,
                   env={**os.environ, "TMPDIR": str(tmp)})
    assert sorted(os.listdir(tmp)) == []
