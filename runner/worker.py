"""One worker: loads a pipeline once, compiles and warms it, then serves shards.

Contract: `Worker(rank, WorkerConfig)` builds the pipeline in `__init__` (load time measured);
`warmup()` compiles it through `compiler` and runs one short call at the job's default shape;
`run_shard(shard)` reads its rows from Parquet itself, generates them in batches of equal shape,
writes each output atomically to `media/<id>.<ext>` and returns one result row per item;
`metrics()` returns the worker's performance figures. The class is plain Python: the driver wraps it
in `ray.remote` (one actor per GPU), and tests can also use it in-process. Nothing here mutates
state shared with other workers; outputs are named by prompt id, so a rerun rewrites the same files.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch

from .config import CompileConfig, GenerationDefaults
from .models import ModelSpec, build_pipeline
from .outputs import write_mp4, write_png
from .prompts import Constraints, Item, Shard, read_items
from .results import failed_row


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelSpec
    generation: GenerationDefaults
    limits: Constraints
    on_empty: str
    job_dir: str
    batch_size: int = 1
    warmup_steps: int = 2
    fps: int = 8
    compile: CompileConfig = CompileConfig()
    num_threads: int | None = None   # CPU workers: torch threads (avoids oversubscribing cores)
    cache_wait_s: float = 900.0      # longest wait for the compiling worker's artifact


class StepClock:
    """Marks the end of each denoising step; the rate over steps 2..N excludes step 1's one-off
    costs. On CUDA the marks are events (no sync inside the loop)."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> tuple[int, float]:
        """(steps, seconds) from the end of step 1 to the end of step N."""
        if len(self.marks) < 2:
            return 0, 0.0
        if self.cuda:
            torch.cuda.synchronize()
            return len(self.marks) - 1, self.marks[0].elapsed_time(self.marks[-1]) / 1e3
        return len(self.marks) - 1, self.marks[-1] - self.marks[0]


def generate(pipe, family: str, items: list[Item], device: str, clock: StepClock | None = None,
             mask_feature: bool = True) -> np.ndarray:
    """One pipeline call for items of equal shape. Returns (B, H, W, 3) or (B, F, H, W, 3) in [0, 1].
    One generator per item: an item's output depends on its seed, not on its batch-mates."""
    first = items[0]
    kw = dict(prompt=[i.prompt for i in items], negative_prompt=[i.negative_prompt for i in items],
              height=first.height, width=first.width, num_inference_steps=first.num_inference_steps,
              guidance_scale=first.guidance_scale, output_type="np",
              generator=[torch.Generator(device).manual_seed(i.seed) for i in items])
    on_step = (lambda *a: clock.mark()) if clock else None
    step_end = (lambda p, i, t, d: (on_step(), d)[1]) if clock else None   # the newer callback API
    if family == "latte":
        # LattePipeline takes one negative prompt string for the whole batch.
        negs = {i.negative_prompt for i in items}
        assert len(negs) == 1, "latte batches must share the negative prompt"
        kw.update(negative_prompt=negs.pop(), video_length=first.num_frames, clean_caption=False,
                  mask_feature=mask_feature)
        if step_end:
            kw["callback_on_step_end"] = step_end
        return np.asarray(pipe(**kw).frames)
    if family.startswith("pixart"):
        # Resolution binning and the size conditions only apply to the 128-latent (1024) checkpoints.
        kw.update(clean_caption=False,
                  use_resolution_binning=pipe.transformer.config.sample_size in (32, 64, 128))
        if on_step:
            kw.update(callback=on_step, callback_steps=1)
        return np.asarray(pipe(**kw).images)
    if step_end:
        kw["callback_on_step_end"] = step_end
    return np.asarray(pipe(**kw).images)


def batches(items: list[Item], batch_size: int, family: str) -> list[list[Item]]:
    """Group equal shapes (order of first appearance), then cut into batches."""
    groups: dict[tuple, list[Item]] = {}
    for it in items:
        key = it.shape_key() + ((it.negative_prompt,) if family == "latte" else ())
        groups.setdefault(key, []).append(it)
    return [g[i:i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def _node_id() -> str | None:
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def _fatal(e: Exception) -> bool:
    """Errors after which this process cannot go on: a CUDA error other than out-of-memory poisons
    the context. The worker exits and the driver starts a replacement."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    if "CUDA error" in str(e) or "cudaError" in str(e):
        os._exit(70)
    return isinstance(e, (KeyboardInterrupt, SystemExit))


def _free_memory(cuda: bool) -> None:
    if cuda:
        torch.cuda.empty_cache()


def _faults() -> list[str]:
    """Fault injection for the failure tests, from RUNNER_FAULTS (comma-separated):
    crash:<id> (the worker process dies at that item, every time), crash_once:<id> (only the first
    time), nan:<id> (the output is NaN), slow:<seconds> (sleep before each batch)."""
    return [f for f in os.environ.get("RUNNER_FAULTS", "").split(",") if f]


def _inject_faults(batch: list[Item], job_dir: str) -> None:
    for f in _faults():
        kind, _, arg = f.partition(":")
        if kind == "slow":
            time.sleep(float(arg))
        for it in batch:
            if kind == "crash" and arg == it.id:
                os._exit(71)
            if kind == "crash_once" and arg == it.id:
                marker = os.path.join(job_dir, f".fault-{it.id}")
                if not os.path.exists(marker):
                    open(marker, "w").close()
                    os._exit(71)


class Worker:
    def __init__(self, rank: int, cfg: WorkerConfig, broker=None, status=None):
        self.rank, self.cfg, self.broker = rank, cfg, broker
        self.status, self.t_start = status, time.perf_counter()   # start-up phases (progress.py)
        self._phase("loading model")
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.spec = cfg.model.resolved()
        self.cuda = self.spec.device.startswith("cuda")
        self.family = self.spec.info["family"]
        self.ext = "mp4" if self.spec.info["kind"] == "video" else "png"
        self.media_dir = os.path.join(cfg.job_dir, "media")
        os.makedirs(self.media_dir, exist_ok=True)
        if cfg.compile.enabled:  # Inductor's imports overlap with loading the model
            import compiler
            compiler.prewarm()
        t0 = time.perf_counter()
        self.pipe = build_pipeline(self.spec)
        self._sync()
        self.m = dict(rank=rank, host=socket.gethostname(), pid=os.getpid(), node_id=_node_id(),
                      device=self.spec.device, dtype=self.spec.dtype,
                      gpu_name=torch.cuda.get_device_name() if self.cuda else None,
                      model_load_s=time.perf_counter() - t0, items=0, failed=0, steps=0,
                      denoise_s=0.0, e2e=[], busy_s=0.0)
        self.ready_at = None

    def _phase(self, name: str) -> None:
        """Tell the driver's status board what this worker is doing now; fire-and-forget."""
        if self.status is not None:
            self.status.set.remote(self.rank, name, time.perf_counter() - self.t_start)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def warmup(self) -> dict:
        """Compile (if configured; from the shared cache when it has this model), then one short
        call at the default shape and batch size, so serving starts with compiled graphs."""
        t0 = time.perf_counter()
        opts = self.cfg.compile
        cache = None
        if opts.enabled:
            import compiler
            from compiler.cache import cache_key, configure_cache_dir
            if "cache-all" in compiler.parse_options(opts.options).flags:
                from .compile_cache import warm_from_shared_cache
                configure_cache_dir(opts.cache_dir)
                key = cache_key(self.pipe, opts.options, self._warmup_shape())
                self._phase("looking up the compile cache")
                cache = warm_from_shared_cache(self.broker, key, self.rank, opts.cache_dir,
                                               self.cfg.cache_wait_s)
            self._phase("warming up from the compile cache" if cache and cache["cache_hit"] else
                        "compiling and warming up" + (" (compile cache miss)" if cache else ""))
            t_compile = time.perf_counter()
            compiler.compile_pipe(self.pipe, opts.options, fuse_qkv_projections=opts.fuse_qkv)
        else:
            t_compile = t0
            self._phase("warming up")
        try:
            self._warmup_call()
        except BaseException:
            if cache and cache["role"] == "compile" and self.broker is not None:
                import ray
                ray.get(self.broker.publish.remote(cache["cache_key"], None))  # waiters: compile
            raise
        self._sync()
        t_end = time.perf_counter()
        self.m["compile_mode"] = opts.options.get("mode", "none")
        self.m["warmup_s"] = t_end - t0
        if opts.enabled:
            # Warm-up from the moment compiling (or loading the artifact) starts; waiting for the
            # compiling worker to publish is reported apart, as cache_wait_s.
            wait = cache["cache_wait_s"] if cache else 0.0
            warm = t_end - t0 - wait
            hit = bool(cache and cache["cache_hit"])
            self.m["warmup_with_cache_s" if hit else "warmup_with_compile_s"] = warm
            self.m.update(cache_hit=hit, cache_wait_s=wait,
                          cache_source=cache and cache["cache_source"],
                          compile_call_s=t_end - t_compile)
            if cache and cache["role"] == "compile":
                from .compile_cache import publish
                publish(self.broker, cache, opts.cache_dir)
                self.m["artifact_bytes"] = cache.get("artifact_bytes")
        if self.cuda:  # peak memory of serving, not of loading/compiling
            torch.cuda.reset_peak_memory_stats()
        self.ready_at = time.perf_counter()
        keys = ("rank", "host", "node_id", "model_load_s", "warmup_s", "warmup_with_compile_s",
                "warmup_with_cache_s", "cache_hit", "cache_wait_s")
        return {k: self.m[k] for k in keys if k in self.m}

    def _warmup_shape(self) -> dict:
        g = self.cfg.generation
        return {"height": g.height, "width": g.width, "num_frames": self.cfg.limits.video_length,
                "batch_size": self.cfg.batch_size, "guidance": g.guidance_scale > 1}

    def _warmup_call(self) -> None:
        if not self.cfg.warmup_steps:
            return
        g = self.cfg.generation
        items = [Item(id="warmup", prompt="warm up", negative_prompt=g.negative_prompt, seed=k,
                      height=g.height, width=g.width, num_frames=self.cfg.limits.video_length,
                      guidance_scale=g.guidance_scale,
                      num_inference_steps=max(self.cfg.warmup_steps, self.cfg.limits.min_steps),
                      file="warmup", row=k) for k in range(self.cfg.batch_size)]
        with torch.inference_mode():
            generate(self.pipe, self.family, items, self.spec.device,
                     mask_feature=self.spec.mask_feature)

    def run_shard(self, shard: Shard) -> list[dict]:
        items = read_items(shard, self.cfg.generation, self.cfg.limits, self.cfg.on_empty)
        return [row for batch in batches(items, self.cfg.batch_size, self.family)
                for row in self._run_or_split(batch)]

    def _run_or_split(self, batch: list[Item]) -> list[dict]:
        """One bad item (NaN, out of memory at one size, ...) must not fail its batch-mates: a
        failing batch is retried item by item, and an item that fails alone is recorded failed."""
        try:
            return self._run_batch(batch)
        except Exception as e:
            if _fatal(e):
                raise
            _free_memory(self.cuda)
            if len(batch) > 1:
                return [row for item in batch for row in self._run_or_split([item])]
            self.m["failed"] += 1
            return [failed_row(batch[0], f"{type(e).__name__}: {e}", worker=self.rank)]

    def _run_batch(self, batch: list[Item]) -> list[dict]:
        _inject_faults(batch, self.cfg.job_dir)
        t0 = time.perf_counter()
        clock = StepClock(self.cuda)
        with torch.inference_mode():
            out = generate(self.pipe, self.family, batch, self.spec.device, clock,
                           mask_feature=self.spec.mask_feature)
        if any(f"nan:{it.id}" in _faults() for it in batch):
            out = out * np.nan
        steps, denoise_s = clock.seconds()
        for item, media in zip(batch, out):
            if not np.isfinite(media).all():
                raise FloatingPointError(f"non-finite values in the output of {item.id!r}")
        rows = []
        for item, media in zip(batch, out):
            path = os.path.join(self.media_dir, f"{item.id}.{self.ext}")
            if self.ext == "mp4":
                write_mp4(path, media, self.cfg.fps)
            else:
                write_png(path, media)
            rows.append({**item.params(), "status": "ok", "error": None,
                         "output": os.path.relpath(path, self.cfg.job_dir), "worker": self.rank,
                         "node_id": self.m["node_id"],
                         "batch_size": len(batch), "denoise_it_s": steps / denoise_s if denoise_s else None})
        e2e = time.perf_counter() - t0
        for r in rows:
            r["e2e_s"] = e2e
        self.m["items"] += len(batch)
        self.m["steps"] += steps
        self.m["denoise_s"] += denoise_s
        self.m["busy_s"] += e2e
        self.m["e2e"].append(e2e)
        return rows

    def metrics(self) -> dict:
        m = {k: v for k, v in self.m.items() if k != "e2e"}
        e2e = np.array(self.m["e2e"]) if self.m["e2e"] else None
        # A batch's E2E is the wall time of the call that produced its items.
        m["e2e_mean_s"] = float(e2e.mean()) if e2e is not None else None
        m["e2e_p95_s"] = float(np.percentile(e2e, 95)) if e2e is not None else None
        m["batches"] = len(self.m["e2e"])
        m["steady_it_s"] = self.m["steps"] / self.m["denoise_s"] if self.m["denoise_s"] else None
        m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
        span = time.perf_counter() - self.ready_at if self.ready_at else None
        m["busy_fraction"] = self.m["busy_s"] / span if span else None
        return m
