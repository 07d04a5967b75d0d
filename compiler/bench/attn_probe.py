"""Time every SDPA backend at the attention shapes of PixArt, Latte and SD 2.1 (dev tool, CUDA).

    python -m compiler.bench.attn_probe [out=attn.json]

For each shape: which backend the dispatcher picks by default and under `transforms.SDPA_PRIORITY`,
and the time of each backend forced alone (None where it refuses the inputs). Inputs are made both
contiguous and as the strided views a fused QKV projection produces. This is what
`transforms.SDPA_PRIORITY` / `transforms.attention_backends` is chosen from.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..transforms import sdpa_backends

# name: (batch, heads, q_len, kv_len, head_dim, masked)
SHAPES = {
    "pixart1024_self": (2, 16, 4096, 4096, 72, False),
    "pixart1024_cross": (2, 16, 4096, 120, 72, True),
    "latte512_spatial_self": (32, 16, 1024, 1024, 72, False),
    "latte512_spatial_cross": (32, 16, 1024, 120, 72, False),
    "latte512_temporal_self": (2048, 16, 16, 16, 72, False),
    "sd768_self_64": (2, 5, 9216, 9216, 64, False),
    "sd768_cross_64": (2, 5, 9216, 77, 64, False),
    "sd768_self_l3": (2, 20, 576, 576, 64, False),
}
BACKENDS = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]


def time_ms(fn, iters=20):
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def make(b, h, lq, lk, d, masked, fused):
    dt, dev = torch.float16, "cuda"
    if fused:  # q, k, v as split views of one (b, l, 3*h*d) projection output, like FusedAttnProcessor2_0
        qkv = torch.randn(b, lq, 3 * h * d, device=dev, dtype=dt)
        q, k, v = (t.view(b, lq, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=-1))
        if lk != lq:
            kv = torch.randn(b, lk, 2 * h * d, device=dev, dtype=dt)
            k, v = (t.view(b, lk, h, d).transpose(1, 2) for t in kv.split(h * d, dim=-1))
    else:
        q = torch.randn(b, lq, h, d, device=dev, dtype=dt).transpose(1, 2)
        k = torch.randn(b, lk, h, d, device=dev, dtype=dt).transpose(1, 2)
        v = torch.randn(b, lk, h, d, device=dev, dtype=dt).transpose(1, 2)
    mask = torch.zeros(b, h, 1, lk, device=dev, dtype=dt) if masked else None
    return q, k, v, mask


def probe() -> dict:
    F = torch.nn.functional.scaled_dot_product_attention
    res = {}
    for name, (b, h, lq, lk, d, masked) in SHAPES.items():
        for fused in (False, True):
            q, k, v, m = make(b, h, lq, lk, d, masked, fused)
            row = {"default": time_ms(lambda: F(q, k, v, attn_mask=m))}
            with sdpa_kernel(sdpa_backends(), set_priority=True):
                row["priority"] = time_ms(lambda: F(q, k, v, attn_mask=m))
            for bk in BACKENDS:
                try:
                    with sdpa_kernel(getattr(SDPBackend, bk)):
                        row[bk] = time_ms(lambda: F(q, k, v, attn_mask=m))
                except RuntimeError:
                    row[bk] = None
            res[f"{name}{'_fusedviews' if fused else ''}"] = {k2: (round(v2, 4) if v2 else v2) for k2, v2 in row.items()}
            print(name, "fused" if fused else "contig", res[f"{name}{'_fusedviews' if fused else ''}"], flush=True)
    return res


if __name__ == "__main__":
    out = dict(a.split("=", 1) for a in sys.argv[1:]).get("out")
    r = probe()
    if out:
        json.dump(r, open(out, "w"), indent=1)
