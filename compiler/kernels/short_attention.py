"""Self-attention over short sequences (Latte's temporal attention: 16 frames) as one Triton kernel.

Contract: `use_short_attention(module) -> int` gives every fused self-attention of `module` (after
`transforms.fuse_qkv`) a processor that, for CUDA inputs of at most `MAX_SEQ` tokens and no mask,
computes softmax(q k^T / sqrt(d)) v straight from the fused QKV projection's output with
`diffcompiler::short_attention`; every other call (long sequences, masks, CPU) takes diffusers'
`FusedAttnProcessor2_0` unchanged. Half precision only: fp32 calls keep SDPA. Returns how many attentions got the processor.

Why: Latte's temporal attention is (2 x 1024 patches) x 16 heads independent 16 x 16 problems with
head dim 72. Its q, k, v and output are 4 x 75 MB at 512x512 (batch 2): ~0.1 ms of HBM traffic on an
H100, but cuDNN/flash take 0.68/0.60 ms per call (tiles sized for long sequences, plus the transposes
to and from (batch, heads, seq, dim)), 28 calls per step. This kernel reads q, k, v in place from
the (N, S, 3*H*D) projection and writes (N, S, H*D), the layout the output projection takes.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

MAX_SEQ = 64     # longest sequence the kernel takes (tile is the next power of two >= 16)

@functools.cache
def _triton_kernel():
    """Built on first use: CPU-only installs have no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def short_attn_kernel(qkv, out, stride_qn, stride_qs, stride_on, stride_os, S, scale,
                          H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
        # one program per (sequence n, head h): q, k, v tiles of (BS, BD), S <= BS, D <= BD
        n = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BS)
        d = tl.arange(0, BD)
        ld_mask = (s[:, None] < S) & (d[None, :] < D)
        base = qkv + n * stride_qn + s[:, None] * stride_qs + h * D + d[None, :]
        q = tl.load(base, mask=ld_mask, other=0.0)
        k = tl.load(base + H * D, mask=ld_mask, other=0.0)
        v = tl.load(base + 2 * H * D, mask=ld_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale                                  # (BS, BS) fp32
        scores = tl.where(s[None, :] < S, scores, float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        o = tl.dot(p.to(v.dtype), v)                                              # (BS, BD) fp32
        tl.store(out + n * stride_on + s[:, None] * stride_os + h * D + d[None, :],
                 o.to(out.dtype.element_ty), mask=ld_mask)

    return short_attn_kernel


def _reference(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    n, s, c3 = qkv.shape
    d = c3 // 3 // heads
    q, k, v = qkv.view(n, s, 3, heads, d).permute(2, 0, 3, 1, 4)                 # 3 x (N, H, S, D)
    o = F.scaled_dot_product_attention(q, k, v)
    return o.transpose(1, 2).reshape(n, s, heads * d)


@torch.library.custom_op("diffcompiler::short_attention", mutates_args=())
def short_attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """(N, S, 3*H*D) fused projection output -> (N, S, H*D) attention output, scale 1/sqrt(D)."""
    if not qkv.is_cuda:
        return _reference(qkv, heads)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    n, s, c3 = qkv.shape
    d = c3 // 3 // heads
    out = qkv.new_empty(n, s, heads * d)
    bs = max(16, 1 << (s - 1).bit_length())
    bd = max(16, 1 << (d - 1).bit_length())
    _triton_kernel()[(n, heads)](qkv, out, qkv.stride(0), qkv.stride(1), out.stride(0), out.stride(1),
                                 s, 1.0 / math.sqrt(d), H=heads, D=d, BS=bs, BD=bd,
                                 num_warps=4 if bd > 64 else 2)
    return out


@short_attention.register_fake
def _(qkv, heads):
    n, s, c3 = qkv.shape
    return qkv.new_empty(n, s, c3 // 3)


class ShortSeqAttnProcessor:
    """Fused self-attention on short CUDA sequences through `short_attention`; anything else goes
    to diffusers' `FusedAttnProcessor2_0`. The choice is made per call shape, so one Dynamo graph
    of a block class holds the kernel for the temporal shape and SDPA for the spatial one."""

    def __init__(self):
        from diffusers.models.attention_processor import FusedAttnProcessor2_0
        self.fallback = FusedAttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        if (encoder_hidden_states is None and attention_mask is None and hidden_states.is_cuda
                and hidden_states.dtype in (torch.float16, torch.bfloat16)  # fp32 keeps exact SDPA
                and hidden_states.ndim == 3 and hidden_states.shape[1] <= MAX_SEQ
                and attn.spatial_norm is None and attn.group_norm is None and attn.norm_q is None
                and attn.norm_k is None and not attn.residual_connection
                and attn.rescale_output_factor == 1.0):
            out = short_attention(attn.to_qkv(hidden_states), attn.heads)
            return attn.to_out[1](attn.to_out[0](out))
        return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)


def use_short_attention(module: torch.nn.Module) -> int:
    """Give every fused self-attention in `module` the short-sequence processor (one shared
    instance, so Dynamo sees the same object in every block)."""
    from diffusers.models.attention_processor import Attention
    proc, n = ShortSeqAttnProcessor(), 0
    for attn in module.modules():
        if isinstance(attn, Attention) and hasattr(attn, "to_qkv") and not attn.is_cross_attention:
            attn.set_processor(proc)
            n += 1
    return n
