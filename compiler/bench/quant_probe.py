"""`python -m compiler.bench.quant_probe [out=x.json]` (CUDA): launch settings of the FP8 activation
quantisation kernels, side by side in one process, each checked against its fp32 reference.

1. `gelu_quant` (compiler/kernels/quant.py) at PixArt-α's and Latte-1's shapes: the kernel before
   2026-11-25 (one block of next_power_of_2(N) lanes, kept here verbatim as `_padded_kernel`)
   against the two-chunk kernel at 4 / 8 / 16 warps (at 1722e93 also with GELU by `tanh.approx.f32`:
   40.1 against 40.6 us, 99.88 % of the e4m3 values identical; not kept).
2. LayerNorm (no affine) x (1 + scale) + shift -> row amax -> e4m3, what runs before the FP8 QKV
   and up-projection GEMMs of a PixArt/Latte block: Inductor's kernel under O3's settings against a
   hand-written one (`_ln_mod_quant_kernel`, one row per program, read once). Not wired into the
   compiler: this measures whether it would pay.

Timing: median of 20 CUDA-graph replays of 10 calls (`cross_attention.graph_time_us`), the calls
cycling through enough input buffers that the L2 (50 MB) cannot hold them. "ok" is the GPU
tests' criterion: scales within rtol 1e-5, every e4m3 value within one step, >= 99 % identical.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch

from ..kernels.cross_attention import graph_time_us
from ..options import FLAGS, parse_options
from ..kernels.quant import row_chunks, reference, launch
from ..transforms import FP8_MAX, FP8Linear

HBM = 3.35e12   # H100 SXM bytes/s


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def padded_kernel(h, bias, q, scale, N, stride_h, stride_q, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(h + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        x += tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
        g = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
        g = tl.where(mask, g, 0.0)
        s = tl.maximum(tl.max(tl.abs(g), axis=0), 1e-12) / FP8_MAX
        tl.store(q + row * stride_q + cols, (g * (1.0 / s)).to(q.dtype.element_ty), mask=mask)
        tl.store(scale + row, s)

    @triton.jit
    def ln_mod_quant_kernel(x, shift, scale, q, s_out, C, S, stride_x, stride_mod, eps,
                            FP8_MAX: tl.constexpr, BLOCK0: tl.constexpr, BLOCK1: tl.constexpr):
        row = tl.program_id(0)
        b = row // S                       # the modulation is per sample: (B, 1, C)
        c0 = tl.arange(0, BLOCK0)
        c1 = BLOCK0 + tl.arange(0, BLOCK1)
        m1 = c1 < C
        x0 = tl.load(x + row * stride_x + c0).to(tl.float32)
        x1 = tl.load(x + row * stride_x + c1, mask=m1, other=0.0).to(tl.float32)
        mean = (tl.sum(x0, axis=0) + tl.sum(x1, axis=0)) / C
        d0 = x0 - mean
        d1 = tl.where(m1, x1 - mean, 0.0)
        rstd = tl.rsqrt((tl.sum(d0 * d0, axis=0) + tl.sum(d1 * d1, axis=0)) / C + eps)
        y0 = d0 * rstd * (1.0 + tl.load(scale + b * stride_mod + c0).to(tl.float32)) \
            + tl.load(shift + b * stride_mod + c0).to(tl.float32)
        y1 = d1 * rstd * (1.0 + tl.load(scale + b * stride_mod + c1, mask=m1, other=0.0).to(tl.float32)) \
            + tl.load(shift + b * stride_mod + c1, mask=m1, other=0.0).to(tl.float32)
        s = tl.maximum(tl.maximum(tl.max(tl.abs(y0), axis=0), tl.max(tl.abs(y1), axis=0)), 1e-12) / FP8_MAX
        r = 1.0 / s
        tl.store(q + row * stride_x + c0, (y0 * r).to(q.dtype.element_ty))
        tl.store(q + row * stride_x + c1, (y1 * r).to(q.dtype.element_ty), mask=m1)
        tl.store(s_out + row, s)

    return padded_kernel, ln_mod_quant_kernel


def padded_gelu_quant(h, bias, num_warps=8):
    import triton
    m, n = h.shape
    q = torch.empty(m, n, device=h.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, 1, device=h.device, dtype=torch.float32)
    _kernels()[0][(m,)](h, bias, q, scale, n, h.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                        BLOCK=triton.next_power_of_2(n), num_warps=num_warps)
    return q, scale


def ln_mod_quant(x, shift, scale, eps=1e-6, num_warps=4):
    """x (B, S, C) contiguous, shift / scale (B, 1, C) -> q (B*S, C) e4m3, s (B*S, 1) fp32."""
    b, s, c = x.shape
    q = torch.empty(b * s, c, device=x.device, dtype=torch.float8_e4m3fn)
    sc = torch.empty(b * s, 1, device=x.device, dtype=torch.float32)
    b0, b1 = row_chunks(c)
    _kernels()[1][(b * s,)](x, shift, scale, q, sc, c, s, c, shift.stride(0), eps, FP8_MAX=FP8_MAX,
                            BLOCK0=b0, BLOCK1=b1, num_warps=num_warps)
    return q, sc


def ln_mod_quant_reference(x, shift, scale, eps=1e-6):
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + scale.float()) + shift.float()
    y = y.reshape(-1, x.shape[-1])
    s = y.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (y / s).to(torch.float8_e4m3fn), s


def ln_mod_quant_model(x, shift, scale):
    """As a PixArt block writes it (fp16 LayerNorm, modulation, then FP8Linear.quantize): Inductor's input."""
    n = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6)
    return FP8Linear.quantize((n * (1 + scale) + shift).reshape(-1, x.shape[-1]))


def check(q, s, rq, rs) -> dict:
    qf, rf = q.float(), rq.float()
    return dict(scale_rel=((s - rs).abs() / rs).max().item(),
                off_step=int((~((qf - rf).abs() <= rf.abs() / 8 + 2**-9)).sum()),
                same=(qf == rf).float().mean().item(),
                ok=bool(torch.allclose(s, rs, rtol=1e-5, atol=0) and ((qf - rf).abs() <= rf.abs() / 8 + 2**-9).all()
                        and (qf == rf).float().mean() > 0.99))


def _timed(fn, bufs) -> float:
    it = itertools.cycle(bufs)
    return graph_time_us(lambda: fn(*next(it)))


def gelu_sweep() -> list[dict]:
    rows = []
    for m, n in [(8192, 4608), (32768, 4608)]:   # PixArt-α 1024² (CFG), Latte-1 512² x 16 frames (CFG)
        g = torch.Generator("cuda").manual_seed(0)
        bufs = [((torch.randn(m, n, device="cuda", generator=g) * 3).to(torch.bfloat16),
                 torch.randn(n, device="cuda", dtype=torch.float16, generator=g)) for _ in range(2)]
        rq, rs = reference(*bufs[0])
        floor = m * n * 3 / HBM * 1e6
        variants = [("padded (before), 8 warps", lambda h, b: padded_gelu_quant(h, b, 8))]
        variants += [(f"two chunks, {w} warps", functools.partial(launch, num_warps=w)) for w in (4, 8, 16)]
        for name, fn in variants:
            r = dict(kernel="gelu_quant", shape=f"{m} x {n}", variant=name, floor_us=round(floor, 1))
            try:
                r.update(check(*fn(*bufs[0]), rq, rs))
                r["us"] = round(_timed(fn, bufs), 1)
            except Exception as e:   # one variant failing to build must not lose the others' figures
                r["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(r)
            print(r, flush=True)
    return rows


def ln_sweep(code_out: str | None) -> list[dict]:
    from torch._inductor.utils import run_and_get_code
    from .. import heuristics
    # O3's settings, from the one place they live (options.py); the FX graph cache off, so that
    # Inductor compiles here and `code_out` gets its code
    o3_opts = parse_options("O3")
    heuristics.set_persistent_rows(max(FLAGS[f].get("persistent_rows", 0) for f in o3_opts.flags))
    o3 = {**o3_opts.inductor_config(), "fx_graph_cache": False}
    rows = []
    for b, s, c in [(2, 4096, 1152), (32, 1024, 1152)]:   # PixArt-α 1024² (CFG); Latte-1 spatial
        g = torch.Generator("cuda").manual_seed(0)
        bufs = [(torch.randn(b, s, c, device="cuda", generator=g).half() * 4,
                 (torch.randn(b, 1, c, device="cuda", generator=g) * 0.5).half(),
                 (torch.randn(b, 1, c, device="cuda", generator=g) * 0.5).half()) for _ in range(4)]
        rq, rs = ln_mod_quant_reference(*bufs[0])
        floor = b * s * c * 3 / HBM * 1e6
        torch._dynamo.reset()
        with torch._inductor.config.patch(o3):
            inductor = torch.compile(ln_mod_quant_model)
            _, code = run_and_get_code(inductor, *bufs[0])
        if code_out:
            with open(f"{code_out}_{b}x{s}.py", "w") as f:
                f.write("\n\n".join(code))
        variants = [("Inductor, O3 settings", inductor)]
        variants += [(f"hand-written, {w} warps", functools.partial(ln_mod_quant, num_warps=w)) for w in (1, 2, 4, 8)]
        for name, fn in variants:
            r = dict(kernel="ln_mod_quant", shape=f"{b * s} x {c}", variant=name, floor_us=round(floor, 1))
            try:
                r.update(check(*fn(*bufs[0]), rq, rs))
                r["us"] = round(_timed(fn, bufs), 1)
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(r)
            print(r, flush=True)
    heuristics.set_persistent_rows(0)
    return rows


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    out = args.get("out")
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    import triton
    res["triton"] = triton.__version__
    res["rows"] = gelu_sweep()
    res["rows"] += ln_sweep(out[:-5] + "_inductor" if out and out.endswith(".json") else None)
    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}")
    print("| kernel | shape | variant | us | HBM floor us | ok | same | scale rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res["rows"]:
        print(f"| {r['kernel']} | {r['shape']} | {r['variant']} | {r.get('us', r.get('error'))} | {r['floor_us']} | "
              f"{r.get('ok')} | {r.get('same', 0):.4f} | {r.get('scale_rel', float('nan')):.1e} |")
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
