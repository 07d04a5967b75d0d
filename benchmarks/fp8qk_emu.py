"""FP8 (e4m3) against INT8 for Q K^T, emulated in float64 on the CPU: would an FP8 attention kernel
(FlashAttention-3's, cuDNN's) hold the int8-attention bound (cosine >= 0.999)?

    python3 benchmarks/fp8qk_emu.py [keys]        (default 16384 keys; ~10 s on 2 cores)

Each arm takes q and k as `compiler.kernels.int8_attention` prepares them (rotated by a signed
Hadamard matrix, k's mean over tokens subtracted), rounds them to its format, and computes P V with
P and V in FP8 as the sm90 kernel does (P x 448 in e4m3, V scaled per channel); 256 query rows of
2 heads x 128 against exact attention. Inputs as `compiler.bench.attn8_probe`'s: Gaussian, K/Q
channel offsets, 4 channels 20x / 5x, and logits x4 ("sharp"). The softmax here takes the row's
global max (the kernel's running max is blockwise): the rounding of P is the same for both arms.
"""
import math, torch, sys
torch.manual_seed(0)
F8 = torch.float8_e4m3fn
def had(d):
    h = torch.ones(1, 1)
    while h.shape[0] < d: h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(0)
    s = torch.where(torch.rand(d, generator=g) < .5, -1., 1.)
    return (s[:, None] * h) / math.sqrt(d)
def inputs(h, n, d, kind, s=1.3):
    qkv = torch.randn(n, 3, h, d); qkv[:, :2] *= s
    ch = torch.randperm(d)[:4]
    if kind == "offset":
        off = (20 + 30 * torch.rand(2, h, 4)) * s
        off *= torch.where(torch.rand(off.shape) < .5, -1., 1.)
        qkv[:, 0, :, ch] += 0.3 * off[0]; qkv[:, 1, :, ch] += off[1]
    elif kind == "scaled":
        qkv[:, 0, :, ch] *= 5; qkv[:, 1, :, ch] *= 20
    elif kind == "sharp":
        qkv[:, :2] *= 2
    qkv = qkv.half().double()
    return qkv[:, 0].transpose(0, 1), qkv[:, 1].transpose(0, 1), qkv[:, 2].transpose(0, 1)  # (h, n, d)
def q8(x, group):  # int8 symmetric per group of rows
    h, n, d = x.shape
    xg = x.reshape(h, n // group, group * d) if group else x
    s = xg.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xg / s).clamp(-127, 127) * s).reshape(h, n, d)
def f8(x, per):  # e4m3 with one scale per head (per='head') or per token ('tok')
    s = (x.abs().amax((-2, -1), keepdim=True) if per == "head" else x.abs().amax(-1, keepdim=True)) / 448
    return (x / s).float().to(F8).double() * s
def attn(q, k, v, qk, pv):
    d = q.shape[-1]; R = had(d).double()
    q, k = q @ R, k @ R
    k = k - k.mean(1, keepdim=True)
    q, k = qk(q, "q"), qk(k, "k")
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    m = s.amax(-1, keepdim=True); p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    if pv:
        vs = v.abs().amax(1, keepdim=True) / 448
        v = (v / vs).float().to(F8).double() * vs
        p = (p * 448).float().to(F8).double() / 448
    return (p @ v) / l
def ref(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
def cos(a, b): a, b = a.flatten(), b.flatten(); return float(a @ b / (a.norm() * b.norm()))
h, n, d, rows = 2, int(sys.argv[1]) if len(sys.argv) > 1 else 16384, 128, 256    # heads, keys, head dim, query rows
arms = {
 "int8 qk (q per 2 rows, k per 32)": lambda x, w: q8(x, 2 if w == "q" else 32),
 "fp8 qk per head": lambda x, w: f8(x, "head"),
 "fp8 qk per token": lambda x, w: f8(x, "tok"),
 "exact qk": lambda x, w: x,
}
for kind in ("gauss", "offset", "scaled", "sharp"):
    q, k, v = inputs(h, n, d, kind)
    qr = q[:, torch.randperm(n)[:rows]]
    r = ref(qr, k, v)
    for name, fn in arms.items():
        o = attn(qr, k, v, fn, True)
        print(f"{kind:7} {name:34} cos {cos(o, r):.6f} relerr {float((o-r).norm()/r.norm()):.4f}", flush=True)
