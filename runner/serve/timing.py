"""Where a worker's seconds go: per-batch marks on the GPU stream (or the CPU clock), the GPU's
utilisation sampled through NVML, and the per-worker totals.

Contract:
- `Marks(cuda)`: `mark(name)` records a CUDA event on the current stream (no sync) or, on CPU, the
  wall clock; `step()` marks the end of one denoising step. `seconds(a, b)` is the time between two
  marks, read only after the batch's last mark has completed (the host stage waits on it anyway).
  A name marked twice keeps its first mark if it ends in `_start`, its last otherwise (Latte decodes
  in chunks: first chunk's start to last chunk's end).
- `instrument(pipe, current)`: wraps `pipe.encode_prompt` and `pipe.vae.decode` so that, while
  `current()` returns a `Marks`, each call is bracketed by `<stage>_start` / `<stage>_end` marks.
  The pipeline's own code is untouched; with no current marks the wrappers only forward.
- `UtilSampler(device)`: NVML's utilisation of the worker's GPU every 250 ms, the same figure
  nvidia-smi shows; `mean(t0, t1)` over a window. None without NVML (`nvidia-ml-py`) or a GPU.
"""

from __future__ import annotations

import os
import threading
import time

import torch


class Marks:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.at: dict[str, object] = {}
        self.steps: list = []

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def mark(self, name: str) -> None:
        if name.endswith("_start") and name in self.at:
            return
        self.at[name] = self._now()

    def step(self) -> None:
        self.steps.append(self._now())

    def wait(self, name: str) -> None:
        """Block the calling (host) thread until mark `name` has happened on the GPU."""
        if self.cuda:
            self.at[name].synchronize()

    def _between(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def seconds(self, a: str, b: str) -> float | None:
        if a not in self.at or b not in self.at:
            return None
        return self._between(self.at[a], self.at[b])

    def steady_steps(self) -> tuple[int, float]:
        """(steps, seconds) from the end of step 1 to the end of step N: the rate without step 1's
        one-off costs."""
        if len(self.steps) < 2:
            return 0, 0.0
        return len(self.steps) - 1, self._between(self.steps[0], self.steps[-1])


def instrument(pipe, current) -> None:
    """Bracket text encoding and VAE decoding with marks (see the module docstring)."""
    def wrap(owner, attr: str, stage: str):
        inner = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            marks = current()
            if marks is None:
                return inner(*args, **kwargs)
            marks.mark(f"{stage}_start")
            out = inner(*args, **kwargs)
            marks.mark(f"{stage}_end")
            return out
        setattr(owner, attr, wrapped)

    wrap(pipe, "encode_prompt", "text_encode")
    wrap(pipe.vae, "decode", "decode")


def _nvml_handle(pynvml, device_index: int):
    """NVML numbers physical GPUs; CUDA_VISIBLE_DEVICES (set by Ray) renumbers them: match by UUID,
    else by the index CUDA_VISIBLE_DEVICES names."""
    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        physical = visible[device_index] if device_index < len(visible) and visible[device_index] else device_index
        return pynvml.nvmlDeviceGetHandleByIndex(int(physical))


class UtilSampler:
    """GPU utilisation (percent of time a kernel ran, per NVML) sampled on a daemon thread."""

    def __init__(self, device_index: int = 0, period_s: float = 0.25):
        import pynvml   # nvidia-ml-py; the GPU machines have it, CPU installs need not
        pynvml.nvmlInit()
        self._handle = _nvml_handle(pynvml, device_index)
        self._nvml, self.period_s = pynvml, period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="nvml-sampler", daemon=True).start()

    @classmethod
    def start(cls, cuda: bool) -> "UtilSampler | None":
        if not cuda:
            return None
        try:
            return cls(torch.cuda.current_device())
        except Exception:       # no nvidia-ml-py, no driver access: the event-based figure remains
            return None

    def _run(self):
        while not self._stop.wait(self.period_s):
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            except Exception:
                return
            self.samples.append((time.perf_counter(), util))

    def mean(self, t0: float, t1: float) -> float | None:
        window = [u for t, u in self.samples if t0 <= t <= t1]
        return sum(window) / len(window) / 100.0 if window else None

    def stop(self):
        self._stop.set()
