"""The Winograd passes' Triton kernels alone (`compiler.kernels.winograd_triton`) at the Wan 2.2 TI2V-5B
decoder's residual-block shapes: achieved memory bandwidth per launch setting (CUDA).

    python -m runner.bench.winograd_kernels [chunk=2] [iters=50] [shapes=all|i,j] [out=kernels.json]

For each residual-block shape of a 704x1280 decode at `chunk` latent frames a pass (channels,
pixels, frames: 1,024 at 44x80 and 88x160, 1,024 -> 512 and 512 at 176x320, 512 -> 256 and 256
at 352x640) times `_in_kernel` (norm, SiLU, B^T from x), its middle form (A^T of the products
first) and `_out_kernel` (A^T, bias, residual) under each (pixels, channels, warps) setting,
median of `iters` launches by CUDA events, and divides the bytes each must move (count below) by
it: GB/s. The decode spends ~320 ms in these kernels (2026-11-27, H100); the settings installed
are `_blocks` and `OUT_BLOCKS`. `shapes`: which of `SHAPES` (indices; a sweep of all six takes
~8 minutes, mostly Triton compiles, so split it over GPUs). Prints a table and, per kernel and
channel count, the fastest.
"""

from __future__ import annotations

import json
import sys

import torch

from . import parse_args

USAGE = __doc__.split("\n\n")[1].strip()

# (input channels, output channels, height, width, latent frames -> frames a pass at this size)
SHAPES = [(1024, 1024, 44, 80, 1), (1024, 1024, 88, 160, 2), (1024, 512, 176, 320, 4),
          (512, 512, 176, 320, 4), (512, 256, 352, 640, 4), (256, 256, 352, 640, 4)]


def settings(c: int) -> list[tuple[int, int, int]]:
    """(pixels, channels, warps) candidates of `_in_kernel` for c channels: all channels at once
    (1,024 to 8,192 elements a frame, 4 or 8 warps; 8 at 8,192) where c is a power of two up to
    1,024, and the two-pass form (64- and, above 128 channels, 128-channel chunks)."""
    one = [(e // c, c, w) for e in (1024, 2048, 4096, 8192) for w in (4, 8)
           if e >= c and (e, w) != (8192, 4)]       # spills: 8-18 ms instead of ~1.3 (2026-11-27)
    two = [(16, 64, 4), (32, 64, 4), (64, 64, 8)] + [(16, 128, 4), (16, 128, 8)] * (c > 128)
    return (one if c & (c - 1) == 0 and c <= 1024 else []) + two


def _time(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def rows_for(ci: int, co: int, h: int, w: int, t: int, iters: int,
             device: str = "cuda") -> list[dict]:
    """One shape's rows: each kernel under each setting, ms and GB/s."""
    from compiler.kernels import winograd_triton as wt
    m = 4 if t % 4 == 0 else 2
    tiles, n, px = t // m, m + 2, h * w
    cl3, cl = dict(memory_format=torch.channels_last_3d), dict(memory_format=torch.channels_last)
    x = torch.randn(1, ci, t, h, w, device=device, dtype=torch.float16).contiguous(**cl3)
    c1 = torch.randn(1, ci, 2, h, w, device=device, dtype=torch.float16).contiguous(**cl3)
    c2 = torch.randn(1, co, 2, h, w, device=device, dtype=torch.float16).contiguous(**cl3)
    p = [torch.randn(tiles, co, h, w, device=device, dtype=torch.float16).contiguous(**cl)
         for _ in range(n)]
    res = torch.randn(1, co, t, h, w, device=device, dtype=torch.float16).contiguous(**cl3)
    g_i, g_o = torch.ones(ci, device=device), torch.ones(co, device=device)
    bias = torch.zeros(co, device=device, dtype=torch.float16)
    frame = lambda c: px * c * 2                                    # bytes of one fp16 frame
    # bytes moved: in reads t frames + the cache, writes tiles x n transformed + the new cache;
    # mid reads the products (twice for the frames a tile takes from the one before), writes
    # the same; out reads the products and the residual, writes t frames
    moved = {"in": frame(ci) * (t + 2 + tiles * n + 2),
             "mid": frame(co) * ((2 * tiles - 1) * n + tiles * n + 4),
             "out": frame(co) * (tiles * n + 2 * t)}
    calls = {
        "in": lambda s: wt._in_launch(x, None, None, c1, g_i, ci**0.5, m, tiles, 1, ci, h, w,
                                      False, s),
        "mid": lambda s: wt._in_launch(p[0], p, bias, c2, g_o, co**0.5, m, tiles, 1, co, h, w,
                                       True, s),
        "out": lambda s: wt._out_launch(p, bias, res, m, 1, s)}
    rows = []
    for kernel, call in calls.items():
        c = ci if kernel == "in" else co
        options = settings(c) if kernel != "out" else [(32, 64, 4), (64, 64, 4), (16, 128, 4),
                                                       (32, 128, 8), (64, 128, 8)]
        for s in options:
            ms = _time(lambda: call(s), iters)
            rows.append(dict(kernel=kernel, channels=f"{ci}->{co}", size=f"{h}x{w}", frames=t,
                             pixels=s[0], chunk_channels=s[1], warps=s[2], ms=round(ms, 4),
                             gb_s=round(moved[kernel] / ms / 1e6)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str]) -> list[dict]:
    a, _ = parse_args(argv, dict(chunk="2", iters="50", shapes="all", out=None), USAGE)
    assert torch.cuda.is_available(), "the Winograd kernel benchmark needs a CUDA GPU"
    chunk = int(a["chunk"])
    pick = range(len(SHAPES)) if a["shapes"] == "all" else [int(i) for i in a["shapes"].split(",")]
    rows = [r for ci, co, h, w, lat in (SHAPES[i] for i in pick)
            for r in rows_for(ci, co, h, w, lat * chunk, int(a["iters"]))]
    print(f"\nWinograd passes' kernels, TI2V-5B decoder shapes at {chunk} latent frames a pass, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| kernel | channels | size | frames | pixels | channels a chunk | warps | ms | GB/s |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['kernel']} | {r['channels']} | {r['size']} | {r['frames']} | {r['pixels']} | "
              f"{r['chunk_channels']} | {r['warps']} | {r['ms']} | {r['gb_s']} |")
    print("\nfastest per kernel and channels:")
    for key in sorted({(r["kernel"], r["channels"], r["size"]) for r in rows}):
        best = min((r for r in rows if (r["kernel"], r["channels"], r["size"]) == key),
                   key=lambda r: r["ms"])
        print(f"  {key}: pixels {best['pixels']}, channels {best['chunk_channels']}, "
              f"warps {best['warps']}: {best['gb_s']} GB/s")
    if a["out"]:
        with open(a["out"], "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
