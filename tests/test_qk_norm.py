"""`compiler.kernels.qk_norm` (q and k's RMS norm + rotary embedding in one Triton pass, used by the
int8-attention processor and AnyFlow's fused one): its reference against the modules' own
arithmetic (AnyFlow: diffusers' RMSNorm + `complex_rope`; Wan: torch's RMSNorm + `_rope`), the
Triton kernel itself under Triton's CPU interpreter, where the q/k/v functions take it and where
they keep their own path; the kernel at the published shapes on a GPU (`gpu`)."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

from compiler.kernels import int8_attention as ia
from compiler.kernels import qk_norm

gpu = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _anyflow_freqs(f=3, h=6, w=10, d=128):
    from diffusers.models.transformers.transformer_anyflow import AnyFlowRotaryPosEmbed
    return AnyFlowRotaryPosEmbed(d, (1, 2, 2), 64)(
        {"total_frames": f, "full_frame_shape": (h, w), "full_token_per_frame": h * w},
        torch.device("cpu"))                             # {"query", "key"}: (1, 1, N, D/2) complex128


def _wan_freqs(f=3, h=6, w=10, d=128):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
    x = torch.zeros(1, 16, f, 2 * h, 2 * w)
    return WanRotaryPosEmbed(d, (1, 2, 2), 64)(x)                      # 2 x (1, N, 1, D) fp32


def _norm(kind, c, dtype, gen):
    from diffusers.models.normalization import RMSNorm
    norm = RMSNorm(c, eps=1e-6) if kind == "anyflow" else torch.nn.RMSNorm(c, eps=1e-6)
    norm.weight.data = (1 + 0.3 * torch.randn(c, generator=gen)).to(dtype)
    return norm


def _modules_path(kind, norm, x, heads, rot):
    """What the processors computed before the fused pass: the module's norm, then the rotation."""
    h = norm(x).unflatten(2, (heads, -1))
    if kind == "anyflow":
        return ia.complex_rope(h, rot["query"].transpose(1, 2)).flatten(2)
    return ia._rope(h, *rot).flatten(2)


def _pairs(kind, rot):
    if kind == "anyflow":
        return torch.view_as_real(rot["query"])[0, 0].unbind(-1)       # 2 x (N, D/2) fp64
    return rot[0][0, :, 0, 0::2], rot[1][0, :, 0, 1::2]               # 2 x (N, D/2) fp32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["anyflow", "wan"])
def test_reference_is_the_modules_norm_then_rotation_bit_for_bit(kind, dtype):
    """On a slice of a fused QKV output (row stride 3C), 2 heads x 128: the reference equals the
    module's norm followed by the rotation exactly; leaving out the rotation or rounding at the
    other place (diffusers' RMSNorm rounds before its weight, torch's after) does not."""
    gen = torch.Generator().manual_seed(0)
    heads, c = 2, 256
    rot = {"anyflow": _anyflow_freqs, "wan": _wan_freqs}[kind]()
    n = 3 * 6 * 10
    qkv = (3 * torch.randn(2, n, 3 * c, generator=gen)).to(dtype)
    x = qkv[..., c:2 * c]                                              # k: a strided view
    norm = _norm(kind, c, dtype, gen)
    want = _modules_path(kind, norm, x, heads, rot)
    cs, sn = _pairs(kind, rot)
    got = qk_norm.reference(x, norm.weight, norm.eps, cs, sn, kind == "anyflow")
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)
    assert not torch.equal(qk_norm.reference(x, norm.weight, norm.eps, cs, 0 * sn, kind == "anyflow"), want)
    other = qk_norm.reference(x, norm.weight, norm.eps, cs, sn, kind != "anyflow")
    assert not torch.equal(other, want)


_INTERPRETED = r"""
import torch
from compiler.kernels import qk_norm
torch.manual_seed(0)
cases = ((1, 37, 3, 8, True, torch.float64), (2, 21, 4, 16, False, torch.float32),
         (1, 9, 6, 128, True, torch.float64), (3, 5, 5, 8, False, torch.float32))
for words, (b, n, heads, d, first, fdt) in [(w, c) for w in (2 ** 31, 1) for c in cases]:
    qk_norm.INT32_WORDS = words       # 1: every launch takes the int64-offset variant
    c = heads * d
    qkv = (3 * torch.randn(b, n, 3 * c)).half()
    x = qkv[..., c:2 * c]
    w = (1 + 0.3 * torch.randn(c)).half()
    ang = torch.rand(n, d // 2, dtype=fdt) * 6.28
    ref = qk_norm.reference(x, w, 1e-6, ang.cos(), ang.sin(), first)
    got = qk_norm._launch(x, w, 1e-6, ang.cos(), ang.sin(), first)
    assert got.shape == (b, n, c) and got.is_contiguous()
    err = (got.float() - ref.float()).abs()
    ulp = torch.finfo(torch.float16).eps * ref.float().abs().clamp_min(2 ** -14)
    print(b, n, c, first, err.max().item(), (err > 0).sum().item())
    assert (err <= ulp).all() and (err > 0).float().mean() < 0.01   # the row's sum in another order
print("ok")
"""


def test_the_triton_kernel_under_the_interpreter_equals_the_reference():
    """The kernel's indexing (pairs as words, heads not a power of two, batch and row strides, the
    two roundings) run by Triton's CPU interpreter on odd sizes, B = 1-3, fp64 and fp32 tables,
    with 32-bit and with 64-bit offsets: the reference's values but for a last-bit tie now and
    then (the row's sum in another order). Triton is a dependency on Linux: there a missing Triton
    fails the test."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Triton is a dependency on Linux only")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-2000:]


def _attention(kind, dtype):
    from diffusers.models.transformers.transformer_anyflow import AnyFlowAttention
    from diffusers.models.transformers.transformer_wan import WanAttention
    from compiler.transforms import fuse_qkv
    torch.manual_seed(0)
    attn = AnyFlowAttention(256, 2, 128) if kind == "anyflow" else WanAttention(256, 2, 128, eps=1e-6)
    attn = attn.to(dtype).eval()
    fuse_qkv(attn)
    return attn


@pytest.mark.parametrize("kind", ["anyflow", "wan"])
def test_the_q_k_v_functions_take_the_fused_pass_in_half_precision_only(kind, monkeypatch):
    """fp16: `fused_norm_rope` makes q and k (the op called twice), and q, k, v equal the modules'
    own path; fp32 (tiny CPU models), a LayerNorm for norm_k, a weight in another dtype, or Wan's
    rotary table in fp16 (a model cast whole: diffusers then rounds after every product) or fp64
    (its rotation then in fp64), or torch's RMSNorm before torch 2.7 (it rounded twice): the
    functions' own path, no op call."""
    calls, real = [], ia.qk_norm_rope
    monkeypatch.setattr(ia, "qk_norm_rope", lambda *a: calls.append(a) or real(*a))
    qkv_fn = ia._qkv_complex_rope if kind == "anyflow" else ia._qkv_cos_sin_rope
    rot = {"anyflow": _anyflow_freqs, "wan": _wan_freqs}[kind]()
    n = 3 * 6 * 10
    with torch.no_grad():
        attn = _attention(kind, torch.float16)
        h = torch.randn(1, n, 256, dtype=torch.float16)
        q, k, v = qkv_fn(attn, h, rot)
        assert len(calls) == 2 and q.shape == k.shape == v.shape == (1, n, 2, 128)
        monkeypatch.setattr(ia, "fused_norm_rope", lambda *a: None)
        q0, k0, v0 = qkv_fn(attn, h, rot)
        assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)
        monkeypatch.undo()
        monkeypatch.setattr(ia, "qk_norm_rope", lambda *a: calls.append(a) or real(*a))
        calls.clear()
        qkv_fn(_attention(kind, torch.float32), h.float(), rot)
        attn.norm_k = torch.nn.LayerNorm(256).half()
        qkv_fn(attn, h, rot)
        attn = _attention(kind, torch.float16)
        attn.norm_q.weight.data = attn.norm_q.weight.data.float()
        with warnings.catch_warnings():       # torch's rms_norm: "Mismatch dtype between input and weight"
            warnings.simplefilter("ignore")
            qkv_fn(attn, h, rot)
        if kind == "wan":           # AnyFlow's table is complex128 whatever the model's dtype
            qkv_fn(_attention(kind, torch.float16), h, tuple(t.half() for t in rot))
            qkv_fn(_attention(kind, torch.float16), h, tuple(t.double() for t in rot))  # _rope in fp64
            monkeypatch.setattr(ia, "TORCH_RMS_ROUNDS_ONCE", False)    # torch < 2.7's RMSNorm
            qkv_fn(_attention(kind, torch.float16), h, rot)
        assert calls == []


# ---------------------------------------------------------------------------------------------
# GPU: the kernel at the published shapes

SHAPES = {   # (batch, tokens, heads): 480x832 x 81 frames = 32,760 tokens; TI2V 704x1280 x 121 = 27,280
    "anyflow_1_3b": ("anyflow", 1, 32760, 12), "wan_1_3b_cfg": ("wan", 2, 32760, 12),
    "wan22_ti2v_5b": ("wan", 1, 27280, 24), "wan_14b": ("wan", 1, 32760, 40),
}


@gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_qk_norm_rope_kernel_matches_the_reference_at_the_published_shapes(shape, dtype):
    """The Triton pass against the reference (torch, the same arithmetic) on the GPU, x a strided
    slice of a fused QKV output with a few channels 20x larger: equal but for a last-bit tie now and
    then (the row's sum in another order); the reference without the rotation is far off."""
    kind, b, n, heads = SHAPES[shape]
    c, d = heads * 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, n, 3 * c, device="cuda", generator=gen)
    qkv[..., torch.randperm(c, device="cuda", generator=gen)[:8]] *= 20
    qkv = qkv.to(dtype)
    x = qkv[..., :c]
    w = (1 + 0.3 * torch.randn(c, device="cuda", generator=gen)).to(dtype)
    ang = torch.rand(n, d // 2, device="cuda", generator=gen, dtype=torch.float64) * 6.28
    cs, sn = (ang.cos(), ang.sin()) if kind == "anyflow" else (ang.cos().float(), ang.sin().float())
    first = kind == "anyflow"
    got = qk_norm.qk_norm_rope(x, w, 1e-6, cs, sn, first)
    want = qk_norm.reference(x, w, 1e-6, cs, sn, first)
    # a last-bit tie in the normalised pair (h[2i], h[2i+1]) moves the rotated value by up to
    # one ulp of |h[2i]| + |h[2i+1]|, not of the (possibly smaller) result
    h = qk_norm.reference(x, w, 1e-6, torch.ones_like(cs), torch.zeros_like(sn), first).float()
    pair = h.unflatten(-1, (-1, 2)).abs().sum(-1, keepdim=True).expand(*h.shape[:-1], -1, 2).flatten(-2)
    tol = torch.finfo(dtype).eps * (pair + want.float().abs()).clamp_min(2 ** -14)
    err = (got.float() - want.float()).abs()
    differ = float((err > 0).float().mean())
    print(f"{shape} {dtype}: max abs {err.max().item():.3g}, differing {differ:.2e}")
    assert (err <= tol).all() and differ < 1e-2
    assert ((h - want.float()).abs() > tol).float().mean() > 0.5     # the rotation is not a no-op
