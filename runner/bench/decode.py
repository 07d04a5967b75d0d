"""VAE decode of one latent at a model's size: what compiling, channels_last and cuDNN's algorithm
search each give, side by side in one process (CUDA).

    python -m runner.bench.decode [model=<preset>] [batch=1] [iters=10] [frames=81]
        [variants=all|installed|winograd] [chunks=auto|N,M] [out=decode.json]

Builds the model's VAE at its published size (random weights, fp16) and times `vae.decode` of a
(batch, C, H/8, W/8) latent (video models: (batch, C, (frames - 1)/4 + 1, H/s, W/s), s the VAE's
spatial compression: Wan 2.1 8, Wan 2.2 TI2V 16): median of `iters` calls after warm-up calls,
CUDA events. Variants, image VAEs: eager / compiled as `compile_pipe` compiles a VAE decoder (its
ResnetBlock2Ds, the lossless settings), each contiguous and channels_last, each with
`torch.backends.cudnn.benchmark` off and on. Wan's causal video VAEs (2.1's, and 2.2's residual
one): diffusers' decode (one latent frame per pass), then `compiler.video.video_vae.chunked_decode`:
`variants=all`, eager and compiled, contiguous and channels_last_3d, cuDNN's search off and on,
all latent frames in one pass; `variants=installed`, what `compile_pipe` installs (compiled,
channels_last_3d, `video_vae.SUBPIXEL`), the same with the four-phase upsampling flipped, and at
twice the chunk. `chunks`: the latent frames per pass of those rows (auto:
`video_vae.decode_chunk`, as installed; a list: each).
`variants=winograd`: the installed decode (its 3x3x3 convolutions over several frames as F(m, 3)
along time, m up to `video_vae.WINOGRAD`; their passes as Triton kernels where
`video_vae.TRITON` and Triton is there; the output convolution as one GEMM to its taps where
`video_vae.TAPS`) at each of `chunks`, the same with the output convolution (3 or 12 channels)
as the other 3x3x3 ones (`TAPS` flipped), with Inductor's passes instead of Triton's (where
those were on), then with time Winograd off or with F(4, 3) (whichever of 0 and 4 is not
installed), each row with where its GPU time goes (torch.profiler: the convolution kernels'
share, the largest kernels of one call, the aten ops launching kernels by input shapes).
`variants=quick`: that table's first rows only (installed at each of `chunks`, the output
convolution flipped). The first call of a compiled variant (its compile) is reported apart; a
variant out of GPU memory is a row saying so. Also the max abs difference and the PSNR (frames
as uint8) of each variant's output against diffusers' (fp16 rounding only).
"""

from __future__ import annotations

import copy
import json
import math
import sys

import torch

from . import parse_args

USAGE = __doc__.split("\n\n")[1].strip()


def time_decode(vae, z, iters: int, warmup: int = 3) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        for _ in range(warmup):
            out = vae.decode(z, return_dict=False)[0]
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = vae.decode(z, return_dict=False)[0]
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2], out


def video_variants(base, z, iters: int, variants: str, chunks: list[int]) -> list[dict]:
    """Wan's VAE: diffusers' per-frame decode against the chunked decode's variants."""
    from compiler.video import video_vae
    sp = video_vae.SUBPIXEL
    rows = [dict(name="diffusers (1 latent frame per pass)")]
    wg = video_vae.WINOGRAD                        # as compile_pipe installs it
    tri = video_vae.TRITON and video_vae.triton_available()    # the Winograd rows' passes
    ours = lambda c, subpixel=sp, name="chunked", winograd=wg, triton=tri, taps=video_vae.TAPS: dict(
        name=name, compiled=True, channels_last=True, chunk=c, subpixel=subpixel, winograd=winograd,
        triton=triton and bool(winograd), taps=taps)
    if variants == "all":
        c = chunks[0]
        rows += [dict(name="chunked", compiled=compiled, channels_last=cl, chunk=c, subpixel=False)
                 for compiled in (False, True) for cl in (False, True)]
        rows += [dict(ours(c, False), cudnn_benchmark=True), ours(z.shape[2], False),
                 ours(c, name="chunked (installed)")]
    elif variants in ("winograd", "quick"):
        c = chunks[0]
        rows += [dict(ours(c, name="chunked (installed)"), profile=True)]
        rows += [dict(ours(more), profile=True) for more in chunks[1:]]
        rows += [dict(ours(c, name=f"chunked, conv_out {'as the others' if video_vae.TAPS else 'taps'}",
                          taps=not video_vae.TAPS), profile=True)]
    if variants == "winograd":
        if tri and wg:
            rows += [dict(ours(c, triton=False), profile=True)]
        rows += [dict(ours(c, winograd=m), profile=True) for m in (0, 4) if m != wg]
    elif variants == "installed":
        for c in chunks:
            rows += [ours(c, name="chunked (installed)"), ours(c, not sp)]
        rows.append(ours(2 * chunks[-1]))
    ref = None
    for v in rows:
        ref = _video_row(base, z, iters, v, ref)
        print(json.dumps(v), flush=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.backends.cudnn.benchmark = False
    return rows


def _video_row(base, z, iters: int, v: dict, ref):
    """Times variant `v` (filled in place: ms, first call, peak, error against `ref`, diffusers'
    output); returns `ref` (the first variant's output)."""
    import time

    import compiler
    from compiler.video import video_vae
    vae = copy.deepcopy(base)
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64            # as compile_pipe raises it
    torch.backends.cudnn.benchmark = v.get("cudnn_benchmark", False)
    if "chunk" in v:
        aux = compiler.compile_kwargs(compiler.parse_options("O2"), denoiser=False)
        video_vae.chunked_decode(vae, v["chunk"], aux if v["compiled"] else None,
                                 channels_last=v["channels_last"], subpixel=v.get("subpixel", False),
                                 winograd=v.get("winograd", 0), triton=v.get("triton", False),
                                 taps=v.get("taps", False))
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            vae.decode(z, return_dict=False)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms, out = time_decode(vae, z, iters, warmup=1)
    except torch.cuda.OutOfMemoryError:
        v["ms"] = "out of memory"
        return ref
    ref = out if ref is None else ref
    if v.get("profile"):
        try:
            v["profile"] = kernel_split(vae, z)
        except Exception as e:                            # a profiler quirk must not lose the row
            v["profile"] = f"profiler failed: {e!r}"[:200]
    v.update(ms=round(ms, 1), first_call_s=round(first, 1),
             peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1),
             max_abs_vs_eager=float((out.float() - ref.float()).abs().max()),
             psnr_db=psnr_uint8(out, ref))
    return ref


def kernel_split(vae, z, top: int = 30) -> dict:
    """Where one decode's GPU time goes (torch.profiler, after warm-up): total kernel ms, the
    convolution kernels' ms (cuDNN/CUTLASS: names with conv, xmma, implicit or cutlass) and the
    `top` largest kernels by name ([name, ms, launches]); `aten`: the aten ops that launched
    kernels themselves, by input shapes ([op, shapes, ms, calls]: copies, extern GEMMs)."""
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                  record_shapes=True) as prof:
        vae.decode(z, return_dict=False)
        torch.cuda.synchronize()
    # which aten ops (by input shapes) launch kernels of their own: copies, extern GEMMs
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    ops = sorted(ops, key=lambda e: -e.self_device_time_total)[:12]
    by, calls = {}, {}
    for e in prof.events():          # kernels, not the GPU-side ranges of compiled graphs ("## ...")
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("## "):
            by[e.name] = by.get(e.name, 0.0) + e.device_time / 1e3
            calls[e.name] = calls.get(e.name, 0) + 1
    conv = sum(ms for k, ms in by.items()
               if any(w in k.lower() for w in ("conv", "xmma", "implicit", "cutlass", "wgrad", "dgrad")))
    big = sorted(by.items(), key=lambda kv: -kv[1])[:top]
    return dict(kernels_ms=round(sum(by.values()), 1), conv_ms=round(conv, 1),
                top=[[k[:120], round(ms, 1), calls[k]] for k, ms in big],
                aten=[[e.key, str(e.input_shapes)[:160], round(e.self_device_time_total / 1e3, 1),
                       e.count] for e in ops])


def psnr_uint8(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR (dB) of two decodes in [-1, 1] as the uint8 frames written from them."""
    u8 = lambda x: ((x.float() + 1) * 127.5).round().clamp(0, 255)
    mse = (u8(a) - u8(b)).pow(2).mean().item()
    return round(10 * math.log10(255**2 / mse), 1) if mse else float("inf")


def _video_table(a: dict, rows: list[dict]) -> None:
    print(f"\n{a['model']} VAE decode, {a['frames']} frames, batch {a['batch']}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| decode | compiled | layout | chunk | four-phase upsampling | time Winograd | Triton passes | "
          "conv_out taps | cudnn.benchmark | ms per decode | first call s | peak GiB | max abs vs diffusers | PSNR dB vs diffusers (uint8) "
          "| GPU kernels ms (convolutions) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        measured = (f"{r['first_call_s']} | {r['peak_gb']} | {r['max_abs_vs_eager']:.2g} | "
                    f"{r['psnr_db']}" if "psnr_db" in r else " | | ")          # out of memory
        p = r.get("profile")
        prof = f"{p['kernels_ms']} ({p['conv_ms']})" if isinstance(p, dict) else ""
        print(f"| {r['name']} | {r.get('compiled', False)} | "
              f"{'channels_last_3d' if r.get('channels_last') else 'contiguous'} | "
              f"{r.get('chunk', 1)} | {r.get('subpixel', False)} | {r.get('winograd', 0) or '-'} | "
              f"{r.get('triton', False)} | {r.get('taps', False)} | {r.get('cudnn_benchmark', False)} | {r['ms']} | {measured} | {prof} |")


def main(argv: list[str]) -> list[dict]:
    import compiler
    from compiler import transforms
    from ..families import DEFAULT_PRESET, PRESETS
    from ..families.parts import sd_vae
    a, _ = parse_args(argv, dict(model=DEFAULT_PRESET, batch="1", iters="10", frames="81",
                                 variants="all", chunks="auto", out=None), USAGE)
    assert torch.cuda.is_available(), "the decode benchmark needs a CUDA GPU"
    fam = PRESETS[a["model"]]
    preset = fam.presets[a["model"]]
    if fam.video_vae is not None:                   # Wan: its causal video VAE
        rows = _video(a, fam, preset)
        if a["out"]:
            with open(a["out"], "w") as fh:
                json.dump(rows, fh, indent=1)
        return rows
    with torch.device("cuda"):
        base = sd_vae(preset["vae"], tiny=False).to(torch.float16).eval()
    f = 2 ** (len(base.config.block_out_channels) - 1)
    z = torch.randn(int(a["batch"]), base.config.latent_channels, preset["height"] // f,
                    preset["width"] // f, device="cuda", dtype=torch.float16)
    aux = compiler.compile_kwargs(compiler.parse_options("O2"), denoiser=False)
    rows, ref = [], None
    for compiled in (False, True):
        for layout in ("contiguous", "channels_last"):
            vae = copy.deepcopy(base)
            if layout == "channels_last":
                for m in vae.modules():
                    if isinstance(m, torch.nn.Conv2d):
                        m.to(memory_format=torch.channels_last)
            if compiled:
                torch._dynamo.reset()
                transforms.compile_blocks(vae.decoder, aux)
            for bench in (False, True):
                torch.backends.cudnn.benchmark = bench
                ms, out = time_decode(vae, z, int(a["iters"]))
                ref = out if ref is None else ref
                rows.append(dict(compiled=compiled, layout=layout, cudnn_benchmark=bench, ms=round(ms, 2),
                                 max_abs_vs_eager=float((out.float() - ref.float()).abs().max())))
                print(json.dumps(rows[-1]), flush=True)
            del vae
    torch.backends.cudnn.benchmark = False
    print(f"\n{a['model']} VAE decode, batch {a['batch']}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| VAE | layout | cudnn.benchmark | ms per decode | max abs vs eager |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {'compiled' if r['compiled'] else 'eager'} | {r['layout']} | {r['cudnn_benchmark']} | "
              f"{r['ms']} | {r['max_abs_vs_eager']:.2g} |")
    if a["out"]:
        with open(a["out"], "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


def _video(a: dict, fam, preset: dict) -> list[dict]:
    from compiler.video import video_vae
    if a["variants"] not in ("all", "installed", "winograd", "quick"):
        raise SystemExit(f"variants={a['variants']}: choose all, installed, winograd or quick")
    with torch.device("cuda"):
        base = fam.video_vae(False).to(torch.float16).eval()
    s, t = base.spatial_compression_ratio, base.config.scale_factor_temporal
    h, w = preset["height"], preset["width"]
    z = torch.randn(int(a["batch"]), base.config.z_dim, (int(a["frames"]) - 1) // t + 1, h // s,
                    w // s, device="cuda", dtype=torch.float16)
    tri = bool(video_vae.WINOGRAD) and video_vae.TRITON and video_vae.triton_available()
    chunks = ([video_vae.decode_chunk(base, h, w, tri)]                     # as installed
              if a["chunks"] == "auto" else [int(c) for c in a["chunks"].split(",")])
    rows = video_variants(base, z, int(a["iters"]), a["variants"], chunks)
    _video_table(a, rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
