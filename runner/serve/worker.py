"""One worker: loads a pipeline once, compiles and warms it, then serves shards as a pipeline.

Contract: `Worker(rank, WorkerConfig)` builds the pipeline in `__init__` (load time measured);
`warmup()` compiles it through `compiler` and runs one short call at the job's default shape;
`submit(items)` queues a shard's items and returns at once; `run_shard(items)` waits for their rows;
`metrics()` returns the worker's performance figures; `phases(since)` the warm-up's phases so far.
The class is plain Python: the driver starts it as a Ray actor through `runner.serve.actor.WorkerActor`
(no torch on the driver; one actor per GPU, threaded: see `start_shard`), and tests also use it
in-process. What the driver calls on the actor (`warmup`, `start_shard`, `finish_shard`, `metrics`,
`phases`) is the typed `WorkerContract`.

Three stages, so the GPU never waits for the host:
    prepare   the driver sends each shard's validated items with it (no Parquet reads here); items
              are grouped into batches of equal shape (image-to-video: rows sharing their image,
              as the pipelines take one image per call); each batch's image is read, decoded and
              fitted to its size on `READ_THREADS` threads (`runner.io.images`) while the GPU works,
              and a missing or undecodable one fails that batch's rows, naming why;
    generate  one thread, `gpu`, runs every model call in submission order: first the text
              encoding of the whole shard (one text-encoder call for its prompts, each negative
              prompt once per worker: `runner.serve.text`), then per batch denoising, VAE decode, uint8
              conversion and the finiteness check on the device and one non-blocking copy of the
              uint8 result into pinned host memory;
    finish    `HOST_THREADS` threads wait for a batch's copy, encode PNG/mp4 (zlib and ffmpeg
              release the GIL) to a local temporary file and put it under `media/<id>.<ext>` of the
              job's store (`storage.Store.atomic_local`: a rename in a local directory, one upload
              to s3:// or gs://, never a partial object); a row is returned only after its file is
              complete under its final name.
While the GPU generates batch k+1, batch k is encoded and written. Queues are bounded by the shards
the driver has in flight per worker (`runner.driver.job.INFLIGHT`), so host memory stays flat. Seeds and
per-item generators are as before, and the uint8 rounding equals `outputs.to_uint8` on diffusers'
float32 output, so files are byte-identical to the sequential path's.

Nothing here mutates state shared with other workers; outputs are named by prompt id, so a rerun
rewrites the same files. Where each second goes: `runner.serve.timing`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from . import adapters, canary, oom, step_cache
from ..io import images
from ..config import WorkerConfig
from ..families import Family
from .models import ModelSpec, build_pipeline, check_gpu_memory
from ..io.outputs import failed_row, write_mp4, write_png
from ..io.prompts import Constraints, Item
from ..io.storage import resolve
from .text import Embeds, TextCache
from .timing import Marks, UtilSampler, instrument

HOST_THREADS = 2   # encode/write threads: one batch's files while the next batch's arrive
READ_THREADS = 4   # image-to-video: input images read (object stores: a request each) ahead
STAGES = ("text_encode", "denoise", "decode", "to_host", "write", "wait")


def generate(pipe, family: Family, items: list[Item], device: str, clock=None,
             mask_feature: bool = True, output_type: str = "np",
             embeds: dict[str, Embeds] | None = None, image=None):
    """One pipeline call for items of equal shape (and equal `TextCache.key`). `output_type="np"`:
    (B, H, W, 3) or (B, F, H, W, 3) float32 on the host; `"pt"`: (B, 3, H, W) or (B, F, 3, H, W)
    on the device, in the model dtype; both in [0, 1]. `clock.step()` is called at the end of each
    denoising step. `embeds`: the items' text embeddings (`TextCache.encode`, the worker encodes a
    shard at once); None: encoded here. `image`: the items' shared input image (a PIL image at
    their size, `images.load`), for an image-to-video family (run by its `image_pipeline`). One
    generator per item, and text encoded with the same padding alone or together: an item's output
    depends on its seed (and image), not on its batch-mates."""
    first = items[0]
    # a step cache's state starts fresh: outputs do not depend on call order
    step_cache.reset(pipe, guidance=first.guidance_scale > 1)
    text = TextCache.of(pipe, family, mask_feature)
    if embeds is None:
        embeds = text.encode(items)
    kw = dict(**text.call_kwargs(items, embeds), **family.call_args(pipe, first.num_frames),
              height=first.height, width=first.width, num_inference_steps=first.num_inference_steps,
              guidance_scale=first.guidance_scale, output_type=output_type,
              generator=[torch.Generator(device).manual_seed(i.seed) for i in items])
    if first.guidance_scale <= 1 and "guidance_scale_2" in kw:
        kw["guidance_scale_2"] = 1.0   # no CFG at all (A14B's second expert too): no negative prompt
    if image is None and family.image == "required":
        raise ValueError(f"{family.name} animates an image per row (the `image` column): none given")
    if hasattr(pipe.scheduler, "generators"):   # a distilled sampler's re-noising: each row's own
        pipe.scheduler.generators = kw["generator"]
    call = pipe
    if image is not None:
        call = family.image_pipeline(pipe) if family.image_pipeline else pipe
        kw["image"] = image
    if clock and "callback_on_step_end" in inspect.signature(call.__call__).parameters:
        kw["callback_on_step_end"] = lambda p, i, t, d: (clock.step(), d)[1]
    elif clock:   # PixArt: the older callback API
        kw.update(callback=lambda *a: clock.step(), callback_steps=1)
    out = call(**kw)
    return _out(out.frames if family.kind == "video" else out.images)


def _out(x):
    return x if isinstance(x, torch.Tensor) else np.asarray(x)


def to_host_uint8(x: torch.Tensor, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, H, W) or (B, F, 3, H, W) in [0, 1] on the device -> uint8 (B, H, W, 3) or
    (B, F, H, W, 3) and per-item finite flags (B,), copied to the host without blocking (pinned
    memory on CUDA: wait for the copy before reading). Float32 math and round-half-even, exactly
    `outputs.to_uint8` on the float32 array diffusers' `output_type="np"` would have returned."""
    finite = torch.isfinite(x.flatten(1)).all(1)
    u8 = (x.float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).movedim(-3, -1).contiguous()
    if not pin:
        return u8, finite
    host_u8 = torch.empty(u8.shape, dtype=torch.uint8, pin_memory=True)
    host_finite = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
    host_u8.copy_(u8, non_blocking=True)
    host_finite.copy_(finite, non_blocking=True)
    return host_u8, host_finite


def batches(items: list[Item], batch_size: int, key=lambda it: ()) -> list[list[Item]]:
    """Group equal shapes and keys (`TextCache.key`; order of first appearance), then cut into
    batches."""
    groups: dict[tuple, list[Item]] = {}
    for it in items:
        groups.setdefault(it.shape_key() + key(it), []).append(it)
    return [g[i:i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def _node_id() -> str | None:
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def _fatal(e: BaseException) -> bool:
    """Errors after which this process cannot go on: a CUDA error other than out-of-memory poisons
    the context. The worker exits and the driver starts a replacement."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    if "CUDA error" in str(e) or "cudaError" in str(e):
        os._exit(70)
    return isinstance(e, (KeyboardInterrupt, SystemExit))


@dataclass
class Generated:
    """The GPU stage's result for one pipeline call (or the error of an item that failed alone)."""
    items: list[Item]
    t_start: float                         # host clock when the call began
    started_at: float = 0.0                # the same moment, epoch seconds (the driver's clock)
    media: torch.Tensor | None = None      # uint8 (B, H, W, 3) | (B, F, H, W, 3), host memory
    finite: torch.Tensor | None = None     # (B,) bool
    marks: Marks | None = None
    error: str | None = None


@dataclass
class ShardRun:
    """Futures of one submitted shard: `gpu` per batch (done when its copy is queued), `rows` per
    batch (done when its files are written)."""
    gpu: list[Future] = field(default_factory=list)
    rows: list[Future] = field(default_factory=list)

    def wait_gpu(self) -> None:
        for f in self.gpu:
            f.result()

    def wait_rows(self) -> list[dict]:
        return [row for f in self.rows for row in f.result()]


class WorkerContract(Protocol):
    """What the driver calls on a worker actor (`runner.driver.raypool.RayPool`, `runner.driver.job`). `Worker`
    implements it, and `runner.serve.actor.WorkerActor` forwards it; tests/test_dispatch.py checks that
    the names and parameters of both match."""

    def warmup(self, asked_at: float | None = None) -> dict:
        """Compile and warm up; the ready info (node, load and compile seconds, ...). `asked_at`:
        when the driver started the worker (epoch seconds), from which it gives the worker
        ray.worker_start_timeout_s to get here."""

    def start_shard(self, seq: int, items: list[Item]) -> int:
        """Queue shard `seq` (0, 1, 2, ... per worker) and return once its GPU work is done."""

    def finish_shard(self, seq: int) -> list[dict]:
        """Shard `seq`'s result rows, once its files are complete under their final names."""

    def canary(self, seq: int) -> dict:
        """At turn `seq` of the shards: the canary batch again against the worker's first
        (`runner.serve.canary`); the verdict."""

    def metrics(self) -> dict:
        """The worker's performance figures."""

    def phases(self, since: int) -> list[tuple[str, float]]:
        """Start-up phases from the `since`-th on: (phase, seconds since the worker started)."""

    def progress(self) -> float:
        """Seconds since the worker's last model call finished (or since it became ready): the
        driver's watchdog asks a worker silent in a long shard whether it still makes progress
        (`runner.driver.watchdog`)."""


class Worker:   # a WorkerContract (structurally, as WorkerActor: no Protocol base)
    def __init__(self, rank: int, cfg: WorkerConfig, broker=None):
        self.rank, self.cfg, self.broker = rank, cfg, broker
        # warm-up's phases, for the driver (progress.py); it shows "loading model" itself: an
        # actor answers no call before its __init__ returns
        self.t_start, self._phases = time.perf_counter(), []
        started_at = time.time()   # epoch: start-ups of several workers on one clock (metrics)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.spec = cfg.model.resolved()
        self.cuda = self.spec.device.startswith("cuda")
        self.family = self.spec.family
        self.ext = "mp4" if self.family.kind == "video" else "png"
        self.store = resolve(cfg.job_dir)    # this process's credentials and endpoint
        # Every model call (compile and warm-up included) runs on this one thread, in submission
        # order: Inductor's per-thread state and the CUDA graphs stay with one thread.
        self._gpu = ThreadPoolExecutor(1, thread_name_prefix="gpu")
        self._host = ThreadPoolExecutor(HOST_THREADS, thread_name_prefix="write")
        self._read = (ThreadPoolExecutor(READ_THREADS, thread_name_prefix="read")
                      if self.family.image else None)
        self._stores: dict = {}               # images on object stores: a filesystem per bucket
        self._marks: Marks | None = None      # the batch the gpu thread is running, for `instrument`
        self._lock = threading.Lock()         # metrics, written by the host threads
        self._turn = threading.Condition()    # start_shard's ordering
        self._next_seq, self._runs = 0, {}
        self._last_call_end = time.perf_counter()   # the last model call's end (`progress`)
        if cfg.compile.enabled:  # Inductor's imports (and a kernel build) overlap with loading the model
            import compiler
            compiler.prewarm(build_int8_attention=cfg.compile.options.has("int8_attention")
                             and self.family.long_attention and self.cuda)
        t0 = time.perf_counter()
        # a model that cannot fit: named now, not an OOM minutes in
        check_gpu_memory(self.spec, fp8=cfg.compile.enabled and cfg.compile.options.has("low_precision"))
        t1 = time.perf_counter()
        self.pipe = build_pipeline(self.spec)
        if self.spec.adapters:   # fused before anything is compiled: the graphs never see them
            adapters.fuse(self.pipe, self.spec.adapters, self.spec.local_files_only,
                          self.spec.family.lora_diffs)
        per_row = tuple(a for a in self.spec.adapters if a.per_row)
        self.switch = (adapters.Switch(self.pipe, per_row, self.spec.local_files_only,
                                       self.spec.family.lora_diffs) if per_row else None)
        # what this worker's rows are made from: the adapter files as it found them (a file
        # replaced since the driver's check: its rows say so, and a rerun remakes them)
        self._adapter_sha = adapters.row_hashes(
            self.spec.adapters, adapters.contents(self.spec.adapters, self.spec.local_files_only))
        self._sync()
        t2 = time.perf_counter()
        self.text = TextCache.of(self.pipe, self.family, self.spec.mask_feature)
        self.text.batch = cfg.encode_batch
        self._sync()
        # where the start-up goes (metrics' startup_parts_s; _warmup adds the warm-up's parts)
        startup = {"gpu_check": t1 - t0, "build": t2 - t1, "text_cache": time.perf_counter() - t2}
        instrument(self.pipe, lambda: self._marks)   # brackets text encoding and decoding
        if self.family.image_pipeline is not None:   # its own encode_prompt; the shared VAE's
            instrument(self.family.image_pipeline(self.pipe), lambda: self._marks)  # marks nest
        self.m = dict(rank=rank, host=socket.gethostname(), pid=os.getpid(), node_id=_node_id(),
                      device=self.spec.device, dtype=self.spec.dtype,
                      gpu_name=torch.cuda.get_device_name() if self.cuda else None,
                      model_load_s=time.perf_counter() - t0, startup_parts_s=startup,
                      started_at=started_at,
                      loaded_at=time.time(), items=0, failed=0, steps=0,
                      steady_s=0.0, e2e=[], time_s=dict.fromkeys(STAGES, 0.0),
                      canaries=0, canary_s=0.0, canary_ref_s=None)
        self.device = canary.device(self.cuda, self.m["node_id"])   # named by a failed canary
        self._reference: np.ndarray | None = None     # the canary batch as first made (uint8)
        self._made_with: dict = {}            # what besides the job's settings made its outputs
        self.ready_at = None
        self._window = [None, None]           # first batch start, last batch on the host
        self._gpu_idle_since = time.perf_counter()
        self._wait_in_window = 0.0
        self._util = None

    def _phase(self, name: str) -> None:
        self._phases.append((name, time.perf_counter() - self.t_start))

    def phases(self, since: int) -> list[tuple[str, float]]:
        # Answered while warmup() runs (a threaded actor); the driver polls it (progress.py).
        return self._phases[since:]

    def progress(self) -> float:
        # Answered from a thread of the actor's own, whatever the gpu thread is stuck in. A
        # duration, not a time: the driver's clock need not agree with this machine's.
        return time.perf_counter() - self._last_call_end

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    # -- start-up ------------------------------------------------------------------------------

    def warmup(self, asked_at: float | None = None) -> dict:
        """Compile (if configured; from the shared cache when it has this model), then one short
        call at the default shape and batch size, so serving starts with compiled graphs."""
        return self._gpu.submit(self._warmup, asked_at).result()

    def _start_time_left(self, asked_at: float | None) -> float:
        """Seconds left of ray.worker_start_timeout_s before the driver gives this worker up: by
        the driver's clock from `asked_at` (Ray's placing, the process's start and imports
        counted), never more than by this process's own clock (a clock behind the driver's)."""
        left = self.cfg.start_timeout_s - (time.perf_counter() - self.t_start)
        if asked_at is not None:
            left = min(left, self.cfg.start_timeout_s - (time.time() - asked_at))
        return left

    def _warmup(self, asked_at: float | None) -> dict:
        t0 = time.perf_counter()
        opts = self.cfg.compile
        cache, t_compile = None, t0
        if opts.enabled:
            import compiler
            from compiler.cache import cache_key, configure_cache_dir
            if opts.options.has("cache"):
                from .compile_cache import local_dir, warm_from_shared_cache
                configure_cache_dir(local_dir(opts.cache_dir))
                key = cache_key(self.pipe, opts.options, self.cache_shapes())
                self._phase("looking up the compile cache")
                t = time.perf_counter()
                cache = warm_from_shared_cache(self.broker, key, self.rank, opts.cache_dir,
                                               self._start_time_left(asked_at))
                self.m["startup_parts_s"]["cache_lookup"] = time.perf_counter() - t
            miss = cache and (f"itself ({cache['fallback']})" if "fallback" in cache
                              else "(compile cache miss)")
            self._phase("warming up from the compile cache" if cache and cache["cache_hit"] else
                        "compiling and warming up" + (f" {miss}" if miss else ""))
            t_compile = time.perf_counter()
        else:
            self._phase("warming up")
        try:   # from the claim on: a claimant that fails says so, or the others wait half their time
            if opts.enabled:
                compiler.compile_pipe(self.pipe, opts.options, fuse_qkv_projections=opts.fuse_qkv)
                self._record_kernels(self.pipe._compile_report)
            step_cache.apply(self.pipe, self.cfg.step_cache, self.family)   # after compile_pipe: see step_cache.py
            t = time.perf_counter()
            self._warmup_call()
            self._sync()
            self.m["startup_parts_s"]["warmup_call"] = time.perf_counter() - t
            if cache and cache["role"] == "compile":   # before the canary's call: the others wait
                from .compile_cache import publish
                publish(self.broker, cache, opts.cache_dir)
                self.m["artifact_bytes"] = cache.get("artifact_bytes")
        except BaseException:   # compile_pipe, the warm-up call or the broker call failed
            if (cache and cache["role"] == "compile" and not cache.get("published")
                    and self.broker is not None):
                import ray
                ray.get(self.broker.publish.remote(cache["cache_key"], None))  # waiters: compile
            raise
        if self.cfg.canary:                  # the reference, with the graphs the job will run
            t_ref = time.perf_counter()
            self._reference, finite = self._canary_output()
            if not finite:
                raise FloatingPointError("the canary batch (the job's default shape) is not "
                                         "finite: this worker's model or GPU computes NaN or inf")
            self.m["canary_ref_s"] = time.perf_counter() - t_ref
            self.m["startup_parts_s"]["canary_ref"] = self.m["canary_ref_s"]
        t_end = time.perf_counter()
        self.m["compile_mode"] = opts.mode
        self.m["warmup_s"] = t_end - t0
        if opts.enabled:
            self._record_compile(cache, t0, t_compile, t_end)
            self.m["compile_times_s"] = compiler.compile_times()   # Dynamo/Inductor's own split
        if self.cuda:  # the start-up's peak (load, adapters, FP8, compile) kept; then serving's
            self.m["startup_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        self._util = UtilSampler.start(self.cuda)
        self.ready_at = self._gpu_idle_since = self._last_call_end = time.perf_counter()
        self.m["ready_at"] = time.time()
        keys = ("rank", "host", "node_id", "model_load_s", "warmup_s", "warmup_with_compile_s",
                "warmup_with_cache_s", "cache_hit", "cache_wait_s", "int8_attention",
                "int8_attention_off", "started_at", "loaded_at", "ready_at")
        # where the kernel counts this process's out-of-memory kills (the driver reads it again
        # if the worker dies: runner.serve.oom)
        return {**{k: self.m[k] for k in keys if k in self.m}, "memory": oom.baseline(),
                "device": self.device}

    def _record_kernels(self, report: dict) -> None:
        """Whether flag `int8-attention` runs its kernel here (`int8_attention`: True, or False and
        `int8_attention_off` says why; absent where the flag does not apply): in the ready info
        (the driver names a worker that fell back) and on each output's row (`_made_with`: the
        driver records it under the settings without the kernel)."""
        if "int8_attention_off" in report:
            self.m.update(int8_attention=False, int8_attention_off=report["int8_attention_off"])
        elif report.get("int8_attention"):
            self.m["int8_attention"] = True
        if "int8_attention" in self.m:
            self._made_with = {"int8_attention": self.m["int8_attention"]}

    def _record_compile(self, cache, t0: float, t_compile: float, t_end: float) -> None:
        # Warm-up from the moment compiling (or loading the artifact) starts; waiting for the
        # compiling worker to publish is reported apart, as cache_wait_s.
        wait = cache["cache_wait_s"] if cache else 0.0
        hit = bool(cache and cache["cache_hit"])
        self.m["warmup_with_cache_s" if hit else "warmup_with_compile_s"] = t_end - t0 - wait
        self.m.update(cache_hit=hit, cache_wait_s=wait, cache_source=cache and cache["cache_source"],
                      compile_call_s=t_end - t_compile)

    def cache_shapes(self) -> dict:
        """What besides model and mode decides the compiled graphs (the compile cache key's
        `shapes`): the warm-up shape, and the step reuse (it changes what is compiled and
        captured)."""
        return {**self._warmup_shape(), "step_cache": self.cfg.step_cache.settings(cfg=False)}

    def _warmup_shape(self) -> dict:
        g = self.cfg.generation
        return {"height": g.height, "width": g.width, "num_frames": self._warmup_frames(),
                "batch_size": self.cfg.batch_size, "guidance": g.guidance_scale > 1,
                "encode_batch": self.cfg.encode_batch}

    def _warmup_frames(self) -> int | None:
        """The frames of the warm-up call: the model's only count, else the job's default."""
        limits = self.cfg.limits
        return (limits.video_length or self.cfg.generation.num_frames) if limits.video else None

    def _warmup_call(self) -> None:
        if not self.cfg.warmup_steps:
            return
        g = self.cfg.generation
        items = [Item(id="warmup", prompt=canary.PROMPT, negative_prompt=g.negative_prompt, seed=k,
                      height=g.height, width=g.width, num_frames=self._warmup_frames(),
                      guidance_scale=g.guidance_scale,
                      num_inference_steps=step_cache.warmup_steps(   # a reused step too, if any
                          self.cfg.step_cache, max(self.cfg.warmup_steps, self.cfg.limits.min_steps)),
                      file="warmup", row=k) for k in range(self.cfg.batch_size)]
        # a model that needs an image warms up on a grey one; one that takes it optionally on both
        # paths (its image rows' pipeline calls the denoiser with one more argument: step graphs of
        # their own, captured here rather than on the first image row)
        grey = images.placeholder(g.width, g.height)
        paths = {"required": [grey], "optional": [None, grey]}.get(self.family.image, [None])
        for image in paths:
            # every unconditional call runs (step_cache.warming): the step graphs that
            # cfg_reuse would skip past are captured here too
            with torch.inference_mode(), step_cache.warming(self.pipe):   # the serving path
                x = generate(self.pipe, self.family, items, self.spec.device,
                             mask_feature=self.spec.mask_feature, output_type="pt", image=image)
                to_host_uint8(x, pin=self.cuda)

    # -- serving -------------------------------------------------------------------------------

    def submit(self, items: list[Item]) -> ShardRun:
        """Queue a shard's items: their text encoding, then each batch, on the gpu thread; each
        batch's finishing on a host thread. The embeddings live as long as the shard's batches."""
        run = ShardRun()
        if self._adapter_sha:
            items = [dataclasses.replace(it, adapters_sha256=self._adapter_sha[it.adapter])
                     for it in items]
        enc = self._gpu.submit(self._encode, items)
        run.gpu.append(enc)
        run.rows.append(self._host.submit(self._account_encode, enc))
        for batch in batches(items, self.cfg.batch_size, self._batch_key):
            image = self._read.submit(self._load_image, batch[0]) \
                if batch[0].image is not None else None
            gen = self._gpu.submit(self._generate, batch, enc, image)
            run.gpu.append(gen)
            run.rows.append(self._host.submit(self._finish, gen))
        return run

    def _batch_key(self, item: Item) -> tuple:
        """What batch-mates share besides their shape: the text key, their image (a pipeline
        call takes one image, repeated over the batch) and their per-row adapter."""
        return self.text.key(item) + ((item.image,) if item.image is not None else ()) + (
            (item.adapter,) if item.adapter is not None else ())

    def _load_image(self, item: Item) -> tuple:
        """read thread: (fitted image, sha256, None), or (None, sha256 of the bytes if they could be
        read, the reason the image is unusable)."""
        sha = None
        try:
            data, sha = images.read(item, self._stores, self.cfg.max_image_bytes)
            return images.fit(data, item.width, item.height, images.label(item)), sha, None
        except images.ImageError as e:
            return None, sha, f"ImageError: {e}"
        except images.InputStoreFault as e:      # the store's, not the row's: the driver stops
            return None, sha, f"{images.INPUT_FAULT}{e}"
        except Exception as e:   # anything else about this image (PIL's decompression-bomb guard)
            return None, sha, f"ImageError: {images.label(item)}: {type(e).__name__}: {e}"

    def _encode(self, items: list[Item]) -> tuple[dict[str, Embeds] | None, Marks]:
        """gpu thread: the shard's prompts in one text-encoder call. An error here is left to the
        batches (they encode alone, item by item), so one bad prompt fails only itself."""
        marks = Marks(self.cuda)
        marks.mark("text_encode_start")
        try:
            with torch.inference_mode():
                embeds = self.text.encode(items)
        except Exception as e:
            if _fatal(e):
                raise
            embeds = None
        marks.mark("text_encode_end")
        return embeds, marks

    def _account_encode(self, enc: Future) -> list[dict]:
        """host thread: the shard encoding's seconds (GPU time on CUDA); no rows of its own."""
        _, marks = enc.result()
        marks.wait("text_encode_end")
        with self._lock:
            self.m["time_s"]["text_encode"] += marks.seconds("text_encode_start", "text_encode_end") or 0.0
        return []

    def run_shard(self, items: list[Item]) -> list[dict]:
        """All of a shard's rows, once its files are written (in-process use and tests)."""
        return self.submit(items).wait_rows()

    def start_shard(self, seq: int, items: list[Item]) -> int:
        """Ray entry, part 1. The driver numbers its shards for this worker 0, 1, 2, ... and calls
        `start_shard` then `finish_shard` for each; the actor is threaded, so calls may arrive on
        different threads, and this turnstile queues the GPU work in `seq` order. Returns once the
        shard's GPU work is done."""
        with self._turn:
            self._turn.wait_for(lambda: self._next_seq == seq)
            run = self._runs[seq] = self.submit(items)
            self._next_seq += 1
            self._turn.notify_all()
        run.wait_gpu()
        return len(items)

    def finish_shard(self, seq: int) -> list[dict]:
        """Ray entry, part 2: the shard's rows, once every file is complete under its final name."""
        with self._turn:
            self._turn.wait_for(lambda: seq in self._runs)
            run = self._runs[seq]
        try:
            return run.wait_rows()
        finally:
            with self._turn:
                del self._runs[seq]

    def canary(self, seq: int) -> dict:
        """Ray entry: at turn `seq` of this worker's shards (after the GPU work of those before
        it, before that of those after), the canary batch again, compared with the reference
        (`runner.serve.canary.compare`): the verdict, with its seconds and this worker's device."""
        if self._reference is None:
            raise RuntimeError("no canary reference: this worker was started with run.canary off")
        with self._turn:
            self._turn.wait_for(lambda: self._next_seq == seq)
            check = self._gpu.submit(self._canary_check)
            self._next_seq += 1
            self._turn.notify_all()
        return check.result()

    def _canary_check(self) -> dict:
        """gpu thread. Its seconds are the canary's own (neither a stage nor waiting)."""
        t0 = time.perf_counter()
        try:
            out, finite = self._canary_output()
        except Exception as e:
            _fatal(e)          # a CUDA error poisons the context: the process exits (see _fatal)
            raise
        verdict = canary.compare(self._reference, out, finite,
                                 exact=self.cfg.compile.options.lossless,
                                 min_psnr_db=self.cfg.canary_min_psnr_db)
        seconds = time.perf_counter() - t0
        self._gpu_idle_since = self._last_call_end = time.perf_counter()
        with self._lock:
            self.m["canaries"] += 1
            self.m["canary_s"] += seconds
        return {**verdict, "s": seconds, "rank": self.rank, "device": self.device}

    def _canary_output(self) -> tuple[np.ndarray, bool]:
        """gpu thread: the canary batch as the job's batches are made (the same call, conversion
        and graphs), uint8 on the host, and whether it was finite."""
        g = self.cfg.generation
        items = canary.items(g, self._warmup_frames(), self.cfg.batch_size)
        image = images.placeholder(g.width, g.height) if self.family.image == "required" else None
        self._use_adapter(None)          # the canary is made from the base weights, always
        with torch.inference_mode():
            x = generate(self.pipe, self.family, items, self.spec.device,
                         mask_feature=self.spec.mask_feature, output_type="pt", image=image)
            u8, finite = to_host_uint8(x, pin=False)
        return u8.cpu().numpy(), bool(finite.all())

    def _generate(self, batch: list[Item], enc: Future | None = None,
                  image: Future | None = None) -> list[Generated]:
        """gpu thread. One bad item (out of memory at one size, ...) must not fail its batch-mates:
        a failing batch is retried item by item, and an item that fails alone is recorded failed.
        `image`: the batch's input image being read (an unusable one fails the batch's rows)."""
        embeds = enc.result()[0] if enc is not None else None   # done: this thread ran it first
        picture = None
        if image is not None:
            picture, sha, error = image.result()
            # what the output (or the failed attempt) is made from: the bytes this worker read
            batch = [dataclasses.replace(it, image_sha256=sha) for it in batch]
            if error is not None:
                return [Generated(batch, time.perf_counter(), time.time(), error=error)]
        try:
            return [self._call(batch, embeds, picture)]
        except Exception as e:
            if _fatal(e):
                raise
            if self.cuda:
                torch.cuda.empty_cache()
            if len(batch) > 1:
                return [g for item in batch for g in self._generate([item], enc, image)]
            return [Generated(batch, time.perf_counter(), time.time(), error=f"{type(e).__name__}: {e}")]

    def _use_adapter(self, name: str | None) -> None:
        """gpu thread: the weights of per-row adapter `name` (None: the base), switched in place."""
        if self.switch is not None:
            self.switch.use(name)

    def _call(self, batch: list[Item], embeds: dict[str, Embeds] | None = None,
              image=None) -> Generated:
        """gpu thread: one pipeline call, conversion and copy queued; returns without waiting."""
        self._use_adapter(batch[0].adapter)   # batch-mates share it (`_batch_key`)
        t0, started_at = time.perf_counter(), time.time()
        with self._lock:
            idle = t0 - self._gpu_idle_since
            self.m["time_s"]["wait"] += idle       # since ready: the driver had no work here
            if self._window[0] is None:
                self._window[0] = t0
            else:
                self._wait_in_window += idle
        marks = self._marks = Marks(self.cuda)
        try:
            with torch.inference_mode():
                x = generate(self.pipe, self.family, batch, self.spec.device, marks,
                             mask_feature=self.spec.mask_feature, output_type="pt", embeds=embeds,
                             image=image)
                marks.mark("to_host_start")
                media, finite = to_host_uint8(x, pin=self.cuda)
                marks.mark("to_host_end")
        finally:
            self._marks = None
            self._gpu_idle_since = self._last_call_end = time.perf_counter()
        return Generated(batch, t0, started_at, media, finite, marks)

    def _finish(self, gen: Future) -> list[dict]:
        """host thread: wait for the batch's copy, then encode and write each item."""
        rows = []
        for g in gen.result():
            if g.error is not None:
                rows += [failed_row(it, g.error, worker=self.rank) for it in g.items]
                with self._lock:
                    self.m["failed"] += len(g.items)
            else:
                rows += self._write(g)
        return rows

    def _write(self, g: Generated) -> list[dict]:
        g.marks.wait("to_host_end")
        t_landed = time.perf_counter()
        steps, steady_s = g.marks.steady_steps()
        rows, write_s = [], 0.0
        for item, media, finite in zip(g.items, g.media.numpy(), g.finite.tolist()):
            if not finite:
                # no id in the message: rows are grouped by it (the row has its id)
                rows.append(failed_row(item, "FloatingPointError: non-finite values (NaN or inf) in "
                                             "the output", worker=self.rank))
                continue
            t = time.perf_counter()
            rel = f"media/{item.id}.{self.ext}"
            with self.store.atomic_local(rel) as tmp:
                if self.ext == "mp4":
                    write_mp4(tmp, media, self.cfg.fps)
                else:
                    write_png(tmp, media)
            write_s += time.perf_counter() - t
            rows.append({**item.params(), "status": "ok", "error": None,
                         "output": rel, "worker": self.rank, **self._made_with,
                         "node_id": self.m["node_id"], "batch_size": len(g.items),
                         "denoise_it_s": steps / steady_s if steady_s else None})
        t_end = time.perf_counter()
        for r in rows:
            if r["status"] == "ok":
                r["e2e_s"] = t_end - g.t_start   # call start to the last file of its batch written
                r["started_at"] = g.started_at
        self._account(g, rows, steps, steady_s, write_s, t_landed, t_end)
        return rows

    def _account(self, g: Generated, rows, steps, steady_s, write_s, t_landed, t_end) -> None:
        mk = g.marks
        stages = dict(text_encode=mk.seconds("text_encode_start", "text_encode_end"),
                      denoise=mk.seconds("text_encode_end", "decode_start"),
                      decode=mk.seconds("decode_start", "decode_end"),
                      to_host=mk.seconds("to_host_start", "to_host_end"), write=write_s)
        ok = sum(r["status"] == "ok" for r in rows)
        with self._lock:
            for k, v in stages.items():
                self.m["time_s"][k] += v or 0.0
            self.m["items"] += ok
            self.m["failed"] += len(rows) - ok
            self.m["steps"] += steps
            self.m["steady_s"] += steady_s
            self.m["e2e"].append(t_end - g.t_start)
            self._window[1] = max(self._window[1] or 0.0, t_landed)

    # -- figures -------------------------------------------------------------------------------

    def metrics(self) -> dict:
        with self._lock:
            m = {k: v for k, v in self.m.items() if k != "e2e"}
            m["time_s"] = dict(self.m["time_s"])
            e2e = np.array(self.m["e2e"]) if self.m["e2e"] else None
            t0, t1 = self._window
        # A batch's E2E: from the start of its pipeline call to its last file written.
        m["e2e_mean_s"] = float(e2e.mean()) if e2e is not None else None
        m["e2e_p95_s"] = float(np.percentile(e2e, 95)) if e2e is not None else None
        m["batches"] = len(self.m["e2e"])
        m["steady_it_s"] = self.m["steps"] / self.m["steady_s"] if self.m["steady_s"] else None
        m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
        # step reuse: attention calls answered from the cache (warm-up included); 0 when off
        m["step_cache_reused"] = step_cache.skipped(self.pipe)
        # cfg_reuse: unconditional denoiser calls skipped (estimated from the conditional output)
        m["step_cache_uncond_skipped"] = step_cache.uncond_skipped(self.pipe)
        # The serving window: the first pipeline call's start to the last batch on the host.
        span = t1 - t0 if t0 is not None and t1 is not None and t1 > t0 else None
        m["serving_s"] = span
        # Model thread busy: the share of the window it was not waiting for work (host view).
        m["busy_fraction"] = min(1.0, 1 - self._wait_in_window / span) if span else None
        # GPU, device view: NVML's utilisation over the window (what nvidia-smi shows: it falls when
        # the GPU idles), and per item the GPU milliseconds of each model stage (CUDA events around
        # them, so gaps between calls are not counted). Null on CPU.
        m["gpu_util"] = self._util.mean(t0, t1) if self._util and span else None
        done = self.m["items"]
        m["gpu_ms_per_item"] = ({k: 1e3 * m["time_s"][k] / done for k in ("text_encode", "denoise", "decode")}
                                if self.cuda and done else None)
        return m
