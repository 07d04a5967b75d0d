"""The core S3 job cases against a real GCS-compatible server: `gcp-storage-emulator` (PyPI) on
127.0.0.1, reached the way Google's own clients reach an emulator, through STORAGE_EMULATOR_HOST
(runner.io.storage then uses pyarrow's GcsFileSystem with that endpoint, anonymous). Prompts in,
media, records and results out, and a driver SIGKILL followed by a rerun."""
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest
from conftest import free_port
from test_s3_jobs import sigkill_then_rerun


pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gcs_server():
    for _ in range(3):     # another process may take the free port between picking and binding it
        proc, endpoint = _start_gcs_emulator(free_port())
        if proc:
            break
    else:
        pytest.fail("gcp-storage-emulator exited at start 3 times (its port taken each time?)")
    yield endpoint
    proc.terminate()
    proc.wait(10)


def _start_gcs_emulator(port: int):
    """(process, endpoint) once it answers; (None, None) if its port was taken (it then logs the
    bind error but does not exit: its server thread died) or it exited at start."""
    exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    proc = subprocess.Popen([exe, "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):            # until it answers (its start takes about a second)
        if proc.poll() is not None or any("Address already in use" in line for line in out):
            proc.kill()
            proc.wait(10)
            return None, None
        try:
            urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail("gcp-storage-emulator did not answer within 10 s:\n" + "".join(out[-20:]))


@pytest.fixture
def gcs_bucket(gcs_server, monkeypatch):
    import json
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    name = f"test-{uuid.uuid4().hex[:12]}"
    # the JSON API's bucket insert (pyarrow's create_dir wants a project id the emulator lacks)
    req = urllib.request.Request(f"{gcs_server}/storage/v1/b?project=test", method="POST",
                                 data=json.dumps({"name": name}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).close()
    return name


def args(job, prompts, bucket, *extra):
    return [f"job={job}", f"prompts.path={prompts}", f"output.dir=gs://{bucket}/out", "job.name=j",
            "generation.height=64", "generation.width=64", "generation.num_inference_steps=2",
            "ray.cpu_workers=1", *extra]


def test_driver_sigkill_then_rerun_on_gcs(gcs_bucket, write_prompts):
    """Prompts read from the bucket, media, record, results, summary, metrics and report written
    to it (`check_store`), a driver SIGKILL and the rerun (was also a separate demo job: the same
    checks, one CLI job more)."""
    sigkill_then_rerun("gs", gcs_bucket, write_prompts)
