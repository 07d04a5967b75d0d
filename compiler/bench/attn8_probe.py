"""Time and check `compiler.kernels.int8_attention.attention8` against cuDNN SDPA (dev tool, CUDA, sm90).

    python -m compiler.bench.attn8_probe [shapes=wan21_81f,...] [capture=1] [out=attn8.json]

Per shape (batch, heads, tokens, head dim): the median time of cuDNN SDPA (fp16 and bf16),
SageAttention's sm90 call alone (`sage`, its quantisation included) and `attention8` (the same with
Q and K rotated), as ms and as TFLOP/s-equivalent (4 B H N^2 D / t); then the output's cosine
against cuDNN fp16 and its relative error against an fp32 reference (256 random query rows) on
three inputs: Gaussian, Q/K with constant offsets of 20-50x the std on 4 channels (`offset`), and
4 channels of Q/K 5x/20x larger (`scaled`). `capture=1` adds q, k, v captured from three
self-attentions of Wan 2.1 1.3B at full size (random weights, 480x832 x 81 frames).
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels.int8_attention import HEAD_DIMS, attention8, unavailable

# name: (batch, heads, tokens, head dim)
SHAPES = {
    "t2v_1_3b_81f": (2, 12, 32760, 128),     # Wan 2.1 1.3B, 480x832 x 81: 21 x 30 x 52 tokens, the CFG pair
    "ti2v_5b_121f": (2, 24, 27280, 128),    # Wan 2.2 TI2V-5B, 704x1280 x 121: 31 x 22 x 40
    "t2v_14b_81f": (2, 40, 32760, 128),     # Wan 2.1 14B / I2V 14B at 480P
    "latte_spatial": (32, 16, 1024, 72),  # Latte-1 512^2: head dim 72, upstream Sage only (too short)
    "tok8k": (1, 12, 8192, 128), "tok12k": (1, 12, 12288, 128), "tok16k": (1, 12, 16384, 128),
    "tok24k": (1, 12, 24576, 128), "odd": (1, 12, 16411, 128),
}


def _bench(fn) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def _inputs(b, h, n, d, kind, gen, dt=torch.float16, s=1.3):
    """q, k, v as (b, n, h, d) views of one fused projection (b, n, 3, h, d), as in the models."""
    qkv = torch.randn(b, n, 3, h, d, device="cuda", generator=gen)
    qkv[:, :, :2] *= s
    ch = torch.randperm(d, device="cuda", generator=gen)[:4]
    if kind == "offset":    # constant offsets of 20-50x the std on 4 channels (K), 6-15x (Q)
        off = (20 + 30 * torch.rand(2, h, 4, device="cuda", generator=gen)) * s
        off *= torch.where(torch.rand(off.shape, device="cuda", generator=gen) < 0.5, -1.0, 1.0)
        qkv[:, :, 0, :, ch] += 0.3 * off[0]
        qkv[:, :, 1, :, ch] += off[1]
    elif kind == "scaled":  # 4 channels 5x (Q) and 20x (K) larger, varying per token
        qkv[:, :, 0, :, ch] *= 5
        qkv[:, :, 1, :, ch] *= 20
    qkv = qkv.to(dt)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def cudnn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2)


def sage():
    """Upstream SageAttention 2's own sm90 call (its quantisation, no rotation), where installed."""
    try:
        from sageattention.core import SM90_ENABLED, sageattn_qk_int8_pv_fp8_cuda_sm90
    except ImportError:
        return None
    return (lambda q, k, v: sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="NHD",
                                                            pv_accum_dtype="fp32+fp32")) if SM90_ENABLED else None


def graph_replay_error(b=1, h=12, n=32760, d=128) -> float:
    """attention8 captured in a CUDA graph, replayed on new inputs copied into the captured ones:
    max |replay - direct call| (0 when every launch went into the graph)."""
    gen = torch.Generator("cuda").manual_seed(1)
    q, k, v = (t.contiguous() for t in _inputs(b, h, n, d, "gauss", gen))
    attention8(q, k, v)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attention8(q, k, v)   # warm-up on the side stream, as torch.cuda.graph asks
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            out = attention8(q, k, v)
    for t, new in zip((q, k, v), _inputs(b, h, n, d, "offset", gen)):
        t.copy_(new)
    g.replay()
    torch.cuda.synchronize()
    return float((out.float() - attention8(q, k, v).float()).abs().max())


def _reference(q, k, v, rows):
    """fp32 attention of the query rows `rows`: (b, len(rows), h, d)."""
    qs, kk, vv = (t.float().transpose(1, 2) for t in (q[:, rows], k, v))
    outs = [torch.softmax(qs[:, i] @ kk[:, i].transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ vv[:, i]
            for i in range(qs.shape[1])]
    return torch.stack(outs, 1).transpose(1, 2)


def _cos(a, b):
    a, b = a.float().flatten(), b.float().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def accuracy(q, k, v, gen, prefix="") -> dict:
    rows = torch.randperm(q.shape[1], device="cuda", generator=gen)[:256]
    ref, o16 = _reference(q, k, v, rows), cudnn(q, k, v)[:, rows]
    row = {f"{prefix}relerr_fp16": float((o16.float() - ref).norm() / ref.norm())}
    for name, fn in (("sage", sage()), ("attn8", attention8 if q.shape[-1] in HEAD_DIMS else None)):
        if fn is None:
            continue
        o = fn(q, k, v)[:, rows]
        row[f"{prefix}cos_{name}"] = round(_cos(o, o16), 6)
        row[f"{prefix}relerr_{name}"] = round(float((o.float() - ref).norm() / ref.norm()), 5)
        row[f"{prefix}finite_{name}"] = bool(torch.isfinite(o).all())
    return row


def speed(q, k, v) -> dict:
    b, n, h, d = q.shape
    flops = 4 * b * h * n * n * d
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    row = {}
    for name, fn in (("cudnn_fp16", lambda: cudnn(q, k, v)), ("cudnn_bf16", lambda: cudnn(qb, kb, vb)),
                     ("sage", sage()), ("attn8", (lambda: attention8(q, k, v)) if d in HEAD_DIMS else None)):
        if name == "sage":
            fn = (lambda f=fn: f(q, k, v)) if fn else None
        if fn is None:
            continue
        ms = _bench(fn)
        row[f"{name}_ms"], row[f"{name}_tflops"] = round(ms, 3), round(flops / ms / 1e9, 1)
    for name in ("sage", "attn8"):
        if f"{name}_ms" in row:
            row[f"{name}_x_cudnn"] = round(row["cudnn_fp16_ms"] / row[f"{name}_ms"], 3)
    return row


def captured(n_frames=81, blocks=(0, 15, 29)) -> dict[str, tuple]:
    """q, k, v entering three self-attentions of Wan 2.1 1.3B (random weights, full size, one
    forward at 480x832 x `n_frames`, timestep 500, random text embeddings)."""
    from diffusers import WanTransformer3DModel
    from ..kernels.int8_attention import self_attention_qkv
    cfg = dict(patch_size=[1, 2, 2], attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, cross_attn_norm=True, eps=1e-6, qk_norm="rms_norm_across_heads",
               num_attention_heads=12, ffn_dim=8960, num_layers=30, rope_max_seq_len=1024)
    with torch.device("cuda"):
        model = WanTransformer3DModel(**cfg).half().eval()
    got = {}
    for i in blocks:
        attn = model.blocks[i].attn1
        fallback = attn.processor

        def capture(attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                    i=i, fallback=fallback):
            got[f"wan13b_block{i}"] = self_attention_qkv(attn, hidden_states, rotary_emb)
            return fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        attn.processor = capture
    x = torch.randn(1, 16, (n_frames - 1) // 4 + 1, 60, 104, device="cuda", dtype=torch.half)
    ctx = torch.randn(1, 512, 4096, device="cuda", dtype=torch.half)
    with torch.no_grad():
        model(x, torch.tensor([500], device="cuda"), ctx)
    del model
    return got


def main(argv: list[str]) -> dict:
    args = dict(a.split("=", 1) for a in argv)
    why = unavailable()
    if why:
        raise SystemExit(f"attention8 cannot run here: {why}")
    gen = torch.Generator("cuda").manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "graph_replay_max_abs_error": graph_replay_error()}
    print("CUDA graph replay vs direct call, max abs error:", res["graph_replay_max_abs_error"], flush=True)
    for name in args.get("shapes", ",".join(SHAPES)).split(","):
        b, h, n, d = SHAPES[name]
        row = {"shape": [b, h, n, d], **speed(*_inputs(b, h, n, d, "gauss", gen))}
        if b * h * n <= 40 * 32760 * 2 and not name.startswith("tok"):
            for kind in ("gauss", "offset", "scaled"):
                row.update(accuracy(*_inputs(b, h, n, d, kind, gen), gen, prefix=f"{kind}_"))
        res[name] = row
        print(name, json.dumps(row), flush=True)
    if args.get("capture") == "1":
        for name, (q, k, v) in captured().items():
            res[name] = accuracy(q, k, v, gen)
            print(name, json.dumps(res[name]), flush=True)
    if args.get("out"):
        with open(args["out"], "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n{'shape':14} {'cudnn ms':>9} {'sage ms':>8} {'attn8 ms':>9} {'TF/s':>6} {'x cudnn':>7} "
          f"{'cos gauss':>9} {'cos offset':>10} {'cos scaled':>10}")
    for name, r in res.items():
        if isinstance(r, dict) and "cudnn_fp16_ms" in r:
            print(f"{name:14} {r['cudnn_fp16_ms']:9} {r.get('sage_ms', '-'):8} {r.get('attn8_ms', '-'):9} {r.get('attn8_tflops', '-'):6} "
                  f"{r.get('attn8_x_cudnn', r.get('sage_x_cudnn')):7} {r.get('gauss_cos_attn8', ''):>9} {r.get('offset_cos_attn8', ''):>10} "
                  f"{r.get('scaled_cos_attn8', ''):>10}")
        elif isinstance(r, dict) and "cos_attn8" in r:
            print(f"{name:14} captured: cos attn8 {r['cos_attn8']}, sage {r.get('cos_sage')}; relerr attn8 "
                  f"{r['relerr_attn8']}, fp16 {r['relerr_fp16']:.5f}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
