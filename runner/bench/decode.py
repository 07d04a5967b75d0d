"""VAE decode of one latent at a model's size: what compiling, channels_last and cuDNN's algorithm
search each give, side by side in one process (CUDA).

    python -m runner.bench.decode [model=<preset>] [batch=1] [iters=10] [out=decode.json]

Builds the model's VAE at its published size (random weights, fp16) and times `vae.decode` of a
(batch, C, H/8, W/8) latent: median of `iters` calls after 3 warm-up calls, CUDA events. Variants:
eager / compiled as `compile_pipe` compiles a VAE decoder (its ResnetBlock2Ds, the lossless
settings), each contiguous and channels_last, each with `torch.backends.cudnn.benchmark` off and on.
Also the max abs difference of each variant's image against eager (fp16 rounding only).
"""

from __future__ import annotations

import copy
import json
import sys

import torch

from . import parse_args

USAGE = __doc__.split("\n\n")[1].strip()


def time_decode(vae, z, iters: int) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        for _ in range(3):
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


def main(argv: list[str]) -> list[dict]:
    import compiler
    from compiler import transforms
    from ..families import DEFAULT_PRESET, PRESETS
    from ..families.parts import sd_vae
    a, _ = parse_args(argv, dict(model=DEFAULT_PRESET, batch="1", iters="10", out=None), USAGE)
    assert torch.cuda.is_available(), "the decode benchmark needs a CUDA GPU"
    preset = PRESETS[a["model"]].presets[a["model"]]
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
