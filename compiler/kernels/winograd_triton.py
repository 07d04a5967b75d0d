"""Triton kernels around the Wan 2.2 decoder's time-Winograd convolutions (CUDA only).

Contract: three custom ops (`torch.library`, opaque to torch.compile) that do a residual block's
memory passes around its 2-D products (`video_vae._fused_resblock`), equal to what
`video_vae.resblock` computes with `_winograd_conv` up to fp32-vs-fp16 rounding of the sums:

- `winograd_in(x, cache, gamma, scale, m) -> (v, new_cache)`: the RMS norm (over channels, times
  `scale` and `gamma`) and SiLU of x (B, C, T, H, W), the frames after its (B, C, 2, H, W) cache
  (already normed and SiLU'd), and B^T of F(m, 3) over each tile of m output frames:
  v (m + 2, T/m B, C, H, W), v[i] channels-last, the tile-major batch `_winograd_conv` convolves;
  new_cache the last 2 of those activated frames (B, C, 2, H, W), channels_last_3d.
- `winograd_mid(products, bias, cache, gamma, scale, m)`: the same with x the A^T recombination of
  the m + 2 products (T/m B, C, H, W) of the previous convolution plus its bias (a tile's first
  two frames recombined from the tile before), so the block's middle activation is never
  written.
- `winograd_out(products, bias, residual, m, batch) -> y`: A^T of the products of T/m tiles of
  `batch` videos, plus bias and the residual (B, C, T, H, W) if given: y (B, C, T, H, W)
  channels_last_3d.

Why: Inductor's kernels for the same graph (2026-11-27's `TORCH_LOGS=output_code`, TI2V-5B at
704x1280) wrote the normed frames and the concatenated cache, read them back for B^T, wrote the
middle activation, some in the contiguous layout, and ran at about half the memory bandwidth:
~800 ms of a 2.55-s decode outside the convolutions; these kernels take ~320 ms (`_in_kernel`
~240, `_out_kernel` ~85; `python -m runner.bench.decode model=wan22_ti2v_5b frames=121
variants=winograd`, H100). A program of `_in_kernel` owns BP pixels of one tile over all
channels: where the channels are a power of two up to 1,024 it loads the tile's frames once
(BP x C a frame), else it sums squares over BC-channel chunks first and reloads them (L2).
Activations are channels-last, so a pixel's channels are contiguous.
"""

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _bt(f0, f1, f2, f3, f4, f5, M: tl.constexpr):
    """B^T of `video_vae.winograd_matrices(M)` (points 0, +-1, +-1/2, inf): 6 (4) frames in."""
    if M == 4:
        v0 = 0.25 * f0 - 1.25 * f2 + f4
        v1 = -0.25 * f1 - 0.25 * f2 + f3 + f4
        v2 = 0.25 * f1 - 0.25 * f2 - f3 + f4
        v3 = -0.5 * f1 - f2 + 0.5 * f3 + f4
        v4 = 0.5 * f1 - f2 - 0.5 * f3 + f4
        v5 = 0.25 * f1 - 1.25 * f3 + f5
    else:
        v0 = f2 - f0
        v1 = f1 + f2
        v2 = f2 - f1
        v3 = f3 - f1
        v4 = v0
        v5 = v0
    return v0, v1, v2, v3, v4, v5


@triton.jit
def _at(p0, p1, p2, p3, p4, p5, M: tl.constexpr):
    """A^T of `video_vae.winograd_matrices(M)`: 6 (4) products in, 4 (2) frames out."""
    if M == 4:
        y0 = p0 + p1 + p2 + p3 + p4
        y1 = p1 - p2 + 0.5 * p3 - 0.5 * p4
        y2 = p1 + p2 + 0.25 * p3 + 0.25 * p4
        y3 = p1 - p2 + 0.125 * p3 - 0.125 * p4 + p5
    else:
        y0 = p0 + p1 + p2
        y1 = p1 - p2 + p3
        y2 = y0
        y3 = y0
    return y0, y1, y2, y3


@triton.jit
def _load6(p0, p1, p2, p3, p4, p5, off, mask, N: tl.constexpr):
    """The N (4 or 6) products at `off`, fp32 (zeros for the two unused where N = 4)."""
    q0 = tl.load(p0 + off, mask=mask, other=0.0).to(tl.float32)
    q1 = tl.load(p1 + off, mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(p2 + off, mask=mask, other=0.0).to(tl.float32)
    q3 = tl.load(p3 + off, mask=mask, other=0.0).to(tl.float32)
    if N == 6:
        q4 = tl.load(p4 + off, mask=mask, other=0.0).to(tl.float32)
        q5 = tl.load(p5 + off, mask=mask, other=0.0).to(tl.float32)
    else:
        q4 = q0 * 0.0
        q5 = q4
    return q0, q1, q2, q3, q4, q5


@triton.jit
def _xf(x_ptr, b, hw, c, t, T, HWC, C, mask):
    """Frame t of x (B, C, T, H, W) channels_last_3d at pixels (b, hw), channels c; zero for t < 0."""
    off = ((b * T + t) * HWC + hw * C)[:, None] + c[None, :]
    return tl.load(x_ptr + off, mask=mask & (t >= 0), other=0.0).to(tl.float32)


@triton.jit
def _raw(x_ptr, p0, p1, p2, p3, p4, p5, bias_ptr, b, hw, c, s, B, T, HWC, C, mask,
         M: tl.constexpr, N: tl.constexpr, MID: tl.constexpr):
    """The tile's N frames before the norm, cat-indexed (frames 0, 1 of tile 0 are the cache's:
    unused here): from x, or (MID) the A^T recombination of the products plus bias."""
    if MID:
        off = ((s * B + b) * HWC + hw * C)[:, None] + c[None, :]    # tile s's products
        q0, q1, q2, q3, q4, q5 = _load6(p0, p1, p2, p3, p4, p5, off, mask, N)
        y0, y1, y2, y3 = _at(q0, q1, q2, q3, q4, q5, M)
        bias = tl.load(bias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
        # frames 0, 1 of tile s > 0: tile s - 1's last two outputs (of tile 0: the cache's)
        q0, q1, q2, q3, q4, q5 = _load6(p0, p1, p2, p3, p4, p5, off - B * HWC, mask & (s > 0), N)
        z0, z1, z2, z3 = _at(q0, q1, q2, q3, q4, q5, M)
        if M == 4:
            r0 = z2 + bias
            r1 = z3 + bias
        else:
            r0 = z0 + bias
            r1 = z1 + bias
        r2 = y0 + bias
        r3 = y1 + bias
        if M == 4:
            r4 = y2 + bias
            r5 = y3 + bias
        else:
            r4 = r0
            r5 = r0
    else:
        t = s * M - 2
        r0 = _xf(x_ptr, b, hw, c, t, T, HWC, C, mask)
        r1 = _xf(x_ptr, b, hw, c, t + 1, T, HWC, C, mask)
        r2 = _xf(x_ptr, b, hw, c, t + 2, T, HWC, C, mask)
        r3 = _xf(x_ptr, b, hw, c, t + 3, T, HWC, C, mask)
        if N == 6:
            r4 = _xf(x_ptr, b, hw, c, t + 4, T, HWC, C, mask)
            r5 = _xf(x_ptr, b, hw, c, t + 5, T, HWC, C, mask)
        else:
            r4 = r0 * 0.0
            r5 = r4
    return r0, r1, r2, r3, r4, r5


@triton.jit
def _act(r, ss, k, cache_ptr, gamma, b, hw, c, HWC, C, scale, mask):
    """Cat frame k normed and SiLU'd from its raw values r and sum of squares ss (BP,), or the
    cache's frame k (k < 2: normed already)."""
    off = ((b * 2 + k) * HWC + hw * C)[:, None] + c[None, :]
    cached = tl.load(cache_ptr + off, mask=mask & (k < 2), other=0.0).to(tl.float32)
    y = r * (scale / tl.maximum(tl.sqrt(ss), 1e-12))[:, None] * gamma
    return tl.where(k < 2, cached, y / (1.0 + tl.exp(-y)))


@triton.jit
def _store(ptr, off, val, mask):
    tl.store(ptr + off, val.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _emit(r0, r1, r2, r3, r4, r5, ss0, ss1, ss2, ss3, ss4, ss5, cache_ptr, gamma_ptr, v_ptr,
          newc_ptr, b, hw, c, s, tiles, B, HWC, C, scale, mask, M: tl.constexpr, N: tl.constexpr):
    """Norm and SiLU of the tile's frames (the cache's as they are), B^T, the N transformed
    frames' stores, and the new cache (the last two frames) from the last tile."""
    k0 = s * M
    g = tl.load(gamma_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
    f0 = _act(r0, ss0, k0, cache_ptr, g, b, hw, c, HWC, C, scale, mask)
    f1 = _act(r1, ss1, k0 + 1, cache_ptr, g, b, hw, c, HWC, C, scale, mask)
    f2 = _act(r2, ss2, k0 + 2, cache_ptr, g, b, hw, c, HWC, C, scale, mask)
    f3 = _act(r3, ss3, k0 + 3, cache_ptr, g, b, hw, c, HWC, C, scale, mask)
    if N == 6:
        f4 = _act(r4, ss4, k0 + 4, cache_ptr, g, b, hw, c, HWC, C, scale, mask)
        f5 = _act(r5, ss5, k0 + 5, cache_ptr, g, b, hw, c, HWC, C, scale, mask)
    else:
        f4 = f0
        f5 = f0
    v0, v1, v2, v3, v4, v5 = _bt(f0, f1, f2, f3, f4, f5, M)
    plane = B * HWC                                      # one transformed frame of one tile
    off = (s * plane + b * HWC + hw * C)[:, None] + c[None, :]
    _store(v_ptr, off, v0, mask)
    _store(v_ptr, off + tiles * plane, v1, mask)
    _store(v_ptr, off + 2 * tiles * plane, v2, mask)
    _store(v_ptr, off + 3 * tiles * plane, v3, mask)
    if N == 6:
        _store(v_ptr, off + 4 * tiles * plane, v4, mask)
        _store(v_ptr, off + 5 * tiles * plane, v5, mask)
    last = mask & (s == tiles - 1)
    coff = (b * 2 * HWC + hw * C)[:, None] + c[None, :]
    if N == 6:
        _store(newc_ptr, coff, f4, last)
        _store(newc_ptr, coff + HWC, f5, last)
    else:
        _store(newc_ptr, coff, f2, last)
        _store(newc_ptr, coff + HWC, f3, last)


@triton.jit
def _in_kernel(x_ptr, p0, p1, p2, p3, p4, p5, bias_ptr, cache_ptr, gamma_ptr, v_ptr, newc_ptr,
               B, HW, C, tiles, scale,
               M: tl.constexpr, N: tl.constexpr, MID: tl.constexpr, BP: tl.constexpr,
               BC: tl.constexpr):
    """Grid (pixels / BP, tiles). BC >= C: one load of the frames (all channels at once);
    else two passes over BC-channel chunks (sums of squares, then the rest), the second
    reloading the frames from L2."""
    s = tl.program_id(1)                                 # tile: cat frames s M .. s M + N - 1
    q = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)
    pm = q < B * HW
    b = q // HW
    hw = q % HW
    T = tiles * M
    HWC = tl.cast(HW, tl.int64) * C          # int64: tiles x B x frame > 2^31 at batch 2
    if BC >= C:
        c = tl.arange(0, BC)
        mask = pm[:, None] & (c < C)[None, :]
        r0, r1, r2, r3, r4, r5 = _raw(x_ptr, p0, p1, p2, p3, p4, p5, bias_ptr, b, hw, c, s, B, T,
                                      HWC, C, mask, M, N, MID)
        _emit(r0, r1, r2, r3, r4, r5, tl.sum(r0 * r0, 1), tl.sum(r1 * r1, 1),
              tl.sum(r2 * r2, 1), tl.sum(r3 * r3, 1), tl.sum(r4 * r4, 1), tl.sum(r5 * r5, 1),
              cache_ptr, gamma_ptr, v_ptr, newc_ptr, b, hw, c, s, tiles, B, HWC, C, scale, mask,
              M, N)
    else:
        ss0 = tl.zeros([BP], tl.float32)
        ss1 = ss0
        ss2 = ss0
        ss3 = ss0
        ss4 = ss0
        ss5 = ss0
        for c0 in range(0, C, BC):                       # pass 1: sums of squares per frame
            c = c0 + tl.arange(0, BC)
            mask = pm[:, None] & (c < C)[None, :]
            r0, r1, r2, r3, r4, r5 = _raw(x_ptr, p0, p1, p2, p3, p4, p5, bias_ptr, b, hw, c, s,
                                          B, T, HWC, C, mask, M, N, MID)
            ss0 += tl.sum(r0 * r0, 1)
            ss1 += tl.sum(r1 * r1, 1)
            ss2 += tl.sum(r2 * r2, 1)
            ss3 += tl.sum(r3 * r3, 1)
            ss4 += tl.sum(r4 * r4, 1)
            ss5 += tl.sum(r5 * r5, 1)
        for c0 in range(0, C, BC):                       # pass 2: norm, SiLU, B^T, stores
            c = c0 + tl.arange(0, BC)
            mask = pm[:, None] & (c < C)[None, :]
            r0, r1, r2, r3, r4, r5 = _raw(x_ptr, p0, p1, p2, p3, p4, p5, bias_ptr, b, hw, c, s,
                                          B, T, HWC, C, mask, M, N, MID)
            _emit(r0, r1, r2, r3, r4, r5, ss0, ss1, ss2, ss3, ss4, ss5, cache_ptr, gamma_ptr,
                  v_ptr, newc_ptr, b, hw, c, s, tiles, B, HWC, C, scale, mask, M, N)


@triton.jit
def _out_kernel(p0, p1, p2, p3, p4, p5, bias_ptr, res_ptr, y_ptr, B, HW, C, tiles,
                M: tl.constexpr, N: tl.constexpr, RES: tl.constexpr, BP: tl.constexpr,
                BC: tl.constexpr):
    q = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)   # pixel of (tiles B, H, W)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (q < tiles * B * HW)[:, None] & (c < C)[None, :]
    s = q // (B * HW)
    b = (q // HW) % B
    hw = q % HW
    HWC = tl.cast(HW, tl.int64) * C
    T = tiles * M
    q0, q1, q2, q3, q4, q5 = _load6(p0, p1, p2, p3, p4, p5, (q * C)[:, None] + c[None, :], mask, N)
    y0, y1, y2, y3 = _at(q0, q1, q2, q3, q4, q5, M)
    bias = tl.load(bias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
    off = ((b * T + s * M) * HWC + hw * C)[:, None] + c[None, :]
    if RES:
        y0 += tl.load(res_ptr + off, mask=mask, other=0.0).to(tl.float32)
        y1 += tl.load(res_ptr + off + HWC, mask=mask, other=0.0).to(tl.float32)
    _store(y_ptr, off, y0 + bias, mask)
    _store(y_ptr, off + HWC, y1 + bias, mask)
    if M == 4:
        if RES:
            y2 += tl.load(res_ptr + off + 2 * HWC, mask=mask, other=0.0).to(tl.float32)
            y3 += tl.load(res_ptr + off + 3 * HWC, mask=mask, other=0.0).to(tl.float32)
        _store(y_ptr, off + 2 * HWC, y2 + bias, mask)
        _store(y_ptr, off + 3 * HWC, y3 + bias, mask)


def _cl3(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last_3d)


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _v_like(x: torch.Tensor, n: int, rows: int, c: int, h: int, w: int) -> torch.Tensor:
    """(n, rows, C, H, W), each [i] channels-last: memory (n, rows, H, W, C)."""
    return x.new_empty(n, rows, h, w, c).permute(0, 1, 4, 2, 3)


def _blocks(c: int) -> tuple[int, int, int]:
    """(pixels, channels, warps) a program of `_in_kernel`: all channels at once where they are
    a power of two up to 1,024 (1,024 elements a frame: 256 channels x 4 pixels ... 1,024 x 1;
    4 warps), else 32 pixels x 64-channel chunks in two passes. Measured (`python -m
    runner.bench.winograd_kernels`, H100, 2026-11-27) at every TI2V-5B decoder shape: fastest
    or within 5 % of it but for the middle kernel at 1,024 channels and 88x160 (0.28 ms, 0.24 at
    2,048 elements and 8 warps); 2,048 elements and 8 warps, installed before, took 2-16 % longer
    at the 176x320 and 352x640 shapes (~16 ms a decode)."""
    if c & (c - 1) == 0 and c <= 1024:
        return max(1, 1024 // c), c, 4
    return 32, 64, 4


def _in_launch(x, products, bias, cache, gamma, scale, m, tiles, b, c, h, w, mid, blocks=None):
    """`_in_kernel` over x (channels_last_3d) or the products (channels-last); `blocks`:
    (pixels, channels, warps) a program instead of `_blocks`' (runner.bench.winograd_kernels)."""
    n = m + 2
    v = _v_like(x, n, tiles * b, c, h, w)
    new = torch.empty_like(cache, memory_format=torch.channels_last_3d)
    bp, bc, warps = blocks or _blocks(c)
    p = list(products) + [products[0]] * (6 - len(products)) if products else [x] * 6
    grid = (triton.cdiv(b * h * w, bp), tiles)
    _in_kernel[grid](x, *p, bias if bias is not None else gamma, cache, gamma, v, new,
                     b, h * w, c, tiles, float(scale), M=m, N=n, MID=mid, BP=bp, BC=bc,
                     num_warps=warps)
    return v, new


@torch.library.custom_op("compiler::winograd_in", mutates_args=())
def winograd_in(x: torch.Tensor, cache: torch.Tensor, gamma: torch.Tensor, scale: float,
                m: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, c, t, h, w = x.shape
    x, cache, gamma = _cl3(x), _cl3(cache), gamma.reshape(-1).contiguous()
    return _in_launch(x, None, None, cache, gamma, scale, m, t // m, b, c, h, w, False)


@winograd_in.register_fake
def _(x, cache, gamma, scale, m):
    b, c, t, h, w = x.shape
    return (_v_like(x, m + 2, t // m * b, c, h, w),
            torch.empty_like(cache, memory_format=torch.channels_last_3d))


@torch.library.custom_op("compiler::winograd_mid", mutates_args=())
def winograd_mid(products: list[torch.Tensor], bias: torch.Tensor, cache: torch.Tensor,
                 gamma: torch.Tensor, scale: float, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, c, h, w = products[0].shape
    products = [_cl(p) for p in products]
    cache, gamma = _cl3(cache), gamma.reshape(-1).contiguous()
    b = cache.shape[0]
    return _in_launch(products[0], products, bias.contiguous(), cache, gamma, scale, m, rows // b,
                      b, c, h, w, True)


@winograd_mid.register_fake
def _(products, bias, cache, gamma, scale, m):
    rows, c, h, w = products[0].shape
    return (_v_like(products[0], m + 2, rows, c, h, w),
            torch.empty_like(cache, memory_format=torch.channels_last_3d))


@torch.library.custom_op("compiler::winograd_out", mutates_args=())
def winograd_out(products: list[torch.Tensor], bias: torch.Tensor,
                 residual: Optional[torch.Tensor], m: int, batch: int) -> torch.Tensor:
    return _out_launch([_cl(p) for p in products], bias.contiguous(),
                       _cl3(residual) if residual is not None else None, m, batch)


# (pixels, channels, warps) a program of `_out_kernel`: fastest or within 3 % of it at every
# TI2V-5B decoder shape (same bench); (32, 64, 4) before took 4-15 % longer (~8 ms a decode).
OUT_BLOCKS = (32, 128, 8)


def _out_launch(products, bias, residual, m, batch, blocks=None):
    """`_out_kernel` over channels-last products; `blocks` instead of `OUT_BLOCKS`
    (runner.bench.winograd_kernels)."""
    rows, c, h, w = products[0].shape
    tiles = rows // batch
    products = list(products) + [products[0]] * (6 - len(products))
    y = products[0].new_empty(batch, tiles * m, h, w, c).permute(0, 4, 1, 2, 3)
    bp, bc, warps = blocks or OUT_BLOCKS
    grid = (triton.cdiv(rows * h * w, bp), triton.cdiv(c, bc))
    _out_kernel[grid](*products, bias, residual if residual is not None else y, y, batch, h * w, c,
                      tiles, M=m, N=m + 2, RES=residual is not None, BP=bp, BC=bc,
                      num_warps=warps)
    return y


@winograd_out.register_fake
def _(products, bias, residual, m, batch):
    rows, c, h, w = products[0].shape
    return products[0].new_empty(batch, rows // batch * m, h, w, c).permute(0, 4, 1, 2, 3)
