"""Compile options: nexfort-style modes parsed into one frozen `CompileOptions`.

Contract: `parse_options(obj)` accepts `None`, a `CompileOptions`, a dict or a JSON string of the
dict nexfort takes::

    {"mode": "max-autotune:cudagraphs:cache-all", "memory_format": "channels_last",
     "dynamic": false, "options": {...Inductor config overrides...},
     "fuse_qkv": true, "sdpa_priority": true, "fuse_gelu": true, "short_attention": true,
     "short_cross_attention": true, "compile_text_encoder": null, "compile_vae": null}

and returns a `CompileOptions`. Anything unknown (a flag, a top-level key, an Inductor option that
`torch._inductor.config` does not have, a memory format) raises `ValueError` naming the bad value and
listing the valid ones. Nothing here touches a model or global state: `compiler.compile_pipe` applies
the result.

`mode` is colon-joined flags. Presets expand to flags before anything else. `FLAGS` below is the one
table of what each flag turns on; `FLAG_TABLE_MD` renders it for docs/compiler.md. Every Inductor setting
the compiler makes lives in `FLAGS` (plus the user's `options` overrides, applied last), nowhere else.

| flag | turns on |
| --- | --- |
| `none` | eager: nothing is compiled (baselines); QKV fusion still applies unless `fuse_qkv: false` |
| `max-autotune` | denoiser blocks: Inductor `max_autotune` (GEMM templates benchmarked per shape) and `coordinate_descent_tuning`; slow first compile |
| `max-optimize` | denoiser blocks: Inductor `aggressive_fusion`, `epilogue_fusion`, `max_autotune_pointwise` (more fusion; a few configs of every pointwise/reduction kernel compiled in parallel and timed once), without `dynamic_scale_rblock` (so the tuned configs come back from the cache in a warm start); and, process-wide, row reductions up to 2048 wide in a single pass (Inductor stops at 1024; DiT rows are 1152 wide; `compiler/heuristics.py`) |
| `cudagraphs` | the whole denoiser call (one denoising step) captured as a CUDA graph per input shape, replayed on later steps (CUDA only; ignored on CPU) |
| `freezing` | Inductor `freezing`: weights inlined as constants and constant-folded; weights can no longer change |
| `low-precision` | lossy, denoiser blocks: their Linear layers in FP8 (e4m3, per-channel weight / per-row activation scales, `torch._scaled_mm`; GPUs of compute capability >= 8.9 only; the projections feeding attention add their bias in the GEMM and write the model dtype, so q/k/v reach the attention kernel as views without a copy), Inductor `triton.codegen_upcast_to_fp32=False` (pointwise math in fp16/bf16), reduced-precision GEMM reductions |
| `int8-attention` | lossy, compiled, CUDA Hopper (sm90): Wan's self-attention over >= 16,384 tokens (the published video sizes), where its q and k are normalised per token (the kernel's domain; elsewhere lossless, one log line), in INT8 (QK; Q and K Hadamard-rotated first, so outlier channels keep their precision) and FP8 (PV) with FP32 accumulation (`compiler/kernels/int8_attention.py`: SageAttention 2's kernel, built once per machine with nvcc, our quantisation): 1.40x cuDNN at 480x832 x 81 frames on an H100, output cosine >= 0.999 also with outlier channels; where it cannot run (another GPU, no nvcc), one log line and cuDNN's attention |
| `cache-all` | Inductor `fx_graph_cache` and `autotune_local_cache` on (in `compiler.cache`'s directory), and portable artifacts packed by `compiler.cache` |
| `deterministic` | Inductor `deterministic`: each reduction kernel takes the one config Inductor's heuristic picks instead of the fastest of a few timed on the GPU, so every worker of a job computes the same bits (two fresh O2 workers made other videos without it: benchmarks/2026-12-04-o2-deterministic-h200.md) |
| `benchmark` | `torch.backends.cudnn.benchmark` (conv algorithms timed per shape: UNet, VAE) and Inductor `benchmark_fusion` |
| `O2` (preset) | `cudagraphs:cache-all:deterministic`: lossless, compiles in seconds, the same bits from every worker |
| `O3` (preset) | `cudagraphs:cache-all:max-optimize:low-precision:int8-attention`: fastest, not bit-faithful (the benchmark states its error); without `deterministic` (`max-optimize` times its reduction configs), so two workers may differ in the last bits |
| key `fuse_qkv` (default true) | one fused QKV (self) / KV (cross) projection in every attention of the denoiser, any mode, eager too |
| key `fuse_gelu` (default true) | compiled, CUDA: Linear + GELU(tanh) as one cuBLASLt GEMM with a GELU epilogue |
| key `short_attention` (default true) | compiled, CUDA: unmasked self-attention over <= 64 tokens (Latte's temporal attention) as one Triton kernel reading the fused QKV output in place |
| key `short_cross_attention` (default true) | compiled, CUDA: masked cross-attention against <= 128 keys (a text encoder's padded prompt, with the key-padding bias the DiTs pass) as one Triton kernel reading q and the fused KV output in place; unmasked calls keep SDPA |
| key `sdpa_priority` (default true) | CUDA: each attention call takes the first of cuDNN, flash, mem-efficient, math that accepts it |
| key `memory_format: "channels_last"` | UNet and VAE in channels_last |
| key `dynamic: true` | symbolic shapes from the first call: several resolutions, no recompiles |
| key `compile_vae` (default null = on when compiling) | compiled, `dynamic: false`: also compile the VAE decoder's ResnetBlock2Ds, with the lossless settings only, in every mode (fused GroupNorm+SiLU: PixArt-α 1024² peak memory 12.60 -> 11.63 GiB, E2E 0.81 -> 0.76 s; Latte decodes in chunks of 14 and 2 frames: two sets of graphs) |
| key `compile_text_encoder` (default null = on when compiling) | compiled: also compile the text encoder's blocks, with the lossless settings only in every mode (the runner encodes a shard's prompts in one call of a fixed batch: one graph) |

`max-autotune` is in neither preset: on an H100 it took first-call compile from 6 s to 58 s for no
gain on PixArt (an early measurement, before benchmarks/ kept one), and the presets must keep the first call short.
Why `max-optimize` uses `max_autotune_pointwise` rather than `coordinate_descent_tuning`
(BENCHMARKS.md, "Compiler, third round"): on Latte-1 O3 the descent ran 290 serial compile-and-time
trials, 97 s of a 128 s first call, for 6.84 it/s; `max_autotune_pointwise` compiles its few
candidates in parallel workers: 48 s for 6.38 it/s; neither: 25 s for 6.04 it/s. What the descent
found beyond that was mostly the FP8 activation-quantisation reductions, which `compiler.kernels.quant`
now does in one hand-written kernel: with it O3 runs Latte-1 at 7.1 it/s after a 27 s first call.
Without `dynamic_scale_rblock` (BENCHMARKS.md, "fifth round"): with it Latte-1 ran 3 % faster, but
torch 2.11 re-benchmarked and rebuilt the scaled-down reduction configs in every warm start (Latte's
warm-up with cache 16.2 s against 10.8 s without).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# flag -> what it turns on. Keys of each entry:
#   inductor:   torch._inductor.config overrides (dotted names as in config)
#   cudagraphs / low_precision / cudnn_benchmark / cache: switches read by compiler/__init__.py
#   compile:    False for eager
#   denoiser_only: the inductor settings apply to the denoiser's blocks, not to the text encoder / VAE
#               (which run once per call: no tuning time spent there, and no lossy arithmetic)
FLAGS: dict[str, dict] = {
    "none": {"compile": False},
    "max-autotune": {"denoiser_only": True, "inductor": {"max_autotune": True, "coordinate_descent_tuning": True}},
    # dynamic_scale_rblock off: torch 2.11's autotune cache cannot restore a reduction config that
    # was scaled down after tuning, so every warm start re-benchmarked (and re-built) those kernels.
    # persistent_rows: row reductions up to 2048 wide in one pass (compiler/heuristics.py; process-wide)
    "max-optimize": {"denoiser_only": True, "persistent_rows": 2048,
                     "inductor": {"aggressive_fusion": True, "epilogue_fusion": True,
                                  "max_autotune_pointwise": True, "dynamic_scale_rblock": False}},
    "cudagraphs": {"cudagraphs": True},
    "freezing": {"inductor": {"freezing": True}},
    "low-precision": {"low_precision": True, "denoiser_only": True, "inductor": {"triton.codegen_upcast_to_fp32": False}},
    "int8-attention": {"int8_attention": True, "denoiser_only": True},
    "cache-all": {"cache": True, "inductor": {"fx_graph_cache": True, "autotune_local_cache": True}},
    # deterministic: without it Inductor times a few configs of each reduction at first launch and keeps
    # the fastest, which differs between workers (noise) and so does the order of the sums.
    "deterministic": {"inductor": {"deterministic": True}},
    "benchmark": {"cudnn_benchmark": True, "inductor": {"benchmark_fusion": True}},
}

# Presets expand to plain flags (O2 lossless, O3 adds lossy speed).
PRESETS: dict[str, tuple[str, ...]] = {
    "O2": ("cudagraphs", "cache-all", "deterministic"),
    "O3": ("cudagraphs", "cache-all", "max-optimize", "low-precision", "int8-attention"),
}

LOSSY_FLAGS = frozenset({"low-precision", "int8-attention"})
MEMORY_FORMATS = (None, "channels_last", "contiguous")
# The boolean keys' defaults are CompileOptions' field defaults.
BOOL_KEYS = ("dynamic", "fuse_qkv", "sdpa_priority", "fuse_gelu", "short_attention", "short_cross_attention",
             "compile_text_encoder", "compile_vae")
NULLABLE_KEYS = ("compile_vae", "compile_text_encoder")  # null: the compiler decides per pipeline
TOP_LEVEL_KEYS = ("mode", "memory_format", "options", *BOOL_KEYS)

FLAG_TABLE_MD = __doc__[__doc__.index("| flag |"):__doc__.index("\n\n`max-autotune` is in")]


@dataclass(frozen=True)
class CompileOptions:
    flags: frozenset[str] = frozenset()
    memory_format: str | None = None
    dynamic: bool = False
    inductor: dict = field(default_factory=dict)   # user overrides only; flag settings: inductor_config()
    fuse_qkv: bool = True
    sdpa_priority: bool = True          # CUDA: SDPA backend priority list (transforms.SDPA_PRIORITY)
    fuse_gelu: bool = True              # CUDA, compiled: Linear+GELU(tanh) as one cuBLASLt GEMM
    short_attention: bool = True        # CUDA, compiled: short self-attention as one Triton kernel
    short_cross_attention: bool = True  # CUDA, compiled: masked cross-attention to <= 128 keys, one Triton kernel
    compile_text_encoder: bool | None = None  # None: yes when compiling (see the table)
    compile_vae: bool | None = None     # None: yes when compiling, unless dynamic (see the table)

    def __hash__(self):  # the inductor field is a dict: hash the JSON of every field
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def compile(self) -> bool:
        return "none" not in self.flags

    @property
    def lossless(self) -> bool:
        return not (self.flags & LOSSY_FLAGS)

    def has(self, switch: str) -> bool:
        """True if any flag turns on `switch` (a non-inductor key of FLAGS, e.g. "cudagraphs")."""
        return any(FLAGS[f].get(switch) for f in self.flags)

    def inductor_config(self, denoiser: bool = True) -> dict:
        """Every Inductor setting to apply: the flags' settings, then the user's overrides.
        `denoiser=False`: for the text encoder / VAE, without the `denoiser_only` flags' settings."""
        cfg: dict = {}
        for f in sorted(self.flags):
            if denoiser or not FLAGS[f].get("denoiser_only"):
                cfg.update(FLAGS[f].get("inductor", {}))
        cfg.update(self.inductor)
        return cfg

    @property
    def mode(self) -> str:
        return ":".join(sorted(self.flags))

    def to_dict(self) -> dict:
        return {"mode": self.mode, "memory_format": self.memory_format, "dynamic": self.dynamic,
                "options": dict(self.inductor), "fuse_qkv": self.fuse_qkv, "sdpa_priority": self.sdpa_priority,
                "fuse_gelu": self.fuse_gelu, "short_attention": self.short_attention,
                "short_cross_attention": self.short_cross_attention,
                "compile_text_encoder": self.compile_text_encoder, "compile_vae": self.compile_vae}


def _valid_inductor_keys() -> set[str]:
    import torch._inductor.config as inductor_config
    return set(inductor_config.get_config_copy())


def expand_mode(mode: str) -> frozenset[str]:
    """'O3:max-autotune' -> the set of plain flags. Empty mode means 'none' (eager)."""
    flags: set[str] = set()
    for part in (p.strip() for p in mode.split(":")):
        if not part:
            continue
        if part in PRESETS:
            flags.update(PRESETS[part])
        elif part in FLAGS:
            flags.add(part)
        else:
            raise ValueError(f"unknown compile mode flag {part!r}; valid flags: {sorted(FLAGS)}, "
                             f"presets: {sorted(PRESETS)}")
    if not flags:
        flags = {"none"}
    if "none" in flags and len(flags) > 1:
        raise ValueError(f"compile mode 'none' (eager) cannot be combined with {sorted(flags - {'none'})}")
    return frozenset(flags)


def parse_options(obj: dict | str | CompileOptions | None) -> CompileOptions:
    if isinstance(obj, CompileOptions):
        return obj
    if obj is None:
        obj = {}
    if isinstance(obj, str):
        s = obj.strip()
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise ValueError(f"compile options are not valid JSON: {e}") from e
        else:  # a bare mode string, e.g. "O3" (what `compile.mode=O3` gives)
            obj = {"mode": s}
    if not isinstance(obj, dict):
        raise ValueError(f"compile options must be a dict, JSON string or CompileOptions, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(f"unknown compile option key(s) {unknown}; valid keys: {list(TOP_LEVEL_KEYS)}")

    mode = obj.get("mode") or "none"
    if not isinstance(mode, str):
        raise ValueError(f"compile mode must be a string like 'O2' or 'max-autotune:cudagraphs', got {mode!r}")
    flags = expand_mode(mode)

    memory_format = obj.get("memory_format")
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"unknown memory_format {memory_format!r}; valid: {list(MEMORY_FORMATS)}")

    inductor = dict(obj.get("options") or {})
    # Importing Inductor costs seconds of CPU: only when there are keys to check.
    valid = _valid_inductor_keys() if inductor else set()
    bad = sorted(k for k in inductor if k not in valid)
    if bad:
        raise ValueError(f"unknown Inductor option(s) {bad} (not in torch._inductor.config); valid options "
                         f"are the {len(valid)} keys of torch._inductor.config.get_config_copy(), e.g. "
                         f"{sorted(valid)[:12]}...")
    for key in BOOL_KEYS:
        if key in obj and not isinstance(obj[key], bool) and not (key in NULLABLE_KEYS and obj[key] is None):
            raise ValueError(f"compile option {key!r} must be true or false, got {obj[key]!r}")
    return CompileOptions(flags=flags, memory_format=memory_format, inductor=inductor,
                          **{k: obj[k] for k in BOOL_KEYS if k in obj})
