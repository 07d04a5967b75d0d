"""VAE decode of one latent at a model's size: what compiling, channels_last and cuDNN's algorithm
search each give, side by side in one process (CUDA).

    python -m runner.bench.decode [model=<preset>] [batch=1] [iters=10] [frames=81] [out=decode.json]

Builds the model's VAE at its published size (random weights, fp16) and times `vae.decode` of a
(batch, C, H/8, W/8) latent (video models: (batch, C, (frames - 1)/4 + 1, H/8, W/8)): median of
`iters` calls after warm-up calls, CUDA events. Variants, image VAEs: eager / compiled as
`compile_pipe` compiles a VAE decoder (its ResnetBlock2Ds, the lossless settings), each contiguous
and channels_last, each with `torch.backends.cudnn.benchmark` off and on. Wan's causal video VAE:
diffusers' decode (one latent frame per pass), then `compiler.video_vae.chunked_decode` eager and
compiled, contiguous and channels_last_3d, chunks of 4 latent frames and of all of them, cuDNN's
search off and on; the first call of a compiled variant (its compile) is reported apart. Also the
max abs difference of each variant's output against eager (fp16 rounding only).
"""

from __future__ import annotations

import copy
import json
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
            vae.decode(z, return_dict=False)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2], out


def video_variants(base, z, iters: int) -> list[dict]:
    """Wan's VAE: diffusers' per-frame decode against the chunked decode's variants."""
    import time

    import compiler
    from compiler import video_vae
    aux = compiler.compile_kwargs(compiler.parse_options("O2"), denoiser=False)
    torch._dynamo.config.recompile_limit = 64            # as compile_pipe raises it
    rows, ref = [], None
    variants = [dict(name="diffusers (1 latent frame per pass)")]
    for compiled in (False, True):
        for cl in (False, True):
            variants.append(dict(name="chunked", compiled=compiled, channels_last=cl, chunk=4))
    variants += [dict(name="chunked", compiled=True, channels_last=True, chunk=4, cudnn_benchmark=True),
                 dict(name="chunked", compiled=True, channels_last=True, chunk=z.shape[2])]
    for v in variants:
        vae = copy.deepcopy(base)
        torch._dynamo.reset()
        torch.backends.cudnn.benchmark = v.get("cudnn_benchmark", False)
        if "chunk" in v:
            video_vae.chunked_decode(vae, v["chunk"], aux if v["compiled"] else None,
                                     channels_last=v["channels_last"])
        t0 = time.perf_counter()
        with torch.no_grad():
            vae.decode(z, return_dict=False)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms, out = time_decode(vae, z, iters, warmup=1)
        ref = out if ref is None else ref
        rows.append(dict(v, ms=round(ms, 1), first_call_s=round(first, 1),
                         peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1),
                         max_abs_vs_eager=float((out.float() - ref.float()).abs().max())))
        print(json.dumps(rows[-1]), flush=True)
        del vae, out
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.backends.cudnn.benchmark = False
    return rows


def main(argv: list[str]) -> list[dict]:
    import compiler
    from compiler import transforms
    from ..families import DEFAULT_PRESET, PRESETS
    from ..families.parts import sd_vae
    a, _ = parse_args(argv, dict(model=DEFAULT_PRESET, batch="1", iters="10", frames="81", out=None),
                      USAGE)
    assert torch.cuda.is_available(), "the decode benchmark needs a CUDA GPU"
    fam = PRESETS[a["model"]]
    preset = fam.presets[a["model"]]
    if fam.kind == "video" and fam.frame_step:      # Wan: its causal video VAE
        from diffusers import AutoencoderKLWan
        with torch.device("cuda"):
            base = AutoencoderKLWan().to(torch.float16).eval()
        z = torch.randn(int(a["batch"]), base.config.z_dim, (int(a["frames"]) - 1) // 4 + 1,
                        preset["height"] // 8, preset["width"] // 8, device="cuda", dtype=torch.float16)
        rows = video_variants(base, z, int(a["iters"]))
        print(f"\n{a['model']} VAE decode, {a['frames']} frames, batch {a['batch']}, "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print("| decode | compiled | layout | chunk | cudnn.benchmark | ms per decode | first call s "
              "| peak GiB | max abs vs diffusers |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['name']} | {r.get('compiled', False)} | "
                  f"{'channels_last_3d' if r.get('channels_last') else 'contiguous'} | "
                  f"{r.get('chunk', 1)} | {r.get('cudnn_benchmark', False)} | {r['ms']} | "
                  f"{r['first_call_s']} | {r['peak_gb']} | {r['max_abs_vs_eager']:.2g} |")
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


if __name__ == "__main__":
    main(sys.argv[1:])
