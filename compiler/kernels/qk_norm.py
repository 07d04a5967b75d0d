"""Self-attention's q or k: RMS norm across all heads + the rotary embedding, one Triton pass.

Contract:
- `qk_norm_rope(x, weight, eps, cos, sin, round_first)`, op `diffcompiler::qk_norm_rope`:
  x (B, N, C) fp16/bf16, any row strides (a slice of the fused QKV output), C = heads x D;
  weight (C,) in x's dtype; cos, sin (N, D/2) any float dtype and strides: pair i of every head at
  token n turns by (cos[n, i], sin[n, i]). Returns (B, N, C) contiguous in x's dtype:
      r = rsqrt(mean(x^2) + eps) in fp32;  h = round(round(x r) w) if round_first else round(x r w)
      out[2i] = h[2i] c - h[2i+1] s,  out[2i+1] = h[2i+1] c + h[2i] s   (fp32, rounded once)
  `round_first` is diffusers' `RMSNorm` (AnyFlow's), otherwise `torch.nn.RMSNorm` (Wan's): the
  modules followed by `int8_attention.complex_rope` / `_rope` in eager PyTorch (torch >= 2.7's
  RMSNorm), bit for bit on a CPU (`reference`); the kernel differs in the last bit now and then
  (the row's sum in another order, fused multiply-adds, the hardware's rsqrt). CUDA, x and weight
  with even strides: one Triton kernel (int64 offsets where they pass 2^31 words); elsewhere
  `reference`.
- `launch_config(c, d)`: the kernel's rows a program and warps for rows of c values.

The kernel reads each rotation pair (x[2i], x[2i+1]) as one 32-bit word, so the row is one
contiguous vector load and every lane holds both values its rotation needs (a gather of the pair
partner, or tl.split of a (.., 2) tile, kept the load/store pipe busy at ~4x the HBM floor).

Why: Inductor compiles the norm + rotation into looped two-pass reductions far from the bytes they
move. q alone (1 x N x C slice of a fused QKV output, H200, `python -m compiler.bench.qknorm_probe
kernels_only=1`; floor = reading and writing it at 4.3 TB/s):

| shape | Inductor (O3 settings) | `qk_norm_rope` | floor |
| --- | --- | --- | --- |
| AnyFlow 1.3B, 32,760 x 1536 (complex128 table) | 181.6 us | 62.6 us | 46.8 us |
| Wan 1.3B, 32,760 x 1536 | 300.7 us | 63.8 us | 46.8 us |
| Wan 2.2 TI2V-5B, 27,280 x 3072 | 310.4 us | 94.5 us | 78.0 us |
| Wan 14B, 32,760 x 5120 | 608.9 us | 181.6 us | 156.0 us |

In AnyFlow's 4-step 480x832 x 81-frame video they were 240 calls of ~258 us (3 % of its GPU
time); Wan 14B's q and k, one 1.55 ms kernel a block and call. benchmarks/2026-11-28-gpu-suite-4xh200.md.
"""

from __future__ import annotations

import functools

import torch

INT32_WORDS = 2 ** 31   # offsets (in 32-bit words) from here on need the kernel's int64 variant


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
              sin: torch.Tensor, round_first: bool) -> torch.Tensor:
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    h = ((xf * r).to(x.dtype) * weight) if round_first else (xf * r * weight.float()).to(x.dtype)
    pairs = h.float().unflatten(-1, (-1, cos.shape[-1], 2))              # (B, N, H, D/2, 2)
    cs, sn = cos.float()[None, :, None], sin.float()[None, :, None]      # (1, N, 1, D/2)
    a, bb = pairs.unbind(-1)
    out = torch.stack((a * cs - bb * sn, bb * cs + a * sn), -1)
    return out.flatten(2).to(x.dtype)


@functools.cache
def _triton_kernel():
    """Built on first use: CPU-only installs have no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_kernel(x, w, cs, sn, out, N, sxb, sxn, scn, scp, ssn, ssp, eps,
                            H: tl.constexpr, HP: tl.constexpr, P: tl.constexpr,
                            ROUND_FIRST: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr,
                            WIDE: tl.constexpr):
        # ROWS tokens of sample b. A rotation pair (x[2i], x[2i+1]) is one 32-bit word: the row is
        # read as (HP >= H heads, P pairs) words, contiguous (vector loads), and each lane has both
        # values of its pair, so nothing is gathered; the token's P (cos, sin) values are loaded
        # once and broadcast over the heads.
        pid, b = tl.program_id(0), tl.program_id(1)
        r = pid * ROWS + tl.arange(0, ROWS)
        if WIDE:    # offsets past 2^31 words (a large batch of 720P 14B tokens): int64 arithmetic
            b = b.to(tl.int64)
            r = r.to(tl.int64)
        hh = tl.arange(0, HP)
        pp = tl.arange(0, P)
        col = hh[:, None] * P + pp[None, :]                                    # (HP, P) words
        m = (r[:, None, None] < N) & (hh[None, :, None] < H)                   # (ROWS, HP, 1)
        word = tl.load(x + b * sxb + r[:, None, None] * sxn + col[None], mask=m, other=0)
        # HALF: fp16 or bf16; a lane's low 16 bits are x[2i], its high 16 bits x[2i + 1]
        a = (word & 0xFFFF).to(tl.uint16).to(HALF, bitcast=True).to(tl.float32)
        c2 = ((word >> 16) & 0xFFFF).to(tl.uint16).to(HALF, bitcast=True).to(tl.float32)
        rs = tl.rsqrt(tl.sum(tl.sum(a * a + c2 * c2, axis=2), axis=1) / (H * P * 2) + eps)
        rs = rs[:, None, None]
        ww = tl.load(w + col, mask=hh[:, None] < H, other=0)[None]
        wa = (ww & 0xFFFF).to(tl.uint16).to(HALF, bitcast=True).to(tl.float32)
        wb = ((ww >> 16) & 0xFFFF).to(tl.uint16).to(HALF, bitcast=True).to(tl.float32)
        if ROUND_FIRST:
            ha = ((a * rs).to(HALF).to(tl.float32) * wa).to(HALF).to(tl.float32)
            hb = ((c2 * rs).to(HALF).to(tl.float32) * wb).to(HALF).to(tl.float32)
        else:
            ha = (a * rs * wa).to(HALF).to(tl.float32)
            hb = (c2 * rs * wb).to(HALF).to(tl.float32)
        rm = r[:, None] < N
        c = tl.load(cs + r[:, None] * scn + pp[None, :] * scp, mask=rm, other=0.0).to(tl.float32)
        s = tl.load(sn + r[:, None] * ssn + pp[None, :] * ssp, mask=rm, other=0.0).to(tl.float32)
        c, s = c[:, None, :], s[:, None, :]                                    # (ROWS, 1, P)
        ya = (ha * c - hb * s).to(HALF).to(tl.uint16, bitcast=True).to(tl.int32)
        yb = (hb * c + ha * s).to(HALF).to(tl.uint16, bitcast=True).to(tl.int32)
        y = ya | (yb << 16)
        tl.store(out + (b * N + r[:, None, None]) * (H * P) + col[None], y, mask=m)

    return qk_norm_rope_kernel


def launch_config(c: int, d: int) -> tuple[int, int]:
    """(rows a program, warps) for rows of c = heads x d values: 2 rows of up to 1024 pairs
    (H200, 2026-11-28, `python -m compiler.bench.qknorm_probe kernels_only=1`: 4 warps beat 8 at
    every Wan / AnyFlow width, 1 vs 2 vs 4 rows within 5 % but for AnyFlow's 1536, where 1 row
    took 98 us and 2 rows 63)."""
    import triton
    pairs = triton.next_power_of_2(c // d) * d // 2
    return max(1, 2048 // pairs), 4


def _launch(x, weight, eps, cos, sin, round_first, rows=None, warps=None):
    """x (B, N, C) 16-bit with x.stride(-1) == 1 and even row strides and offset (pairs as words)."""
    import triton
    import triton.language as tl
    b, n, c = x.shape
    p = cos.shape[-1]
    heads = c // (2 * p)
    out = torch.empty((b, n, c), dtype=x.dtype, device=x.device)
    rows0, warps0 = launch_config(c, 2 * p)
    rows, warps = rows or rows0, warps or warps0
    xw, ow, ww = x.view(torch.int32), out.view(torch.int32), weight.view(torch.int32)
    reach = max((b - 1) * xw.stride(0) + (n - 1) * xw.stride(1) + c // 2, b * n * c // 2)
    _triton_kernel()[(triton.cdiv(n, rows), b)](
        xw, ww, cos, sin, ow, n, xw.stride(0), xw.stride(1), cos.stride(0), cos.stride(1),
        sin.stride(0), sin.stride(1), eps, H=heads, HP=triton.next_power_of_2(heads), P=p,
        ROUND_FIRST=round_first, HALF=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16,
        ROWS=rows, WIDE=reach >= INT32_WORDS, num_warps=warps)
    return out


def _words(x: torch.Tensor) -> bool:
    """Whether x's rotation pairs can be read as 32-bit words."""
    return (x.stride(-1) == 1 and x.shape[-1] % 2 == 0 and x.storage_offset() % 2 == 0
            and all(st % 2 == 0 for st in x.stride()[:-1]) and x.data_ptr() % 4 == 0)


@torch.library.custom_op("diffcompiler::qk_norm_rope", mutates_args=())
def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, round_first: bool) -> torch.Tensor:
    if x.is_cuda and _words(x) and _words(weight):
        return _launch(x, weight, eps, cos, sin, round_first)
    return reference(x, weight, eps, cos, sin, round_first)


@qk_norm_rope.register_fake
def _(x, weight, eps, cos, sin, round_first):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
