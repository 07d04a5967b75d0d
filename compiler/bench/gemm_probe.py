"""Time the FP8 GEMMs of `low-precision` at the models' shapes: cuBLAS (`torch._scaled_mm`, what
`FP8Linear` runs) against a plain Triton row-wise-scaled GEMM at a few fixed tile configs (dev tool,
CUDA, compute capability >= 8.9).

    python -m compiler.bench.gemm_probe

Each figure is GPU time per call from 20 calls captured in one CUDA graph (no launch overhead, as
in the compiled step), median of 5 replays. Inductor's own `max_autotune_gemm` ranking is not used
for this: on an H100 it put a Triton template 1.5x ahead of cuBLAS for 8192 x 1152 x 1152, which
this timing does not reproduce (BENCHMARKS.md, "fifth round").
"""

from __future__ import annotations

import functools

import torch

# (M, K, N): PixArt-α 1024² (8192 rows at batch 2) and Latte-1 512² x 16 (32768 rows), hidden 1152
SHAPES = [(8192, 1152, 1152), (8192, 1152, 3456), (8192, 1152, 4608), (8192, 4608, 1152),
          (240, 1152, 2304), (32768, 1152, 1152), (32768, 1152, 4608)]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
CONFIGS = [(64, 128, 128, 3, 4), (128, 64, 64, 3, 4), (128, 128, 128, 3, 8), (128, 256, 64, 3, 8)]


def graph_time_us(fn, iters: int = 20) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (and compile) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return sorted(times)[2]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_mm(a, b, sa, sb, c, M, N, K, s_am, s_bn, s_cm,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        # a (M, K) e4m3 row-major, b (N, K) e4m3 row-major (the weight), row scales sa (M,), sb (N,)
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        first_m = (pid // (GROUP_M * num_n)) * GROUP_M
        group = min(num_m - first_m, GROUP_M)
        pm = first_m + (pid % (GROUP_M * num_n)) % group
        pn = (pid % (GROUP_M * num_n)) // group
        rm, rn, rk = pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN), tl.arange(0, BK)
        pa = a + rm[:, None] * s_am + rk[None, :]
        pb = b + rn[None, :] * s_bn + rk[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            x = tl.load(pa, mask=(rm[:, None] < M) & (rk[None, :] + k * BK < K), other=0.0)
            w = tl.load(pb, mask=(rn[None, :] < N) & (rk[:, None] + k * BK < K), other=0.0)
            acc = tl.dot(x, w, acc)
            pa += BK
            pb += BK
        acc *= tl.load(sa + rm, mask=rm < M, other=0.0)[:, None] * tl.load(sb + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(c + rm[:, None] * s_cm + rn[None, :], acc.to(c.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return fp8_mm


def triton_fp8_mm(x8, w8, sa, sb, cfg) -> torch.Tensor:
    import triton
    (m, k), n = x8.shape, w8.shape[0]
    bm, bn, bk, stages, warps = cfg
    c = torch.empty(m, n, device=x8.device, dtype=torch.bfloat16)
    _kernel()[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        x8, w8, sa, sb, c, m, n, k, x8.stride(0), w8.stride(0), c.stride(0),
        BM=bm, BN=bn, BK=bk, GROUP_M=8, num_stages=stages, num_warps=warps)
    return c


def main() -> None:
    for m, k, n in SHAPES:
        x8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        w8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
        cublas = lambda: torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        ref = cublas().float()
        line = f"M={m} K={k} N={n}: cuBLAS {graph_time_us(cublas):.1f} us"
        for cfg in CONFIGS:
            run = lambda: triton_fp8_mm(x8, w8, sa.view(-1), sb.view(-1), cfg)
            err = (run().float() - ref).abs().max().item() / ref.abs().max().item()
            assert err < 1e-2, f"Triton GEMM {cfg} is wrong at {(m, k, n)}: relative error {err:.1e}"
            line += f" | {cfg}: {graph_time_us(run):.1f} us"
        print(line, flush=True)


if __name__ == "__main__":
    main()
