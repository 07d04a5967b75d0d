"""Shared fixtures. GPU tests (`@pytest.mark.gpu`) are skipped, with the reason shown, without CUDA.

The CLI runs of a test session share one Ray cluster (`ray start --head`, started here before any
test and stopped after the last), as jobs on a real cluster do: a job's own local Ray costs ~15
CPU-seconds of daemons and start-up, ~40 % of a small job on the 2-core CI machine. RAY_ADDRESS
names it to every CLI run. What a job's Ray workers need from a test's environment (faults, storage
endpoints) goes with the job as its runtime_env (`cli_env`), since the workers are the cluster's
processes, not the CLI's children. Tests about a job's own local Ray (its quiet start, a second
driver on a new cluster, `ray job submit` onto a multi-node cluster) drop RAY_ADDRESS. Set
RAY_ADDRESS yourself to run the suite on another cluster, or RUNNER_TEST_RAY=local for a local Ray
per job as before.
"""
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings

# pytest -n 4 on a small machine (CI: 2 cores) runs 4 test processes, plus their CLI runs and Ray
# workers, at once. Left at the defaults, each in-process torch spins 2 OpenMP threads (spin-waiting
# burns CPU when the cores are oversubscribed) and each compiling process starts Inductor's pool of
# 2 compile subprocesses (each importing torch). One thread and compiles in-process there: the
# suite's CPU 628 -> 499 s and its wall 447 -> 383 s on the 2-core machine, same tests (one run
# each; later runs of the same code gave 479-567 CPU-s and 354-426 s: that machine varies). Set
# before torch (and its OpenMP runtime) loads; inherited by every process the session starts.
# And Inductor trusts the CPU's flags for its vector ISA (AVX512 here) instead of compiling and
# loading a probe program per ISA in every fresh cache directory: ~9 CPU-s per directory (a tiny
# compile in a fresh directory: 19 -> 9.5 CPU-s), and the suite's processes start several (the
# session's, a job's own local cache, a test's cold cache). A machine with 8+ cores (the GPU box)
# keeps the defaults; set any of these variables yourself to override.
if (os.cpu_count() or 1) < 8:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# First: in a pytest-xdist worker on a GPU machine, pins this process to its GPU (CUDA_VISIBLE_DEVICES)
# before torch is imported; its hooks spread `pytest -m gpu -n auto --dist loadgroup` over the GPUs.
import gpu_spread  # noqa: F401,E402

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

pytest_plugins = ["gpu_spread"]

# A suite started in the background of a non-interactive shell (`cmd &`, as a CI wrapper may) begins
# with SIGINT ignored, and the runner, as Python does, then leaves Ctrl-C alone (`nohup` semantics):
# the tests that send SIGINT to a job in this process would see nothing happen. Give them Python's
# default, as a terminal-started suite has.
import signal
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # tests never touch the network
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# onnxruntime (1.29 on; the GPU machine's image has 1.30.0) starts Microsoft's 1DS telemetry SDK
# ("MAT") when it is imported, and diffusers imports it in every process that loads a pipeline from
# a checkpoint (`load_sub_model` checks each component against `OnnxRuntimeModel`, whose module
# imports onnxruntime where it is installed). The SDK writes `.ses` (its session file: a launch
# time in ms and an id, 51 bytes) and an empty `mat-debug-<pid>.log` into TMPDIR, a device id and
# an event database under ~/.cache/Microsoft/DeveloperTools/.onnxruntime, and sends events: the
# two files the gpu suite's temp-folder check found (issue 61). ORT_DISABLE_TELEMETRY=1 turns all
# of it off (onnxruntime 1.30.0 on a CPU: `import onnxruntime` with a fresh TMPDIR left both
# files; with the variable, nothing). Inherited by every process the session starts.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


# Upper bound on any one CLI run or wait in a test: a guard against a hang, not a measured figure
# (bounds a test asserts are written where it asserts them). CI machines have run this suite at
# half the speed of a quiet 2-core box, with a CLI run's Ray start and model load taking minutes.
GUARD_S = 900

FAULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")


# What a job's Ray workers take from a test's environment (names, or prefixes ending in "_").
WORKER_ENV = ("RUNNER_", "AWS_", "STORAGE_EMULATOR_HOST", "PYTHONPATH", "HF_HUB_OFFLINE",
              "ORT_DISABLE_TELEMETRY")


def fault_env(faults: str, **extra) -> dict:
    """Environment for a CLI run with injected faults: RUNNER_FAULTS and tests/faults first on
    PYTHONPATH, whose sitecustomize.py wraps the worker's functions in every process of the job;
    RUNNER_FAULT_DIR, a fresh directory for the markers of `wait_ready` (and the run's mark:
    `ray_workers_of` finds the job's worker processes by it)."""
    path = os.pathsep.join(p for p in (FAULTS_DIR, os.environ.get("PYTHONPATH")) if p)
    return cli_env(RUNNER_FAULTS=faults, PYTHONPATH=path, RUNNER_FAULT_DIR=fault_dir(), **extra)


_FAULT_DIRS: list[str] = []     # this test process's fault directories: removed as its session ends


def fault_dir() -> str:
    """A fresh directory for a CLI run's fault markers (RUNNER_FAULT_DIR), removed when the test
    process's session ends (`pytest_sessionfinish`): each run leaving one behind was 27 empty
    `runner-faults-*` directories in the temp folder per suite run (issue 47)."""
    d = tempfile.mkdtemp(prefix="runner-faults-")
    _FAULT_DIRS.append(d)
    return d


def cli_env(**extra) -> dict:
    """os.environ + `extra` for a CLI run. On a cluster (RAY_ADDRESS) the job's Ray workers get
    WORKER_ENV's variables as the job's runtime_env, as `ray job submit --runtime-env-json` hands
    them over: Ray's `ray.init` reads RAY_JOB_CONFIG_JSON_ENV_VAR, which is how a submitted job's
    driver gets it."""
    env = {**os.environ, **extra}
    if env.get("RUNNER_TEST_TIMELINE"):    # tags the run's processes for tests/cpu_sampler.py
        env.setdefault("RUNNER_TEST_ID", os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0])
    if env.get("RAY_ADDRESS"):
        env_vars = {k: v for k, v in env.items()
                    if any(k == w or (w.endswith("_") and k.startswith(w)) for w in WORKER_ENV)}
        env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"env_vars": env_vars}})
    return env


def ray_workers_of(env: dict) -> list[int]:
    """PIDs of the `ray::WorkerActor` actor processes of the CLI run started with `env` (a `fault_env`):
    found by its RUNNER_FAULT_DIR, so not another test's (pytest -n runs several jobs at once, on
    one cluster or each on its own local Ray)."""
    import psutil
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if ("ray::WorkerActor" in " ".join(p.info["cmdline"] or [])
                    and p.environ().get("RUNNER_FAULT_DIR") == env["RUNNER_FAULT_DIR"]):
                found.append(p.pid)
    return found


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: each socket stays bound until all are picked, as the OS may hand a
    just-closed port out again (two of a Ray start's ports once came out equal, and it refused)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def stop_ray(temp_dir: str, gcs_port: int | None = None) -> None:
    """Kill one Ray's processes only (`ray stop` would kill every Ray on the machine, also another
    test's under pytest -n): those whose command line names its temp dir or its GCS port (the
    head's Ray client server names only `--address=HOST:PORT`; orphaned when its `ray start` has
    ended, it outlived the cluster by a minute or two), and their children (the agents a raylet
    starts rename themselves)."""
    import psutil

    def ours(cmdline: list[str]) -> bool:
        return any(temp_dir in a or (gcs_port is not None and a.startswith("--address=")
                                     and a.endswith(f":{gcs_port}")) for a in cmdline)
    roots = [p for p in psutil.process_iter(["cmdline"]) if ours(p.info["cmdline"] or [])]
    procs = list(roots)
    for p in roots:
        with contextlib.suppress(psutil.Error):
            procs += p.children(recursive=True)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=30)


_SESSION: dict = {}


@contextlib.contextmanager
def tmpfs(path, size: str):
    """`path` (an existing empty directory) as a real disk of `size` (a tmpfs mounted there),
    unmounted after. Mounting needs root (CI runs as root); elsewhere the test is skipped, with
    the reason shown."""
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


def fill_disk(path, name: str = ".filler") -> str:
    """Fills the disk under `path` until a write raises ENOSPC (unbuffered: nothing is left to
    flush); returns the filler file's path (removing it frees the disk)."""
    filler = os.path.join(path, name)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"x" * 4096)
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def full_disk(path, size: str = "4k"):
    """`path` (an existing empty directory) as a real full disk: a tmpfs of `size` mounted there
    and filled, so every write raises ENOSPC; unmounted after (skipped where mounting needs root
    this process lacks)."""
    with tmpfs(path, size):
        fill_disk(path)
        yield path


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A new memory cgroup limited to `limit_bytes`, under this process's own (cgroup v1's memory
    controller, or v2 where the memory controller is enabled for children): its directory, which
    a process joins by writing its pid to `cgroup.procs`; removed after (once its processes are
    gone: 10 s at most). Skipped, with the reason, where none can be made (not root, no memory
    controller, a read-only /sys/fs/cgroup)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError as e:
        pytest.skip(f"no cgroups here ({e})")
    parents = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            parents.append(("v1", os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))))
        elif controllers == "":
            d = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            try:
                if "memory" in open(os.path.join(d, "cgroup.subtree_control")).read().split():
                    parents.append(("v2", d))
            except OSError:
                pass
    if not parents:
        pytest.skip("no memory cgroup controller this process may divide (cgroup v1 memory, or v2 "
                    "with memory in cgroup.subtree_control)")
    version, parent = parents[0]
    d = os.path.join(parent, f"runner-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(d)
        with open(os.path.join(d, "memory.limit_in_bytes" if version == "v1" else "memory.max"),
                  "w") as f:
            f.write(str(limit_bytes))
        if version == "v1":          # no swap either (where swap accounting exists)
            with contextlib.suppress(OSError):
                with open(os.path.join(d, "memory.memsw.limit_in_bytes"), "w") as f:
                    f.write(str(limit_bytes))
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(d)
        pytest.skip(f"cannot make a memory cgroup under {parent} ({e}; needs root and a "
                    f"writable /sys/fs/cgroup)")
    try:
        yield d
    finally:
        deadline = time.time() + 10
        while True:
            try:
                os.rmdir(d)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)


def compile_cache() -> str:
    """The session's compile cache directory (Inductor's and Triton's caches under it, as
    `compiler.cache.configure_cache_dir` lays them out): every in-process compile of the session
    uses it, and a CLI run or bench that does not test a cold cache passes it as
    `compile.cache_dir` / `cache_dir`. The tiny models' graphs recur across tests, and a cold
    compile is Inductor's C++ build (tens of CPU-seconds on CI's 2 cores); a cache hit still
    runs Dynamo and AOTAutograd, so only the C++ build is shared, never a test's outcome."""
    return os.environ["RUNNER_TEST_COMPILE_CACHE"]


def pytest_configure(config):
    """The session's temp folder, compile cache directory and Ray cluster, made once by the main
    process (pytest -n's workers inherit the environment). Every test process configures the
    compile cache for its in-process compiles: the environment does not carry where Inductor
    puts its precompiled headers (`compiler.cache.configure_cache_dir`)."""
    from compiler.cache import configure_cache_dir
    if hasattr(config, "workerinput"):
        configure_cache_dir(compile_cache())
        return
    session_temp_folder()
    if not os.environ.get("RUNNER_TEST_COMPILE_CACHE"):
        os.environ["RUNNER_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="runner-test-cc-")
        _SESSION["compile_cache"] = os.environ["RUNNER_TEST_COMPILE_CACHE"]
    configure_cache_dir(compile_cache())
    if not (os.environ.get("RAY_ADDRESS") or os.environ.get("RUNNER_TEST_RAY") == "local"):
        start_shared_ray(config)
    if gpu_spread._gpu_run(config) and gpu_spread.listed_gpus():
        prebuild_int8_attention()


def prebuild_int8_attention() -> None:
    """A gpu run's `int8-attention` kernel, built by a subprocess of the main process from the
    session's start, into the session's compile cache (its build directory: the environment the
    test processes inherit), while they start and collect. Built there at a worker's start instead
    (`compiler.prewarm`), its ~1 min of nvcc lay on the suite's longest path: the A14B 720P test,
    first in its process, waited 32 s in `compile_pipe` after its 32 s load (2 x H200,
    2026-11-28). No GPU is needed (the build names sm_90a); a build that fails changes nothing:
    the test processes build as before, and report what failed."""
    # nvcc's own temporary files under the compile cache, which the temp-folder check expects
    tmp = os.path.join(compile_cache(), "nvcc-tmp")
    os.makedirs(tmp, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": tmp}
    _SESSION["int8_build"] = subprocess.Popen(
        [sys.executable, "-c", "from compiler.kernels.int8_attention import extension; extension()"],
        env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def session_temp_folder() -> None:
    """Every temporary file of the session (its test processes, the CLI runs and Ray workers they
    start, the servers) under one directory of its own, TMPDIR for all of them: what is still
    there once every test and fixture is done is a leak, which `pytest_sessionfinish` names and
    fails the session for; the folder goes at the end (`pytest_unconfigure`). Pytest's own
    base temp stays in the temp folder as before (it keeps the last 3 runs' `tmp_path`
    directories on purpose: PYTEST_DEBUG_TEMPROOT)."""
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="runner-suite-")   # short: a local Ray's sockets go under it
    os.environ["TMPDIR"] = tempfile.tempdir = root
    _SESSION["temp"] = root


# Left in the session's temp folder by design, not by our code: the session directories (logs)
# of the tests that start a local Ray of their own; Ray never removes them.
KEPT_BY_DESIGN = ("ray",)

# Left-overs whose maker is known (a name pattern, the maker and what lets it write there): named by
# the check beside the file. They still fail the session: each means a process that escaped the
# setting that stops it.
KNOWN_MAKERS = (
    (r"\.ses|mat-debug-\d+\.log",
     "onnxruntime's telemetry (1DS SDK; mat-debug-<pid>: the importing process), in a process "
     "without ORT_DISABLE_TELEMETRY=1 (set at the top of tests/conftest.py)"),
)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """This process's fault directories removed; then, in the main process (after every test
    process is done), the session's temp folder checked: anything left there is a leak."""
    import shutil
    for d in _FAULT_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    root = _SESSION.get("temp")
    if root is None or hasattr(session.config, "workerinput"):
        return
    own = {os.path.basename(_SESSION.get("compile_cache", "")), *KEPT_BY_DESIGN}
    left = sorted(set(os.listdir(root)) - own)
    if left:
        tw = session.config.get_terminal_writer()
        tw.line()
        tw.line(f"the suite left {len(left)} files or directories in its temp folder ({root}): "
                f"{', '.join(left[:20])}; whatever makes them must remove them", red=True)
        for name in left[:5]:      # what each is, to find its maker (a GPU run named two unknowns)
            tw.line(f"  {_describe(os.path.join(root, name))}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _describe(path: str) -> str:
    """One line on a left-over file: its name, size, age and first bytes (or a folder's entries),
    and its maker where KNOWN_MAKERS knows it."""
    import re
    import stat
    import time
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            return f"{os.path.basename(path)}/: {sorted(os.listdir(path))[:8]}"
        if not stat.S_ISREG(st.st_mode):    # a FIFO's open() would block; a socket, a link
            return f"{os.path.basename(path)}: mode {stat.filemode(st.st_mode)}"
        with open(path, "rb") as f:
            head = f.read(160)
    except OSError as e:
        return f"{os.path.basename(path)}: {e}"
    line = (f"{os.path.basename(path)}: {st.st_size} bytes, written {time.time() - st.st_mtime:.0f} s "
            f"ago, starts {head!r}")
    return line + "".join(f"; made by {maker}" for pattern, maker in KNOWN_MAKERS
                          if re.fullmatch(pattern, os.path.basename(path)))


def start_shared_ray(config):
    """The session's Ray cluster (RAY_ADDRESS for every CLI run), started here and waited for in
    `pytest_runtestloop`: its start (~8 s on the 2-core CI machine) overlaps with pytest -n's
    workers importing torch and collecting the tests (~14 s there), instead of coming before them.
    No test runs before the wait: xdist's controller sends tests from its own runtestloop, which
    runs after this module's. Its worker processes start with this environment; token auth is off
    for every process of the session, as one cluster's processes must agree on it."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")    # short: Ray's socket paths
    port = free_port()
    _SESSION.update(proc=_popen_ray(port, temp_dir), port=port, temp_dir=temp_dir, ray_waited=False)
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"      # before pytest -n's workers inherit it


def _popen_ray(port: int, temp_dir: str) -> subprocess.Popen:
    client, agent, metrics, env_agent = free_ports(4)
    return subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
         "--node-ip-address=127.0.0.1", f"--port={port}", f"--temp-dir={temp_dir}",
         # slots for every job pytest -n runs at once; the CPU itself is shared by the OS
         "--num-cpus=64", "--include-dashboard=false", "--disable-usage-stats",
         "--object-store-memory=1000000000", f"--ray-client-server-port={client}",
         # another Ray on the machine (a test's own) must not find its default ports taken
         f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={env_agent}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_ray(proc: subprocess.Popen, timeout: float) -> tuple[bool, list[str]]:
    lines, t0 = [], time.monotonic()
    for line in proc.stdout:                 # `--block` keeps running once the cluster is up
        lines.append(line)
        if "Ray runtime started" in line:
            return True, lines
        if time.monotonic() - t0 > timeout:
            break
    return False, lines


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """In the process that started the session's Ray (the main one): wait until it is up before
    any test runs (a test process's own runtestloop has nothing to wait for)."""
    if "proc" not in _SESSION or _SESSION["ray_waited"]:
        return
    _SESSION["ray_waited"] = True
    for attempt in range(3):
        started, lines = _wait_ray(_SESSION["proc"], timeout=180)
        if started:
            break
        # A port picked free may be taken by another process before Ray binds it (a start then
        # exits at once, naming the port): again with fresh ports; the GCS port stays, as pytest
        # -n's workers already have it in RAY_ADDRESS.
        stop_ray(_SESSION["temp_dir"], _SESSION["port"])
        with contextlib.suppress(subprocess.TimeoutExpired):
            _SESSION["proc"].wait(timeout=30)
        if attempt == 2 or not any("port" in line for line in lines):
            raise pytest.UsageError("the session's Ray cluster did not start:\n" + "".join(lines[-40:]))
        _SESSION["proc"] = _popen_ray(_SESSION["port"], _SESSION["temp_dir"])
    proc = _SESSION["proc"]
    # its further output (worker deaths it reports) is not read: drain it so it never blocks
    import threading
    threading.Thread(target=proc.stdout.read, daemon=True).start()


def pytest_unconfigure(config):
    import shutil
    build = _SESSION.pop("int8_build", None)
    if build is not None and build.poll() is None:   # a run that ended first: its nvcc stopped
        with contextlib.suppress(ProcessLookupError):
            os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    if "compile_cache" in _SESSION:
        shutil.rmtree(_SESSION.pop("compile_cache"), ignore_errors=True)
    if "proc" in _SESSION:
        proc, temp_dir = _SESSION.pop("proc"), _SESSION.pop("temp_dir")
        proc.terminate()                     # `ray start --block` stops its cluster on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        stop_ray(temp_dir, _SESSION["port"])   # whatever did not stop with it
        shutil.rmtree(temp_dir, ignore_errors=True)
    if "temp" in _SESSION:                   # last: the cluster's workers wrote under it
        shutil.rmtree(_SESSION.pop("temp"), ignore_errors=True)


# The tests of the longest wall time on the 2-core CI machine (35-120 s each in a -n 4 run), at
# the heads of pytest -n's slices, dealt round-robin: FIRST[k::n] leads worker k's slice. xdist's
# worksteal hands each worker a contiguous slice of the collection and steals from the slices'
# tails, so a worker runs the head of its own slice itself: a long test in the middle of a slice ran
# late (a run of 2026-11-26: the stalled store's 80 s the tail), and a slice whose head held many
# long tests bounded the run. The second slice's head held test_compile_job's 190 s test, then
# (in collection order) every CLI fault test, the e2e demo video, GCS and i2v jobs: ~620 s of the
# long tests of a 727 s run on one worker while the others stole its short tail. Order: the rounds
# of 4 pair a test that mostly waits (a stalled store, hang timeouts) with ones that compute.
FIRST = (# round 1
         "test_s3_jobs.py::test_a_stalled_store_ends_the_job_within_120_s_naming_it",
         "test_compile_job.py::test_second_worker_warms_from_the_first_workers_artifact",
         "test_s3_jobs.py::test_ray_job_submit_with_outputs_on_s3_and_no_shared_dir",
         "test_cluster.py::test_worker_node_removed_mid_job",
         # round 2
         "test_scaling.py::test_cold_then_warm_runs_each_from_its_own_cache",
         "test_compiler_compile.py::test_compiled_matches_eager_shares_graphs_and_never_recompiles[pixart_alpha_512]",
         "test_step_reuse.py::test_o2_with_reuse_on_cpu_matches_eager_reuse_without_recompiles[flux1_dev-blocks1]",
         "test_step_cache.py::test_bench_reports_error_and_psnr_of_each_lossy_variant",
         # round 3 (the second worker, behind test_compile_job's: the frozen store, which mostly waits)
         "test_faults.py::test_a_row_that_runs_its_worker_out_of_memory_fails_naming_it",
         "test_i2v_jobs.py::test_an_image_store_frozen_mid_job_stops_it_exit_3_and_a_rerun_makes_the_rest",
         "test_faults.py::test_a_hung_row_ends_the_job_by_itself_and_a_rerun_retries_it[1]",
         "test_faults.py::test_a_hung_row_ends_the_job_by_itself_and_a_rerun_retries_it[2]",
         # round 4: not e2e (in-process), ~100 s of compiling: it started last, at 960 s of a
         # 1,064 s run, and ran alone to the end (tests/timeline.py, 2026-12-02)
         "test_worker.py::test_a_compiled_wan_worker_serves_a_second_row_size",
         "test_adapters.py::test_per_row_adapters_switch_in_place_with_no_recompile_and_equal_single_adapter_jobs",
         "test_step_reuse.py::test_o2_with_reuse_on_cpu_matches_eager_reuse_without_recompiles[wan22_t2v_a14b-blocks0]",
         "test_simulate.py::test_the_bench_end_to_end_on_small_numbers")


def long_tests_first(config, items) -> None:
    """Under `-n N --dist worksteal`: FIRST's tests, then the other `e2e` tests (real CLI jobs on
    Ray: tens of seconds each) in collection order, dealt round-robin to the heads of the N slices
    worksteal deals out (as `WorkStealingScheduling.check_schedule` sizes them), the rest in
    collection order: the long tests start first, spread over the workers, and the short ones
    balance the workers' ends (stolen from the tails). Every worker collects, so each computes the
    same order, as xdist requires (a worker's own `dist` option is "no": the main process's comes
    in workerinput, `pytest_configure_node`)."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if n < 2 or getattr(config, "workerinput", {}).get("dist") != "worksteal":
        return
    first = [it for name in FIRST for it in items if it.nodeid.endswith(name)]
    first += [it for it in items if it not in first and it.get_closest_marker("e2e") is not None]
    rest = [it for it in items if it not in first]
    ordered, left = [], len(items)
    for k in range(n):
        size = left // (n - k)
        head = first[k::n]
        ordered += head + rest[:max(0, size - len(head))]
        rest = rest[max(0, size - len(head)):]
        left -= size
    items[:] = ordered + rest


# RUNNER_TEST_TIMELINE=FILE: each test's start and end (wall clock) and the xdist worker that ran
# it, one JSON line per test appended to FILE, to see where a run's minutes go (its idle tail):
#   python -m pytest -q -n 4 --dist worksteal; python tests/timeline.py FILE
def _cpu_now() -> tuple[float, float]:
    """(this process's CPU-s, its waited-for children's CPU-s): a test's share is the difference."""
    import resource
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), kids.ru_utime + kids.ru_stime


def pytest_runtest_logstart(nodeid, location):
    if os.environ.get("RUNNER_TEST_TIMELINE"):
        _SESSION.setdefault("started", {})[nodeid] = (time.time(), *_cpu_now())


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get("RUNNER_TEST_TIMELINE")
    started = _SESSION.get("started", {}).pop(nodeid, None)
    if path and started is not None:
        (t0, cpu0, kids0), (cpu, kids) = started, _cpu_now()
        with open(path, "a") as f:    # one short write per line: lines of 4 workers do not mix
            f.write(json.dumps({"id": nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                "start": t0, "end": time.time(), "cpu": cpu - cpu0,
                                "children_cpu": kids - kids0}) + "\n")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist, in the main process, per worker: hands it the --dist mode (`long_tests_first`)."""
    node.workerinput["dist"] = node.config.getoption("dist")


@pytest.hookimpl(trylast=True)   # after -k / -m deselection: the slices count what runs
def pytest_collection_modifyitems(config, items):
    long_tests_first(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (on the GPU machine: `pytest -m gpu -n auto --dist loadgroup`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def signal_handlers():
    """`runner.driver.job.main` run in-process installs SIGTERM/SIGINT handlers that only record a stop
    for its dispatch loop: put back after each test, so that the test process stops on them."""
    import signal
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that builds a `runner.serve.worker.Worker` in-process starts `compiler.prewarm`'s import
    thread; `compile_pipe` waits for it, but a test whose compile never runs (mocked, or failing
    first) left it importing Inductor into the next tests. Each import that makes a logger then
    raced pytest's logging set-up at the start of a test phase, which walks logging's logger dict
    without its lock ("RuntimeError: dictionary changed size during iteration" at the set-up of a
    test in tests/test_compiler_cache.py failed CI once). Joined here, at the end of the call
    phase that started it (a fixture's teardown would be too late: the teardown phase's logging
    set-up comes first); seconds of imports that happen anyway."""
    try:
        return (yield)
    finally:
        import threading
        for t in threading.enumerate():
            if t.name == "compiler-prewarm":
                t.join(300)


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
    runner.io.storage at it set for this test only. Returns the bucket name."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    return name


@pytest.fixture(autouse=True)
def _gpu_memory_returned(request):
    """After each gpu test, what it left on the GPU is collected and handed back, so one test's
    leftovers (a 64 GiB model held by a reference cycle) cannot run the next tests of the same
    process out of memory; what is still allocated after that is named in a warning. The garbage
    collector runs only where more than 1 GiB is still reserved once the allocator's free cache is
    handed back (reserved, not allocated: a CUDA graph's private pool, which a step graph in a
    reference cycle keeps, is reserved): a full collection of a process holding Inductor's graphs
    costs ~0.9 s, which after every test was ~80 s of the 2-GPU suite (2026-11-28: setup +
    teardown 0.9-1.2 s a test, kernel tests included)."""
    yield
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_initialized():
        return
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() > 2**30:
        gc.collect()
        torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() / 2**30
    if left > 2:
        warnings.warn(f"{request.node.nodeid} left {left:.1f} GiB allocated on the GPU")


# ---------------------------------------------------------------------------------------------
# gpu tests: one full-size model at a time per test process

def free_pipeline(pipe, others_held: bool = False) -> None:
    """Drop a pipeline's modules before the next build (a gpu test process holds one model at a
    time: A14B is 64 GiB): their weights moved to the meta device (freed even where a reference outlives the
    pipeline: on an H100 28 GiB of A14B's, 35 of I2V 14B's, were still allocated into the next
    build, which then found too little memory; what held them is not identified), off the pipeline, its image
    twin and Dynamo's caches. `others_held`: the test still holds another pipeline (the build
    its variants are copied from), whose memory is not a leftover: no warning."""
    pipe.__dict__.pop("_image_pipeline", None)
    for name, c in list(pipe.components.items()):
        if isinstance(c, torch.nn.Module):
            c.to("meta")
            setattr(pipe, name, None)
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated() / 2**30
        if left > 2 and not others_held:   # what held the 14B weights before: named if it recurs
            warnings.warn(f"{left:.1f} GiB still allocated after freeing {type(pipe).__name__}; "
                          f"largest live CUDA tensors: {_live_cuda_tensors()}")


def _live_cuda_tensors(n: int = 8) -> str:
    """The n largest CUDA tensors the garbage collector can see, with the types of what refers to
    each (a tensor held only from C++, e.g. a CUDA graph's pool, is not among them)."""
    from torch._subclasses.fake_tensor import FakeTensor
    found = []
    with warnings.catch_warnings():      # isinstance on some lazy objects warns (deprecations)
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            with contextlib.suppress(Exception):
                # a FakeTensor (Dynamo's shape-only stand-in, kept by its compile records) says
                # it is on CUDA but holds no memory: 2026-11-28 such "tensors" were named here
                if isinstance(o, torch.Tensor) and o.is_cuda and not isinstance(o, FakeTensor):
                    found.append((o.untyped_storage().nbytes(), o))
    found.sort(key=lambda t: -t[0])
    return "; ".join(
        f"{b / 2**30:.2f} GiB {tuple(t.shape)} {t.dtype} held by "
        f"{sorted({type(r).__name__ for r in gc.get_referrers(t)} - {'list', 'tuple', 'frame'})}"
        for b, t in found[:n]) or "none visible to gc"
