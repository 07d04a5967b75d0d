"""Load, merge and check a job's config; split it into the narrow typed pieces the rest uses.

The schema is the dataclasses below, and only them: every key, its type, its default and a one-line
doc (`key(default, doc)`). `Config` is the tree of sections. Key and type checks, `--help`, the
docs/configuration.md's key table (`python -m runner.config --markdown`) and `ModelSpec`'s defaults all come from
it; adding a key is one line in its section (a `run.*`, `ray.*` or `generation.*` key reaches
its typed piece with no other change). Merge order, later wins:

    schema defaults  <  conf/models/<model.preset>.yaml  <  jobs/<job>.yaml  <  command line

`job=NAME` picks `jobs/NAME.yaml` (or `job=path/to/file.yaml`); every other argument is
`dotted.key=value` (the value may itself contain `=`; it is parsed as YAML, so `steps=20` is an int).
The model preset is read after the job file and the command line are known, so `model.preset=sd21`
on the command line switches presets. Unknown keys and values of the wrong type are `ConfigError`s
that name the key and what is valid. Only `runner.driver.job` sees the whole tree: it hands each part of
the runner one of the frozen dataclasses below, each of which validates itself.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from compiler import CompileOptions, parse_options   # light: no torch

from .families import DEFAULT_PRESET, PRESETS   # light: no torch

if typing.TYPE_CHECKING:
    from .io.prompts import Constraints

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
JOBS_DIR = ROOT / "jobs"
REQUIRED = "???"   # OmegaConf's "missing" marker: a key the job file or command line must set


class ConfigError(ValueError):
    pass


def key(default, doc: str):
    """A config key of a schema section: its default and one line for --help and docs/configuration.md."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def _choice(name: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {list(valid)}")


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


# ---------------------------------------------------------------------------------------------
# The schema. Sections that are also a typed piece of the runner (generation, run, ray) validate
# themselves in __post_init__; the others are checked where they are split (see `split`).

@dataclass(frozen=True)
class JobSection:
    name: str | None = key(None, "output subdirectory; null = the job file's name (an empty value "
                                 "is an error)")


SOURCES = ("pretrained", "random", "tiny")
DTYPES = ("fp16", "bf16", "fp32")


ADAPTER_KEYS = ("path", "weight_name", "scale", "expert", "name", "per_row")


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter of `model.adapters`: checked and fused by `runner.serve.adapters`."""
    path: str                      # local file or directory, s3:// or gs:// URI, or hub id
    weight_name: str | None = None  # the file inside a directory or hub repo
    scale: float = 1.0             # multiplies the adapter's own scaling (alpha / rank)
    expert: str = "transformer"    # the denoiser it goes into (Wan 2.2 A14B: or transformer_2)
    name: str = ""                 # shown in errors and logs, named by rows; default: the stem
    per_row: bool = False          # fused only for rows whose `adapter` column names it

    def settings(self) -> dict:
        """What decides the outputs. A job-wide adapter's name does not; a per-row adapter's does:
        rows name it (their `adapter` param), so the file a name stands for is part of what each
        row's output is made from (two names swapped between files must remake those rows)."""
        out = dict(path=self.path, weight_name=self.weight_name, scale=self.scale,
                   expert=self.expert)
        return {**out, "per_row": True, "name": self.name} if self.per_row else out

    @property
    def shown(self) -> str:
        return f"model.adapters[{self.name!r}] ({self.path}" + (
            f", {self.weight_name})" if self.weight_name else ")")


def parse_adapters(value, experts: tuple[str, ...]) -> tuple[Adapter, ...]:
    """`model.adapters` as Adapters: a list of mappings with keys `ADAPTER_KEYS` (`path`
    required); a `ConfigError` names the entry and what is valid."""
    if value is None:
        return ()
    if isinstance(value, Adapter) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"model.adapters must be a list of mappings with keys "
                          f"{list(ADAPTER_KEYS)} (path required), got {value!r}")
    out = []
    for i, entry in enumerate(value):
        if isinstance(entry, Adapter):
            out.append(entry)
            continue
        where = f"model.adapters[{i}]"
        if not isinstance(entry, dict) or not entry.get("path"):
            raise ConfigError(f"{where}={entry!r} must be a mapping with a `path` (a .safetensors "
                              f"file, a directory, s3:// / gs:// or a hub id); keys: "
                              f"{list(ADAPTER_KEYS)}")
        unknown = sorted(set(entry) - set(ADAPTER_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}"
                              f"{did_you_mean(unknown[0], ADAPTER_KEYS)}; valid: {list(ADAPTER_KEYS)}")
        scale = entry.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale \
                or abs(scale) == float("inf"):
            raise ConfigError(f"{where}.scale={scale!r} must be a finite number (1.0 = as "
                              f"trained)")
        expert = entry.get("expert") or experts[0]
        if expert not in experts:
            raise ConfigError(f"{where}.expert={expert!r}: this model's denoisers are "
                              f"{list(experts)}")
        path, weight = str(entry["path"]), entry.get("weight_name")
        name = entry.get("name") or Path(weight or path.rstrip("/")).stem
        per_row = entry.get("per_row", False)
        if not isinstance(per_row, bool):
            raise ConfigError(f"{where}.per_row={per_row!r} must be true or false")
        out.append(Adapter(path=path, weight_name=None if weight is None else str(weight),
                           scale=float(scale), expert=expert, name=str(name), per_row=per_row))
    names = [a.name for a in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"model.adapters: names {dup} given twice; set `name:` on each")
    return tuple(out)


@dataclass(frozen=True)
class ModelSpec:
    """The model section, validated: which preset, from which weights, where. `family` is the
    preset's record (`runner/families/`), `info` its published facts."""
    preset: str = key(DEFAULT_PRESET, " | ".join(PRESETS) + " (conf/models/<preset>.yaml; "
                                           "families: runner/families/)")
    source: str = key("pretrained", "pretrained (from_pretrained) | random (published size, random "
                                    "weights) | tiny (CPU tests)")
    path: str | None = key(None, "pretrained: hub id or local directory; null = the preset's hub id")
    local_files_only: bool = key(False, "pretrained: never touch the network (also HF_HUB_OFFLINE=1)")
    dtype: str = key("auto", "auto (fp16 on GPU, fp32 on CPU) | fp16 | bf16 | fp32")
    device: str = key("auto", "auto (cuda when the worker has a GPU) | cuda | cpu")
    mask_feature: bool = key(True, "Latte: trim text embeddings to the real token count "
                                   "(false = always 120)")
    adapters: list = key([], "LoRA adapters fused into the weights before compiling: a list of "
                             "{path (a .safetensors file, a directory, s3://, gs:// or a hub id), "
                             "weight_name (the file in a directory or hub repo), scale (1.0), "
                             "expert (transformer; Wan 2.2 A14B: or transformer_2), name, per_row "
                             "(false; true: only for rows whose `adapter` column names it)}; "
                             "docs/models.md, Step-distilled models and adapters")

    def __post_init__(self):
        from .families import PRESETS
        if self.preset not in PRESETS:
            raise ValueError(f"unknown model preset {self.preset!r}"
                             f"{did_you_mean(self.preset, PRESETS)}; valid: {sorted(PRESETS)}")
        if self.source not in SOURCES:
            raise ValueError(f"unknown model.source {self.source!r}; valid: {list(SOURCES)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown model.dtype {self.dtype!r}; valid: auto, {', '.join(DTYPES)}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"unknown model.device {self.device!r}; valid: auto, cpu, cuda, cuda:N")
        object.__setattr__(self, "adapters", parse_adapters(self.adapters,
                                                            PRESETS[self.preset].experts))

    def resolved(self) -> "ModelSpec":
        """`auto` device/dtype made concrete for the process this runs in."""
        import torch
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype
        if dtype == "auto":
            dtype = "fp32" if device == "cpu" else "fp16"
        return dataclasses.replace(self, device=device, dtype=dtype)

    @property
    def family(self):
        from .families import PRESETS
        return PRESETS[self.preset]

    @property
    def info(self) -> dict:
        """The preset's published facts (hub_id, size_factor, max_tokens, height, width, ...)."""
        return self.family.presets[self.preset]

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[
            self.resolved().dtype])


@dataclass(frozen=True)
class PromptsSection:
    path: str | list = key(REQUIRED, "a .parquet file, a directory of them, or a list of either; "
                                     "local, s3:// or gs://")
    on_empty: str = key("error", "null/empty prompt: error (before any model is built) | skip")
    strict: bool = key(False, "unknown prompt columns: false = one warning line naming them (with "
                              "the closest known name) | true = an error")
    max_image_mib: int = key(64, "the largest input image (the `image` column) read, in MiB; a "
                                 "larger one fails its row, unread")


@dataclass(frozen=True)
class GenerationDefaults:
    """Values for the Parquet columns a prompt file leaves out (the model preset sets its own)."""
    seed: int = key(0, "per-row default: random seed")
    height: int = key(1024, "per-row default: pixels, a multiple of the model's factor")
    width: int = key(1024, "per-row default: pixels, a multiple of the model's factor")
    num_frames: int = key(16, "per-row default, video models: must equal the model's video_length")
    num_inference_steps: int = key(20, "per-row default: denoising steps, at most the model's "
                                       "limit (docs/models.md, Step limits)")
    guidance_scale: float = key(4.5, "per-row default: classifier-free guidance scale")
    negative_prompt: str = key("", "per-row default: negative prompt")

    def __post_init__(self):
        for k in ("height", "width", "num_frames", "num_inference_steps"):
            _positive(f"generation.{k}", getattr(self, k))
        if self.seed < 0:
            raise ConfigError(f"generation.seed={self.seed} must be >= 0")
        g = self.guidance_scale
        if not isinstance(g, (int, float)) or isinstance(g, bool) or not math.isfinite(g) or g < 0:
            raise ConfigError(f"generation.guidance_scale={g!r} must be a finite number >= 0 "
                              f"(<= 1: no classifier-free guidance)")


CANARY_BATCHES = 200   # run.canary_every_items=null: a canary batch per this many batches


@dataclass(frozen=True)
class RunOptions:
    batch_size: int = key(1, "rows of one shard with the same shape are batched up to this")
    shard_size: int = key(8, "rows per shard (the unit a worker takes from the queue)")
    warmup_steps: int = key(2, "denoising steps of the warm-up call after load/compile (at most "
                               "the model's step limit)")
    max_shard_retries: int = key(2, "a row whose shard keeps raising in the worker is recorded "
                                    "failed after this many retries")
    max_row_deaths: int = key(2, "a row in flight at this many worker deaths is recorded failed "
                                 "(with the cause) and not run again in this job; such deaths do "
                                 "not count against ray.max_worker_restarts")
    canary_every_items: int | None = key(None, "each worker regenerates its canary batch (fixed "
                                               "prompt and seeds at the job's default size and "
                                               "steps) after this many items and compares it with "
                                               "its own first, made when it became ready; null: "
                                               "200 x run.batch_size (~0.5 % of GPU time); 0: no "
                                               "canary (docs/failures.md)")
    canary_every_s: float | None = key(None, "also a canary once this many seconds passed since "
                                             "the worker's last (null: no time trigger)")
    canary_min_psnr_db: float = key(40.0, "lossy compile modes (O3...): a canary passes at this "
                                          "PSNR against the first (uint8); lossless modes: bit "
                                          "for bit")
    hang_timeout_s: float = key(1800.0, "a worker with no model call finished for 10 x its "
                                        "measured time for one call of the work it holds (at "
                                        "least 60 s), and never more than this many seconds, is "
                                        "hung: killed, replaced, its shard's rows counted as in "
                                        "flight at a death (see run.max_row_deaths); 0: never "
                                        "(docs/failures.md)")
    dry_run: bool = key(False, "true: check config and prompts, print the plan against the job "
                               "directory, exit (no Ray)")

    def __post_init__(self):
        _positive("run.max_shard_retries", self.max_shard_retries, allow_zero=True)
        _positive("run.max_row_deaths", self.max_row_deaths)
        if self.canary_every_items is not None:
            _positive("run.canary_every_items", self.canary_every_items, allow_zero=True)
        if self.canary_every_s is not None:
            _positive("run.canary_every_s", self.canary_every_s)
        _positive("run.canary_min_psnr_db", self.canary_min_psnr_db)
        _positive("run.hang_timeout_s", self.hang_timeout_s, allow_zero=True)
        _positive("run.batch_size", self.batch_size)
        _positive("run.shard_size", self.shard_size)
        _positive("run.warmup_steps", self.warmup_steps, allow_zero=True)

    @property
    def canary_items(self) -> int:
        """Items between a worker's canaries (0: none by count)."""
        every = self.canary_every_items
        return CANARY_BATCHES * self.batch_size if every is None else every

    @property
    def canary(self) -> bool:
        return self.canary_items > 0 or self.canary_every_s is not None


@dataclass(frozen=True)
class RayOptions:
    address: str | None = key(None, "null: RAY_ADDRESS if set, else an embedded local Ray; "
                                     "or auto / host:port")
    num_workers: int | None = key(None, "a fixed pool of this many workers; null: an elastic "
                                        "pool (min_workers, max_workers)")
    cpu_workers: int = key(2, "CPU workers: with model.device=cpu, or a tiny model on a cluster "
                              "without GPUs")
    cpus_per_worker: int = key(1, "CPU cores (and torch threads) of each CPU worker")
    min_workers: int | None = key(None, "elastic pool: workers started at once and kept while "
                                        "work is queued; null: the GPUs there are, at least 1")
    max_workers: int | None = key(None, "elastic pool: at most this many workers; null: one per "
                                        "GPU the cluster has or its autoscaler can add")
    gpu_wait_s: float = key(600.0, "a job whose model needs GPUs and has no worker: asks the "
                                   "autoscaler and waits this long for one, then exits 3")
    gpu_gib: float | None = key(None, "GPU memory a worker needs to be placed on a node's GPU type; "
                                      "null: the preset's stated need (docs/models.md)")
    max_worker_restarts: int = key(3, "per worker and per hour it served: replacements after "
                                      "deaths of its own (crash, out of memory, start-up), not "
                                      "node losses or deaths pinned on a row (run.max_row_deaths)")
    worker_start_timeout_s: float = key(900.0, "a worker not ready after this many seconds "
                                               "(load + compile + warm-up) is given up; one "
                                               "waiting for another's compile artifact waits "
                                               "half its time left, then compiles itself")

    def __post_init__(self):
        _positive("ray.max_worker_restarts", self.max_worker_restarts, allow_zero=True)
        _positive("ray.worker_start_timeout_s", self.worker_start_timeout_s)
        for name in ("num_workers", "min_workers", "max_workers"):
            if getattr(self, name) is not None:
                _positive(f"ray.{name}", getattr(self, name))
        if self.num_workers is not None and (self.min_workers or self.max_workers):
            raise ConfigError(f"ray.num_workers={self.num_workers} is a fixed pool size: leave "
                              f"ray.min_workers and ray.max_workers unset with it, or drop it")
        if (self.min_workers or 0) > (self.max_workers or math.inf):
            raise ConfigError(f"ray.min_workers={self.min_workers} exceeds ray.max_workers="
                              f"{self.max_workers}; set min_workers <= max_workers")
        _positive("ray.gpu_wait_s", self.gpu_wait_s, allow_zero=True)
        if self.gpu_gib is not None:
            _positive("ray.gpu_gib", self.gpu_gib)
        _positive("ray.cpu_workers", self.cpu_workers)
        _positive("ray.cpus_per_worker", self.cpus_per_worker)


@dataclass(frozen=True)
class OutputSection:
    dir: str = key("outputs", "outputs go to <dir>/<job name>/: a local path, s3://bucket/prefix "
                              "or gs://bucket/prefix")
    fps: int = key(8, "frame rate of mp4 outputs")
    results_every_s: float = key(30.0, "results.parquet and report.html are rewritten at most "
                                       "this often while running (in the background), in seconds")
    overwrite: bool = key(False, "false: a rerun resumes (skips finished prompts); "
                                 "true: regenerate everything")


@dataclass(frozen=True)
class CompileSection:
    """Handed to `compiler.parse_options` as one dict (all but cache_dir); see docs/compiler.md's flags."""
    mode: str = key("none", "none (eager) | colon-joined flags, e.g. max-optimize:cache-all | O2 | O3")
    memory_format: str | None = key(None, "null | channels_last | contiguous")
    dynamic: bool = key(False, "true: one compiled graph serves several resolutions")
    fuse_qkv: bool = key(True, "fuse the q/k/v projections of every attention block")
    fuse_gelu: bool = key(True, "compiled, CUDA: Linear + GELU(tanh) as one GEMM with a GELU epilogue")
    short_attention: bool = key(True, "compiled, CUDA: self-attention over <= 64 tokens "
                                      "(Latte temporal) as one Triton kernel")
    short_cross_attention: bool = key(True, "compiled, CUDA: masked cross-attention to <= 128 text "
                                            "tokens (padded prompts) as one Triton kernel")
    sdpa_priority: bool = key(True, "CUDA: attention takes the first of cuDNN, flash, "
                                    "mem-efficient, math that fits")
    compile_text_encoder: bool | None = key(None, "also compile the text encoder's blocks "
                                                  "(lossless settings); null: when compiling")
    compile_vae: bool | None = key(None, "also compile the VAE decoder's blocks (lossless "
                                         "settings); null: when compiling, unless dynamic")
    cache_dir: str | None = key(None, "compile cache shared by jobs: a path, s3:// or gs:// "
                                      "URI; null = <output.dir>/.compile-cache")
    options: dict = key({}, "Inductor config overrides (free-form), "
                            "e.g. compile.options.coordinate_descent_tuning=true")


STEP_CACHE_METHODS = ("none", "residual", "fastercache", "pab")
# The keys each method reads (what decides its outputs, its settings hash and compile-cache key).
STEP_CACHE_KEYS = {"none": (), "residual": ("compute_ratio", "compute_steps", "first_blocks"),
                   "fastercache": ("block_skip_range", "timestep_range", "uncond_skip_range"),
                   "pab": ("block_skip_range", "timestep_range")}
CFG_REUSE = ("none", "fastercache")
# The keys of the unconditional-branch reuse (`cfg_reuse`), in the settings when it is on.
CFG_KEYS = ("cfg_reuse", "cfg_window", "cfg_interval", "cfg_alpha", "uncond_steps")


@dataclass(frozen=True)
class StepCacheSection:
    """Step reuse (lossy): docs/compiler.md "Step reuse"; applied by runner/serve/step_cache.py."""
    method: str = key("none", "none | residual (the block stack skipped on a fixed schedule; "
                              "composes with O2/O3; Wan, PixArt, Latte, FLUX) | fastercache | pab "
                              "(attention outputs reused; Latte); lossy, docs/compiler.md")
    compute_ratio: float = key(0.54, "residual: share of the steps computed in full, the rest reuse "
                                     "the last computed step's residual (0.54 = 27 of 50 steps)")
    compute_steps: list | None = key(None, "residual: the step indices computed in full (0 = first; "
                                           "overrides compute_ratio); null = a schedule from "
                                           "compute_ratio")
    first_blocks: int = key(0, "residual: leading blocks computed on every step, reused steps "
                               "included (0 = the whole stack reused, as TeaCache and LeMiCa; 1 = "
                               "cache-dit's F1B0 first-block cache)")
    block_skip_range: int = key(2, "spatial self-attention computed every N steps, reused in "
                                   "between (>= 2)")
    timestep_range: list | None = key(None, "[low, high]: reuse only at timesteps strictly inside; "
                                            "null = the method's default (fastercache [-1, 681], "
                                            "pab [100, 800])")
    uncond_skip_range: int = key(5, "fastercache: the unconditional (CFG) branch computed every N "
                                    "steps, approximated in between (1 = always computed)")
    cfg_reuse: str = key("none", "none | fastercache: the unconditional (CFG) branch's "
                                 "denoiser call skipped on a fixed schedule, its output taken as "
                                 "this step's conditional output plus the cond/uncond difference "
                                 "of its last call (FasterCache's CFG-Cache); composes with "
                                 "residual and O2/O3; Wan only; lossy, docs/compiler.md")
    cfg_window: list = key([0.33, 0.96], "cfg_reuse: [start, end) as fractions of the step "
                                         "count; the unconditional call is skipped only at steps "
                                         "inside (at 50 steps: 16-47, maxdiffusion's Wan 2.1 "
                                         "480p setting)")
    cfg_interval: int = key(5, "cfg_reuse: inside the window the unconditional call runs every N "
                               "steps (from the window's first), skipped in between")
    cfg_alpha: float = key(0.2, "cfg_reuse: the kept difference's low-frequency part weighted "
                                "1 + alpha in the first half of the steps, its high-frequency part "
                                "in the second (FasterCache); 0 = the plain difference")
    uncond_steps: list | None = key(None, "cfg_reuse: the step indices whose unconditional call "
                                          "runs (0 = first; overrides cfg_window and "
                                          "cfg_interval); null = the window's schedule")

    def __post_init__(self):
        _choice("step_cache.method", self.method, STEP_CACHE_METHODS)
        if self.block_skip_range is None or self.block_skip_range < 2:
            raise ConfigError(f"step_cache.block_skip_range={self.block_skip_range!r} must be >= 2 "
                              f"(2 = compute every other step; 1 would never reuse)")
        _positive("step_cache.uncond_skip_range", self.uncond_skip_range)
        if not isinstance(self.first_blocks, int) or isinstance(self.first_blocks, bool) \
                or self.first_blocks < 0:
            raise ConfigError(f"step_cache.first_blocks={self.first_blocks!r} must be an integer >= 0 "
                              f"(0 = the whole block stack reused on a reused step)")
        if not isinstance(self.compute_ratio, (int, float)) or not 0 < self.compute_ratio <= 1:
            raise ConfigError(f"step_cache.compute_ratio={self.compute_ratio!r} must be in (0, 1] "
                              f"(the share of steps computed in full; 1 = never reuse)")
        c = self.compute_steps
        if c is not None and (not c or not all(isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 0 for v in c) or 0 not in c
                              or len(set(c)) != len(c)):
            raise ConfigError(f"step_cache.compute_steps={list(c)!r} must be distinct step indices "
                              f">= 0 that include 0 (the first step is always computed), or null")
        self._check_cfg()
        r = self.timestep_range
        if r is not None and (len(r) != 2 or not all(isinstance(v, (int, float)) and
                                                     not isinstance(v, bool) for v in r)
                              or r[0] >= r[1]):
            raise ConfigError(f"step_cache.timestep_range={list(r)!r} must be two numbers "
                              f"[low, high] with low < high (timesteps run from ~1000 down to 0), "
                              f"or null")

    def _check_cfg(self) -> None:
        _choice("step_cache.cfg_reuse", self.cfg_reuse, CFG_REUSE)
        w = self.cfg_window
        if not (isinstance(w, (list, tuple)) and len(w) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in w)
                and 0 <= w[0] < w[1] <= 1):
            raise ConfigError(f"step_cache.cfg_window={w!r} must be two fractions [start, end) of "
                              f"the step count with 0 <= start < end <= 1 (e.g. [0.33, 0.96])")
        if not isinstance(self.cfg_interval, int) or isinstance(self.cfg_interval, bool) \
                or self.cfg_interval < 1:
            raise ConfigError(f"step_cache.cfg_interval={self.cfg_interval!r} must be an integer "
                              f">= 1 (1 = the unconditional call always runs)")
        if not isinstance(self.cfg_alpha, (int, float)) or isinstance(self.cfg_alpha, bool) \
                or not 0 <= self.cfg_alpha <= 1:
            raise ConfigError(f"step_cache.cfg_alpha={self.cfg_alpha!r} must be in [0, 1] "
                              f"(0 = the plain cond/uncond difference; FasterCache's 0.2 on Wan)")
        u = self.uncond_steps
        if u is not None and (not u or not all(isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 0 for v in u) or 0 not in u
                              or len(set(u)) != len(u)):
            raise ConfigError(f"step_cache.uncond_steps={list(u)!r} must be distinct step indices "
                              f">= 0 that include 0 (the first step has no difference to reuse), "
                              f"or null")

    def settings(self, cfg: bool = True) -> dict:
        """The method and the keys it reads, and the unconditional-branch reuse's keys when it is
        on: what makes its outputs (hashes). `cfg=False`: without them (the compile cache key:
        the skipped call runs no graph, so the compiled and captured graphs are the same)."""
        out = {"method": self.method, **{k: getattr(self, k) for k in STEP_CACHE_KEYS[self.method]}}
        if cfg and self.cfg_reuse != "none":
            out.update({k: getattr(self, k) for k in CFG_KEYS})
        return out

    @property
    def on(self) -> bool:
        """Anything of step reuse is on (a method, or the unconditional-branch reuse)."""
        return self.method != "none" or self.cfg_reuse != "none"


@dataclass(frozen=True)
class Config:
    """The whole tree: one field per section."""
    job: JobSection = field(default_factory=JobSection)
    model: ModelSpec = field(default_factory=ModelSpec)
    prompts: PromptsSection = field(default_factory=PromptsSection)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    run: RunOptions = field(default_factory=RunOptions)
    ray: RayOptions = field(default_factory=RayOptions)
    output: OutputSection = field(default_factory=OutputSection)
    compile: CompileSection = field(default_factory=CompileSection)
    step_cache: StepCacheSection = field(default_factory=StepCacheSection)


# The keys `--help` shows; every key is in `python -m runner.config` and docs/configuration.md.
COMMON_KEYS = ("model.preset", "model.source", "model.path", "prompts.path",
               "generation.num_inference_steps", "run.batch_size", "ray.num_workers", "output.dir",
               "output.overwrite", "compile.mode", "step_cache.method")


@dataclass(frozen=True)
class KeyInfo:
    name: str        # dotted: section.key
    type: object     # the annotation, e.g. int, str | None
    default: object
    doc: str


def schema() -> dict[str, KeyInfo]:
    """Every key of `Config`, in declaration order."""
    out = {}
    for sec in fields(Config):
        cls = sec.default_factory
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            default = f.default_factory() if f.default is MISSING else f.default
            name = f"{sec.name}.{f.name}"
            out[name] = KeyInfo(name, hints[f.name], default, f.metadata.get("doc", ""))
    return out


def defaults() -> DictConfig:
    """The schema's defaults as the bottom layer of the merge."""
    tree: dict = {}
    for k in schema().values():
        sec, name = k.name.split(".")
        tree.setdefault(sec, {})[name] = k.default
    return OmegaConf.create(tree)


def _allowed(hint) -> tuple:
    """The plain types a key accepts: `int | None` -> (int, NoneType)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _type_name(hint) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in _allowed(hint))


def _free_form(k: KeyInfo) -> bool:
    return k.type is dict


# ---------------------------------------------------------------------------------------------
# Loading and checking.

def available_jobs() -> list[str]:
    return sorted(p.stem for p in JOBS_DIR.glob("*.yaml"))


def available_presets() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "models").glob("*.yaml"))


def _job_path(job: str) -> Path:
    p = Path(job)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"job file {job!r} does not exist")
        return p
    p = JOBS_DIR / f"{job}.yaml"
    if not p.is_file():
        raise ConfigError(f"unknown job {job!r}{did_you_mean(job, available_jobs())}; valid: "
                          f"{available_jobs()} (or job=path/to/file.yaml)")
    return p


def _load_yaml(path: Path, what: str) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml syntax errors name the line
        raise ConfigError(f"cannot parse {what} {path}: {e}") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{what} {path} must be a mapping of config keys")
    return cfg


def parse_cli(argv: list[str]) -> tuple[str | None, DictConfig]:
    """Split `job=NAME` from the `key=value` overrides."""
    job, dotlist = None, []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not key=value; usage: python -m runner "
                              f"job=NAME [key=value ...] (jobs: {available_jobs()}; "
                              f"python -m runner --help)")
        k, value = arg.split("=", 1)
        if k == "job.name" and not value.strip():
            # not "unset": an empty name would silently fall back to the job file's name
            raise ConfigError("job.name is empty on the command line; give a name "
                              "(job.name=NAME) or leave the argument out to use the job file's name")
        if k == "job":
            job = value
        else:
            dotlist.append(f"{k}={value}")
    try:
        return job, OmegaConf.from_dotlist(dotlist)
    except Exception as e:
        raise ConfigError(f"bad command-line override: {e}") from e


def did_you_mean(name: str, valid, prefix: str = "") -> str:
    """The hint for a misspelt `name`: ` (did you mean 'x'?)` naming the closest of `valid`,
    or nothing when none is close."""
    hint = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1)
    return f" (did you mean {prefix + hint[0]!r}?)" if hint else ""


def _unknown(name: str, valid: list[str], source: str, prefix: str) -> ConfigError:
    return ConfigError(
        f"unknown config key {prefix + name!r} in {source}{did_you_mean(name, valid, prefix)}"
        f"; valid keys{' under ' + repr(prefix[:-1]) if prefix else ''}: {valid}")


def _check_keys(cfg: DictConfig, source: str) -> None:
    """Every key of `cfg` (a job file, preset or the command line) is in the schema."""
    keys = schema()
    sections = [f.name for f in fields(Config)]
    for sec in cfg.keys():
        if sec not in sections:
            raise _unknown(str(sec), sections, source, "")
        valid = [k.split(".", 1)[1] for k in keys if k.startswith(f"{sec}.")]
        node = cfg._get_node(sec)
        if not isinstance(node, DictConfig):
            raise ConfigError(f"{sec!r} in {source} must be a mapping with keys {valid}")
        for name in node.keys():
            if name not in valid:
                raise _unknown(str(name), valid, source, f"{sec}.")
            k = keys[f"{sec}.{name}"]
            if _free_form(k) and not isinstance(node._get_node(name), DictConfig):
                raise ConfigError(f"{k.name!r} in {source} must be a mapping")


def _check_types(cfg: DictConfig) -> None:
    """Every leaf has one of its annotated types (ints are floats; numbers are strings)."""
    for k in schema().values():
        sec, name = k.name.split(".")
        got, allowed = cfg[sec][name], _allowed(k.type)
        if got == REQUIRED or _free_form(k):
            continue
        if str in allowed and isinstance(got, (int, float)) and not isinstance(got, bool):
            cfg[sec][name] = str(got)         # generation.negative_prompt=123, job.name=2024
            continue
        ok = any(
            (t is type(None) and got is None)
            or (t is bool and isinstance(got, bool))
            or (t is int and isinstance(got, int) and not isinstance(got, bool))
            or (t is float and isinstance(got, (int, float)) and not isinstance(got, bool))
            or (t is str and isinstance(got, str))
            or (t is list and isinstance(got, ListConfig))
            for t in allowed)
        if not ok:
            raise ConfigError(f"{k.name}={got!r} has the wrong type: expected {_type_name(k.type)} "
                              f"(default {k.default!r})")
        bad = _non_finite(got)
        if bad is not None:   # NaN passes every range check (NaN < 0 is False) and NaN != NaN
            what = "is not a finite number" if bad is got else f"holds {bad}, not a finite number"
            raise ConfigError(f"{k.name}={_plain(got)!r} {what}; give a finite value (default "
                              f"{_show(k.default)})")


def _non_finite(value) -> float | None:
    """The first NaN or infinity in a number or a list of them (nested), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if isinstance(value, (list, tuple, ListConfig)):
        for v in value:
            if (bad := _non_finite(v)) is not None:
                return bad
    return None


def _plain(value):
    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value


def load_config(argv: list[str]) -> DictConfig:
    """The merged, checked config for `python -m runner job=NAME key=value ...`."""
    job, cli = parse_cli(argv)
    if job is None:
        raise ConfigError(f"no job given: python -m runner job=NAME [key=value ...]; "
                          f"jobs: {available_jobs()} (python -m runner --help)")
    job_path = _job_path(job)
    base = defaults()
    job_cfg = _load_yaml(job_path, "job file")
    _check_keys(job_cfg, f"job file {job_path}")
    _check_keys(cli, "the command line")

    preset = OmegaConf.select(cli, "model.preset") or OmegaConf.select(job_cfg, "model.preset") \
        or base.model.preset
    preset_path = CONF_DIR / "models" / f"{preset}.yaml"
    if not preset_path.is_file():
        raise ConfigError(f"unknown model.preset {preset!r}"
                          f"{did_you_mean(preset, available_presets())}; valid: {available_presets()}")
    preset_cfg = _load_yaml(preset_path, "model preset")
    _check_keys(preset_cfg, f"model preset {preset_path}")

    cfg = OmegaConf.merge(base, preset_cfg, job_cfg, cli)
    if cfg.job.name is None:
        cfg.job.name = job_path.stem
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"required config keys not set: {missing} (set them in the job file or "
                          f"on the command line, e.g. prompts.path=prompts.parquet)")
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:
        raise ConfigError(f"cannot resolve interpolation: {e}") from e
    _check_types(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


# ---------------------------------------------------------------------------------------------
# The narrow pieces that are not schema sections. Each validates itself; nothing below
# runner.driver.job sees the whole tree.

@dataclass(frozen=True)
class PromptSource:
    paths: tuple[str, ...]
    on_empty: str
    strict: bool = False          # prompts.strict: unknown columns are an error
    max_image_bytes: int = 64 << 20   # prompts.max_image_mib, in bytes

    def __post_init__(self):
        _choice("prompts.on_empty", self.on_empty, ("error", "skip"))
        _positive("prompts.max_image_mib", self.max_image_bytes >> 20)   # the MiB given
        if not self.paths:
            raise ConfigError("prompts.path is empty: give a .parquet file, a directory or a list")


@dataclass(frozen=True)
class OutputOptions:
    job_dir: str                   # <output.dir>/<job.name>
    fps: int
    results_every_s: float

    def __post_init__(self):
        _positive("output.fps", self.fps)
        _positive("output.results_every_s", self.results_every_s, allow_zero=True)


def _compile_options(section: dict) -> CompileOptions:
    """The compile section (all but cache_dir) as the compiler's typed options, parsed and checked
    here, once, before anything uses them: a bad value is a ConfigError naming its key and the
    valid values."""
    from compiler.options import expand_mode
    options = {k: v for k, v in section.items() if k != "cache_dir"}
    try:
        expand_mode(str(options.get("mode") or "none"))
    except ValueError as e:
        raise ConfigError(f"compile.mode={options.get('mode')!r}: {e}") from e
    try:
        return parse_options(options)
    except ValueError as e:          # the compiler's message names the key and the valid values
        raise ConfigError(f"compile: {e}") from e


@dataclass(frozen=True)
class CompileConfig:
    """The job's compile options (`compiler.CompileOptions`, parsed once by `split`), the mode as
    the job named it (`O2`; for logs and the summary) and the compile cache directory."""
    options: CompileOptions = field(default_factory=lambda: _compile_options(
        OmegaConf.to_container(defaults().compile)))
    cache_dir: str | None = None
    mode: str = "none"

    @property
    def enabled(self) -> bool:
        return self.options.compile

    @property
    def fuse_qkv(self) -> bool:
        return self.options.fuse_qkv


def _step_cache(section: dict) -> StepCacheSection:
    try:
        return StepCacheSection(**section)
    except TypeError as e:   # e.g. a string where a number belongs inside timestep_range
        raise ConfigError(f"step_cache: {e}") from e


def _join(location: str, name: str) -> str:
    """location/name for a local path or an s3:// / gs:// URI."""
    return f"{location.rstrip('/')}/{name}" if "://" in location else os.path.join(location, name)


def _as_paths(value) -> tuple[str, ...]:
    if isinstance(value, (list, tuple, ListConfig)):
        return tuple(str(v) for v in value)
    return (str(value),) if value not in (None, "") else ()


def split(cfg: DictConfig) -> dict:
    """The typed pieces of a merged config (see the dataclasses above)."""
    from .io import storage

    def section(name):
        return OmegaConf.to_container(cfg[name], resolve=True)

    try:
        model = ModelSpec(**section("model"))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    name = str(cfg.job.name)
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"job.name={name!r} must be a plain directory name")
    c = section("compile")
    for k, v in [("output.dir", cfg.output.dir), ("compile.cache_dir", c["cache_dir"] or ""),
                 *(("prompts.path", p) for p in _as_paths(cfg.prompts.path))]:
        try:
            v and storage.check(str(v))
        except ValueError as e:
            raise ConfigError(f"{k}={str(v)!r}: {e}") from e
    out_dir = str(cfg.output.dir)
    cache_dir = str(c["cache_dir"] or _join(out_dir, ".compile-cache"))
    return dict(
        name=name,
        model=model,
        prompts=PromptSource(paths=_as_paths(cfg.prompts.path), on_empty=cfg.prompts.on_empty,
                             strict=cfg.prompts.strict,
                             max_image_bytes=cfg.prompts.max_image_mib << 20),
        generation=GenerationDefaults(**section("generation")),
        run=RunOptions(**section("run")),
        ray=RayOptions(**section("ray")),
        output=OutputOptions(job_dir=_join(out_dir, name), fps=cfg.output.fps,
                             results_every_s=cfg.output.results_every_s),
        step_cache=_step_cache(section("step_cache")),
        compile=CompileConfig(
            options=_compile_options(c), mode=str(c["mode"]),
            cache_dir=cache_dir if storage.is_uri(cache_dir) else storage.resolve(cache_dir).base),
    )


@dataclass(frozen=True)
class WorkerConfig:
    """What the driver hands each worker (`runner.serve.actor.WorkerActor`): the only part of the job's
    config a worker sees."""
    model: ModelSpec
    generation: GenerationDefaults
    limits: Constraints
    on_empty: str
    job_dir: str
    batch_size: int = 1
    warmup_steps: int = 2
    fps: int = 8
    compile: CompileConfig = field(default_factory=CompileConfig)
    step_cache: StepCacheSection = field(default_factory=StepCacheSection)
    num_threads: int | None = None   # CPU workers: torch threads (avoids oversubscribing cores)
    encode_batch: int = 8            # prompts per text-encoder call (the shard size: one shape)
    start_timeout_s: float = 900.0   # ray.worker_start_timeout_s: a fetching worker waits for the
                                     # compiling one's artifact half of what is left of it
    max_image_bytes: int = 64 << 20  # prompts.max_image_mib: the largest input image read
    canary: bool = False             # make a canary reference when ready (run.canary_*)
    canary_min_psnr_db: float = 40.0  # lossy modes' canary tolerance


# ---------------------------------------------------------------------------------------------
# Documentation from the schema: docs/configuration.md's key table and `--help`.

def _show(v) -> str:
    if v == REQUIRED:
        return "required"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if v == "":
        return '""'
    return str(v)


def markdown_table() -> str:
    """Every key as a markdown table (tests/test_ux.py checks docs/configuration.md holds exactly this)."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for k in schema().values():
        doc = k.doc.replace("|", r"\|")   # a doc's own "a | b" choices: unescaped, more cells
        rows.append(f"| `{k.name}` | {_type_name(k.type)} | `{_show(k.default)}` | {doc} |")
    return "\n".join(rows)


def keys_text(names=None) -> str:
    """Keys as aligned plain text: `name  default  doc`."""
    keys = [k for k in schema().values() if names is None or k.name in names]
    w = max(len(k.name) for k in keys)
    d = max(len(_show(k.default)) for k in keys)
    return "\n".join(f"  {k.name:<{w}}  {_show(k.default):<{d}}  {k.doc}" for k in keys)


def _job_summary(name: str) -> str:
    """A job file's first comment line."""
    for line in (JOBS_DIR / f"{name}.yaml").read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def jobs_markdown() -> str:
    """The shipped jobs as a markdown list, each with its file's first comment line
    (tests/test_ux.py checks docs/configuration.md holds exactly this)."""
    return "\n".join(f"- `{j}`: {_job_first_sentence(j)}" for j in available_jobs())


def _job_first_sentence(name: str) -> str:
    """The first sentence of a job file's leading comment block."""
    lines = []
    for line in (JOBS_DIR / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(lines)
    return text.split(". ", 1)[0].rstrip(".") + "."


def help_text() -> str:
    jobs = available_jobs()
    w = max(map(len, jobs))
    job_lines = "\n".join(f"  {j:<{w}}  {_job_summary(j)}" for j in jobs)
    return f"""\
usage: python -m runner job=NAME [key=value ...]

Generates one image or video per prompt of a Parquet file, on a local Ray (one worker per GPU, or
CPU workers) or an existing cluster (ray.address, RAY_ADDRESS). Outputs go to
<output.dir>/<job name>/: media/, results.parquet, summary.txt. A rerun resumes.

jobs (jobs/NAME.yaml; or job=path/to/file.yaml):
{job_lines}

examples:
  python -m runner job=demo_image                 # CPU demo: tiny random model, no weights, no network
  python -m runner job=pixart_batch prompts.path=my_prompts.parquet compile.mode=O2
  python -m runner job=latte_batch model.path=/models/Latte-1 model.local_files_only=true \\
      ray.num_workers=4 output.dir=/shared/outputs

common keys (key=value; values are YAML; later wins: model preset < job file < command line):
{keys_text(COMMON_KEYS)}

every key, its type, default and meaning: python -m runner.config (docs/configuration.md);
the summary table's columns: python -m runner --explain (and every job's summary.txt);
compile modes and step reuse: docs/compiler.md; failures and resume: docs/failures.md; models: docs/models.md.
exit status: 0 all ok (or a dry run: run.dry_run=true), 1 some prompts failed, 2 bad input,
3 stopped early on a persistent fault (the same error on every output, e.g. a full disk: summary.txt
names it; or the store of the images does not answer), 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM)."""


if __name__ == "__main__":
    if "--jobs" in sys.argv[1:]:
        print(jobs_markdown())
    else:
        print(markdown_table() if "--markdown" in sys.argv[1:] else keys_text())
