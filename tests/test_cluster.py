"""Multi-node Ray on one machine: a head and a worker node, each advertising one GPU resource (the
tiny models run on CPU; one job worker per node), the fewest nodes that show a job across nodes. Every process of a test cluster runs with the same
RAY_AUTH_MODE (token auth is on by default for local clusters in Ray 2.60)."""
import json
import shutil
import os
import subprocess
import sys
import tempfile
import time

import pyarrow.parquet as pq
import pytest
from conftest import GUARD_S, fault_dir, fault_env, free_ports, stop_ray
from test_faults import finish_within, record_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# its own clusters: not the session's (RAY_ADDRESS, tests/conftest.py)
ENV = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled",
       "RAY_USAGE_STATS_ENABLED": "0"}
pytestmark = pytest.mark.e2e


def sh(cmd, timeout=GUARD_S, **kw):
    r = subprocess.run(cmd, env=kw.pop("env", ENV), capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def add_node_within(cluster, bound_s: float, **node_args):
    """`cluster.add_node(**node_args)`, with `bound_s` rather than Ray's fixed 30 s for the new raylet
    to register with the GCS (`raylet_start_wait_time_s = 30` in ray/_private/node.py): a 2-core
    machine under load can take longer. On that timeout the half-started node (its processes run,
    but Ray drops the Node object) is adopted once it registers, or killed and the test failed."""
    from ray._private import node as ray_node
    from ray._private.services import wait_for_node
    started, start = [], ray_node.Node.start_ray_processes

    def recording(self):
        started.append(self)
        return start(self)

    t0 = time.monotonic()
    ray_node.Node.start_ray_processes = recording
    try:
        return cluster.add_node(**node_args)
    except Exception as e:
        if "timed out during startup" not in str(e) or not started:
            raise
        node = started[-1]
    finally:
        ray_node.Node.start_ray_processes = start
    try:
        wait_for_node(node.gcs_address, node.plasma_store_socket_name,
                      max(1.0, bound_s - (time.monotonic() - t0)))
    except TimeoutError:
        node.kill_all_processes(check_alive=False, allow_graceful=False)
        raise AssertionError(f"a worker node did not register with the GCS in {bound_s:.0f} s")
    cluster.worker_nodes.add(node)     # so remove_node/shutdown stop it like any other
    return node


def submit(dashboard: str, runtime_env: dict, args: list, env=ENV, timeout=GUARD_S):
    """`ray job submit ... -- python -m runner <args>`, the working directory uploaded. Retried
    while the head's job agent is not up yet (`ray start` returns before it is; nothing was
    submitted then). Paced with wait_ready (tests/faults): both worker nodes serve."""
    runtime_env = {"excludes": [".venv", "outputs", ".git"], **runtime_env}
    runtime_env["env_vars"] = {"RUNNER_FAULTS": "wait_ready", "PYTHONPATH": "tests/faults",
                               "RUNNER_FAULT_DIR": fault_dir(),
                               **runtime_env.get("env_vars", {})}
    cmd = [*RAY, "job", "submit", "--address", dashboard, "--working-dir", ROOT,
           "--runtime-env-json", json.dumps(runtime_env), "--", "python", "-m", "runner", *args]
    end = time.monotonic() + 120
    while True:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if "No available agent to submit job" not in r.stderr or time.monotonic() > end:
            break
        time.sleep(2)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture
def ray_cluster():
    """A head (with the dashboard `ray job submit` talks to) and a worker node. Their processes'
    temporary files go under the cluster's own temp dir (TMPDIR), removed with it: the processes
    (the Ray client server among them, on a port of its own) are killed at the end (`stop_ray`),
    so what they would remove at their exit stays (the dashboard's multiprocessing `pymp-*`
    directory)."""
    # Each node's job agent on a free port: its default (52365) is taken by any other Ray on the
    # machine (another test's under pytest -n), and the head's dashboard then finds no agent to run
    # a submitted job on; the head's Ray client server too (its default 10001 is any Ray's). Picked
    # together: ports picked one by one can come out equal.
    port, dash, head_agent, node_agent, client = free_ports(5)
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")    # short: Ray's socket paths
    env = {**ENV, "TMPDIR": temp_dir}
    sh([*RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
        "--num-gpus=1", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}", "--disable-usage-stats", f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={head_agent}", f"--ray-client-server-port={client}"], env=env)
    try:
        sh([*RAY, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1",
            "--num-cpus=2", "--num-gpus=1", f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={node_agent}"], env=env)
        yield dict(address=f"127.0.0.1:{port}", dashboard=f"http://127.0.0.1:{dash}")
    finally:
        stop_ray(temp_dir, gcs_port=port)
        shutil.rmtree(temp_dir, ignore_errors=True)


# `ray job submit` onto this multi-node cluster: tests/test_s3_jobs.py's
# test_ray_job_submit_with_outputs_on_s3_and_no_shared_dir (both worker nodes serve, outputs in a
# bucket as on a real cluster without a shared filesystem; the same job on a local output directory
# was a second full cluster run checking less).


def test_worker_node_removed_mid_job(tmp_path, write_prompts, monkeypatch):
    import ray
    from ray.cluster_utils import Cluster
    # The nodes' processes inherit this environment: auth off, and paced workers (tests/faults).
    for k, v in {**fault_env("slow:0.5"), "RAY_AUTH_MODE": "disabled"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)      # its own cluster, not the session's
    ids = [f"q{i:02d}" for i in range(12)]
    prompts = write_prompts({"prompt": [f"p {i}" for i in range(12)], "id": ids})
    # the head serves one worker, the doomed node the other
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, num_gpus=1, include_dashboard=False,
        _system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 3}))
    try:
        doomed = add_node_within(cluster, GUARD_S, num_cpus=2, num_gpus=1)
        job_dir = tmp_path / "demo_image"
        p = subprocess.Popen(
            [sys.executable, "-m", "runner", "job=demo_image", f"prompts.path={prompts}",
             f"output.dir={tmp_path}", f"ray.address={cluster.address}", "run.shard_size=1",
             "generation.num_inference_steps=2"],
            cwd=ROOT, env={**ENV, **fault_env("slow:0.5")}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        t0 = time.time()
        while len(record_rows(job_dir)) < 3:
            assert p.poll() is None, f"job ended early ({p.returncode}): {p.stderr.read()[-4000:]}"
            assert time.time() - t0 < GUARD_S, "job made no progress"
            time.sleep(0.2)
        cluster.remove_node(doomed)
        out, err = finish_within(p, GUARD_S, "the job that lost a node")
        assert p.returncode == 0, err[-4000:]
        assert "lost" in err
        table = pq.read_table(job_dir / "results.parquet").to_pylist()
        assert sorted(r["id"] for r in table) == ids and all(r["status"] == "ok" for r in table)
        assert sorted(os.listdir(job_dir / "media")) == [f"{i}.png" for i in ids]
    finally:
        ray.shutdown()
        cluster.shutdown()
