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
  cross-attention, which falls through to the next accepting backend). Measured on torch 2.11 /
  H100 (`python -m compiler.bench.attn_probe`): the default dispatch already picks cuDNN everywhere, so
  the list only pins that choice across torch versions; the one shape where another backend wins
  is Latte's 16-token temporal attention (flash 0.60 ms vs cuDNN 0.68 ms), not exploited yet.
- `fuse_gelu(module)`: Linear + GELU(tanh) as one cuBLASLt GEMM with a GELU epilogue (custom op).
- `to_fp8(module, blocks)`: the blocks' Linears as FP8Linear (`low-precision`, lossy); the projections
  feeding attention (ATTENTION_INPUTS) add their bias in the GEMM and write the model's dtype.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# Model class name -> names of its repeated block classes (compiled one graph per class), where
# the model's own `_repeated_blocks` (diffusers' and transformers' declaration) is missing or
# names fewer. A DiT that declares none is read from its structure (`block_classes`).
REPEATED_BLOCKS: dict[str, tuple[str, ...]] = {
    "UNet2DConditionModel": ("BasicTransformerBlock", "ResnetBlock2D"),
    # text encoders / VAE decoder, compiled only when asked for
    "T5EncoderModel": ("T5Block",),
    "UMT5EncoderModel": ("UMT5Block",),
    "CLIPTextModel": ("CLIPEncoderLayer",),
    "Decoder": ("ResnetBlock2D",),  # the mid-block attention specialises on its size under dynamic=True
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


def _fuse_into(attn: nn.Module, fused: str, names: tuple[str, ...]) -> None:
    """`attn.<fused>` computing `names` at once; which rows of it each one is, kept on `attn`
    (`FUSED_ROWS`: where `set_linear_weight` writes a projection's weight after fusion)."""
    linears = [getattr(attn, n) for n in names]
    setattr(attn, fused, _fuse_linears(linears))
    rows, start = {}, 0
    for n, lin in zip(names, linears):
        rows[n] = (fused, start)
        start += lin.out_features
    attn.__dict__.setdefault(FUSED_ROWS, {}).update(rows)


FUSED_ROWS = "_fused_rows"   # {projection name: (fused linear's name, its first row there)}


def fuse_qkv(module: nn.Module) -> int:
    """Fuse the projections of every diffusers `Attention` in `module`, of the newer attention
    classes whose processor reads `fused_projections` (Wan's), and of AnyFlow's self-attentions
    (`int8_attention.FusedAnyFlowAttnProcessor` reads them). Returns how many were fused."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0, FusedAttnProcessor2_0
    from diffusers.models.transformers.transformer_anyflow import AnyFlowAttention, AnyFlowAttnProcessor
    n, shared = 0, None
    for attn in module.modules():
        if getattr(attn, "fused_projections", False):
            continue
        if isinstance(attn, AnyFlowAttention):
            # its processors never read fused projections: a self-attention (AnyFlow's own
            # processor) gets ours, which does (one instance for every block); cross-attention,
            # whose processor reads to_q/k/v, and FAR's causal one are left as they are
            if type(attn.processor) is AnyFlowAttnProcessor:
                from .kernels.int8_attention import FusedAnyFlowAttnProcessor
                shared = shared or FusedAnyFlowAttnProcessor()
                _fuse_into(attn, "to_qkv", ("to_q", "to_k", "to_v"))
                attn.fused_projections = True
                attn.set_processor(shared)
                n += 1
            continue
        if not isinstance(attn, Attention) and _fuse_own(attn):
            n += 1
            continue
        if not isinstance(attn, Attention):
            continue
        if type(attn.processor) is not AttnProcessor2_0:  # only the plain processor has a fused twin
            continue
        if not attn.is_cross_attention:
            _fuse_into(attn, "to_qkv", ("to_q", "to_k", "to_v"))
        else:
            _fuse_into(attn, "to_kv", ("to_k", "to_v"))
        attn.fused_projections = True
        attn.set_processor(FusedAttnProcessor2_0())
        n += 1
    return n


def _fuse_own(attn: nn.Module) -> bool:
    """An attention whose own processor switches on `fused_projections` (diffusers' WanAttention,
    FluxAttention: `to_qkv` for self-, `to_kv` for cross-attention; FLUX's double-stream joint
    attention also `to_added_qkv` for its text stream's own q/k/v). Its `fuse_projections()` would
    copy the weights; here they become views. Wan's image-conditioned ones (added K/V without an
    added query) are left alone."""
    if not hasattr(attn, "fuse_projections"):
        return False
    joint = getattr(attn, "add_q_proj", None) is not None
    if getattr(attn, "added_kv_proj_dim", None) is not None and not joint:
        return False
    if not getattr(attn, "is_cross_attention", False):   # FluxAttention has no such attribute
        _fuse_into(attn, "to_qkv", ("to_q", "to_k", "to_v"))
    else:
        _fuse_into(attn, "to_kv", ("to_k", "to_v"))
    if joint:
        _fuse_into(attn, "to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))
    attn.fused_projections = True
    return True


# ---------------------------------------------------------------------------------------------
# Per-block compilation

def block_classes(module: nn.Module) -> tuple[str, ...]:
    """The class names of `module`'s repeated blocks: the table above, else the model's own
    `_repeated_blocks`, else the classes in its block lists (diffusers' DiTs keep their blocks in
    `transformer_blocks`, video DiTs also in `temporal_transformer_blocks`)."""
    found = REPEATED_BLOCKS.get(type(module).__name__) or tuple(getattr(module, "_repeated_blocks", ()) or ())
    if found:
        return found
    lists = [getattr(module, n, None) for n in ("transformer_blocks", "temporal_transformer_blocks")]
    return tuple(dict.fromkeys(type(b).__name__ for l in lists if isinstance(l, nn.ModuleList) for b in l))


def _call_dense(fn, module, *args, **kwargs):
    """Call a compiled block with its token tensors (3-D) contiguous. A DiT's first block gets
    PatchEmbed's transposed view, the others contiguous tensors: without this the first block has
    a graph of its own (a second compile of the whole block). No-op for contiguous inputs."""
    args = tuple(a.contiguous() if isinstance(a, torch.Tensor) and a.ndim == 3 else a for a in args)
    kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) and v.ndim == 3 else v for k, v in kwargs.items()}
    return fn(module, *args, **kwargs)


def compile_blocks(module: nn.Module, compile_kwargs: dict,
                   compiled_fns: dict | None = None) -> dict[str, int]:
    """Compile every repeated block of `module`; returns {class name: instances compiled}.

    Blocks nested inside a block that is itself compiled are left to the outer one. `compiled_fns`
    ({class: compiled forward}, filled here): pass the same dict for several modules whose blocks
    share classes (Wan 2.2's two experts), so that they share one compiled function, one graph.
    """
    wanted = set(block_classes(module))
    compiled_fns = {} if compiled_fns is None else compiled_fns
    counts: dict[str, int] = {}

    def visit(m: nn.Module):
        for child in m.children():
            cls = type(child)
            if cls.__name__ in wanted:
                if cls not in compiled_fns:
                    # One torch.compile wrapper per class: every instance runs the same code object
                    # with its own parameters as graph inputs, so they share one graph.
                    compiled_fns[cls] = torch.compile(cls.forward, **compile_kwargs)
                child.forward = functools.partial(_call_dense, compiled_fns[cls], child)
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


# ---------------------------------------------------------------------------------------------
# Linear + GELU(tanh) as one cuBLASLt GEMM with a GELU epilogue (CUDA)
#
# The FF up-projection's output is the largest activation of a DiT block (4x hidden). Inductor
# keeps the GEMM in cuBLAS and runs GELU as a separate pass over that tensor (~2 ms of a 33 ms
# PixArt step on an H100); cuBLASLt can apply the same tanh-GELU in the GEMM epilogue. A custom op
# keeps Inductor from decomposing it back into GEMM + pointwise.

@torch.library.custom_op("diffcompiler::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:  # aten's CPU path applies exact GELU: keep the op's meaning the same everywhere
        return torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias), approximate="tanh")
    x2 = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)  # CUDA epilogue: tanh approx
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_gelu_tanh.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class LinearGELUTanh(nn.Module):
    """Drop-in for diffusers' `GELU(approximate="tanh")` (same `proj` submodule and state dict).

    A module class, not a per-instance `forward` attribute: Dynamo guards on the identity of an
    instance's bound `forward`, so a per-instance function would give every block its own graph
    (28-56 graphs instead of one per block class, and Latte's 56 blocks past the recompile limit).
    """

    def __init__(self, gelu: nn.Module):
        super().__init__()
        self.proj = gelu.proj

    def forward(self, hidden_states):
        return linear_gelu_tanh(hidden_states, self.proj.weight, self.proj.bias)


def fuse_gelu(module: nn.Module) -> int:
    """Replace every diffusers `GELU(approximate="tanh")` with a biased projection by
    `LinearGELUTanh`. Returns how many were replaced. (GELU "none" and GEGLU stay as they are.)"""
    from diffusers.models.activations import GELU
    n = 0
    for parent in list(module.modules()):
        for name, m in list(parent.named_children()):
            if isinstance(m, GELU) and m.approximate == "tanh" and m.proj.bias is not None \
                    and not isinstance(m.proj, FP8Linear):
                setattr(parent, name, LinearGELUTanh(m))
                n += 1
    return n


# ---------------------------------------------------------------------------------------------
# FP8 linears (low-precision, Hopper/Ada): e4m3 weights with one scale per output channel,
# activations quantised per row on the fly (Inductor fuses that into the preceding kernel).

FP8_MAX = 448.0

# Projections whose output goes straight into attention: their GEMM adds the bias and writes the
# model's dtype itself, so q/k/v reach the attention kernel as strided views of the GEMM's output.
# Otherwise bias + cast is a pointwise pass that Inductor must materialise as dense q, k, v copies
# (three kernels, ~48 us per PixArt-α block on an H100, ~1.3 ms of a 31 ms step). The other
# projections keep the bias in the Inductor kernel that follows (residual, LayerNorm), where it is free.
ATTENTION_INPUTS = ("to_qkv", "to_kv", "to_q", "to_k", "to_v")


@functools.cache
def _rowwise_out_ok(dtype: torch.dtype, device_type: str) -> bool:
    """Whether this torch/GPU can write `dtype` from a row-wise scaled GEMM (torch 2.11 on an H100
    can for fp16; older builds only for bf16). Probed once per dtype on a tiny GEMM."""
    try:
        a = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn)
        one = torch.ones(16, 1, device=device_type)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t().contiguous(),
                         bias=torch.zeros(16, device=device_type, dtype=dtype), out_dtype=dtype)
        return True
    except Exception:   # whatever a build without it raises: keep the bf16 path, which every build has
        return False


class FP8Linear(nn.Module):
    """`bias_in_gemm`: the GEMM adds the bias and writes the layer's dtype (attention inputs, see
    ATTENTION_INPUTS); otherwise it writes bf16 and bias + cast are left to Inductor's next kernel."""

    def __init__(self, lin: nn.Linear, bias_in_gemm: bool = False):
        super().__init__()
        w8, scale = self.quantize_weight(lin.weight.data)
        self.register_buffer("w8", w8)                                            # (N, K) row-major
        self.register_buffer("w_scale", scale.t().contiguous())                   # (1, N)
        self.bias = lin.bias
        self.out_dtype = lin.weight.dtype
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.bias_in_gemm = bias_in_gemm and _rowwise_out_ok(self.out_dtype, w8.device.type)

    @staticmethod
    def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, K) 16-bit weight -> (N, K) e4m3 and (N, 1) fp32 row scales; row by row, so rows
        written later (`write_rows`) are what quantising the whole weight gives them."""
        w = w.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX      # (N, 1)
        return (w / scale).to(torch.float8_e4m3fn), scale

    def write_rows(self, start: int, weight: torch.Tensor) -> None:
        """Rows start.. of the weight replaced by `weight` ((n, K), 16 bits), in place: the
        buffers keep their storage, so compiled graphs and CUDA graphs stay valid."""
        w8, scale = self.quantize_weight(weight)
        self.w8[start:start + len(w8)].copy_(w8)
        self.w_scale[0, start:start + len(w8)].copy_(scale[:, 0])

    @staticmethod
    def quantize(x2):
        """(M, K) half -> (M, K) e4m3 and (M, 1) fp32 row scales (traced: Inductor fuses it into
        the kernel that produces x)."""
        s = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (M, 1)
        return (x2.float() / s).to(torch.float8_e4m3fn), s

    def gemm(self, x8, s, bias=None, out_dtype=torch.bfloat16):
        """(M, K) e4m3 with row scales -> (M, N) `out_dtype` (+ `bias` in the epilogue). Row-wise
        scaled GEMM: bf16 output, no bias, is what every torch version supports for row-wise scales."""
        return torch._scaled_mm(x8, self.w8.t(), scale_a=s, scale_b=self.w_scale, bias=bias, out_dtype=out_dtype)

    def forward(self, x):
        shape = x.shape
        x8, s = self.quantize(x.reshape(-1, shape[-1]))
        if self.bias_in_gemm:   # (M, N) in the layer's dtype, bias added in the GEMM's epilogue
            y = self.gemm(x8, s, self.bias, self.out_dtype)
        else:
            y = self.gemm(x8, s)
            if self.bias is not None:
                y = y + self.bias
        return y.to(self.out_dtype).view(*shape[:-1], self.out_features)


def fp8_supported(module: nn.Module) -> bool:
    p = next(module.parameters(), None)
    return (p is not None and p.is_cuda and torch.cuda.get_device_capability(p.device) >= (8, 9)
            and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm"))


def to_fp8(module: nn.Module, block_names: tuple[str, ...]) -> int:
    """Swap the Linear layers inside the repeated blocks for FP8Linear. Returns how many."""
    from diffusers.models.attention_processor import Attention
    n = 0
    for blk in module.modules():
        if type(blk).__name__ not in block_names:
            continue
        for parent in list(blk.modules()):
            for name, child in list(parent.named_children()):
                # projections superseded by a fused QKV/KV linear are unused: leave them
                unused = getattr(parent, "fused_projections", False) and (
                    name in ("to_k", "to_v") or (name == "to_q" and hasattr(parent, "to_qkv")))
                if type(child) is nn.Linear and unused and child.weight.numel():
                    _drop_weight(child)
                elif type(child) is nn.Linear and not unused and child.in_features % 16 == 0 \
                        and child.out_features % 16 == 0:
                    attn_input = isinstance(parent, Attention) and name in ATTENTION_INPUTS
                    setattr(parent, name, FP8Linear(child, bias_in_gemm=attn_input))
                    n += 1
    return n


def _drop_weight(lin: nn.Linear) -> None:
    """A projection superseded by a fused QKV/KV linear holds a view into the fused 16-bit weight:
    once that fused linear is FP8, the view alone keeps the 16-bit copy on the GPU (Wan 14B: 5.2 G
    values, 10.5 GB an expert). Nothing reads it (its processor calls the fused linear): emptied."""
    lin.weight = nn.Parameter(lin.weight.new_empty(0), requires_grad=False)


def linear_rows(module: nn.Module, path: str) -> tuple[nn.Module, int]:
    """(the module that computes the Linear at `path`, its first row there): the Linear itself
    and 0, or after `fuse_qkv` the fused QKV/KV linear (16-bit or FP8) and the projection's
    first row in it."""
    parent_path, _, name = path.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    fused = parent.__dict__.get(FUSED_ROWS, {}).get(name)
    return (getattr(parent, fused[0]), fused[1]) if fused else (getattr(parent, name), 0)


def set_linear_weight(module: nn.Module, path: str, weight: torch.Tensor) -> None:
    """The Linear at `path` (named as before any transform: `blocks.0.attn1.to_q`) given `weight`
    ((out, in), the model's dtype), in place wherever it lives after `fuse_qkv` and `to_fp8`: its
    own parameter, its rows of a fused QKV/KV linear, or those rows of an FP8Linear, quantised as
    `to_fp8` quantises. Storage never moves: compiled graphs and CUDA graphs stay valid (an
    adapter switched between calls: `runner.serve.adapters`)."""
    target, start = linear_rows(module, path)
    with torch.no_grad():
        if isinstance(target, FP8Linear):
            target.write_rows(start, weight)
        else:
            target.weight[start:start + weight.shape[0]].copy_(weight)
