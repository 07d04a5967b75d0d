"""Compile diffusers pipelines (PixArt, Latte, SD 2.1) with nexfort-style modes.

    from compiler import compile_pipe
    pipe = compile_pipe(pipe, '{"mode": "O2", "memory_format": "channels_last"}')

Contract: `compile_pipe(pipe, options, fuse_qkv_projections=True) -> pipe` transforms `pipe` in place
and returns it; `options` is anything `parse_options` takes (see `compiler/options.py` for the flag
table). Nothing compiles until the first call. The result is recorded on `pipe._compile_options`.
Lossless modes give the eager output within half-precision tolerance.

Layout: the API and the transforms here (`pipeline`, `options`, `transforms`, `heuristics`,
`cudagraph`, `step_reuse`, `cache`); the kernels they install in `compiler.kernels`; the
video-model parts in `compiler.video`; measurement probes in `compiler.bench` (never imported).

Order of transforms (each later one wraps the earlier):
  1. process-wide switches the flags ask for (low-precision matmul reductions, cudnn.benchmark,
     Inductor's single-pass row-reduction limit: `compiler/heuristics.py`);
  2. QKV fusion of the denoiser's attention (`fuse_qkv_projections` and `options.fuse_qkv` both on);
     then, CUDA only and when compiling: `low-precision` swaps the blocks' Linears for FP8Linear
     (compute capability >= 8.9) and their feed-forwards for FP8FeedForward (bias + GELU + FP8
     quantisation of the hidden activation in one Triton pass, `compiler/kernels/quant.py`), and `fuse_gelu` routes Linear+GELU(tanh) through one cuBLASLt
     GEMM with a GELU epilogue (a custom op Inductor keeps whole), and `short_attention` gives the
     fused self-attentions a processor that runs sequences of <= 64 tokens (Latte's temporal
     attention) through one Triton kernel, and `short_cross_attention` the fused cross-attentions one
     that runs masked key sets of <= 128 tokens (a text encoder's padded prompt) through another;
  3. `memory_format`: channels_last for the UNet and the VAE (conv models; DiTs are unaffected);
  4. `torch.compile` of the denoiser's repeated blocks, one compiled function per block class,
     with the flags' Inductor settings (`CompileOptions.inductor_config()`, the one place they come
     from); for Latte one compiled function per (spatial, temporal) block pair with the layout
     changes between them (`compiler/video/block_pairs.py`); text encoder / VAE decoder blocks likewise, without
     the denoiser-only settings, if `compile_text_encoder` / `compile_vae`;
  5. SDPA kernel priority around the denoiser forward (CUDA only: CPU keeps the default);
  6. `cudagraphs`: the denoiser call captured as one CUDA graph per input shape (CUDA only).
"""

from __future__ import annotations

from .options import FLAG_TABLE_MD, FLAGS, PRESETS, CompileOptions, parse_options

# These need torch (`compiler/pipeline.py`): imported on first use, so that checking options alone
# (a job's driver, before any worker starts) imports no torch: ~1.3 s of CPU in every process.
_PIPELINE = ("compile_pipe", "prewarm", "denoiser_of", "StepGraph", "compile_kwargs", "compile_times")

__all__ = ["parse_options", "CompileOptions", "FLAGS", "PRESETS", "FLAG_TABLE_MD", *_PIPELINE]


def __getattr__(name: str):
    if name in _PIPELINE:
        from . import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module 'compiler' has no attribute {name!r}")
