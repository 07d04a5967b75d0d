"""The model transforms `compile_pipe` applies, each a plain function on an `nn.Module`.

- `fuse_qkv(module)`: every diffusers `Attention` inside gets one fused QKV (self-attention) or KV
  (cross-attention) linear and `FusedAttnProcessor2_0`. Works for PixArt, Latte and the SD UNet alike
  (diffusers' own `fuse_qkv_projections()` does not exist for Latte, and keeps a second copy of the
  weights). Here the old `to_q/to_k/to_v` weights become views into the fused weight: no extra memory.
- `compile_blocks(module, classes, ...)`: `torch.compile` each repeated block from outside the model.
  One compiled function per block *class*, bound to every instance, so all blocks of a type share one
  Dynamo cache entry (one graph) instead of one wrapper per instance.
- `with_sdpa_priority(module)`: run the module's forward under an SDPA backend priority list; the
  dispatcher takes the first backend that accepts each call's shapes/mask, so the kernel is chosen
  per shape (cuDNN for PixArt's unmasked head-dim-72 self-attention; flash refuses the masked
  cross-attention, which falls through to the next accepting backend).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# Denoiser class name -> names of its repeated block classes (compiled one graph per class).
REPEATED_BLOCKS: dict[str, tuple[str, ...]] = {
    "PixArtTransformer2DModel": ("BasicTransformerBlock",),
    "LatteTransformer3DModel": ("BasicTransformerBlock",),
    "UNet2DConditionModel": ("BasicTransformerBlock", "ResnetBlock2D"),
    # text encoders / VAE decoder, compiled only when asked for
    "T5EncoderModel": ("T5Block",),
    "CLIPTextModel": ("CLIPEncoderLayer",),
    "Decoder": ("ResnetBlock2D", "UNetMidBlock2D"),
}

# On CUDA: first backend that accepts the call wins (cuDNN ran PixArt's head-dim-72 attention 1.5x
# faster than flash on an H100; flash does not take an attention mask).
SDPA_PRIORITY = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


# ---------------------------------------------------------------------------------------------
# QKV fusion

def _fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear computing all of `linears` at once; the originals become views into it."""
    w = torch.cat([l.weight.data for l in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    fused.weight.data = w
    if has_bias:
        fused.bias.data = torch.cat([l.bias.data for l in linears])
    row = 0
    for l in linears:  # re-point the originals at slices: unfusing or reading them still works
        n = l.out_features
        l.weight.data = fused.weight.data[row:row + n]
        if has_bias:
            l.bias.data = fused.bias.data[row:row + n]
        row += n
    fused.requires_grad_(linears[0].weight.requires_grad)
    return fused


def fuse_qkv(module: nn.Module) -> int:
    """Fuse the projections of every diffusers `Attention` in `module`. Returns how many were fused."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0, FusedAttnProcessor2_0
    n = 0
    for attn in module.modules():
        if not isinstance(attn, Attention) or getattr(attn, "fused_projections", False):
            continue
        if type(attn.processor) is not AttnProcessor2_0:  # only the plain processor has a fused twin
            continue
        if not attn.is_cross_attention:
            attn.to_qkv = _fuse_linears([attn.to_q, attn.to_k, attn.to_v])
        else:
            attn.to_kv = _fuse_linears([attn.to_k, attn.to_v])
        attn.fused_projections = True
        attn.set_processor(FusedAttnProcessor2_0())
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# Per-block compilation

def block_classes(module: nn.Module) -> tuple[str, ...]:
    name = type(module).__name__
    return REPEATED_BLOCKS.get(name) or tuple(getattr(module, "_repeated_blocks", ()) or ())


def compile_blocks(module: nn.Module, compile_kwargs: dict) -> dict[str, int]:
    """Compile every repeated block of `module`; returns {class name: instances compiled}.

    Blocks nested inside a block that is itself compiled are left to the outer one.
    """
    wanted = set(block_classes(module))
    compiled_fns: dict[type, callable] = {}
    counts: dict[str, int] = {}

    def visit(m: nn.Module):
        for child in m.children():
            cls = type(child)
            if cls.__name__ in wanted:
                if cls not in compiled_fns:
                    # One torch.compile wrapper per class: every instance runs the same code object
                    # with its own parameters as graph inputs, so they share one graph.
                    compiled_fns[cls] = torch.compile(cls.forward, **compile_kwargs)
                child.forward = functools.partial(compiled_fns[cls], child)
                counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
            else:
                visit(child)

    visit(module)
    return counts


def compile_whole(module: nn.Module, compile_kwargs: dict) -> None:
    """Compile a module that runs once per call (VAE decoder fallback when it has no known blocks)."""
    module.forward = torch.compile(module.forward, **compile_kwargs)


# ---------------------------------------------------------------------------------------------
# Attention kernel priority

def sdpa_backends() -> list:
    from torch.nn.attention import SDPBackend
    return [getattr(SDPBackend, n) for n in SDPA_PRIORITY if hasattr(SDPBackend, n)]


def with_sdpa_priority(module: nn.Module) -> None:
    """Run `module.forward` under the SDPA priority list (active while blocks are traced, so the
    compiled graphs bake in the chosen kernels, and at run time for eager parts)."""
    from torch.nn.attention import sdpa_kernel
    inner = module.forward
    backends = sdpa_backends()

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with sdpa_kernel(backends, set_priority=True):
            return inner(*args, **kwargs)

    module.forward = forward
