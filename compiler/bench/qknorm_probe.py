"""Time and check `compiler.kernels.qk_norm.qk_norm_rope` inside the compiled q/k/v path (dev tool, CUDA).

    python -m compiler.bench.qknorm_probe [cases=complex_1536_81f,cos_sin_5120_81f,...] [kernels_only=1] [out=qknorm.json]

Per case (a full-size self-attention of the family, fused QKV, random weights, one video's tokens):
the family's q/k/v function (`int8_attention._qkv_complex_rope` / `_qkv_cos_sin_rope`, what
`self_attention_qkv` calls) compiled with O3's Inductor settings, once as it runs now (the
norms + rotary embedding through `fused_norm_rope`: one Triton pass each for q and k) and once with
that hook off (Inductor's own fused norm + rotation kernels): the median time of the whole call
(the QKV GEMM included), the kernels of one call (torch.profiler), and both outputs against an
fp64 reference of the module's arithmetic (max abs, and how many values differ between the two).
`kernels_only=1`: instead, the norm + rotation of q alone, Inductor's kernel for the modules' path
against `qk_norm_rope` at each launch setting (rows a program x warps), with the HBM floor.
"""

from __future__ import annotations

import json
import sys

import torch

from .. import heuristics
from ..kernels import int8_attention as ia
from ..options import parse_options
from ..transforms import fuse_qkv

# name: (rotary table, dim, heads, tokens): "complex" is AnyFlow's attention (diffusers' RMSNorm, a
# complex128 table), "cos_sin" Wan's (torch's RMSNorm, fp32 cos and sin); 480x832 x 81 frames =
# 21 x 30 x 52 tokens, TI2V-5B's 704x1280 x 121 = 31 x 22 x 40
CASES = {
    "complex_1536_81f": ("complex", 1536, 12, 32760),     # AnyFlow Wan 2.1 1.3B
    "cos_sin_1536_81f": ("cos_sin", 1536, 12, 32760),     # Wan 2.1 T2V 1.3B
    "cos_sin_3072_121f": ("cos_sin", 3072, 24, 27280),    # Wan 2.2 TI2V-5B
    "cos_sin_5120_81f": ("cos_sin", 5120, 40, 32760),     # Wan 2.1 14B, Wan 2.2 A14B at 480P
}


def _module(table: str, dim: int, heads: int):
    from diffusers.models.transformers.transformer_anyflow import AnyFlowAttention
    from diffusers.models.transformers.transformer_wan import WanAttention
    with torch.device("cuda"):
        attn = (AnyFlowAttention(dim, heads, dim // heads) if table == "complex"
                else WanAttention(dim, heads, dim // heads, eps=1e-6))
    attn = attn.half().eval().requires_grad_(False)
    for n in (attn.norm_q, attn.norm_k):    # weights away from 1, so the weight's rounding counts
        n.weight.copy_(1 + 0.3 * torch.randn_like(n.weight))
    fuse_qkv(attn)                           # one QKV GEMM, as every compiled mode has it
    return attn


def _rotary(table: str, n: int, d: int):
    ang = torch.rand(n, d // 2, device="cuda", dtype=torch.float64) * 6.28
    if table == "complex":                 # complex128 (1, 1, N, D/2), for query and key
        f = torch.polar(torch.ones_like(ang), ang)[None, None]
        return {"query": f, "key": f}
    cos = ang.cos().float().repeat_interleave(2, -1)[None, :, None]   # (1, N, 1, D) fp32
    sin = ang.sin().float().repeat_interleave(2, -1)[None, :, None]
    return (cos, sin)


def _pairs(table: str, rot) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) of each rotation pair, 2 x (N, D/2), as the q/k/v functions pass them."""
    if table == "complex":
        return torch.view_as_real(rot["query"])[0, 0].unbind(-1)
    return rot[0][0, :, 0, 0::2], rot[1][0, :, 0, 1::2]


def _kernels(fn) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 5) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(((k[:90], round(t, 1)) for k, t in rows), key=lambda r: -r[1])


def case(name: str) -> dict:
    import triton
    table, dim, heads, n = CASES[name]
    torch.manual_seed(0)
    attn = _module(table, dim, heads)
    h = torch.randn(1, n, dim, device="cuda", dtype=torch.float16)
    rot = _rotary(table, n, dim // heads)
    res, outs = {}, {}
    hook = ia.fused_norm_rope
    make_qkv = ia._qkv_complex_rope if table == "complex" else ia._qkv_cos_sin_rope
    for variant, fused in (("qk_norm_rope", hook), ("inductor", lambda *a: None)):
        ia.fused_norm_rope = fused          # read at trace time by the q/k/v functions
        torch._dynamo.reset()
        fn = torch.compile(lambda: torch.cat([t.flatten(2) for t in make_qkv(attn, h, rot)], -1),
                           options=parse_options("O3").inductor_config(denoiser=True))
        outs[variant] = fn().clone()
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        res[variant] = dict(ms=round(ms, 4), kernels=_kernels(fn)[:8])
    ia.fused_norm_rope = hook
    # fp64 reference of the module's arithmetic (diffusers' own processor math, in fp64 throughout)
    with torch.no_grad():
        qkv = attn.to_qkv(h).double()
        c = dim
        qf, kf, vf = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]

        def norm(x, m):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps) * m.weight.double()
        cs, sn = (t.double() for t in _pairs(table, rot))

        def rope(x):
            p = x.unflatten(-1, (heads, -1, 2))
            a, b = p.unbind(-1)
            cc, ss = cs[None, :, None], sn[None, :, None]
            return torch.stack((a * cc - b * ss, b * cc + a * ss), -1).flatten(2)
        ref = torch.cat([rope(norm(qf, attn.norm_q)), rope(norm(kf, attn.norm_k)), vf], -1)
    for variant, o in outs.items():
        res[variant]["max_abs_vs_fp64"] = float((o.double() - ref).abs().max())
        res[variant]["mean_abs_vs_fp64"] = float((o.double() - ref).abs().mean())
    diff = (outs["qk_norm_rope"].float() - outs["inductor"].float()).abs()
    res["between"] = dict(max_abs=float(diff.max()), differ=int((diff > 0).sum()), of=diff.numel())
    res["speedup"] = round(res["inductor"]["ms"] / res["qk_norm_rope"]["ms"], 3)
    # bytes the norm + rotation must move: q, k read and written (fp16), the rotary table read once
    moved = 4 * n * dim * 2
    res["floor_us_at_4.3TBps"] = round(moved / 4.3e12 * 1e6, 1)        # q and k: two launches
    return res


def kernels_only(name: str) -> dict:
    """The norm + rotation of q alone, (1, N, C) sliced from a fused QKV buffer: Inductor's kernel
    for the modules' own path (O3's settings) against `qk_norm_rope` at each launch setting."""
    import triton
    from ..kernels import qk_norm
    table, dim, heads, n = CASES[name]
    torch.manual_seed(0)
    attn = _module(table, dim, heads)
    rot = _rotary(table, n, dim // heads)
    x = torch.randn(1, n, 3 * dim, device="cuda", dtype=torch.float16)[..., :dim]
    norm = attn.norm_q
    cs, sn = _pairs(table, rot)
    first = table == "complex"
    if first:
        path = lambda x: ia.complex_rope(norm(x).unflatten(2, (heads, -1)), rot["query"].transpose(1, 2))
    else:
        path = lambda x: ia._rope(norm(x).unflatten(2, (heads, -1)), *rot)
    torch._dynamo.reset()
    fn = torch.compile(path, options=parse_options("O3").inductor_config(denoiser=True))
    want = fn(x).flatten(2)
    bench = lambda f: round(1e3 * triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median"), 1)
    res = dict(inductor_us=bench(lambda: fn(x)), floor_us=round(2 * n * dim * 2 / 4.3e12 * 1e6, 1))
    for rows in (1, 2, 4):
        for warps in (4, 8):
            f = lambda: qk_norm._launch(x, norm.weight, norm.eps, cs, sn, first, rows, warps)
            res[f"ours_{rows}x{warps}_us"] = bench(f)
    got = qk_norm._launch(x, norm.weight, norm.eps, cs, sn, first)
    res["max_abs_vs_inductor"] = float((got.float() - want.float()).abs().max())
    return res


def main(argv: list[str]) -> None:
    kw = dict(a.split("=", 1) for a in argv)
    heuristics.set_persistent_rows(2048)     # as O3's max-optimize does
    names = kw.get("cases", ",".join(CASES)).split(",")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if kw.get("kernels_only") == "1":
        for name in names:
            out[name] = kernels_only(name)
            print(name, out[name], flush=True)
        names = []
    for name in names:
        out[name] = case(name)
        r = out[name]
        print(f"{name}: qkv path {r['inductor']['ms']:.3f} -> {r['qk_norm_rope']['ms']:.3f} ms "
              f"({r['speedup']}x); vs fp64 max abs {r['inductor']['max_abs_vs_fp64']:.2e} -> "
              f"{r['qk_norm_rope']['max_abs_vs_fp64']:.2e}; between {r['between']}", flush=True)
        print(f"   q and k's bytes at 4.3 TB/s: {r['floor_us_at_4.3TBps']} us")
        for v in ("inductor", "qk_norm_rope"):
            for k, t in r[v]["kernels"]:
                print(f"   {v:13s} {t:9.1f} us  {k}")
    if "out" in kw:
        with open(kw["out"], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
