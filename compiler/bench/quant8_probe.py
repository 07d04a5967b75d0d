"""`python -m compiler.bench.quant8_probe [shapes=a,b] [out=x.json]` (CUDA, sm90): the 8-bit
attention's quantisation (`int8_attention.quantize`, what runs before the sm90 kernel on every
Wan self-attention) against the one before 2026-11-28 (`old_quantize`: K's mean and V's |max| by
torch, the abs written out first; one tile a rotation program), side by side in one process.

Per shape: the whole quantisation, old and new, per launch setting of SWEEP (each setting with the
others at their defaults), and the old path's two torch statistics alone, in us (median of 20
CUDA-graph replays of 10 calls, `cross_attention.graph_time_us`, cycling through two input sets;
at 480P the inputs are 100+ MB each, past the 50-60 MB L2), the new one's GB/s of the bytes it
must move; then the outputs of the two
against each other on inputs with outlier channels (at the default settings, fp16 and bf16, and
at the fastest): q8, qs, v8 and vs must be bit-equal (same arithmetic), k8 may differ by a step
where K's mean (summed in another order) differs in its last bit.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from ..kernels import int8_attention as ia
from ..kernels.cross_attention import graph_time_us

# name: (batch, tokens, heads, head dim), one video as the worker runs it (guidance 1.0)
SHAPES = {
    "wan21_1_3b_480p": (1, 32760, 12, 128),   # Wan 2.1 1.3B / AnyFlow, 480x832 x 81
    "wan21_14b_480p": (1, 32760, 40, 128),    # Wan 2.1 14B (LightX2V), 480x832 x 81
    "wan22_5b_704p": (1, 27280, 24, 128),     # Wan 2.2 TI2V-5B, 704x1280 x 121
    "odd_hd64": (1, 16411, 12, 64),           # ragged tail, the other head dim
}
SWEEP = {"stats": [(128, 4), (256, 8), (512, 8)],
         "rot_q": [(1, 2), (1, 4), (2, 4), (4, 4), (4, 8)],
         "rot_k": [(1, 4), (1, 8), (2, 4), (2, 8)]}


def old_quantize(q, k, v):
    """`int8_attention.quantize` before 2026-11-28, verbatim but for the kernels' TILES=1."""
    _, rotate_quant, v_fp8 = ia._kernels()
    b, n, h, d = q.shape
    r = ia.signed_hadamard(d, str(q.device), q.dtype)
    km = k.mean(dim=1)                                                       # (B, H, D)
    q8, k8 = torch.empty(q.shape, dtype=torch.int8, device=q.device), torch.empty(k.shape, dtype=torch.int8, device=q.device)
    qs = torch.empty(b, h, (n + 63) // 64 * 32, dtype=torch.float32, device=q.device)
    ks = torch.empty(b, h, (n + 127) // 128 * 4, dtype=torch.float32, device=q.device)
    for x, mean, out, sc, rows, key in ((q, km, q8, qs, 64, False), (k, km, k8, ks, 128, True)):
        rotate_quant[((n + rows - 1) // rows, h, b)](
            x, mean, r, out, sc, n, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
            out.stride(2), sc.stride(0), sc.stride(1), km.stride(0), km.stride(1), d ** -0.5, D=d, KEY=key,
            TILES=1, num_warps=4 if key else 2)
    np_ = (n + 127) // 128 * 128
    vs = (v.abs().amax(dim=1).float() / 448.0).clamp_min(1e-12)             # (B, H, D)
    v8 = torch.empty(b, h, d, np_, dtype=torch.float8_e4m3fn, device=q.device)
    v_fp8[(np_ // 128, h, b)](v, vs, v8, n, np_, v.stride(0), v.stride(1), v.stride(2), vs.stride(0),
                              vs.stride(1), v8.stride(0), v8.stride(1), D=d, num_warps=8)
    return q8, qs, k8, ks, v8, vs


def inputs(b, n, h, d, gen, dtype=torch.float16):
    """q, k contiguous (as `qk_norm_rope` writes them), v a view of the fused projection's output
    (B, N, 3 H D), with outlier channels: 4 channels of q and k offset by 20-50x the std, 4 of v
    20x larger (the attention tests' `offset` and `scaled` kinds); on `gen`'s device."""
    dev = gen.device
    q, k = (torch.randn(b, n, h, d, device=dev, generator=gen) for _ in range(2))
    for t in (q, k):
        t[..., :4] += torch.tensor([20.0, -30.0, 40.0, -50.0], device=dev)
    qkv = torch.randn(b, n, 3 * h * d, device=dev, generator=gen)
    v = qkv[..., 2 * h * d:].unflatten(2, (h, d))
    v[..., 4:8] *= 20
    return q.to(dtype), k.to(dtype), qkv.to(dtype)[..., 2 * h * d:].unflatten(2, (h, d))


def compare(new, old) -> dict:
    """The two quantisations' outputs: bit-equality where the arithmetic is the same."""
    (q8, qs, k8, ks, v8, vs), (oq8, oqs, ok8, oks, ov8, ovs) = new, old
    diff = (k8.int() - ok8.int()).abs()
    return {"q8_equal": torch.equal(q8, oq8), "qs_equal": torch.equal(qs, oqs),
            "v8_equal": torch.equal(v8.view(torch.uint8), ov8.view(torch.uint8)), "vs_equal": torch.equal(vs, ovs),
            "k8_differing": int((diff != 0).sum()), "k8_of": diff.numel(), "k8_max_step": int(diff.max()),
            "ks_max_rel": float(((ks - oks).abs() / oks).max())}


def timings(sets, d) -> dict:
    """us per call of the whole quantisation, old and new per launch setting, and of the old
    path's two torch statistics; cycling through `sets` of inputs so the L2 holds none of them."""
    it = itertools.cycle(sets)

    def cyc(fn):
        return lambda: fn(*next(it))

    b, n, h, _ = sets[0][0].shape
    mb = b * n * h * d * 2 / 1e6             # one of q, k, v in fp16, MB
    res = {"old_total": graph_time_us(cyc(old_quantize)),
           "old_k_mean": graph_time_us(cyc(lambda q, k, v: k.mean(dim=1))),
           "old_v_absmax": graph_time_us(cyc(lambda q, k, v: v.abs().amax(dim=1)))}
    best = {}
    for key in ("stats", "rot_q", "rot_k"):   # each swept with the others at their defaults
        ts = {}
        for cfg in SWEEP[key]:
            ts[cfg] = graph_time_us(cyc(lambda q, k, v, cfg=cfg, key=key: ia.quantize(q, k, v, **{key: cfg})))
            res[f"total_{key}_{cfg[0]}x{cfg[1]}w"] = round(ts[cfg], 1)
        best[key] = min(ts, key=ts.get)
    res["new_total_default"] = graph_time_us(cyc(ia.quantize))
    res["new_total_best"] = graph_time_us(cyc(lambda q, k, v: ia.quantize(q, k, v, **best)))
    res["best"] = {k: list(v) for k, v in best.items()}
    # bytes each must move: old reads K, V twice more and writes |V|; new reads K, V once for stats
    res["new_gbps"] = round((3 * mb + 2 * mb + 3 * mb / 2) / res["new_total_best"] * 1e3, 0)
    res["old_x_new"] = round(res["old_total"] / res["new_total_best"], 3)
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items()}


def main(argv: list[str]) -> dict:
    args = dict(a.split("=", 1) for a in argv)
    why = ia.unavailable()
    if why:
        raise SystemExit(f"the int8 attention cannot run here: {why}")
    gen = torch.Generator("cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in args.get("shapes", ",".join(SHAPES)).split(","):
        b, n, h, d = SHAPES[name]
        x = inputs(b, n, h, d, gen)
        row = {"shape": [b, n, h, d], **compare(ia.quantize(*x), old_quantize(*x))}
        xb = tuple(t.bfloat16() for t in x[:2]) + (x[2].bfloat16(),)
        row["bf16"] = compare(ia.quantize(*xb), old_quantize(*xb))
        row.update(timings([x, inputs(b, n, h, d, gen)], d))
        best = {k: tuple(v) for k, v in row["best"].items()}
        row["best_against_old"] = compare(ia.quantize(*x, **best), old_quantize(*x))
        res[name] = row
        print(name, json.dumps(row), flush=True)
        del x, xb
        torch.cuda.empty_cache()
    if args.get("out"):
        with open(args["out"], "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
