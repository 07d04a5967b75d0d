"""Wan's causal video VAE decoder (Wan 2.1's and Wan 2.2's), run over chunks of frames with its causal
caches as plain tensors.

Contract: `chunked_decode(vae, chunk=None, compile_kwargs=None, channels_last=False,
subpixel=False, winograd=0, triton=False, taps=False)` replaces `vae._decode` of a diffusers
`AutoencoderKLWan` whose decoder is Wan 2.1's (`WanUpBlock`s) or Wan 2.2's
(`WanResidualUpBlock`s; `supported(vae)` says whether it is either) so that `vae.decode(z)`
decodes latent frame 0 alone, then the other latent frames `chunk` at a time, and returns what
diffusers' decode returns: the same causal convolutions over the same frames, grouped
differently, so equal up to the rounding of the convolution kernels (fp16 tolerance;
tests/test_video_vae.py). Tiled decoding (`vae.enable_tiling()`) keeps diffusers' own
path. Returns the number of blocks per compiled function, by name (`compile_kwargs=None`: eager).

Why: diffusers decodes one latent frame per decoder pass (4 video frames; 21 passes for 81
frames), every causal convolution taking its 2-frame cache from a Python list that also holds the
marker string "Rep", indexed by a counter in another list. Per-frame passes keep the
low-resolution convolutions small (60x104 latents: 6,240 positions per pass), and the list, the
string and the counter are Python state that Dynamo would guard on (one recompile per block
index). Here each block is a function (module, x, caches) -> (x, new caches): one compiled graph
per block shape and chunk length, shared by every block of that shape, with RMS norm, SiLU and
the cache concatenation fused around cuDNN's convolutions. Caches start as zeros, which is what
the causal padding was. `channels_last`: the decoder's weights and activations in
`torch.channels_last_3d`, the layout cuDNN's tensor-core kernels for 3-D convolutions read
natively (measured against the default in BENCHMARKS).

Wan 2.2's decoder (TI2V-5B: 48 latent channels, 16x space) is Wan 2.1's but for: each up block
adds a shortcut after its upsampler, its own input with channels spread over 2x2 pixels (and over
2 frames where the block doubles time, the first chunk's first frame dropped as the upsampler
keeps frame 0 one frame: diffusers' `DupUp3D`); its upsamplers keep their channels (2.1's halve
them); its output is 12 channels, 3 per pixel of a 2x2 patch, unfolded (`unpatchify`) before the
clamp. Caches, chunks and the first chunk work the same, so the same functions run both, the
shortcut added inside the `upsample` graph.

`subpixel`: an upsampler's 3x3 convolution of the 2x nearest-upsampled frame, computed as one 2x2
convolution of the frame itself with four output phases (the 3x3 kernel's taps summed per phase)
interleaved into the 2x frame: 16 instead of 36 multiply-adds per input pixel and channel pair,
no upsampled copy; equal up to the rounding of the summed kernel.

`winograd` (m = 2 or 4): each 3x3x3 convolution over a multiple of m frames as Toom-Cook F(m, 3)
along time (`_winograd_conv`): m output frames from m + 2 input frames with m + 2 2-D
convolutions of transformed frames by transformed kernels instead of 3m, the kernels transformed
once (`winograd_weights`, buffers beside the weights); F(4, 3) halves the multiply-adds, F(2, 3)
takes a third off. Exact in exact arithmetic, rounded differently in fp16 (~5x direct's
rounding error for F(4, 3): PSNR 59 dB instead of 60 against diffusers at TI2V-5B's size).
`triton` (CUDA): a residual block whose convolutions both run as F(m, 3) does its norms, SiLUs,
transforms, biases and residual in three Triton kernels around the 2-D products
(`_fused_resblock`, `compiler.kernels.winograd_triton`), in fp32 sums.
`taps`: a 3x3x3 convolution to fewer than `NARROW` channels (the output convolution: 3 or 12)
as one GEMM of every input pixel to its 27 taps' contributions, then their shifted sum in fp32
(`_taps_conv`): cuDNN's kernels for so few output channels run at a few % of the FLOP rate.

Shapes (Wan 2.1, 480x832, 81 frames): latents (B, 16, 21, 60, 104) -> video (B, 3, 81, 480, 832);
275 TFLOP of convolutions, 96.6 of them at full resolution with 96 channels. Wan 2.2, 704x1280,
121 frames: latents (B, 48, 31, 44, 80) -> (B, 12, 121, 352, 640) -> video (B, 3, 121, 704,
1280); 2,010 TFLOP of convolutions (FlopCounter on the meta device), 1,364 of them in the last two
up blocks' residual blocks (512 and 256 channels at 176x320 and 352x640), 273 in the upsamplers'
3x3 convolutions (123 with `subpixel`): 2.0 s at an H100's dense fp16 peak (989 TFLOP/s), 1.9 s
with `subpixel`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

CACHE_T = 2   # frames of a causal convolution's input kept for the next chunk (time kernel 3)
# What compile_pipe installs (measured, `python -m runner.bench.decode model=wan21_t2v_1_3b` in
# BENCHMARKS: 81 frames at 480x832 on an H100, diffusers 2066 ms; chunks of 4, compiled: 1065 ms
# contiguous, 875 ms channels_last_3d, peak 18.6 GiB): latent frames per decoder pass after the
# first at 480x832, scaled down for larger frames or a wider decoder so that a pass's widest
# activation stays that size (`chunk_for`), and the CUDA layout.
CHUNK = 4
CHANNELS_LAST = True
# What compile_pipe installs for the upsamplers (both decoders): the 2x2 four-phase convolution
# (module docstring), 2.25x fewer FLOPs in them (Wan 2.2 at 704x1280 x 121: 273 -> 123 of 2,010
# TFLOP). Not measured yet: `python -m runner.bench.decode` prints the decode with it on and off.
SUBPIXEL = True
# What compile_pipe installs for Wan 2.2's decoder's 3x3x3 convolutions over 2 or more frames:
# F(m, 3) along time, m up to this (`_winograd_conv`; 0 off). Measured (`python -m
# runner.bench.decode model=wan22_ti2v_5b frames=121 variants=winograd`, H100, 704x1280 x 121):
# 3,251 -> 2,579 ms (convolution kernels 3,017 -> 1,756 ms; the transforms' passes 237 -> 808),
# PSNR 60.1 -> 59.1 dB against diffusers, peak 15.4 -> 19.0 GiB (the transformed kernels). Wan
# 2.1's decoder too since 2026-11-27 (same bench, model=wan21_t2v_1_3b frames=81, H100, with the
# Triton passes: 849 -> 481 ms, peak 19.5 -> 10.5 GiB, PSNR 57.7 -> 55.6 dB).
WINOGRAD = 4
# What compile_pipe installs with Winograd on CUDA where Triton imports: the residual blocks'
# norm / SiLU / B^T and A^T / bias / residual passes as `compiler.kernels.winograd_triton`'s kernels
# instead of Inductor's. Measured (same bench, `variants=winograd`, H100, 2 latent frames a
# pass): 2,532 -> 2,042 ms (GPU kernels 2,500 -> 2,032 ms), peak 26.6 -> 17.7 GiB (no middle
# activation or concatenated cache written), PSNR 58.8 -> 58.9 dB against diffusers.
TRITON = True
# Latent frames per pass at least where time Winograd is on (`chunk=None`): one latent frame
# leaves the 44x80 blocks of a 704x1280 decode one frame a pass (direct convolutions) and the
# 88x160 ones two (F(2, 3)); two latent frames give them F(2, 3) and F(4, 3). Measured with the
# Triton passes (H100, one call): 2,190 ms at 1 latent frame a pass, 2,089 at 2 (convolution
# kernels 1,762 -> 1,626 ms), peak 14.5 -> 19.7 GiB, PSNR 59.0 -> 58.6 dB; that was before
# `winograd_mid` recombined a tile's first frames from the tile before (then 2,042 ms, 17.7
# GiB, 58.9 dB, not rerun at 1). Four latent frames give the 44x80 blocks F(4, 3) too and halve
# the passes (`python -m runner.bench.decode model=wan22_ti2v_5b frames=121 variants=quick
# chunks=2,4`, H100, 2026-11-27, tuned kernels and conv_out as taps): 1,999 ms at 2 (2,010 on
# another GPU of the call), 1,906 at 4; peak 17.7 -> 24.6 GiB, PSNR 58.9 -> 57.9 dB. Only with
# the Triton passes (`decode_chunk`).
WINOGRAD_CHUNK = 4
# What compile_pipe installs for a 3x3x3 convolution to fewer than `NARROW` output channels (both
# decoders' conv_out: Wan 2.1 96 -> 3, Wan 2.2 256 -> 12 channels): one GEMM of every input pixel
# to all 27 taps' contributions, then their shifted sum (`_taps_conv`). cuDNN's kernels for a dozen
# output channels run at a few % of the FLOP rate: TI2V-5B's conv_out took 85 ms a decode direct,
# ~60 ms as F(4, 3) (2026-11-27, H100), for 4.5 TFLOP (~8 ms at 600 TFLOP/s). Measured (`python
# -m runner.bench.decode ... variants=winograd`, H100, same call): TI2V 2,025 -> 1,999 ms (1,921
# -> 1,903 at 4 latent frames a pass), Wan 2.1 483 -> 472 ms; error as cuDNN fp16's (gpu test).
TAPS = True
NARROW = 64
WIDEST = 96   # Wan 2.1's decoder: channels a pixel of its widest full-resolution activation


def chunk_for(height: int, width: int, chunk: int = CHUNK, widest: int = WIDEST) -> int:
    """Latent frames per pass for (height, width) video frames: `chunk` at 480x832 for Wan 2.1's
    decoder, fewer where a pass's widest activation (`widest` channels a pixel: `widest_of`)
    would be larger (720x1280: 1; Wan 2.2 at 704x1280: 1), at least 1."""
    return max(1, chunk * WIDEST * 480 * 832 // (widest * height * width))


def widest_of(vae) -> int:
    """Channels a video pixel of the decoder's widest full-resolution activation, its last up
    block's input (Wan 2.1: 96; Wan 2.2: 512 on 2x2-pixel patches, 128)."""
    patch = vae.config.get("patch_size") or 1
    return vae.decoder.up_blocks[-1].resnets[0].conv1.in_channels // patch**2


def decode_chunk(vae, height: int, width: int, triton: bool) -> int:
    """Latent frames per pass after the first where `chunked_decode(chunk=None)`: `chunk_for` the
    (height, width) video frames and the decoder's width, at least `WINOGRAD_CHUNK` with the
    Triton passes (`triton` needs time Winograd; with Inductor's passes 2 frames a pass only
    cost memory: 2,520 vs 2,532 ms)."""
    return max(WINOGRAD_CHUNK if triton else 1, chunk_for(height, width, widest=widest_of(vae)))


def triton_available() -> bool:
    """Triton imports and a CUDA device is there (what `chunked_decode(triton=True)` runs on)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def supported(vae) -> bool:
    """A Wan causal video VAE: Wan 2.1's decoder or Wan 2.2's residual one (not a mix)."""
    dec = getattr(vae, "decoder", None)
    kinds = {type(u).__name__ for u in getattr(dec, "up_blocks", None) or ()}
    return type(vae).__name__ == "AutoencoderKLWan" and kinds in ({"WanUpBlock"}, {"WanResidualUpBlock"})


def _sampler(up):
    """An up block's upsampler (None where it has none) and Wan 2.2's shortcut (`DupUp3D`)."""
    if type(up).__name__ == "WanResidualUpBlock":
        return up.upsampler, up.avg_shortcut
    return (up.upsamplers[0] if up.upsamplers is not None else None), None


def _cconv(conv, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A WanCausalConv3d over (B, Ci, T, H, W) after its (B, Ci, 2, H, W) cache: (B, Co, T, H, W)
    and the new cache (the last 2 frames of cache + input). Spatial zero padding is the
    convolution's own (no padded copy); the time padding is the cache. Where `winograd_weights`
    gave the convolution a time-Winograd kernel for m dividing T, it runs as `_winograd_conv`."""
    x = torch.cat([cache, x], 2)
    pad = conv._padding                                   # (w, w, h, h, 2 * t, 0) as diffusers keeps it
    m = _tile(conv, x.shape[2] - CACHE_T)
    if hasattr(conv, "taps"):
        y = _taps_conv(x, conv.taps, conv.bias, (pad[2], pad[0]))
    elif m:
        y = _winograd_conv(x, getattr(conv, f"winograd{m}"), conv.bias, m, (pad[2], pad[0]))
    else:
        y = F.conv3d(x, conv.weight, conv.bias, conv.stride, (0, pad[2], pad[0]))
    return y, x[:, :, -CACHE_T:].clone()


def taps_weight(conv) -> torch.Tensor | None:
    """A 3x3x3 convolution's (stride 1) kernel as `_taps_conv` reads it, (Ci, 27 Co): column
    (i, j, l, o) is output channel o's weights at tap (time i, row j, column l); None for another
    convolution or one to `NARROW` output channels or more."""
    if (tuple(conv.kernel_size) != (3, 3, 3) or tuple(conv.stride) != (1, 1, 1)
            or tuple(conv.dilation) != (1, 1, 1) or conv.groups != 1
            or conv.out_channels >= NARROW):
        return None
    with torch.no_grad():
        return conv.weight.permute(1, 2, 3, 4, 0).reshape(conv.in_channels, -1).contiguous()


def _taps_conv(x: torch.Tensor, k: torch.Tensor, bias, padding) -> torch.Tensor:
    """A 3x3x3 convolution (time unpadded, stride 1) of (B, Ci, T + 2, H, W) frames to a few
    output channels: (B, Co, T, H', W'), as one GEMM of every input pixel by `k` ((Ci, 27 Co),
    `taps_weight`) to each tap's contribution, y: (B, T + 2, H, W, 3, 3, 3, Co), then out[t, h,
    w] = sum over taps (i, j, l) of y[t + i, h + j - ph, w + l - pw, i, j, l] (zero outside) in
    fp32 (or x's wider dtype). Each input pixel is read once, by a GEMM 27 Co wide,
    instead of 27 times by a convolution Co wide; the contributions round to x's dtype before
    their sum."""
    b, ci, t2, h, w = x.shape
    ph, pw = padding
    co = k.shape[1] // 27
    y = (x.permute(0, 2, 3, 4, 1).reshape(-1, ci) @ k.to(x.dtype)).view(b, t2, h, w, 3, 3, 3, co)
    t, ho, wo = t2 - 2, h + 2 * ph - 2, w + 2 * pw - 2
    acc = torch.promote_types(x.dtype, torch.float32)
    out = bias.to(acc) if bias is not None else 0.0
    for i in range(3):
        for j in range(3):
            for l in range(3):   # the tap's contributions, zero-padded (no padded copy of x or y)
                tap = F.pad(y[:, i:i + t, :, :, i, j, l], (0, 0, pw, pw, ph, ph))
                out = out + tap[:, :, j:j + ho, l:l + wo].to(acc)
    return out.to(x.dtype).permute(0, 4, 1, 2, 3)                     # (B, Co, T, H', W')


def _tile(conv, t: int) -> int:
    """The F(m, 3) tile for a convolution over t output frames: the largest m (4, 2) dividing t
    that `winograd_weights` gave it a kernel for; 0 for none (direct)."""
    return next((m for m in (4, 2) if t % m == 0 and hasattr(conv, f"winograd{m}")), 0)


def winograd_matrices(m: int, r: int = 3) -> tuple[list, list, list]:
    """Toom-Cook F(m, r) for a correlation along time, y[j] = sum_k g[k] x[j + k] (j < m):
    y = A^T ((G g) * (B^T x)) over n = m + r - 1 points, returned as (A^T (m x n), G (n x r),
    B^T (n x n)) nested lists of floats. Points 0, +-1 (F(2, 3)) and +-1/2 (F(4, 3)) and infinity:
    every entry of B^T and A^T within [-1.25, 1.25], so the transformed frames stay the input's
    size (fp16 rounding: 2.3x direct's error for F(2, 3), 5x for F(4, 3), 0.05 %-0.1 %)."""
    from fractions import Fraction as Q
    points = {2: [Q(0), Q(1), Q(-1)], 4: [Q(0), Q(1), Q(-1), Q(1, 2), Q(-1, 2)]}[m]
    n = m + r - 1
    at = [[p**j for p in points] + [Q(int(j == m - 1))] for j in range(m)]
    f = [math.prod(p - q for q in points if q != p) for p in points]
    g = [[p**k / fi for k in range(r)] for p, fi in zip(points, f)] + [[Q(int(k == r - 1)) for k in range(r)]]
    # B^T row i: the coefficients (ascending powers) of prod_{j != i} (x - p_j), the Lagrange
    # basis' numerator at point i (G divides by its value there); the last row, infinity's:
    # those of prod_j (x - p_j).
    bt = [_poly([q for q in points if q != p]) + [Q(0)] for p in points] + [_poly(points)]
    for j in range(m):                              # exact (Fractions): y[j] = sum_k g[k] x[j + k]
        for k in range(r):
            for col in range(n):
                got = sum(at[j][i] * g[i][k] * bt[i][col] for i in range(n))
                assert got == int(col == j + k), (m, j, k, col, got)
    return ([[float(v) for v in row] for row in at], [[float(v) for v in row] for row in g],
            [[float(v) for v in row] for row in bt])


def _poly(roots: list) -> list:
    """Coefficients, ascending powers, of prod (x - root)."""
    c = [1]
    for a in roots:
        c = [(c[i - 1] if i else 0) - a * (c[i] if i < len(c) else 0) for i in range(len(c) + 1)]
    return c


def _winograd_conv(x: torch.Tensor, u: torch.Tensor, bias, m: int, padding) -> torch.Tensor:
    """A 3x3x3 convolution (time unpadded, stride 1) of (B, Ci, T + 2, H, W) frames as F(m, 3)
    along time: (B, Co, T, H, W), m dividing T. Each tile of m output frames reads n = m + 2
    input frames, transformed (B^T, sums of frames: fused by Inductor into whatever wrote them)
    into n frames, each convolved in 2-D with its own transformed kernel (`u`: (n, Co, Ci, 3, 3),
    `winograd_weights`), the n results recombined (A^T) into m frames: n instead of 3m 2-D
    convolutions (F(4, 3): 6 instead of 12, half the multiply-adds; F(2, 3): 4 instead of 6)."""
    at, _, bt = _WINOGRAD[m]
    n = m + 2
    b, t2 = x.shape[0], x.shape[2]
    tiles = (t2 - CACHE_T) // m
    frames = [x[:, :, f] for f in range(t2)]                              # (B, Ci, H, W) each
    products = []                          # one 2-D convolution per point, every tile in its batch
    for i in range(n):
        v = torch.cat([_combine(bt[i], frames[s * m:s * m + n]) for s in range(tiles)], 0)
        mi = F.conv2d(v, u[i], None, 1, padding)                         # (tiles B, Co, H', W')
        products.append(mi.view(tiles, b, *mi.shape[1:]))   # (tiles, B, Co, H', W'): the cat's order
    y = torch.stack([_combine(at[j], [mi[s] for mi in products])
                     for s in range(tiles) for j in range(m)], 2)        # (B, Co, T, H', W')
    return y if bias is None else y + bias.view(1, -1, 1, 1, 1)


def _combine(coeffs: list, frames: list) -> torch.Tensor:
    """sum_l coeffs[l] frames[l], zero coefficients skipped."""
    out = None
    for c, f in zip(coeffs, frames):
        if c:
            term = f if c == 1 else -f if c == -1 else c * f
            out = term if out is None else out + term
    return out


_WINOGRAD = {m: winograd_matrices(m) for m in (2, 4)}


def winograd_weights(conv, largest: int) -> None:
    """Give a 3x3x3 causal convolution (stride 1) its time-Winograd kernels for F(m, 3), m = 2
    up to `largest` (2 or 4), as non-persistent buffers `winograd<m>`: (n, Co, Ci, 3, 3), G times
    the weight along time (float64 sums, then the weight's dtype and memory format). Built
    without autograd: from a weight that requires grad they would be non-leaf tensors, which
    `copy.deepcopy` of the module refuses."""
    if (tuple(conv.kernel_size) != (3, 3, 3) or tuple(conv.stride) != (1, 1, 1)
            or tuple(conv.dilation) != (1, 1, 1) or conv.groups != 1):
        return
    for m in (2, 4):
        if m > largest:
            continue
        g = torch.tensor(_WINOGRAD[m][1], dtype=torch.float64, device=conv.weight.device)
        with torch.no_grad():
            u = torch.einsum("ik,ocktv->ioctv", g, conv.weight.double()).to(conv.weight.dtype)
        if conv.weight.is_contiguous(memory_format=torch.channels_last_3d):   # each u[i] channels_last
            u = u.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
        conv.register_buffer(f"winograd{m}", u, persistent=False)


def resblock(block, x, c1, c2, triton: bool = False):
    """WanResidualBlock: (B, Ci, T, H, W) -> (B, Co, T, H, W) and its two convolutions' caches.
    `triton` (CUDA): where both convolutions run as F(m, 3), the memory passes around them as the
    kernels of `compiler.kernels.winograd_triton` (`_fused_resblock`)."""
    m = _tile(block.conv1, x.shape[2])
    if triton and m and _fusable(block, m):
        return _fused_resblock(block, x, c1, c2, m)
    h = block.conv_shortcut(x)                            # identity, or a 1x1x1 conv (no cache)
    y = block.nonlinearity(block.norm1(x))
    y, c1 = _cconv(block.conv1, y, c1)
    y = block.nonlinearity(block.norm2(y))                # (dropout: eval, none)
    y, c2 = _cconv(block.conv2, y, c2)
    return y + h, c1, c2


def _fusable(block, m: int) -> bool:
    """The block is what `_fused_resblock`'s kernels compute: RMS norms without bias, SiLU, both
    convolutions with biases and F(m, 3) kernels, a shortcut that is the identity or a 1x1x1
    convolution."""
    sc = block.conv_shortcut
    return (isinstance(block.nonlinearity, torch.nn.SiLU)
            and (isinstance(sc, torch.nn.Identity) or (isinstance(sc, torch.nn.Conv3d)
                 and tuple(sc.kernel_size) == (1, 1, 1) and tuple(sc.stride) == (1, 1, 1)
                 and not any(sc.padding) and sc.groups == 1))
            and all(isinstance(n.bias, float) and n.bias == 0 for n in (block.norm1, block.norm2))
            and all(c.bias is not None and hasattr(c, f"winograd{m}")
                    for c in (block.conv1, block.conv2)))


def _fused_resblock(block, x, c1, c2, m: int):
    """`resblock` with F(m, 3) convolutions, its memory passes as three Triton kernels: norm1,
    SiLU and B^T (`winograd_in`); A^T, bias, norm2, SiLU and B^T (`winograd_mid`: the middle
    activation never written); A^T, bias and the residual (`winograd_out`). The 2-D products
    stay cuDNN's; a 1x1x1 shortcut is a GEMM without its bias, which `winograd_out` adds with
    conv2's (no pass over the shortcut's output to add it)."""
    from ..kernels import winograd_triton as wt
    sc, bias = block.conv_shortcut, block.conv2.bias.float()
    h = x
    if isinstance(sc, torch.nn.Conv3d):
        h = F.conv3d(x, sc.weight)
        bias = bias if sc.bias is None else bias + sc.bias.float()
    n1, n2, b = block.norm1, block.norm2, x.shape[0]
    v, c1 = wt.winograd_in(x, c1, n1.gamma, n1.scale, m)        # (m + 2, T/m B, Ci, H, W)
    p = _products(block.conv1, v, m)                           # m + 2 of (T/m B, Co, H, W)
    v, c2 = wt.winograd_mid(p, block.conv1.bias, c2, n2.gamma, n2.scale, m)
    p = _products(block.conv2, v, m)
    return wt.winograd_out(p, bias, h, m, b), c1, c2


def _products(conv, v: torch.Tensor, m: int) -> list:
    """The m + 2 2-D convolutions of transformed frames v[i] by transformed kernels u[i]."""
    u, pad = getattr(conv, f"winograd{m}"), conv._padding
    return [F.conv2d(v[i], u[i], None, 1, (pad[2], pad[0])) for i in range(m + 2)]


# Which rows (columns) of a 3x3 kernel each of the two taps of a 2x2 kernel sums, per output phase,
# for a 3x3 convolution (padding 1) of a 2x nearest upsampling: an even output row 2y reads
# upsampled rows 2y-1, 2y, 2y+1 = input rows y-1, y, y; an odd one 2y+1 reads y, y, y+1.
_PHASE_TAPS = (((1, 0, 0), (0, 1, 1)), ((1, 1, 0), (0, 0, 1)))


def subpixel_weight(conv) -> torch.Tensor:
    """The four phases' 2x2 kernels of a 3x3 convolution (`_PHASE_TAPS`): (4 Co, Ci, 2, 2),
    channels-last, the weight's dtype; `chunked_decode(subpixel=True)` keeps them as the
    non-persistent buffer `subpixel` (each call computed them anew: ~25 ms a TI2V-5B decode)."""
    taps = torch.tensor(_PHASE_TAPS, dtype=torch.float32, device=conv.weight.device)  # (2, 2, 3)
    with torch.no_grad():
        k = torch.einsum("aui,bvj,ocij->abocuv", taps, taps, conv.weight.float())  # summed taps
    k = k.reshape(4 * conv.out_channels, -1, 2, 2).to(conv.weight.dtype)
    return k.contiguous(memory_format=torch.channels_last)


def _up2x_conv(conv, x: torch.Tensor) -> torch.Tensor:
    """conv (3x3, padding 1) of the 2x nearest upsampling of x: (N, Ci, H, W) -> (N, Co, 2H, 2W),
    as one 2x2 convolution (padding 1) of x itself to the four phases' outputs, (N, 4 Co, H+1,
    W+1), phase (a, b) of input pixel (i, j) at (i + a, j + b), interleaved (built channels-last)."""
    n, _, h, w = x.shape
    co = conv.out_channels
    k = conv.subpixel if hasattr(conv, "subpixel") else subpixel_weight(conv)
    y = F.conv2d(x, k.to(x.dtype), conv.bias.repeat(4), padding=1)
    y = y.permute(0, 2, 3, 1)                                                      # (N, H+1, W+1, 4Co)
    y = y.reshape(n, h + 1, w + 1, 2, 2, co)
    rows = [torch.stack([y[:, a:a + h, b:b + w, a, b] for b in (0, 1)], 3) for a in (0, 1)]
    y = torch.stack(rows, 2).reshape(n, 2 * h, 2 * w, co)       # (N, H, 2, W, 2, Co) -> (N, 2H, 2W, Co)
    return y.permute(0, 3, 1, 2)


def upsample(up, x, cache, first: bool, dup=None, skip=None, subpixel: bool = False):
    """WanResample upsample2d / upsample3d: (B, C, T, H, W) -> (B, C', T', 2H, 2W), T' = 2T for
    upsample3d except on the first chunk (frame 0 stays one frame: diffusers' "Rep"); C' = C/2
    (Wan 2.1) or C (2.2). `dup`, `skip`: Wan 2.2's shortcut and its up block's input, added."""
    b, c, t, h, w = x.shape
    if up.mode == "upsample3d" and not first:
        y, cache = _cconv(up.time_conv, x, cache)         # (B, 2C, T, H, W): each frame's two halves
        x = y.reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        t = 2 * t
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)      # per frame, 2-D
    y = _up2x_conv(up.resample[1], x) if subpixel else up.resample(x)
    y = y.view(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)
    if dup is not None:                                    # (B, C', T', 2H, 2W) as well
        y = y + dup(skip, first_chunk=first)
    return y, cache


def _plain_up2x(up) -> bool:
    """The upsampler is a 2x nearest upsampling and a 3x3 convolution (padding 1, stride 1)."""
    scale, conv = up.resample[0].scale_factor, up.resample[1]
    return (up.resample[0].mode in ("nearest", "nearest-exact") and tuple(scale) == (2.0, 2.0)
            and conv.kernel_size == (3, 3) and conv.padding == (1, 1) and conv.stride == (1, 1))


def head(dec, x, cache):
    """The decoder's RMS norm, SiLU and output convolution: (B, 96, T, H, W) -> (B, 3, T, H, W)
    (Wan 2.2: 256 -> 12 channels, RGB of 2x2-pixel patches)."""
    return _cconv(dec.conv_out, dec.nonlinearity(dec.norm_out(x)), cache)


def stem(dec, x, cache):
    """The decoder's input convolution: (B, 16, T, h, w) latents -> (B, 384, T, h, w) (Wan 2.2:
    48 -> 1024 channels)."""
    return _cconv(dec.conv_in, x, cache)


def attention(attn, x):
    """The middle block's per-frame spatial self-attention (no time cache)."""
    return attn(x)


FUNCTIONS = {f.__name__: f for f in (stem, resblock, attention, upsample, head)}


class _Caches:
    """The causal caches of one decode, in call order: zeros before the first chunk (what the
    causal padding was), each call's new cache in place of its old one."""

    def __init__(self, memory_format):
        self.k, self.slots, self.format = 0, [], memory_format

    def take(self, like: torch.Tensor, channels: int | None = None) -> torch.Tensor:
        """The next cache: for an input like `like` (B, C, T, H, W), with `channels` if given."""
        if self.k == len(self.slots):
            b, c, _, h, w = like.shape
            self.slots.append(like.new_zeros(b, channels or c, CACHE_T, h, w).contiguous(
                memory_format=self.format))
        self.k += 1
        return self.slots[self.k - 1]

    def put(self, *new: torch.Tensor) -> None:
        """The new caches of the last len(new) taken."""
        self.slots[self.k - len(new):self.k] = list(new)


def _res(fns: dict, block, x: torch.Tensor, caches: _Caches, triton: bool) -> torch.Tensor:
    # the second convolution's input has the block's output channels
    c1, c2 = caches.take(x), caches.take(x, block.conv2.in_channels)
    x, c1, c2 = fns["resblock"](block, x, c1, c2, triton)
    caches.put(c1, c2)
    return x


def _chunk(fns: dict, dec, x: torch.Tensor, caches: _Caches, first: bool,
           subpixel: bool, triton: bool) -> torch.Tensor:
    """One decoder pass over a chunk of latent frames, as WanDecoder3d.forward with its caches."""
    caches.k = 0
    x, c = fns["stem"](dec, x, caches.take(x))
    caches.put(c)
    mid = dec.mid_block
    x = _res(fns, mid.resnets[0], x, caches, triton)
    for attn, res in zip(mid.attentions, mid.resnets[1:]):
        x = _res(fns, res, fns["attention"](attn, x), caches, triton)
    for up in dec.up_blocks:
        skip = x                                   # Wan 2.2's shortcut reads the up block's input
        for res in up.resnets:
            x = _res(fns, res, x, caches, triton)
        sampler, dup = _sampler(up)
        if sampler is not None:
            cache = caches.take(x) if sampler.mode == "upsample3d" else None
            x, c = fns["upsample"](sampler, x, cache, first, dup, skip if dup is not None else None,
                                   subpixel)
            if cache is not None:
                caches.put(c)
    x, c = fns["head"](dec, x, caches.take(x))
    caches.put(c)
    return x


def _decode(vae, fns: dict, chunk: int | None, channels_last: bool, subpixel: bool,
            triton: bool, original, z: torch.Tensor, return_dict: bool = True):
    """`vae._decode` (diffusers' signature): (B, Z, F, h, w) latents -> (B, 3, 4(F-1)+1, s h, s w)
    in [-1, 1], s the spatial compression (Wan 2.1: 8, 2.2: 16). `chunk` None: `decode_chunk`."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify
    from diffusers.models.autoencoders.vae import DecoderOutput
    _, _, frames, height, width = z.shape
    ratio = vae.spatial_compression_ratio
    if vae.use_tiling and (width > vae.tile_sample_min_width // ratio
                           or height > vae.tile_sample_min_height // ratio):
        return original(z, return_dict=return_dict)
    x = vae.post_quant_conv(z)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    chunk = chunk or decode_chunk(vae, height * ratio, width * ratio, triton)
    caches = _Caches(torch.channels_last_3d if channels_last else torch.contiguous_format)
    out = []
    starts = [0, *range(1, frames, chunk)]
    for i, s in enumerate(starts):
        e = 1 if i == 0 else min(s + chunk, frames)
        out.append(_chunk(fns, vae.decoder, x[:, :, s:e], caches, i == 0, subpixel, triton))
    out = torch.cat(out, 2)
    if vae.config.get("patch_size"):               # Wan 2.2: (B, 3 x 2 x 2, ...) -> pixels
        out = unpatchify(out, vae.config.patch_size)
    out = torch.clamp(out, min=-1.0, max=1.0)
    return DecoderOutput(sample=out) if return_dict else (out,)


def chunked_decode(vae, chunk: int | None = None, compile_kwargs: dict | None = None,
                   channels_last: bool = False, subpixel: bool = False,
                   winograd: int = 0, triton: bool = False, taps: bool = False) -> dict[str, int]:
    """Install the chunked decode on `vae` (module docstring). `chunk`: latent frames per pass
    after the first (None: `decode_chunk` each call's frame size). `compile_kwargs`: torch.compile's
    arguments for each block function (None: eager). `subpixel`: the upsamplers as four-phase
    2x2 convolutions (where each is a 2x nearest upsampling and a 3x3 convolution). `winograd`:
    the 3x3x3 convolutions over 2 or more frames as F(m, 3) along time, m up to it (0: off, 2
    or 4; `_winograd_conv`). `triton`: the residual blocks' passes around those convolutions as
    `compiler.kernels.winograd_triton`'s kernels (CUDA, Triton; `triton_available`). `taps`: 3x3x3
    convolutions to fewer than `NARROW` channels (conv_out) as `_taps_conv` (before Winograd).
    The transformed, four-phase and taps kernels are buffers made here from the weights: load
    weights before this."""
    if triton and not triton_available():
        raise ValueError("triton=True: Triton does not import or there is no CUDA device; "
                         "install triton (with a CUDA torch) or pass triton=False")
    if winograd not in (0, 2, 4):
        raise ValueError(f"winograd={winograd}: the largest F(m, 3) tile must be 0 (off), 2 or 4")
    if triton and not winograd:
        raise ValueError("triton=True fuses the passes of time-Winograd convolutions: needs "
                         "winograd=2 or 4")
    if not supported(vae):
        raise ValueError(f"{type(vae).__name__}: not a Wan causal video VAE (Wan 2.1's or 2.2's "
                         "decoder)")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk={chunk}: latent frames per decoder pass must be >= 1")
    if channels_last:   # convolution weights in the activations' layout (3-D and the 2-D resamples)
        for m in vae.decoder.modules():
            if isinstance(m, (torch.nn.Conv3d, torch.nn.Conv2d)):
                fmt = torch.channels_last_3d if m.weight.dim() == 5 else torch.channels_last
                m.weight.data = m.weight.data.contiguous(memory_format=fmt)
    for m in vae.decoder.modules():
        if isinstance(m, torch.nn.Conv3d):
            k = taps_weight(m) if taps else None
            if k is not None:
                m.register_buffer("taps", k, persistent=False)
            elif winograd:
                winograd_weights(m, winograd)
    dec = vae.decoder
    samplers = [u for u, _ in map(_sampler, dec.up_blocks) if u is not None]
    subpixel = subpixel and all(map(_plain_up2x, samplers))
    if subpixel:
        for up in samplers:
            conv = up.resample[1]
            conv.register_buffer("subpixel", subpixel_weight(conv), persistent=False)
    fns = dict(FUNCTIONS)
    if compile_kwargs is not None:
        fns = {k: torch.compile(f, **compile_kwargs) for k, f in fns.items()}
    original = vae._decode
    vae._decode = functools.partial(_decode, vae, fns, chunk, channels_last, subpixel, triton,
                                    original)
    counts = {"resblock": len(dec.mid_block.resnets) + sum(len(u.resnets) for u in dec.up_blocks),
              "attention": len(dec.mid_block.attentions), "upsample": len(samplers),
              "stem": 1, "head": 1}
    return counts if compile_kwargs is not None else {}
