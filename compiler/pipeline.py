"""`compile_pipe` and what it needs: the torch side of `compiler` (contract: `compiler/__init__.py`,
which exports these names and imports this module on first use)."""

from __future__ import annotations

import logging
import sys
import threading

import torch

from .options import FLAGS, CompileOptions, parse_options
from . import transforms
from .kernels import int8_attention, quant
from .video import block_pairs, video_vae
from .cudagraph import StepGraph, wrap_step
from .kernels.cross_attention import use_short_cross_attention
from .kernels.short_attention import use_short_attention

log = logging.getLogger("compiler")


def denoiser_of(pipe) -> torch.nn.Module:
    den = getattr(pipe, "transformer", None)
    den = den if den is not None else getattr(pipe, "unet", None)
    if den is None:
        raise ValueError(f"{type(pipe).__name__} has neither .transformer nor .unet to compile")
    return den


def denoisers_of(pipe) -> list[torch.nn.Module]:
    """The denoiser, and a second expert where the pipeline has one (diffusers' `transformer_2`:
    Wan 2.2 A14B's low-noise expert, switched to at the pipeline's `boundary_ratio`)."""
    second = getattr(pipe, "transformer_2", None)
    return [denoiser_of(pipe)] + ([second] if second is not None else [])


# The text encoders, compiled when `compile_text_encoder` is on: text_encoder_2 is the T5 of
# two-encoder pipelines (FLUX's CLIP + T5). An image-to-video pipeline's image encoder stays eager:
# Wan 2.1 I2V reads its hidden states, which transformers 5 collects through forward hooks on a
# ContextVar that Dynamo cannot trace, and it is one 224x224 image per call (~0.2 TFLOP).
ENCODERS = ("text_encoder", "text_encoder_2")


# Set once a prewarm thread's imports are done (None: no prewarm in this process). compile_pipe waits
# for it: importing Inductor from two threads at once can hand one of them the partly initialised
# package ("cannot import name 'lowering' from 'torch._inductor'") when the model loads fast.
_imports_done: threading.Event | None = None
PREWARM_WAIT_S = 300   # they take seconds; a hung import (a GPU driver's) must not hang compiling


def prewarm(build_int8_attention: bool = False) -> threading.Thread:
    """Start importing what a compiled call needs (Dynamo, Inductor with its lowerings and kernel
    templates, the Triton runtime) and the torch source hash Inductor's caches are keyed on, in a
    daemon thread, so that this overlaps with loading the model instead of adding to the first call.

    Why: Inductor is imported lazily by the first compiled call, even when every graph comes from
    the cache: 2-3 s of a warm start (more where Python cannot keep bytecode, e.g. under
    PYTHONDONTWRITEBYTECODE). Purely an optimisation: any failure is logged and ignored (the
    first call imports whatever is missing as it would anyway).
    `build_int8_attention`: also build (or load) the `int8-attention` kernel now, ~1 min of nvcc on a
    machine that has not built it yet, instead of in `compile_pipe` after the model loaded.
    """
    global _imports_done
    done = _imports_done = threading.Event()

    def work():
        import importlib
        try:
            for name in ("torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.lowering",
                         "torch._inductor.kernel", "torch._inductor.select_algorithm",
                         "torch._inductor.runtime.triton_heuristics", "triton.compiler"):
                importlib.import_module(name)
            from torch._inductor import codecache
            codecache.torch_key()   # hash of torch's own sources (cached per process)
        except Exception as e:
            log.debug("prewarm stopped early: %s: %s", type(e).__name__, e)
        finally:
            done.set()
        if build_int8_attention:   # after the imports (seconds), not before them (a minute)
            int8_attention.unavailable()   # cached: compile_pipe's call returns at once

    t = threading.Thread(target=work, name="compiler-prewarm", daemon=True)
    t.start()
    return t


def compile_times(min_s: float = 0.001) -> dict[str, float]:
    """Seconds this process spent in each of Dynamo's and Inductor's timed phases, summed over every
    compile so far (`torch._dynamo.utils.compile_times`: bytecode tracing, the backend call, its
    cache loads, guards...), those of at least `min_s`: where a warm start's first call goes.
    Nested phases overlap (a parent's time includes its children's). {} where torch has no table."""
    try:   # a private table: another torch may move it or change its format
        from torch._dynamo.utils import compile_times as table
        names, values = table(repr="csv", aggregate=True)
        return {n: round(float(v), 3) for n, v in zip(names, values) if float(v) >= min_s}
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}


def _device_type(module: torch.nn.Module) -> str:
    p = next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _apply_switches(opts: CompileOptions) -> None:
    """Process-wide backend switches (not Inductor config: that is passed per compile), and the
    one Inductor heuristic that is not a config setting (`persistent_rows`, set for every compile)."""
    rows = max((FLAGS[f].get("persistent_rows", 0) for f in opts.flags), default=0)
    if opts.compile and (rows or "torch._inductor.virtualized" in sys.modules):  # else nothing to reset
        from . import heuristics   # imports Inductor
        heuristics.set_persistent_rows(rows)
    if opts.has("low_precision"):
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    if opts.has("cudnn_benchmark"):
        torch.backends.cudnn.benchmark = True


# Row sizes (height x width x frames) one compiled pipeline serves, each with graphs of its own
# (`dynamic: false` specialises on shapes); a row of a size past them fails with Dynamo's
# FailOnRecompileLimitHit (fullgraph): `compile.dynamic` serves any number of sizes.
SIZES = 8


def _raise_recompile_limit(n_blocks: int) -> None:
    """Dynamo keeps at most `recompile_limit` graphs per code object; all instances of a block class
    share one code object, and a UNet's ResnetBlock2D comes in ~10 shapes (channels x resolution).
    That is per row size: tiny Wan's VAE `resblock` hit a limit of 26 on its second size (64x48
    then 48x64, 5 frames) and every row of it failed; the limit holds `SIZES` sizes."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, SIZES * (n_blocks + 8))
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit,
                                          4 * SIZES * (n_blocks + 8))


def compile_kwargs(opts: CompileOptions, denoiser: bool = True) -> dict:
    """Arguments for every torch.compile call the compiler makes (`denoiser=False`: text encoder,
    VAE: without the denoiser-only settings, see FLAGS)."""
    # dynamic=True: symbolic shapes from the first call (one graph serves all resolutions);
    # False: specialise on each shape (fastest kernels, a recompile per new resolution).
    return dict(fullgraph=True, dynamic=opts.dynamic, options=opts.inductor_config(denoiser))


def _compile_vae(vae, opts: CompileOptions, aux_kw: dict, device: str) -> dict[str, int]:
    """The VAE decoder, with the lossless settings. A causal video VAE (Wan 2.1's and 2.2's)
    decodes in chunks of frames, its blocks compiled (`compiler.video.video_vae`; on CUDA in
    channels_last_3d, its upsamplers as four-phase convolutions, its 3x3x3 convolutions as
    time-Winograd ones, the output convolution as one GEMM to its taps); a 2-D one has its
    ResnetBlock2Ds compiled. `dynamic`: the blocks specialise on sizes and strides and would
    recompile per resolution, which `dynamic` promises not to do: the 2-D VAE stays eager, the
    video VAE runs its chunks eager."""
    if video_vae.supported(vae):
        cuda = device == "cuda"
        winograd = video_vae.WINOGRAD if cuda else 0
        triton = bool(winograd) and video_vae.TRITON and video_vae.triton_available()
        if winograd and video_vae.TRITON and not triton:
            log.warning("Triton or CUDA missing: the Wan VAE's Winograd passes stay Inductor's "
                        "(slower)")
        return video_vae.chunked_decode(vae, None, None if opts.dynamic else aux_kw,
                                        channels_last=cuda and video_vae.CHANNELS_LAST,
                                        subpixel=cuda and video_vae.SUBPIXEL,
                                        winograd=winograd, triton=triton,
                                        taps=cuda and video_vae.TAPS)
    return {} if opts.dynamic else transforms.compile_blocks(vae.decoder, aux_kw)


def _gpu_transforms(den, opts: CompileOptions, fused: bool, report: dict) -> None:
    """The CUDA-only transforms of one denoiser (FP8, fused GELU, short attention kernels);
    counts are added to `report`'s."""
    def add(key, n):
        report[key] = report.get(key, 0) + n
    blocks = transforms.block_classes(den)
    if opts.has("low_precision") and transforms.fp8_supported(den):
        add("fp8_linears", transforms.to_fp8(den, blocks))
        add("fp8_feedforwards", quant.fp8_feedforward(den))
    if opts.fuse_gelu:
        add("fused_gelu", transforms.fuse_gelu(den))
    if opts.short_attention and fused:
        add("short_attention", use_short_attention(den))
    if opts.short_cross_attention and fused:
        add("short_cross_attention", use_short_cross_attention(den))
    _int8_attention(den, opts, "cuda", report)


def _int8_attention(den, opts: CompileOptions, device: str, report: dict) -> None:
    """Flag `int8-attention` on one denoiser: its Wan (and AnyFlow) self-attentions inside the
    kernel's domain (q and k normalised per token: `int8_attention.domain_miss`) on the kernel (the count in
    `report["int8_attention"]`; those outside stay lossless, one log line and their count in
    `report["int8_attention_lossless"]`), or, where none is inside or the kernel cannot run
    (`device` not CUDA, another GPU, no nvcc), `report["int8_attention_off"]` says why and the
    attention stays SDPA's: the caller records which outputs were made without it."""
    if not (opts.has("int8_attention") and int8_attention.has_long_attention(den)):
        return
    outside = int8_attention.outside_domain(den)
    why = _int8_attention_off(den, device, outside)
    if why:   # said once per process
        if "int8_attention_off" not in report:
            log.warning("int8 attention off, Wan self-attention stays on SDPA (cuDNN): %s", why)
        report["int8_attention_off"] = why
        return
    report["int8_attention"] = report.get("int8_attention", 0) + int8_attention.use_int8_attention(den)
    if outside:   # a lossy kernel outside the inputs it was shown to hold on: the lossless path
        if "int8_attention_lossless" not in report:
            name, why = next(iter(outside.items()))
            log.warning("int8 attention: %d self-attention(s) stay on SDPA (lossless), outside its "
                        "domain: %s (%s, ...)", len(outside), why, name)
        report["int8_attention_lossless"] = report.get("int8_attention_lossless", 0) + len(outside)


def _int8_attention_off(den, device: str, outside: dict[str, str]) -> str | None:
    """Why flag `int8-attention` leaves `den` as it is, or None: none of its self-attentions is
    inside the kernel's domain (asked first: no kernel build for nothing), or the kernel cannot
    run here."""
    if len(outside) == len(int8_attention.self_attentions(den)):
        return "no self-attention inside its domain: " + next(iter(outside.values()))
    return int8_attention.unavailable() if device == "cuda" else f"no CUDA device ({device})"


def _add_counts(counts) -> dict[str, int]:
    """{class name: instances} summed over several `compile_blocks` reports."""
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


def compile_pipe(pipe, options=None, fuse_qkv_projections: bool = True):
    opts = parse_options(options)
    done = getattr(pipe, "_compile_options", None)
    if done is not None:  # transforms are not reversible: a second call can only be a no-op
        if done == opts:
            return pipe
        raise ValueError(f"pipeline already compiled with mode {done.mode!r}; build a fresh pipeline "
                         f"to compile it with {opts.mode!r}")
    if _imports_done is not None and not _imports_done.wait(PREWARM_WAIT_S):   # see _imports_done
        log.warning("compiler.prewarm's imports not done after %d s: compiling anyway",
                    PREWARM_WAIT_S)
    dens = denoisers_of(pipe)
    den = dens[0]
    device = _device_type(den)
    report: dict = {"options": opts.to_dict(), "device": device}

    _apply_switches(opts)

    fused = fuse_qkv_projections and opts.fuse_qkv
    if fused:
        report["fused_attention"] = sum(transforms.fuse_qkv(d) for d in dens)

    if opts.compile and device == "cuda":
        for d in dens:   # every expert the same transforms: counts add up over them
            _gpu_transforms(d, opts, fused, report)
    elif opts.compile:   # the CPU: no INT8 kernel, said as on a GPU without it
        for d in dens:
            _int8_attention(d, opts, device, report)

    if opts.memory_format == "channels_last":   # 2-D convolutions only (Wan's VAE is 3-D)
        for m in (getattr(pipe, "unet", None), getattr(pipe, "vae", None)):
            for conv in (m.modules() if m is not None else ()):
                if isinstance(conv, torch.nn.Conv2d):
                    conv.to(memory_format=torch.channels_last)

    if opts.compile:
        kw = compile_kwargs(opts)
        if block_pairs.has_block_pairs(den):  # spatial+temporal pairs, the layout changes between them
            report["compiled_blocks"] = block_pairs.compile_pairs(den, kw)
        else:   # experts share the compiled function of their block class: one graph for both
            shared: dict = {}
            report["compiled_blocks"] = _add_counts(
                transforms.compile_blocks(d, kw, shared) for d in dens)
        aux_kw = compile_kwargs(opts, denoiser=False)
        if opts.compile_text_encoder is not False:
            encoders = [getattr(pipe, n, None) for n in ENCODERS]
            encoders = [e for e in encoders if isinstance(e, torch.nn.Module)]
            if encoders:
                shared = {}
                report["text_encoder_blocks"] = _add_counts(
                    transforms.compile_blocks(e, aux_kw, shared) for e in encoders)
        vae = getattr(pipe, "vae", None)
        if opts.compile_vae is not False and vae is not None:
            report["vae_blocks"] = _compile_vae(vae, opts, aux_kw, device)
        # the VAE's ResnetBlock2D shares its code object (and Dynamo's graph count) with the UNet's
        _raise_recompile_limit(sum(sum(report.get(k, {}).values())
                                   for k in ("compiled_blocks", "text_encoder_blocks", "vae_blocks")))

    if device == "cuda" and opts.sdpa_priority:
        for d in dens:
            transforms.with_sdpa_priority(d)
        report["sdpa_priority"] = list(transforms.SDPA_PRIORITY)

    if opts.has("cudagraphs"):
        if device == "cuda":
            first = wrap_step(den)
            for d in dens[1:]:       # the experts never run at once: one pool of step memory
                wrap_step(d, share=first)
            report["cudagraphs"] = "denoiser step" + (f" ({len(dens)} experts)" if len(dens) > 1 else "")
        else:
            log.info("cudagraphs ignored on %s", device)

    pipe._compile_options = opts
    pipe._compile_report = report
    log.info("compile_pipe: %s", report)
    return pipe
