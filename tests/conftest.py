"""Shared fixtures. GPU tests (`@pytest.mark.gpu`) are skipped, with the reason shown, without CUDA."""
import contextlib
import os
import tempfile
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # tests never touch the network
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# Upper bound on any one CLI run or wait in a test: a guard against a hang, not a measured figure
# (bounds a test asserts are written where it asserts them). CI machines have run this suite at
# half the speed of a quiet 2-core box, with a CLI run's Ray start and model load taking minutes.
GUARD_S = 900

FAULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")


def fault_env(faults: str) -> dict:
    """Environment for a CLI run with injected faults: RUNNER_FAULTS and tests/faults first on
    PYTHONPATH, whose sitecustomize.py wraps the worker's functions in every process of the job;
    RUNNER_FAULT_DIR, a fresh directory for the markers of `crash_once` faults."""
    path = os.pathsep.join(p for p in (FAULTS_DIR, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "RUNNER_FAULTS": faults, "PYTHONPATH": path,
            "RUNNER_FAULT_DIR": tempfile.mkdtemp(prefix="runner-faults-")}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def write_prompts(tmp_path):
    """write_prompts({"prompt": [...], ...}, name="p.parquet") -> path of a Parquet file."""
    def write(columns: dict, name: str = "prompts.parquet"):
        path = tmp_path / name
        pq.write_table(pa.table(columns), path)
        return str(path)
    return write


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's standalone server, tests/s3server.py) on 127.0.0.1 for the
    whole session; fails the test, with the server's log, if it cannot start."""
    from s3server import moto_server
    with contextlib.ExitStack() as stack:
        for _ in range(3):  # another process may take the free port between picking and binding it
            try:
                server = stack.enter_context(moto_server())
                break
            except RuntimeError as e:
                error = e
        else:
            pytest.fail(str(error), pytrace=False)
        yield server


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A fresh, empty bucket on the session's S3 server, with the AWS_* environment that points
    runner.storage at it set for this test only. Returns the bucket name."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    return name
