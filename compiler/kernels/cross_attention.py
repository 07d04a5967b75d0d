"""Cross-attention over short key sets (a text encoder's <= 128 tokens) as one Triton kernel.

Contract: `use_short_cross_attention(module) -> int` gives every fused cross-attention of `module`
(after `transforms.fuse_qkv`: `to_q` and one `to_kv`) a processor that, for CUDA half-precision
inputs with at most `MAX_KV` keys and either no mask or the additive key-padding bias diffusers'
DiTs pass (shape (N, 1, Skv), e.g. 0 / -10000), computes softmax(q k^T / sqrt(d) + bias) v with
`diffcompiler::short_cross_attention`, reading q from `to_q`'s (N, Sq, H*D) output and k, v in place
from `to_kv`'s (N, Skv, 2*H*D) output, and writing (N, Sq, H*D), the layout `to_out[0]` takes.
Every other call (CPU, fp32, longer key sets, other mask shapes, norms on q/k, ...; and, while
`MASKED_ONLY`, unmasked calls) takes diffusers' `FusedAttnProcessor2_0` unchanged. Returns how many
attentions got the processor.

Why: a DiT's cross-attention at 1024² is (batch 2 x 16 heads) x 4096 queries against 120 keys, head
dim 72, with the prompts' padding masked: 4.5 GFLOP and ~38 MB of q and output, ~12 us of HBM
traffic on an H100, against ~40 us in cuDNN (its masked path reads the bias as (N, H, 1, Skv)).
Here a program takes one head and `BLOCKS` blocks of queries against all (<= 128) keys: K, V and
the bias are loaded once, the scores tile stays in registers, the softmax is a single pass in fp32
(no running max / rescaling), and the q loads of the next block are pipelined. Measured (H100):
~33 us against cuDNN's ~42 us at that shape; the head dim is padded to one tile of 128.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

MAX_KV = 128     # most keys the kernel takes (one tile of the next power of two >= 16)
MAX_HEAD_DIM = 128
# Launch configuration: queries per block, warps, head-dim split (0: one padded tile, see
# `head_tiles`), query blocks per program, pipeline stages of their q loads. Chosen on an H100 at
# a 1024² DiT's shape (BENCHMARKS.md, "masked cross-attention kernel"). The split head dim (72 as
# 64 + 16) ran 1.3x faster there but triton 3.6 miscompiled it in other launch configurations
# (illegal memory accesses, wrong results): one padded tile only.
BLOCK_M, NUM_WARPS, SPLIT_HEAD_DIM, BLOCKS, STAGES = 64, 4, 0, 4, 2
# Unmasked calls keep SDPA: the kernel won only against cuDNN's masked path (unmasked, a video
# DiT's 32 x 1024 queries: 119 us against cuDNN's 104 us).
MASKED_ONLY = True


@functools.cache
def _triton_kernel():
    """Built on first use: CPU-only installs have no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def cross_attn_kernel(q, kv, bias, out, Sq, Skv, stride_qn, stride_qs, stride_kn, stride_ks,
                          stride_bn, stride_bk, stride_on, stride_os, qk_scale,
                          H: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                          BM: tl.constexpr, BKV: tl.constexpr, HAS_BIAS: tl.constexpr,
                          G: tl.constexpr, STAGES: tl.constexpr):
        # program (head h, G consecutive query blocks, sequence n): heads vary fastest, so the
        # programs that share rows run together and each q / output row is read / written whole.
        # K, V (and the bias) are loaded once per program; the q loads are pipelined over the blocks.
        h = tl.program_id(0)
        n = tl.program_id(2)
        j = tl.arange(0, BKV)
        j_ok = j < Skv
        k_base = kv + n * stride_kn + j[:, None] * stride_ks + h * D
        v_base = k_base + H * D
        d0 = tl.arange(0, D0)[None, :]
        c0_ok = d0 < D                                        # all true unless D0 pads the head dim
        k0t = tl.trans(tl.load(k_base + d0, mask=j_ok[:, None] & c0_ok, other=0.0))
        v0 = tl.load(v_base + d0, mask=j_ok[:, None] & c0_ok, other=0.0)
        if D1 > 0:   # the head dim's remainder (72 = 64 + 8 in a wider tile)
            d1 = D0 + tl.arange(0, D1)[None, :]
            c1_ok = d1 < D
            k1t = tl.trans(tl.load(k_base + d1, mask=j_ok[:, None] & c1_ok, other=0.0))
            v1 = tl.load(v_base + d1, mask=j_ok[:, None] & c1_ok, other=0.0)
        if HAS_BIAS:   # additive, in log2 units like the scores; padded keys -inf
            b = tl.load(bias + n * stride_bn + j * stride_bk, mask=j_ok, other=0.0).to(tl.float32)
            b = tl.where(j_ok, b * 1.4426950408889634, float("-inf"))
        else:
            b = tl.where(j_ok, 0.0, float("-inf"))
        for g in tl.range(0, G, num_stages=STAGES):
            m = (tl.program_id(1) * G + g) * BM + tl.arange(0, BM)
            m_ok = (m < Sq)[:, None]
            q_base = q + n * stride_qn + m[:, None] * stride_qs + h * D
            s = tl.dot(tl.load(q_base + d0, mask=m_ok & c0_ok, other=0.0), k0t)   # (BM, BKV) fp32
            if D1 > 0:
                s = tl.dot(tl.load(q_base + d1, mask=m_ok & c1_ok, other=0.0), k1t, s)
            s = s * qk_scale + b[None, :]                     # qk_scale: 1/sqrt(D) * log2(e)
            p = tl.exp2(s - tl.max(s, axis=1)[:, None])
            inv_l = 1.0 / tl.sum(p, axis=1)[:, None]
            pv = p.to(v0.dtype)
            o_base = out + n * stride_on + m[:, None] * stride_os + h * D
            tl.store(o_base + d0, (tl.dot(pv, v0) * inv_l).to(out.dtype.element_ty), mask=m_ok & c0_ok)
            if D1 > 0:
                tl.store(o_base + d1, (tl.dot(pv, v1) * inv_l).to(out.dtype.element_ty), mask=m_ok & c1_ok)

    return cross_attn_kernel


def head_tiles(d: int, split: int = 16) -> tuple[int, int]:
    """Head dim -> (first tile, second tile or 0). `split` 0: one tile, the next power of two
    (72 -> (128, 0)); else a power of two in one tile, otherwise the largest power of two below it
    plus a tile of at least `split` (>= 16, tl.dot's least) for the rest: 72 -> (64, 16)."""
    if d & (d - 1) == 0 or not split:
        return max(16, 1 << (d - 1).bit_length()), 0
    d0 = 1 << (d.bit_length() - 1)
    return d0, max(split, 16, 1 << (d - d0 - 1).bit_length())


def _reference(q: torch.Tensor, kv: torch.Tensor, bias: Optional[torch.Tensor], heads: int) -> torch.Tensor:
    n, sq, c = q.shape
    d = c // heads
    qh = q.view(n, sq, heads, d).transpose(1, 2)
    k, v = (t.view(n, -1, heads, d).transpose(1, 2) for t in kv.split(c, dim=-1))
    mask = None if bias is None else bias.view(bias.shape[0], 1, 1, bias.shape[-1]).to(q.dtype)
    o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask)
    return o.transpose(1, 2).reshape(n, sq, c)


def launch(q, kv, bias, heads: int, block_m: int = BLOCK_M, num_warps: int = NUM_WARPS,
           split: int = SPLIT_HEAD_DIM, blocks: int = BLOCKS, stages: int = STAGES) -> torch.Tensor:
    """The kernel on CUDA tensors (no checks beyond the layout); for tuning: `block_m` queries per
    block, `num_warps`, `split` (`head_tiles`), `blocks` query blocks per program, `stages` of
    pipelining of their q loads."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    n, sq, c = q.shape
    skv = kv.shape[1]
    d = c // heads
    d0, d1 = head_tiles(d, split)
    out = q.new_empty(n, sq, c)
    if bias is not None:
        bias = bias.expand(n, 1, skv)            # a batch of 1 broadcasts (stride 0)
        sb = (bias.stride(0), bias.stride(2))
    else:
        bias, sb = q, (0, 0)                     # never read (HAS_BIAS=False)
    blocks = max(1, min(blocks, _cdiv(sq, block_m)))
    grid = (heads, _cdiv(sq, block_m * blocks), n)
    _triton_kernel()[grid](q, kv, bias, out, sq, skv, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1),
                           sb[0], sb[1], out.stride(0), out.stride(1), 1.4426950408889634 / math.sqrt(d),
                           H=heads, D=d, D0=d0, D1=d1, BM=block_m, BKV=max(16, 1 << (skv - 1).bit_length()),
                           HAS_BIAS=bias is not q, G=blocks, STAGES=stages, num_warps=num_warps)
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
    """The additive key-padding bias the DiTs pass: floating, (N or 1, 1, Skv); or no mask, unless
    MASKED_ONLY."""
    if mask is None:
        return not MASKED_ONLY
    return (mask.is_floating_point() and mask.ndim == 3 and mask.shape[1] == 1 and mask.shape[2] == skv
            and mask.shape[0] in (1, n))


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
# python -m compiler.kernels.cross_attention [out=x.json] [sweep=64x4x0x4x2,...]: the kernel against SDPA (CUDA, dev tool)

SHAPES = {   # name: (batch incl. CFG, heads, queries, keys, head dim, key-padding mask)
    "dit1024_cross_masked": (2, 16, 4096, 120, 72, True),
    "dit512_cross_masked": (2, 16, 1024, 120, 72, True),
    "video512_spatial_cross": (32, 16, 1024, 120, 72, False),
    "unet768_cross_64": (2, 5, 9216, 77, 64, False),
    "unet768_cross_l3": (2, 20, 576, 77, 64, False),
}
# (BLOCK_M, warps, split, blocks per program, stages): single padded tiles only (the split head
# dim crashed triton 3.6 builds in some of these)
SWEEP = [(64, 4, 0, 4, 2), (64, 4, 0, 1, 1), (128, 4, 0, 1, 1), (128, 8, 0, 4, 2), (64, 4, 0, 8, 3)]


def graph_time_us(fn, reps: int = 20, inner: int = 10) -> float:
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


DEFAULT = (BLOCK_M, NUM_WARPS, SPLIT_HEAD_DIM, BLOCKS, STAGES)


def _name(cfg) -> str:
    return "bm{}_w{}_split{}_g{}_s{}".format(*cfg)


def probe(sweep=SWEEP) -> dict:
    """Per shape: SDPA (default dispatch, cuDNN first as `transforms.SDPA_PRIORITY`) on the fused
    projections' views with the mask as diffusers passes it (N, H, 1, Skv), and the kernel at each
    launch configuration of SWEEP; max abs error of each against fp32 math."""
    from torch.nn.attention import sdpa_kernel
    from ..transforms import sdpa_backends
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
        # the mask exactly as diffusers hands it to SDPA: prepare_attention_mask's (N*H, 1, Skv) as (N, H, 1, Skv)
        mask = None if bias is None else bias.repeat_interleave(h, dim=0).view(b, h, 1, lk)
        sdpa = lambda: F.scaled_dot_product_attention(qh, k, v, attn_mask=mask).transpose(1, 2).reshape(b, lq, h * d)
        with sdpa_kernel(sdpa_backends(), set_priority=True):
            row = {"sdpa_us": graph_time_us(sdpa), "sdpa_err": (sdpa().float() - ref).abs().max().item()}
        for cfg in sweep:
            f = lambda: launch(q, kv, bias, h, *cfg)
            row[f"kernel_{_name(cfg)}_us"] = graph_time_us(f)
            row[f"kernel_{_name(cfg)}_err"] = (f().float() - ref).abs().max().item()
        row["kernel_default_us"] = row.get(f"kernel_{_name(DEFAULT)}_us", float("nan"))
        row["hbm_bytes"] = 2 * q.numel() * 2 + kv.numel() * 2
        res[name] = {k2: round(v2, 5) if isinstance(v2, float) else v2 for k2, v2 in row.items()}
        print(name, res[name], flush=True)
    return res


if __name__ == "__main__":
    import json
    import sys
    # out=FILE, sweep=64x4x0x4x2,... (BLOCK_M x warps x split x blocks x stages)
    argv = dict(a.split("=", 1) for a in sys.argv[1:])
    out = argv.get("out")
    sweep = [tuple(map(int, c.split("x"))) for c in argv["sweep"].split(",")] if argv.get("sweep") else SWEEP
    r = probe(sweep)
    print(f"{'shape':28s} {'sdpa us':>8s} {'kernel us (default)':>20s}  best of the sweep")
    for name, row in r.items():
        best = min(sweep, key=lambda c: row[f"kernel_{_name(c)}_us"])
        print(f"{name:28s} {row['sdpa_us']:8.1f} {row['kernel_default_us']:20.1f}  "
              f"{_name(best)} {row[f'kernel_{_name(best)}_us']:.1f}")
    if out:
        json.dump(r, open(out, "w"), indent=1)
