"""FP8 (e4m3) against INT8 for Q K^T, emulated in float64 on the CPU: would an FP8 attention kernel
(FlashAttention-3's, cuDNN's) hold the int8-attention bound (cosine >= 0.999)?

    python3 benchmarks/fp8qk_emu.py [keys]        (default 16384 keys; ~10 s on 2 cores)

(from the checkout root, the project installed: it uses the kernel's own Hadamard matrix.)

Each arm takes q and k as `compiler.kernels.int8_attention` prepares them (rotated by a signed
Hadamard matrix, k's mean over tokens subtracted), rounds them to its format, and computes P V with
P and V in FP8 as the sm90 kernel does (P x 448 in e4m3, V scaled per channel); 256 query rows of
2 heads x 128 against exact attention. Inputs as `compiler.bench.attn8_probe`'s: Gaussian, K/Q
channel offsets, 4 channels 20x / 5x, and logits x4 ("sharp"). The softmax here takes the row's
global max (the kernel's running max is blockwise): the rounding of P is the same for both arms.
"""
import math
import sys

import torch

from compiler.kernels.int8_attention import signed_hadamard

F8 = torch.float8_e4m3fn


def inputs(h, n, d, kind, s=1.3):
    """q, k, v (h, n, d) in float64 of fp16 values, as attn8_probe's `_inputs` (on the CPU)."""
    qkv = torch.randn(n, 3, h, d)
    qkv[:, :2] *= s
    ch = torch.randperm(d)[:4]
    if kind == "offset":
        off = (20 + 30 * torch.rand(2, h, 4)) * s
        off *= torch.where(torch.rand(off.shape) < .5, -1., 1.)
        qkv[:, 0, :, ch] += 0.3 * off[0]
        qkv[:, 1, :, ch] += off[1]
    elif kind == "scaled":
        qkv[:, 0, :, ch] *= 5
        qkv[:, 1, :, ch] *= 20
    elif kind == "sharp":
        qkv[:, :2] *= 2
    qkv = qkv.half().double()
    return tuple(qkv[:, i].transpose(0, 1) for i in range(3))


def q8(x, group):
    """INT8, symmetric, one scale per `group` rows."""
    h, n, d = x.shape
    xg = x.reshape(h, n // group, group * d)
    s = xg.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xg / s).clamp(-127, 127) * s).reshape(h, n, d)


def f8(x, per):
    """E4M3 with one scale a head (per='head') or a token ('tok')."""
    amax = x.abs().amax((-2, -1), keepdim=True) if per == "head" else x.abs().amax(-1, keepdim=True)
    s = amax / 448
    return (x / s).float().to(F8).double() * s


def attn(q, k, v, qk):
    """q, k rotated and k smoothed as the kernel does, rounded by `qk`; P and V in FP8."""
    d = q.shape[-1]
    r = signed_hadamard(d, "cpu", torch.float64) / math.sqrt(d)
    q, k = q @ r, k @ r
    k = k - k.mean(1, keepdim=True)
    q, k = qk(q, "q"), qk(k, "k")
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    l = p.sum(-1, keepdim=True)
    vs = v.abs().amax(1, keepdim=True) / 448
    v = (v / vs).float().to(F8).double() * vs
    p = (p * 448).float().to(F8).double() / 448
    return (p @ v) / l


def ref(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v


def cos(a, b):
    a, b = a.flatten(), b.flatten()
    return float(a @ b / (a.norm() * b.norm()))


ARMS = {
    "int8 qk (q per 2 rows, k per 32)": lambda x, w: q8(x, 2 if w == "q" else 32),
    "fp8 qk per head": lambda x, w: f8(x, "head"),
    "fp8 qk per token": lambda x, w: f8(x, "tok"),
    "exact qk": lambda x, w: x,
}


def main(argv):
    torch.manual_seed(0)
    h, n, d, rows = 2, int(argv[0]) if argv else 16384, 128, 256    # heads, keys, head dim, query rows
    for kind in ("gauss", "offset", "scaled", "sharp"):
        q, k, v = inputs(h, n, d, kind)
        qr = q[:, torch.randperm(n)[:rows]]
        r = ref(qr, k, v)
        for name, fn in ARMS.items():
            o = attn(qr, k, v, fn)
            print(f"{kind:7} {name:34} cos {cos(o, r):.6f} relerr {float((o - r).norm() / r.norm()):.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
