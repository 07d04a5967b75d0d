"""`pytest -m gpu -n auto --dist loadgroup`: the gpu tests spread over this machine's GPUs, one test
process (a pytest-xdist worker) per GPU, each seeing its own GPU only; every gpu test's report
names the GPU that ran it. A pytest plugin, loaded by tests/conftest.py (imported before torch).

- `-n auto` with `-m gpu`: as many workers as GPUs (`nvidia-smi -L`, or the entries of
  CUDA_VISIBLE_DEVICES where it is set); the controller never initialises CUDA. Without GPUs, or
  without `-m gpu`, pytest-xdist's own count (the CPUs).
- Worker gwK: CUDA_VISIBLE_DEVICES is the K-th of those GPUs (K mod their number), set when this
  module is imported in the worker, before torch can initialise CUDA. So a test's "cuda" is its
  worker's GPU, and a test that needs a whole 80 GB GPU (the 14B models) never shares it: a
  process runs one test at a time. Any run with workers on a GPU machine is pinned this way.
- `-m gpu` runs order the gpu tests longest first (`SLOW_FIRST`); `--dist loadgroup` hands out
  one test at a time in that order (xdist's `load` would hand each worker a run of consecutive
  tests), so the longest start first, one per GPU, and the short ones fill in behind them.
- Each gpu test's report carries `("gpu", "gwK GPU i (name)")` in its user_properties (junit XML
  shows it), and the terminal summary lists every gpu test with its GPU, outcome and seconds, and
  under it the last lines it printed (the figures tests print: errors, peaks; pytest-xdist
  captures them, `-s` or not).
- A test that needs several GPUs: none today. One that does must run its GPU work in a subprocess
  with CUDA_VISIBLE_DEVICES set to RUNNER_TEST_GPUS's ids (every GPU of the run; its own process
  sees only one), and is best given its own command, as it shares those GPUs with the others.

PYTEST_DONT_REWRITE: conftest imports it before pytest registers it (no asserts to rewrite).
"""
import functools
import json
import os
import re
import subprocess
import time

import pytest

# gpu tests, longest first (a substring of the test id each; the rest keep their order after
# these): the seconds of each in the whole suite on 1 H200, 2026-11-28 (benchmarks/2026-11-28-
# gpu-suite-1xh200.md), those marked * from the trims' own run there (17 frames, eager text
# encoder and VAE); the summary prints each test's seconds: reorder from a measured run.
SLOW_FIRST = (
    "test_a14b_lightning_720p_with_adapters_fits_one_80gb_gpu",          # 220
    "test_full_size_wan22_chunked_decode",                               # 102 (one call fewer since)
    "test_full_size_lossless_matches_eager[O2-sd21",                     # 66
    "test_full_size_o2_item_alone_and_in_a_shard",                       # 59
    "test_full_size_compiled_chunked_decode",                            # 47
    "test_published_blocks_step_reuse_under_o2_and_o3",                  # 44 FLUX, 38 and 32 Wan (33 frames)
    "test_full_size_latte_step_reuse_under_compiled_modes",              # 27
    "test_full_size_o2_matches_eager_without_recompiles[wan21_i2v_14b_480p]",    # * 25-40
    "test_full_size_o3_close_to_eager_with_decode",                      # 23
    "test_full_size_o2_matches_eager_without_recompiles[wan22_t2v_a14b_480p]",   # * 18.5
    "test_full_size_step_reuse_under_compiled_modes[wan21",              # 18
    "test_full_size_o2_matches_eager_without_recompiles[flux1_dev]",     # * 17
    "test_full_size_14b_fused_adapters",                                 # 16
    "test_full_size_o2_matches_eager_without_recompiles[wan22_i2v_a14b_480p]",   # * 15.6
    "test_step_cache_with_compiled_modes_on_gpu[fastercache-O3",         # * 13.4
    "test_triton_winograd_resblock_matches_the_reference[3-100-96",      # 10.6
    "test_full_size_o2_matches_eager_without_recompiles",                # * 6-9 TI2V
)

ENV = "RUNNER_TEST_GPUS"     # the run's GPUs, [[id, name], ...] as JSON, handed to the workers


def listed_gpus() -> list[list[str]]:
    """[id, name] of each GPU this process may use, without initialising CUDA: `nvidia-smi -L`'s
    GPUs, narrowed to CUDA_VISIBLE_DEVICES's entries (indices or UUIDs) where it is set; [] without
    nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5c1e...)"
    found = [m.groups() for m in re.finditer(r"^GPU (\d+): (.*?) \(UUID: (\S+)\)", out, re.M)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [[i, name] for i, name, _ in found]
    names = {k: name for i, name, uuid in found for k in (i, uuid)}
    return [[v, names.get(v, "?")] for v in (e.strip() for e in visible.split(",")) if v]


def _pin_worker() -> str | None:
    """In a worker of a run with GPUs: CUDA_VISIBLE_DEVICES = its GPU; returns its label."""
    worker, gpus = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(ENV)
    if not (worker and gpus and json.loads(gpus)):
        return None
    gpus = json.loads(gpus)
    gid, name = gpus[int(worker.removeprefix("gw")) % len(gpus)]
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"       # CUDA's indices as nvidia-smi's
    os.environ["CUDA_VISIBLE_DEVICES"] = gid
    return f"{worker} GPU {gid} ({name})"


LABEL = _pin_worker()        # at import: before any test module (or torch) can initialise CUDA


def _gpu_run(config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    return "gpu" in expr and "not gpu" not in expr


@pytest.hookimpl(optionalhook=True, tryfirst=True)     # before pytest-xdist's own (the CPUs)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` under `-m gpu`: one worker per GPU (None: pytest-xdist's own count)."""
    if _gpu_run(config):
        return len(listed_gpus()) or None
    return None


def pytest_configure(config):
    """The controller of a run with workers hands its GPUs to them (they start after this)."""
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        gpus = listed_gpus()
        if gpus:
            os.environ[ENV] = json.dumps(gpus)


def pytest_collection_modifyitems(config, items):
    """`-m gpu` runs: the gpu tests longest first (a stable sort: the rest keep their order)."""
    if not _gpu_run(config):
        return
    rank = lambda item: next((k for k, s in enumerate(SLOW_FIRST) if s in item.nodeid), len(SLOW_FIRST))
    items.sort(key=rank)


@functools.cache
def _label() -> str | None:
    """This process's GPU: its worker's, or (one process) the first visible GPU."""
    if LABEL:
        return LABEL
    gpus = listed_gpus()
    return f"GPU {gpus[0][0]} ({gpus[0][1]})" if gpus else None


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and not any(k == "gpu" for k, _ in item.user_properties):
        label = _label()
        if label:
            item.user_properties.append(("gpu", label))


_REPORTS: list = []     # (label, outcome, seconds, test id, printed lines) of each gpu test here
PRINTED = 5             # the last lines a test printed (its figures), shown under it in the summary
_SPANS: dict = {}       # test id -> [label, first phase's start, last phase's stop] (epoch s)
_T0: list = []          # the session's start here (the controller's, under xdist)


def pytest_sessionstart(session):
    _T0.append(time.time())


def pytest_runtest_logreport(report):
    """Kept by the process that reports (the controller under xdist): a gpu test's call, or the
    setup that failed or skipped it."""
    gpu = dict(report.user_properties).get("gpu")
    if gpu and report.start:        # setup, call and teardown: where a process's seconds went
        span = _SPANS.setdefault(report.nodeid, [gpu, report.start, report.stop])
        span[1], span[2] = min(span[1], report.start), max(span[2], report.stop)
    if gpu and (report.when == "call" or report.outcome != "passed"):
        printed = [line for line in report.capstdout.splitlines() if line.strip()][-PRINTED:]
        _REPORTS.append((gpu, report.outcome, report.duration, report.nodeid, printed))


def pytest_terminal_summary(terminalreporter):
    if not _REPORTS:
        return
    terminalreporter.section("gpu tests: the GPU that ran each")
    for gpu, outcome, seconds, nodeid, printed in sorted(_REPORTS, key=lambda r: r[0]):  # GPU, run order
        terminalreporter.write_line(f"{gpu}  {outcome:7} {seconds:7.1f} s  {nodeid}")
        for line in printed:
            terminalreporter.write_line(f"    {line}")
    for line in process_times(_SPANS.values(), _T0[0] if _T0 else None, time.time()):
        terminalreporter.write_line(line)


def process_times(spans, t0: float | None, end: float) -> list[str]:
    """Per GPU: when its first test started and its last ended (seconds after the session's
    start), its tests' seconds (setup, call, teardown) and the seconds between them: a 2-GPU wall
    60 s over its processes' test seconds (2026-11-28) shows where (start-up, gaps, the end)."""
    by_gpu: dict = {}
    for gpu, a, b in spans:
        by_gpu.setdefault(gpu, []).append((a, b))
    lines = []
    for gpu, ab in sorted(by_gpu.items()):
        first, last, busy = min(a for a, _ in ab), max(b for _, b in ab), sum(b - a for a, b in ab)
        t = t0 if t0 is not None else first
        lines.append(f"{gpu}: first test at +{first - t:.1f} s, last done at +{last - t:.1f} s "
                     f"(session ends +{end - t:.1f} s); tests {busy:.1f} s, between them "
                     f"{last - first - busy:.1f} s")
    return lines
