"""FP8 feed-forward (`low-precision`): bias + GELU(tanh) + per-row FP8 quantisation in one Triton pass.

Contract:
- `gelu_quant(h, bias) -> (q, scale)`, op `diffcompiler::gelu_quant`: h (M, N) the up-projection's
  raw GEMM output (bf16/fp16), bias (N,). With g = GELU_tanh(h + bias) in fp32 per row:
  scale (M, 1) fp32 = max(|g|) / 448 (at least 1e-12 / 448), q (M, N) float8_e4m3fn = g / scale.
  CUDA runs one Triton kernel (one program per row, the row held in registers); CPU runs the same
  arithmetic in torch (tests, and the reference the kernel is checked against).
- `fp8_feedforward(module) -> int`: every diffusers `FeedForward` whose up-projection (GELU tanh)
  and down-projection are already `FP8Linear` (see `transforms.to_fp8`) and whose dropouts are 0
  becomes an `FP8FeedForward` (a module class: one Dynamo graph per block class). Returns how many.

Why: after `to_fp8`, Inductor fuses bias + GELU + row amax + cast into one reduction over the
4 x hidden-wide activation (4608 for PixArt/Latte) with a looped two-pass schedule whose default
config ran at 0.56 ms per call on an H100 for Latte's 32768 x 4608 rows (0.41 ms after 10 s of
coordinate descent), ~3-4x the 0.15 ms that reading 302 MB and writing 151 MB takes, 56 times a step.
A row is 4608 values: one program keeps it in registers and reads it once, as two power-of-two
chunks (no lanes past the row): 40.6 us for PixArt's 8192 x 4608 and 151 us for Latte's
32768 x 4608 on an H100, 1.2x / 1.1x the HBM floor (one padded block of 8192 lanes: 61 / 231 us;
Inductor's default: 163 / 631 us; BENCHMARKS.md; `python -m compiler.kernels.quant` times it,
`python -m compiler.bench.quant_probe` sweeps its launch settings).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..transforms import FP8_MAX, FP8Linear

_SQRT_2_OVER_PI = 0.7978845608028654


def reference(h: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = h.float() + bias.float()
    g = 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    scale = g.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (g / scale).to(torch.float8_e4m3fn), scale


@functools.cache
def _triton_kernel():
    """Built on first use: CPU-only installs have no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_quant_kernel(h, bias, q, scale, N, stride_h, stride_q, FP8_MAX: tl.constexpr,
                          BLOCK0: tl.constexpr, BLOCK1: tl.constexpr):
        # The row as two power-of-two chunks: [0, BLOCK0) lies inside it, [BLOCK0, BLOCK0 + BLOCK1)
        # is masked at N (4608 = 4096 + 512, 1152 = 1024 + 128: no idle lanes). One block of
        # next_power_of_2(N) = 8192 lanes also computed the GELU on 3584 padding lanes, and the
        # kernel is bound by that arithmetic more than by memory (61 -> 41 us on an H100).
        row = tl.program_id(0)
        c0 = tl.arange(0, BLOCK0)
        c1 = BLOCK0 + tl.arange(0, BLOCK1)
        m1 = c1 < N
        x0 = tl.load(h + row * stride_h + c0).to(tl.float32) + tl.load(bias + c0).to(tl.float32)
        x1 = (tl.load(h + row * stride_h + c1, mask=m1, other=0.0).to(tl.float32)
              + tl.load(bias + c1, mask=m1, other=0.0).to(tl.float32))   # 0 in masked lanes: GELU(0) = 0
        # 0.5 x (1 + tanh u) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3); the sigmoid form
        # keeps its fp32 digits for negative x, where 1 + tanh u cancels (tanh.approx.f32, one MUFU
        # op instead of exp + reciprocal, measured no faster: compiler.bench.quant_probe at 1722e93)
        g0 = x0 * tl.sigmoid(x0 * (1.5957691216057308 + 0.07135481627260025 * x0 * x0))
        g1 = x1 * tl.sigmoid(x1 * (1.5957691216057308 + 0.07135481627260025 * x1 * x1))
        s = tl.maximum(tl.maximum(tl.max(tl.abs(g0), axis=0), tl.max(tl.abs(g1), axis=0)), 1e-12) / FP8_MAX
        r = 1.0 / s
        tl.store(q + row * stride_q + c0, (g0 * r).to(q.dtype.element_ty))
        tl.store(q + row * stride_q + c1, (g1 * r).to(q.dtype.element_ty), mask=m1)
        tl.store(scale + row, s)

    return gelu_quant_kernel


def row_chunks(n: int) -> tuple[int, int]:
    """(BLOCK0, BLOCK1): the largest power of two below n, and the power of two covering the rest."""
    b0 = 1 if n <= 2 else 1 << ((n - 1).bit_length() - 1)
    return b0, 1 << (max(n - b0, 1) - 1).bit_length()


NUM_WARPS = 8   # H100, 8192 x 4608: 4 warps 43.9 us, 8: 40.6, 16: 48.3 (compiler.bench.quant_probe)


def launch(h: torch.Tensor, bias: torch.Tensor, num_warps: int = NUM_WARPS):
    """The kernel on CUDA tensors: h (M, N) with unit column stride, bias (N,) contiguous."""
    m, n = h.shape
    q = torch.empty(m, n, device=h.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, 1, device=h.device, dtype=torch.float32)
    b0, b1 = row_chunks(n)
    _triton_kernel()[(m,)](h, bias, q, scale, n, h.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                           BLOCK0=b0, BLOCK1=b1, num_warps=num_warps)
    return q, scale


@torch.library.custom_op("diffcompiler::gelu_quant", mutates_args=())
def gelu_quant(h: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not h.is_cuda:
        return reference(h, bias)
    if h.stride(-1) != 1:
        h = h.contiguous()
    return launch(h, bias.contiguous())


@gelu_quant.register_fake
def _(h, bias):
    m, n = h.shape
    return h.new_empty(m, n, dtype=torch.float8_e4m3fn), h.new_empty(m, 1, dtype=torch.float32)


class FP8FeedForward(nn.Module):
    """Drop-in for diffusers' `FeedForward(activation_fn="gelu-approximate")` whose Linears are
    FP8Linear: up-GEMM (bf16 out, no bias) -> gelu_quant -> down-GEMM, the hidden activation never
    in half precision."""

    def __init__(self, ff: nn.Module):
        super().__init__()
        self.up = ff.net[0].proj     # FP8Linear (in -> 4 x in)
        self.down = ff.net[2]        # FP8Linear (4 x in -> out)
        # the same Linears under their original path (`net.0.proj`, `net.2`), unregistered (no
        # second entry in state_dict or modules()): `transforms.set_linear_weight` finds them
        self.__dict__["net"] = ff.net

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x8, xs = self.up.quantize(hidden_states.reshape(-1, shape[-1]))
        h = self.up.gemm(x8, xs)                                        # (M, 4C) bf16, no bias
        h8, hs = gelu_quant(h, self.up.bias)
        y = self.down.gemm(h8, hs)
        if self.down.bias is not None:
            y = y + self.down.bias
        return y.to(self.down.out_dtype).view(*shape[:-1], self.down.out_features)


def fp8_feedforward(module: nn.Module) -> int:
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward
    n = 0
    for parent in list(module.modules()):
        for name, ff in list(parent.named_children()):
            if not isinstance(ff, FeedForward):
                continue
            net = list(ff.net)
            up = net[0] if net else None
            if (len(net) in (3, 4) and isinstance(up, GELU) and up.approximate == "tanh"
                    and isinstance(up.proj, FP8Linear) and up.proj.bias is not None
                    and isinstance(net[2], FP8Linear)
                    and all(isinstance(m, nn.Dropout) and m.p == 0 for m in net[1::2])):
                setattr(parent, name, FP8FeedForward(ff))
                n += 1
    return n


def _bench() -> None:
    """`python -m compiler.kernels.quant`: the kernel against Inductor's default code for the same math, timed in
    CUDA graphs (`cross_attention.graph_time_us`). Launched from Python one call at a time, PixArt's
    8192 rows read 70.5 us against 40.6 in graphs (Latte's 32768: 150.3 and 151.1): that loop timed
    the CPU's dispatch of the op, not the kernel (BENCHMARKS.md, 2026-11-25)."""
    from .cross_attention import graph_time_us
    inductor = torch.compile(reference)
    for m, n in [(8192, 4608), (32768, 4608)]:  # PixArt-α 1024², Latte-1 512² x 16 (batch 2, CFG)
        h = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.float16)
        floor = m * n * 3 / 3.35e12 * 1e6  # bytes read + written at the H100's 3.35 TB/s
        print(f"{m} x {n}: gelu_quant {graph_time_us(lambda: gelu_quant(h, b)):.1f} us, "
              f"Inductor {graph_time_us(lambda: inductor(h, b)):.1f} us, HBM floor {floor:.1f} us")


if __name__ == "__main__":
    _bench()
