"""Cross-attention over short key sets (a text encoder's <= 128 tokens) as one Triton kernel.

Contract: `use_short_cross_attention(module) -> int` gives every fused cross-attention of `module`
(after `transforms.fuse_qkv`: `to_q` and one `to_kv`) a processor that, for CUDA half-precision
inputs with at most `MAX_KV` keys and either no mask or the additive key-padding bias diffusers'
DiTs pass (shape (N, 1, Skv), e.g. 0 / -10000), computes softmax(q k^T / sqrt(d) + bias) v with
`diffcompiler::short_cross_attention`, reading q from `to_q`'s (N, Sq, H*D) output and k, v in place
from `to_kv`'s (N, Skv, 2*H*D) output, and writing (N, Sq, H*D), the layout `to_out[0]` takes.
Every other call (CPU, fp32, longer key sets, other mask shapes, norms on q/k, ...) takes diffusers'
`FusedAttnProcessor2_0` unchanged. Returns how many attentions got the processor.

Why: a DiT's cross-attention at 1024² is (batch 2 x 16 heads) x 4096 queries against 120 keys, head
dim 72: 4.5 GFLOP and ~38 MB of q and output, ~12 us of HBM traffic on an H100, against ~39 us in
cuDNN (tiles and pipelining sized for long key sequences, the mask read as a (N, H, 1, Skv) bias).
Here one program takes a block of queries of one head and all (<= 128) keys at once: the scores
tile stays in registers, the softmax is a single pass in fp32, no running max / rescaling. Head dims
that are not a power of two are split into two tiles (72 = 64 + 16, the second one masked), so the
padded work is 80 columns, not 128.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

MAX_KV = 128     # most keys the kernel takes (one tile of the next power of two >= 16)
MAX_HEAD_DIM = 128
# Launch configuration: queries per program, warps. Chosen on an H100 at a 1024² DiT's shape
# (`python -m compiler.cross_attention`, BENCHMARKS.md "masked cross-attention kernel").
BLOCK_M, NUM_WARPS = 128, 8


@functools.cache
def _triton_kernel():
    """Built on first use: CPU-only installs have no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def cross_attn_kernel(q, kv, bias, out, Sq, Skv, stride_qn, stride_qs, stride_kn, stride_ks,
                          stride_bn, stride_bk, stride_on, stride_os, qk_scale,
                          H: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                          BM: tl.constexpr, BKV: tl.constexpr, HAS_BIAS: tl.constexpr):
        # program (head h, query block, sequence n): heads vary fastest, so the 16 programs that
        # share a block of rows run together and each q / output row is read / written whole.
        h = tl.program_id(0)
        n = tl.program_id(2)
        m = tl.program_id(1) * BM + tl.arange(0, BM)
        j = tl.arange(0, BKV)
        m_ok = (m < Sq)[:, None]
        j_ok = j < Skv
        q_base = q + n * stride_qn + m[:, None] * stride_qs + h * D
        k_base = kv + n * stride_kn + j[:, None] * stride_ks + h * D
        v_base = k_base + H * D
        d0 = tl.arange(0, D0)[None, :]
        k0 = tl.load(k_base + d0, mask=j_ok[:, None], other=0.0)
        q0 = tl.load(q_base + d0, mask=m_ok, other=0.0)
        s = tl.dot(q0, tl.trans(k0))                                           # (BM, BKV) fp32
        if D1 > 0:   # the head dim's remainder (72 = 64 + 8 of a 16-wide tile)
            d1 = D0 + tl.arange(0, D1)[None, :]
            k1 = tl.load(k_base + d1, mask=j_ok[:, None] & (d1 < D), other=0.0)
            q1 = tl.load(q_base + d1, mask=m_ok & (d1 < D), other=0.0)
            s = tl.dot(q1, tl.trans(k1), s)
        s = s * qk_scale                                      # 1/sqrt(D) * log2(e): exp2 below
        if HAS_BIAS:
            b = tl.load(bias + n * stride_bn + j * stride_bk, mask=j_ok, other=0.0).to(tl.float32)
            s = s + b[None, :] * 1.4426950408889634
        s = tl.where(j_ok[None, :], s, float("-inf"))
        p = tl.exp2(s - tl.max(s, axis=1)[:, None])
        inv_l = 1.0 / tl.sum(p, axis=1)[:, None]
        o_base = out + n * stride_on + m[:, None] * stride_os + h * D
        v0 = tl.load(v_base + d0, mask=j_ok[:, None], other=0.0)
        pv = p.to(v0.dtype)
        o0 = tl.dot(pv, v0) * inv_l
        tl.store(o_base + d0, o0.to(out.dtype.element_ty), mask=m_ok)
        if D1 > 0:
            v1 = tl.load(v_base + d1, mask=j_ok[:, None] & (d1 < D), other=0.0)
            o1 = tl.dot(pv, v1) * inv_l
            tl.store(o_base + d1, o1.to(out.dtype.element_ty), mask=m_ok & (d1 < D))

    return cross_attn_kernel


def head_tiles(d: int) -> tuple[int, int]:
    """Head dim -> (first tile, second tile or 0): a power of two in one tile, else the largest
    power of two below it plus a tile (>= 16, tl.dot's least) for the rest: 72 -> (64, 16)."""
    if d & (d - 1) == 0:
        return max(16, d), 0
    d0 = 1 << (d.bit_length() - 1)
    return d0, max(16, 1 << (d - d0 - 1).bit_length())


def _reference(q: torch.Tensor, kv: torch.Tensor, bias: Optional[torch.Tensor], heads: int) -> torch.Tensor:
    n, sq, c = q.shape
    d = c // heads
    qh = q.view(n, sq, heads, d).transpose(1, 2)
    k, v = (t.view(n, -1, heads, d).transpose(1, 2) for t in kv.split(c, dim=-1))
    mask = None if bias is None else bias.view(bias.shape[0], 1, 1, bias.shape[-1]).to(q.dtype)
    o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask)
    return o.transpose(1, 2).reshape(n, sq, c)


def launch(q, kv, bias, heads: int, block_m: int = BLOCK_M, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The kernel on CUDA tensors (no checks beyond the layout); `block_m` / `num_warps` for tuning."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    n, sq, c = q.shape
    skv = kv.shape[1]
    d = c // heads
    d0, d1 = head_tiles(d)
    out = q.new_empty(n, sq, c)
    if bias is not None:
        bias = bias.expand(n, 1, skv)            # a batch of 1 broadcasts (stride 0)
        sb = (bias.stride(0), bias.stride(2))
    else:
        bias, sb = q, (0, 0)                     # never read (HAS_BIAS=False)
    grid = (heads, _cdiv(sq, block_m), n)
    _triton_kernel()[grid](q, kv, bias, out, sq, skv, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1),
                           sb[0], sb[1], out.stride(0), out.stride(1), 1.4426950408889634 / math.sqrt(d),
                           H=heads, D=d, D0=d0, D1=d1, BM=block_m, BKV=max(16, 1 << (skv - 1).bit_length()),
                           HAS_BIAS=bias is not q, num_warps=num_warps)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.custom_op("diffcompiler::short_cross_attention", mutates_args=())
def short_cross_attention(q: torch.Tensor, kv: torch.Tensor, bias: Optional[torch.Tensor], heads: int) -> torch.Tensor:
    """q (N, Sq, H*D), kv (N, Skv, 2*H*D) (k then v, as `to_kv` writes them), bias None or (N or 1,
    1, Skv) added to the scores -> (N, Sq, H*D) attention output, scale 1/sqrt(D)."""
    if not q.is_cuda:
        return _reference(q, kv, bias, heads)
    return launch(q, kv, bias, heads)


@short_cross_attention.register_fake
def _(q, kv, bias, heads):
    return q.new_empty(q.shape)


def _mask_fits(mask, n: int, skv: int) -> bool:
    """No mask, or the additive key-padding bias the DiTs pass: floating, (N or 1, 1, Skv)."""
    return mask is None or (mask.is_floating_point() and mask.ndim == 3 and mask.shape[1] == 1
                            and mask.shape[2] == skv and mask.shape[0] in (1, n))


class ShortKVCrossAttnProcessor:
    """Fused cross-attention over short CUDA key sets through `short_cross_attention`; anything
    else goes to diffusers' `FusedAttnProcessor2_0`. Chosen per call shape (static under Dynamo)."""

    def __init__(self):
        from diffusers.models.attention_processor import FusedAttnProcessor2_0
        self.fallback = FusedAttnProcessor2_0()

    @staticmethod
    def fits(attn, hidden_states, encoder_hidden_states, attention_mask) -> bool:
        if encoder_hidden_states is None or hidden_states.ndim != 3 or encoder_hidden_states.ndim != 3:
            return False
        n, skv = encoder_hidden_states.shape[:2]
        d = attn.inner_dim // attn.heads
        return (hidden_states.is_cuda and hidden_states.dtype in (torch.float16, torch.bfloat16)
                and encoder_hidden_states.dtype == hidden_states.dtype  # fp32 keeps exact SDPA
                and hidden_states.shape[0] == n and skv <= MAX_KV
                and attn.inner_dim == attn.inner_kv_dim and attn.inner_dim % attn.heads == 0
                and 16 <= d <= MAX_HEAD_DIM and _mask_fits(attention_mask, n, skv)
                and attn.norm_cross is None and attn.spatial_norm is None and attn.group_norm is None
                and attn.norm_q is None and attn.norm_k is None and not attn.residual_connection
                and attn.rescale_output_factor == 1.0)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        if not args and not kwargs and self.fits(attn, hidden_states, encoder_hidden_states, attention_mask):
            out = short_cross_attention(attn.to_q(hidden_states), attn.to_kv(encoder_hidden_states),
                                        attention_mask, attn.heads)
            return attn.to_out[1](attn.to_out[0](out))
        return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)


def use_short_cross_attention(module: torch.nn.Module) -> int:
    """Give every fused cross-attention in `module` the short-key-set processor (one shared
    instance, so Dynamo sees the same object in every block)."""
    from diffusers.models.attention_processor import Attention
    proc, n = ShortKVCrossAttnProcessor(), 0
    for attn in module.modules():
        if isinstance(attn, Attention) and hasattr(attn, "to_kv") and attn.is_cross_attention:
            attn.set_processor(proc)
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# python -m compiler.cross_attention [out=x.json]: the kernel against SDPA (CUDA, dev tool)

SHAPES = {   # name: (batch incl. CFG, heads, queries, keys, head dim, key-padding mask)
    "dit1024_cross_masked": (2, 16, 4096, 120, 72, True),
    "dit512_cross_masked": (2, 16, 1024, 120, 72, True),
    "video512_spatial_cross": (32, 16, 1024, 120, 72, False),
    "unet768_cross_64": (2, 5, 9216, 77, 64, False),
    "unet768_cross_l3": (2, 20, 576, 77, 64, False),
}
SWEEP = [(64, 4), (64, 8), (128, 4), (128, 8), (256, 8)]


def _graph_time_us(fn, reps: int = 20, inner: int = 10) -> float:
    """Median over `reps` CUDA-graph replays of `inner` back-to-back calls, per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / inner)
    return sorted(ts)[len(ts) // 2]


def probe() -> dict:
    """Per shape: SDPA (default dispatch, cuDNN first as `transforms.SDPA_PRIORITY`) on the fused
    projections' views with the mask as diffusers passes it (N, H, 1, Skv), and the kernel at each
    launch configuration of SWEEP; max abs error of each against fp32 math."""
    from torch.nn.attention import sdpa_kernel
    from .transforms import sdpa_backends
    res = {}
    for name, (b, h, lq, lk, d, masked) in SHAPES.items():
        g = torch.Generator("cuda").manual_seed(0)
        q = torch.randn(b, lq, h * d, device="cuda", dtype=torch.float16, generator=g)
        kv = torch.randn(b, lk, 2 * h * d, device="cuda", dtype=torch.float16, generator=g)
        bias = None
        if masked:   # the first 20..lk-1 keys valid, the rest padding, as a DiT pipeline pads prompts
            valid = torch.arange(lk, device="cuda")[None, :] < torch.tensor([[20], [lk - 7]], device="cuda")[:b]
            bias = ((1 - valid.to(torch.float16)) * -10000.0).unsqueeze(1)      # (N, 1, Skv)
        ref = _reference(q.float(), kv.float(), bias, h)
        qh = q.view(b, lq, h, d).transpose(1, 2)
        k, v = (t.view(b, lk, h, d).transpose(1, 2) for t in kv.split(h * d, dim=-1))
        mask = None if bias is None else bias[:, None].expand(b, h, 1, lk)      # as prepare_attention_mask
        sdpa = lambda: F.scaled_dot_product_attention(qh, k, v, attn_mask=mask).transpose(1, 2).reshape(b, lq, h * d)
        with sdpa_kernel(sdpa_backends(), set_priority=True):
            row = {"sdpa_us": _graph_time_us(sdpa), "sdpa_err": (sdpa().float() - ref).abs().max().item()}
        for bm, w in SWEEP:
            f = lambda: launch(q, kv, bias, h, bm, w)
            row[f"kernel_bm{bm}_w{w}_us"] = _graph_time_us(f)
            row[f"kernel_bm{bm}_w{w}_err"] = (f().float() - ref).abs().max().item()
        row["kernel_default_us"] = row[f"kernel_bm{BLOCK_M}_w{NUM_WARPS}_us"]
        row["hbm_bytes"] = 2 * q.numel() * 2 + kv.numel() * 2
        res[name] = {k2: round(v2, 5) if isinstance(v2, float) else v2 for k2, v2 in row.items()}
        print(name, res[name], flush=True)
    return res


if __name__ == "__main__":
    import json
    import sys
    out = dict(a.split("=", 1) for a in sys.argv[1:]).get("out")
    r = probe()
    print(f"{'shape':28s} {'sdpa us':>8s} {'kernel us':>9s} {'best (bm, warps)':>18s}")
    for name, row in r.items():
        best = min(SWEEP, key=lambda c: row[f"kernel_bm{c[0]}_w{c[1]}_us"])
        print(f"{name:28s} {row['sdpa_us']:8.1f} {row['kernel_default_us']:9.1f} "
              f"{str(best):>12s} {row[f'kernel_bm{best[0]}_w{best[1]}_us']:.1f}")
    if out:
        json.dump(r, open(out, "w"), indent=1)
