"""What a new user sees (issue 17): `--help`, start-up phases and progress lines, a no-op rerun,
a quiet embedded Ray, the summary's legend; and the two structural rules behind them: one config
schema, and `compiler` independent of `runner`."""
import ast
import contextlib
import os
import pathlib

import pytest
from conftest import GUARD_S

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_compiler_never_imports_runner():
    """`compiler` is a library; `runner` is its application (the benchmark lives in runner/bench.py)."""
    bad = []
    for path in sorted((ROOT / "compiler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "runner"]
    assert bad == []


# ---------------------------------------------------------------------------------------------
# One source of truth for config (runner/config.py's dataclasses).

def test_schema_is_the_only_place_defaults_live():
    from dataclasses import fields

    from runner.config import ModelSpec, defaults, schema
    assert not (ROOT / "conf" / "defaults.yaml").exists()
    keys = schema()
    assert all(k.doc for k in keys.values()), "every key has a one-line doc"
    d = defaults()
    assert {f"{s}.{k}" for s in d for k in d[s]} == set(keys)
    # ModelSpec is the schema's model section (its defaults used to disagree: tiny vs pretrained)
    for f in fields(ModelSpec):
        assert getattr(ModelSpec(), f.name) == d.model[f.name]
    assert ModelSpec("sd21").source == "pretrained" == d.model.source


def test_compile_section_defaults_match_the_compiler():
    from compiler.options import parse_options
    from runner.config import CompileConfig, defaults
    section = {k: v for k, v in defaults().compile.items() if k != "cache_dir"}
    assert parse_options({"mode": "none"}).to_dict() == section
    assert CompileConfig().options == parse_options("none")


def test_the_documented_key_table_is_generated_from_the_schema():
    from runner.config import markdown_table
    doc = (ROOT / "docs" / "configuration.md").read_text()
    start = doc.index("<!-- config-table")
    body = doc[doc.index("\n", start) + 1:doc.index("<!-- /config-table -->")].strip()
    assert body == markdown_table(), ("docs/configuration.md's key table is stale: paste "
                                      "`python -m runner.config --markdown`")
    # each row four cells: a doc's "a | b" escaped (it split rows into up to 17 cells)
    rows = [r.replace("\\|", "") for r in body.splitlines()]
    assert [r.count("|") for r in rows] == [5] * len(rows)


def test_the_documented_job_list_is_generated_from_jobs():
    """docs/configuration.md's job list is `python -m runner.config --jobs` (it missed five jobs)."""
    from runner.config import available_jobs, jobs_markdown
    doc = (ROOT / "docs" / "configuration.md").read_text()
    start = doc.index("<!-- job-list")
    body = doc[doc.index("\n", start) + 1:doc.index("<!-- /job-list -->")].strip()
    assert body == jobs_markdown(), ("docs/configuration.md's job list is stale: paste "
                                     "`python -m runner.config --jobs`")
    assert [line.split("`")[1] for line in body.splitlines()] == available_jobs()


def test_every_job_file_says_how_to_run_without_weights():
    """Each job file's leading comment names a weightless source (or the job is tiny itself)."""
    from omegaconf import OmegaConf
    from runner.config import JOBS_DIR, available_jobs
    silent = []
    for job in available_jobs():
        text = (JOBS_DIR / f"{job}.yaml").read_text()
        comment = " ".join(line for line in text.splitlines() if line.startswith("#"))
        tiny = OmegaConf.load(JOBS_DIR / f"{job}.yaml").model.get("source") == "tiny"
        if not tiny and "model.source=random" not in comment and "model.source=tiny" not in comment:
            silent.append(job)
    assert silent == []


@pytest.mark.parametrize("arg,needle", [
    ("ray.num_workers=two", "ray.num_workers='two' has the wrong type: expected int or null"),
    ("compile.compile_vae=sometimes", "expected bool or null"),
    ("prompts.path=3.5", None),                      # numbers are accepted where strings are
    ("job.name=2024", None),
])
def test_types_come_from_the_annotations(arg, needle):
    from runner.config import ConfigError, load_config
    if needle is None:
        cfg = load_config(["job=demo_image", arg])
        k, v = arg.split("=")
        assert cfg[k.split(".")[0]][k.split(".")[1]] == v
        return
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(["job=demo_image", arg])


def test_unknown_section_suggests_and_lists_valid_sections():
    from runner.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"did you mean 'generation'\?.*valid keys: \[.*'compile'"):
        load_config(["job=demo_image", "generaton.seed=1"])


# ---------------------------------------------------------------------------------------------
# --help

def test_help_lists_jobs_examples_and_where_keys_are_documented(capsys):
    from runner.config import COMMON_KEYS, available_jobs
    from runner.driver.job import main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m runner job=NAME")
    for job in available_jobs():
        assert f"  {job}  " in out
    examples = out.split("examples:")[1].split("\n\n")[0]
    assert examples.count("python -m runner job=") == 3
    for k in COMMON_KEYS:
        assert k in out
    assert "python -m runner.config" in out and "docs/configuration.md" in out
    for page in ("docs/compiler.md", "docs/failures.md", "docs/models.md"):   # the pages exist
        assert page in out and (ROOT / page).is_file()
    assert "main(argv)" not in out and "results.py" not in out      # no developer docstring


def test_no_arguments_prints_help_and_exits_2(capsys):
    from runner.driver.job import main
    assert main([]) == 2
    assert "examples:" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Start-up phases and progress (runner/driver/progress.py), unit level.

class FakeStream:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_progress_off_a_terminal_prints_plain_lines_from_first_ready(monkeypatch):
    from runner.driver import progress as p
    now = [100.0]
    monkeypatch.setattr(p.time, "monotonic", lambda: now[0])
    stream = FakeStream(tty=False)
    prog = p.Progress(total=100, every_s=10, stream=stream)
    prog.tick()
    now[0] += 30                      # 30 s of start-up: shown nowhere, counted nowhere
    assert stream.text == ""
    prog.start()
    now[0] += 5
    prog.update(10)                   # not due yet
    assert stream.text == ""
    now[0] += 5
    prog.update(10)                   # 10 s after ready: 20 items, 2 items/s, 40 s left
    assert stream.text == "generating: 20/100 items, 2 items/s, 10 s elapsed, ETA 40 s\n"
    now[0] += 40
    prog.update(80)
    prog.close()
    assert stream.text.splitlines()[-1].startswith("generating: 100/100 items, 2 items/s")
    assert "\r" not in stream.text


def test_progress_on_a_terminal_is_a_tqdm_bar_started_at_first_ready():
    from runner.driver.progress import Progress
    stream = FakeStream(tty=True)
    prog = Progress(total=4, stream=stream)
    prog.update(0)
    assert prog.bar is None and stream.text == ""      # no 0 % bar while workers load
    prog.start()
    prog.update(4)
    prog.close()
    assert "\r" in stream.text and "4/4" in stream.text


def test_worker_reports_start_up_phases(tmp_path):
    """The worker keeps its warm-up phases for the driver, which asks for the ones it has not seen
    (the driver shows "loading model" itself while the actor's __init__ runs; CLI test below)."""
    from runner.config import GenerationDefaults
    from runner.serve.models import ModelSpec
    from runner.io.prompts import Constraints
    from runner.config import WorkerConfig
    from runner.serve.worker import Worker

    cfg = WorkerConfig(model=ModelSpec("pixart_alpha_512", source="tiny"),
                       generation=GenerationDefaults(height=64, width=64, num_inference_steps=2),
                       limits=Constraints(size_factor=16, video_length=None, min_steps=2),
                       on_empty="error", job_dir=str(tmp_path), num_threads=1)
    w = Worker(0, cfg)
    assert w.phases(0) == []
    w.warmup()
    assert [p for p, _ in w.phases(0)] == ["warming up"] and w.phases(1) == []
    assert 0 < w.phases(0)[0][1] < 600                 # seconds since the worker started


class PhasesPool:
    """The part of a `dispatch.Pool` PhasePrinter uses: a phases() call is answered when made,
    with the worker's phases at that moment, or raises when the worker is gone."""

    def __init__(self):
        self.recorded, self.gone = [], set()

    def phases(self, worker, since):
        return (worker, since, tuple(self.recorded[since:]))   # hashable, as futures are

    def wait(self, futures, timeout):
        return list(futures)

    def result(self, f):
        worker, since, events = f
        if worker in self.gone:
            raise RuntimeError("actor died")
        return events


def test_phase_printer_shows_the_last_phases_when_a_worker_is_ready(caplog):
    """A phases() call answered before warm-up recorded its phases must not hide them: when the
    slot is ready, the driver asks once more."""
    import logging
    from types import SimpleNamespace
    from runner.driver.progress import PhasePrinter
    pool = PhasesPool()
    slot = SimpleNamespace(rank=0, actor="w0", state="starting")
    printer = PhasePrinter(pool, every_s=0)
    with caplog.at_level(logging.INFO, logger="runner"):
        printer.poll([slot])                           # answered: nothing yet; asked again
        pool.recorded.append(("warming up", 1.0))      # the warm-up runs and returns
        slot.state = "ready"
        printer.poll([slot], flush=slot)
        printer.poll([slot])                           # ready: not asked any more
    assert [r.getMessage() for r in caplog.records] == ["worker 0: starting, then loading model",
                                                        "worker 0: warming up"]

    # a phases() call that fails (the worker gone): logged once, not started over
    pool.gone.add("w1")
    other = SimpleNamespace(rank=1, state="starting", actor="w1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runner"):
        for _ in range(3):
            printer.poll([other])
    assert [r.getMessage() for r in caplog.records] == ["worker 1: starting, then loading model"]


def test_a_long_phase_is_said_again_with_its_seconds(monkeypatch, caplog):
    """Issue 75: an O3 compile printed nothing for 100 s. A phase still running is said again
    15, 30, 45, 60 s into it, then once a minute; a new phase starts its own count."""
    import logging
    from types import SimpleNamespace
    from runner.driver import progress as p
    now = [0.0]
    monkeypatch.setattr(p.time, "monotonic", lambda: now[0])
    pool = PhasesPool()
    slot = SimpleNamespace(rank=0, actor="w0", state="starting")
    printer = p.PhasePrinter(pool, every_s=0)
    with caplog.at_level(logging.INFO, logger="runner"):
        for t in range(200):                              # the dispatch loop's ticks, 1 a second
            now[0] = float(t)
            if t == 20:                                   # the model loaded: compiling
                pool.recorded.append(("compiling and warming up", 20.0))
            printer.poll([slot])
    said = [r.getMessage() for r in caplog.records]
    assert said == ["worker 0: starting, then loading model",
                    "worker 0: starting, then loading model, 15 s",
                    "worker 0: compiling and warming up",
                    *(f"worker 0: compiling and warming up, {s}" for s in
                      ("15 s", "30 s", "45 s", "60 s", "2 min"))], said


# ---------------------------------------------------------------------------------------------
# The summary on the terminal (issue 75: 175 columns, a 15-line legend after every run).

def _worker(rank, gpu=None, **figures):
    """A `summary.worker_detail` row: every figure set, GPU ones only for a GPU worker."""
    from runner.driver.summary import worker_detail
    ms = dict(text_encode=1.5, denoise=812.0, decode=95.3) if gpu else {}
    m = dict(rank=rank, host=f"node-{rank}", gpu_name=gpu, items=40, failed=0, restarts=0,
             model_load_s=61.2, warmup_s=98.7, steady_it_s=12.3, e2e_mean_s=4.12, e2e_p95_s=4.48,
             busy_fraction=0.97, peak_mem_gb=31.4 if gpu else None,
             gpu_util=0.99 if gpu else None, gpu_ms_per_item=ms)
    return worker_detail({**m, **figures})


def test_the_worker_table_fits_100_columns_and_drops_empty_columns():
    from runner.driver.summary import WIDTH, workers_text
    gpu = workers_text([_worker(0, "NVIDIA H200"), _worker(1, "NVIDIA H200", failed=2)])
    assert max(map(len, gpu.splitlines())) <= WIDTH
    assert "gpu_ms_denoise" in gpu and "failed" in gpu and "restarts" not in gpu   # all 0
    assert gpu.count("rank") == 2        # too wide for one block: two, each led by the rank
    cpu = workers_text([_worker(0), _worker(1)])
    assert max(map(len, cpu.splitlines())) <= WIDTH and cpu.count("rank") == 1
    for empty in ("peak_mem_gb", "gpu_util", "gpu_ms_text", "failed", "restarts"):
        assert empty not in cpu
    assert "busy_fraction" in cpu and "steady_it_s" in cpu


def test_workers_of_different_gpu_types_are_grouped_by_type():
    from runner.driver.summary import WIDTH, workers_text
    text = workers_text([_worker(0, "NVIDIA H200"), _worker(1, "NVIDIA A100-SXM4-80GB"),
                         _worker(2, "NVIDIA H200"), _worker(3)])
    assert max(map(len, text.splitlines())) <= WIDTH
    heads = [line for line in text.splitlines() if ": " in line and "worker" in line]
    assert heads == ["CPU: 1 worker, 40 items", "NVIDIA A100-SXM4-80GB: 1 worker, 40 items",
                     "NVIDIA H200: 2 workers, 80 items"]
    h200 = text.split("NVIDIA H200: ")[1]
    assert [line.split()[0] for line in h200.splitlines()[1:] if line.strip()[:1].isdigit()] \
        == ["0", "2", "0", "2"]               # its rows, in both blocks of columns
    cpu = text.split("CPU: ")[1].split("NVIDIA")[0]
    assert "gpu_util" not in cpu               # each group drops its own empty columns


def test_the_legend_is_shown_on_a_terminal_once(monkeypatch, tmp_path):
    from runner.driver.summary import LEGEND
    from runner.driver.terminal import legend_due
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert not legend_due(LEGEND, FakeStream(tty=False))      # a log file: summary.txt has it
    assert legend_due(LEGEND, FakeStream(tty=True))
    assert not legend_due(LEGEND, FakeStream(tty=True))       # the second run's: not again
    assert legend_due(LEGEND + " A new column.", FakeStream(tty=True))   # a changed legend: again
    (tmp_path / "runner").chmod(0o500)                        # state not writable: shown
    try:
        assert legend_due(LEGEND, FakeStream(tty=True))
    finally:
        (tmp_path / "runner").chmod(0o700)


def test_colour_codes_are_kept_off_a_log_file():
    """Ray forwards worker lines with coloured prefixes; a file kept them as raw escapes."""
    import subprocess
    import sys
    code = ("import logging, sys; from runner.driver import job; job._configure_logging(); "
            "print('\\x1b[2m\\x1b[36m(WorkerActor pid=7)\\x1b[0m loaded', file=sys.stderr); "
            "logging.getLogger('runner').info('\\x1b[1;31mred\\x1b[0m line'); "
            "import os; print(os.environ['RAY_COLOR_PREFIX'])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stderr and "(WorkerActor pid=7) loaded" in r.stderr, r.stderr
    assert r.stderr.rstrip().endswith("runner: red line") and r.stdout == "0\n"


def test_plurals():
    from runner.io.outputs import plural
    assert [plural(n, "shard") for n in (0, 1, 2)] == ["0 shards", "1 shard", "2 shards"]
    assert plural(1, "CPU worker") == "1 CPU worker" and plural(3, "entry", "entries") == "3 entries"


def test_a_stop_signal_raises_in_the_dispatch_loop_not_where_it_lands(monkeypatch):
    """SIGTERM (or Ctrl-C) raises nothing where it lands, which could be inside a lock of Ray or
    of the snapshot executor (a driver then hung at exit after its summary); `_check_stop`, called
    by the dispatch loop each second, raises KeyboardInterrupt; a second signal raises at once."""
    import signal
    import threading
    from runner.driver import job
    monkeypatch.setattr(job, "STOPS", [])
    monkeypatch.setattr(job, "CHECKING", [])   # a test that called `run` may have left it set
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    lock = threading.Lock()
    try:
        job._handle_stop_signals()
        job._check_stop()                                  # nothing received: no stop
        with lock:                                         # a handler that raised would leave the
            os.kill(os.getpid(), signal.SIGTERM)           # code under this lock half done
            for _ in range(100):                           # (the handler runs between bytecodes)
                pass
        assert job.STOPS == [signal.SIGTERM] and job._terminated()
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            job._check_stop()
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):
                pass
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_an_exit_that_hangs_ends_with_the_jobs_status():
    """After the summary, an exit that never finishes (here a thread that never ends; in a CI run,
    a driver after SIGTERM) ends within the guard's time, with the job's status and a message."""
    import subprocess
    import sys
    code = ("import threading, sys; from runner.driver.job import exit_within; "
            "threading.Thread(target=threading.Event().wait).start(); "   # not a daemon: blocks exit
            "print('summary'); sys.stdout.flush(); exit_within(3, timeout_s=1.0); sys.exit(3)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 3 and r.stdout == "summary\n"
    assert "took over 1 s; exiting anyway with status 3" in r.stderr


# ---------------------------------------------------------------------------------------------
# The real CLI, once: the demo image job with overrides, its outputs; start-up lines, plain
# progress, quiet Ray, legend; then a no-op rerun.

@pytest.mark.e2e
def test_cli_run_with_overrides_is_quiet_shows_phases_and_a_noop_rerun_keeps_the_summary(tmp_path):
    import subprocess
    import sys
    import imageio.v3 as iio
    from omegaconf import OmegaConf
    from test_e2e import check_job_dir
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "RAY_ADDRESS")}
    args = [sys.executable, "-m", "runner", "job=demo_image", f"output.dir={tmp_path}",
            "generation.height=96", "generation.width=64", "generation.num_inference_steps=2",
            "run.batch_size=3", "ray.cpu_workers=1"]
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 0, r.stderr[-4000:]
    err = r.stderr
    for noise in ("Token authentication", "RAY_AUTH_MODE", "usage stats", "Usage stats"):
        assert noise not in err, err
    # phases before progress, in order; progress as plain lines (stderr is a pipe, not a terminal)
    lines = err.splitlines()
    at = {key: next(i for i, l in enumerate(lines) if key in l)
          for key in ("worker 0: starting, then loading model", "worker 0: warming up", "worker 0: ready at",
                      "generating: 8/8 items")}
    assert list(at.values()) == sorted(at.values()), err
    assert "\r" not in err and "%|" not in err
    # issue 75: the summary fits 100 columns, empty columns dropped; the legend in summary.txt,
    # not under every run's table (stdout is not a terminal here)
    summary = r.stdout[r.stdout.index("job demo_image: "):]
    assert max(map(len, summary.splitlines())) <= 100, summary
    table = summary.split("\n\n")[1]
    assert "rank" in table and "steady_it_s" in table and "gpu_ms_denoise" not in table
    assert "peak_mem_gb" not in table and "restarts" not in table
    assert all(set(line.split()) != {"-"} for line in table.splitlines()), table
    assert "steady_it_s: denoising steps/s" not in r.stdout and "--explain" in summary

    job_dir = tmp_path / "demo_image"
    assert "steady_it_s: denoising steps/s" in " ".join((job_dir / "summary.txt").read_text().split())
    for row in check_job_dir(job_dir, "png", n_workers=1):        # the overrides took effect
        assert iio.imread(job_dir / row["output"]).shape == (96, 64, 3)
    assert OmegaConf.load(job_dir / "config.yaml").generation.height == 96
    before = {n: (job_dir / n).read_bytes() for n in ("summary.txt", "summary.json", "config.yaml")}
    mtimes = {n: (job_dir / n).stat().st_mtime_ns for n in before}
    # a rerun with nothing to do, under another (lossless) mode: config.yaml keeps the mode that
    # made the outputs, like the summary does
    r = subprocess.run(args + ["compile.mode=cache-all"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=GUARD_S)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip().startswith("nothing to do: all 8 prompts already done")
    assert len(r.stdout.strip().splitlines()) == 1 and "summary.txt" in r.stdout
    assert "starting" not in r.stderr                                # no Ray, no workers
    for n in before:
        assert (job_dir / n).read_bytes() == before[n]
        assert (job_dir / n).stat().st_mtime_ns == mtimes[n]


def test_help_and_key_list_from_the_command_line():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "runner", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "examples:" in r.stdout and "demo_video" in r.stdout
    r = subprocess.run([sys.executable, "-m", "runner.config"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "run.batch_size" in r.stdout and "compile.options" in r.stdout


@pytest.mark.e2e
def test_ctrl_c_while_ray_starts_exits_130_at_once_leaving_no_process(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the process group) while the job's local Ray
    starts: exit 130 within 2 s (issue 37: acknowledged after 8.7 s), saying nothing ran, and no
    process of Ray's left behind (the abandoned start's raylet agents outlived it at first)."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    import psutil
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}    # its own local Ray
    p = subprocess.Popen([sys.executable, "-m", "runner", "job=demo_image",
                          f"output.dir={tmp_path}", "ray.cpu_workers=1"], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in p.stderr),
                     daemon=True).start()

    def session(name=""):
        """Its session's live processes (Ray's own included) whose command line holds `name`:
        (pid, parent pid, start time, command line) each."""
        found = []
        for q in psutil.process_iter(["cmdline", "ppid", "create_time"]):
            with contextlib.suppress(psutil.Error, OSError):
                cmd = " ".join(q.info["cmdline"] or [])
                if os.getsid(q.pid) == p.pid and q.status() != psutil.STATUS_ZOMBIE and name in cmd:
                    found.append((q.pid, q.info["ppid"], q.info["create_time"], cmd))
        return found
    try:
        # mid-start, Ray's processes running: its raylet is up (it starts agents of its own),
        # and ray.init still waits for it to register
        t0 = time.monotonic()
        while not session("raylet"):
            assert p.poll() is None and time.monotonic() - t0 < GUARD_S, lines
            time.sleep(0.05)
        t = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=60)
        took = time.monotonic() - t
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and took <= 2.0, (p.returncode, took, lines)
    assert lines[-1] == ("interrupted: Ray was still starting: no worker ran; rerun the same "
                         "command to resume"), lines
    # Ray's processes got the same SIGINT: on a loaded 2-core machine an agent took over 0.5 s
    # to exit; one still there after 10 s was left behind
    t, t_exit = time.monotonic(), time.time()
    while session() and time.monotonic() - t < 10:
        time.sleep(0.2)
    # what a failure needs: who started each, and when against the exit
    left = [(pid, ppid, round(born - t_exit, 2), cmd[:160]) for pid, ppid, born, cmd in session()]
    assert left == [], left       # (pid, parent, started s after the job's exit, command)


def test_an_orphaned_grandchild_is_still_killed_at_exit(tmp_path):
    """A process whose parent died before the job's exit (a raylet killed by the same Ctrl-C,
    its agents left: a CI run) is still below the job (adopt_orphans) and dies with it."""
    import subprocess
    import sys
    import time

    import psutil
    code = ("import subprocess, sys, time; from runner.driver import job; job.adopt_orphans(); "
            # a child that starts a sleeper and exits at once: the sleeper's parent is gone
            "subprocess.run([sys.executable, '-c', 'import subprocess; "
            "print(subprocess.Popen([\"sleep\", \"60\"], stdout=subprocess.DEVNULL, "
            "stderr=subprocess.DEVNULL).pid)'], "
            "check=True); "
            "time.sleep(0.5); job.exit_now(0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    sleeper = int(r.stdout.split()[-1])
    time.sleep(0.2)
    try:
        alive = psutil.Process(sleeper).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    if alive:
        os.kill(sleeper, 9)
    assert not alive


def test_the_terminal_shows_the_runners_lines_not_the_libraries():
    """`main`'s logging: the runner's INFO lines; libraries' INFO lines, matplotlib's font-cache
    notice and Python warnings of libraries (a matplotlib UserWarning from report.py, issue 37)
    stay off the terminal, unless the user asks for warnings (-W)."""
    import subprocess
    import sys
    code = ("import logging, warnings; from runner.driver import job; job._configure_logging(); "
            "logging.getLogger('runner').info('runner line'); "
            "logging.getLogger('ray').info('library info'); "
            "logging.getLogger('matplotlib.font_manager').warning('Matplotlib is building the font cache'); "
            "logging.getLogger('pyarrow').warning('library warning line'); "
            "warnings.warn('a library UserWarning', UserWarning)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == ["runner: runner line",
                                                         "pyarrow: library warning line"], lines
    r = subprocess.run([sys.executable, "-W", "default", "-c", code], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert "UserWarning: a library UserWarning" in r.stderr


def test_lost_worker_lines_fit_100_columns():
    from runner.driver.summary import WIDTH, loss_lines, wrapped
    s = {"losses": [dict(rank=12, node="f" * 56, gpu="NVIDIA H200", at_s=1234.5, kind="node lost",
                         cause="its node has died (spot preemption: the instance was reclaimed)",
                         rows_back=17, charged=False)], "idle_worker_s": 42.0}
    raw = loss_lines(s)
    assert max(map(len, raw)) > WIDTH          # the case: one LOST line is wider than the summary
    text = "\n".join(wrapped(raw))
    assert max(map(len, text.splitlines())) <= WIDTH
    assert " ".join(text.split()) == " ".join(" ".join(raw).split())   # nothing cut, only wrapped
    assert text.startswith("LOST: worker 12 on node ffffffffffff (NVIDIA H200) at 1234.5 s")
