"""8-bit self-attention for long sequences (video DiTs): SageAttention 2's Hopper kernel
(vendored in `csrc/sage_sm90`, built once per machine) fed by our own quantisation, which rotates
Q and K first so that channel outliers cannot eat the INT8 range.

Contract:
- `attention8(q, k, v) -> o`: q, k, v of shape (B, N, H, D), D in `HEAD_DIMS`, fp16/bf16 on CUDA;
  o like q, softmax(q k^T / sqrt(D)) v. A custom op (`diffcompiler::attention8`, opaque to Dynamo,
  captured by CUDA graphs: every launch on the current stream, no host sync). On the CPU it is
  exact SDPA (tests of the logic).
- `unavailable() -> str | None`: why the kernel cannot run in this process (no CUDA, a GPU other
  than sm90, no nvcc to build it and no build in `build_dir()`), or None once it is loaded.
- `use_int8_attention(denoiser, min_tokens=MIN_TOKENS) -> int`: every Wan self-attention
  (`WanAttention` without cross-attention) and AnyFlow self-attention (`AnyFlowAttention` with
  AnyFlow's self-attention processor; `_kinds`) inside the kernel's domain gets
  `LongSelfAttnProcessor`: calls of at least `min_tokens` tokens (per sample) go through
  `attention8`, all others (shorter sequences, masks, fp32, CPU) through the class's own
  processor (diffusers' `WanAttnProcessor`; `FusedAnyFlowAttnProcessor`, AnyFlow's reading the
  fused `to_qkv`). Returns how many attentions got it.
- The domain (`domain_miss(attn)`, `outside_domain(denoiser)`): attentions whose q and k are
  each normalised per token (`norm_q`, `norm_k` an RMS or layer norm over the channels, as
  Wan's), read from the module: the kernel loses accuracy on key tokens much larger than the
  rest (below), which such a norm rules out. Others keep diffusers' processor (lossless).
- `complex_rope(x, freqs)`: AnyFlow's rotary embedding (diffusers' `apply_rotary_emb`, complex128)
  as fp32 pointwise math Inductor can fuse; AnyFlow's processors here make q and k with it where
  `fused_norm_rope` does not apply (fp32).
- `fused_norm_rope(attn, q, k, cs_q, cs_k)`: q and k's RMS norms + rotary embedding in one Triton
  pass each (`qk_norm.qk_norm_rope`), where the module's norms are what that kernel computes; the
  q/k/v functions here (Wan's and AnyFlow's) take it first, in every mode.

Arithmetic (what is lossy, and why it survives outliers):
- Q and K multiplied by one fixed orthogonal matrix R (a Hadamard matrix with random signs, seed 0,
  / sqrt(D)): (qR)(kR)^T = q k^T exactly, but an outlier channel's energy is spread over all D
  channels, so the INT8 scales are no longer set by a few channels ~20x the others (QuaRot's and
  FlashAttention-3's incoherent processing): output cosine 0.9987 -> 0.9993 with offsets of 20-50x
  the std on 4 channels, 0.9969 -> 0.9994 with 4 channels 20x larger (H200, 2 x 12 x 32,760 x 128;
  benchmarks/2026-11-26-int8-attention.md). Done inside the quantisation kernel (a (64|128, D) x
  (D, D) tile product), so it costs no extra pass over memory.
- QK^T in INT8 with SageAttention's per-thread scales (2 query rows / 32 key rows per scale), K
  smoothed first (its mean over tokens subtracted: exact under softmax);
- P V in FP8 (e4m3, V scaled per channel) with FP32 accumulation, output in the input dtype.
- Where it does not hold: Gaussian inputs, K channel offsets, Q outlier channels, a sharp softmax
  (logits x4), V outlier channels and K token spikes each alone keep cosine >= 0.999, but key
  token spikes together with K offsets and V outliers give 0.989, all five 0.954 (H200, fp32
  reference; issue 61): hence the domain. Q outlier channels (20x) with logits x4 together also
  fall to 0.998, normalised or not: a limit the rule does not rule out (pinned by a gpu test).
- Only long sequences pay: the kernel is ~1.3x cuDNN at 32,760 tokens but slower below ~12k
  tokens (H100/H200), hence `MIN_TOKENS`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from .qk_norm import qk_norm_rope

MIN_TOKENS = 16384     # below this cuDNN's BF16/FP16 kernel is faster (H100, head dim 128)
SRC = Path(__file__).parent / "csrc" / "sage_sm90"
HEAD_DIMS = (64, 128)   # the kernel's; Wan's is 128
DTYPES = (torch.float16, torch.bfloat16)   # the kernel's (the CPU tests add fp32: exact SDPA there)
# torch's RMSNorm rounds x * rsqrt(..) * weight once since pytorch#147203 (torch 2.7); before, it
# rounded x * rsqrt(..) first: `fused_norm_rope` then leaves Wan's norms to their own path.
TORCH_RMS_ROUNDS_ONCE = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 7)


def _digest() -> str:
    """What the built extension depends on: its sources, torch and CUDA versions."""
    h = hashlib.sha256(f"{torch.__version__}|{torch.version.cuda}".encode())
    for f in sorted(SRC.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """Beside the compile cache (`compiler.cache.configure_cache_dir` sets TORCHINDUCTOR_CACHE_DIR
    to <cache>/inductor), else torch's extension directory: built once per machine and cache."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor:
        return Path(inductor).parent / "ext" / f"sage_sm90-{_digest()}"
    from torch.utils.cpp_extension import _get_build_directory
    return Path(_get_build_directory(f"sage_sm90_{_digest()}", verbose=False))


@functools.cache
def extension():
    """The sm90 kernel's module: loaded from `build_dir()` when a worker built it already (no
    compiler needed), else built there with nvcc (~1-2 min; torch's file lock makes concurrent
    workers wait for one build)."""
    import importlib.machinery
    import importlib.util
    name = f"diffcompiler_sage_sm90_{_digest()}"
    d = build_dir()
    built = d / f"{name}.so"
    if not built.exists():
        from torch.utils.cpp_extension import load
        d.mkdir(parents=True, exist_ok=True)
        flags = ["-O3", "-std=c++17", "-DENABLE_BF16", "-DSAGE_SLIM"]
        load(name=name, sources=[str(SRC / "qattn" / "qk_int_sv_f8_cuda_sm90.cu")], build_directory=str(d),
             extra_cflags=flags, extra_ldflags=["-lcuda"], verbose=False,
             extra_cuda_cflags=flags + ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                                        "--use_fast_math", "--threads=4", "-diag-suppress=174,177,549",
                                        "-gencode", "arch=compute_90a,code=sm_90a"])
    spec = importlib.util.spec_from_file_location(name, built,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, str(built)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BUILD = threading.Lock()   # prewarm's thread and compile_pipe may ask at once: one build


def unavailable() -> str | None:
    """None when the kernel can run here (building it if needed), else the reason in one line."""
    with _BUILD:
        return _unavailable()


@functools.cache
def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        return f"the INT8/FP8 attention kernel is built for Hopper (sm90); this GPU is sm{cc[0]}{cc[1]}"
    try:
        extension()
    except Exception as e:   # no nvcc/ninja, a failed build: the message says which
        return f"its CUDA kernel could not be built or loaded ({type(e).__name__}: {str(e).strip()[-300:]})"
    return None


@functools.cache
def signed_hadamard(d: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """(d, d) with entries +-1 (exact in fp16/bf16): random signs (seed 0) times Sylvester's
    Hadamard matrix; divided by sqrt(d) it is orthogonal. d a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    return (signs[:, None] * h).to(device=device, dtype=dtype)


@functools.cache
def _kernels():
    """The Triton quantisation kernels (built on first use; on a CPU only Triton's interpreter runs them)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kv_stats(k, v, ksum, vmax, N, skb, skn, skh, svb, svn, svh, spn, spb, sph,
                 D: tl.constexpr, ROWS: tl.constexpr):
        """One (b, h) and ROWS tokens of K and V, read once: K's column sums and V's column
        |max| over those tokens (fp32), to partials (ceil(N / ROWS), B, H, D) the caller reduces."""
        blk, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = blk * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, D)
        inb = rows[:, None] < N
        tk = tl.load(k + b * skb + h * skh + rows[:, None] * skn + cols[None, :], mask=inb, other=0.0)
        tv = tl.load(v + b * svb + h * svh + rows[:, None] * svn + cols[None, :], mask=inb, other=0.0)
        off = blk * spn + b * spb + h * sph + cols
        tl.store(ksum + off, tl.sum(tk.to(tl.float32), axis=0))
        tl.store(vmax + off, tl.max(tl.abs(tv.to(tl.float32)), axis=0))

    @triton.jit
    def rotate_quant(x, mean, r, out, scale, N, sxb, sxn, sxh, sob, son, soh, ssb, ssh, smb, smh,
                     inv_sqrt_d, D: tl.constexpr, KEY: tl.constexpr, TILES: tl.constexpr):
        """One (b, h) and TILES tiles of ROWS tokens: (x - mean) R / sqrt(D) in INT8 with the
        kernel's per-thread scales. Q (KEY=0): 64-row tiles; rows r and r + 8 of each 16-row group
        share a scale (8 a group, 32 a tile). K (KEY=1): 128-row tiles; rows 8i + 2t + j (j = 0, 1;
        i = 0..15) share scale t (4 a tile). R (and K's mean) loaded once for the TILES tiles."""
        ROWS: tl.constexpr = 128 if KEY else 64
        pid, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cols = tl.arange(0, D)
        rot = tl.load(r + cols[:, None] * D + cols[None, :])
        if KEY:   # K smoothed: its mean over tokens subtracted (softmax ignores it); padding stays 0
            mu = tl.load(mean + b * smb + h * smh + cols)
        for i in tl.static_range(TILES):
            blk = pid * TILES + i
            rows = blk * ROWS + tl.arange(0, ROWS)
            inb = rows[:, None] < N
            t = tl.load(x + b * sxb + h * sxh + rows[:, None] * sxn + cols[None, :], mask=inb, other=0.0)
            if KEY:
                t = tl.where(inb, t - mu[None, :], 0.0).to(mu.dtype)
            y = tl.dot(t, rot) * inv_sqrt_d                                              # (ROWS, D) fp32
            amax = tl.max(tl.abs(y), axis=1)                                             # (ROWS,)
            live = blk * ROWS < N      # the grid's last program may hold tiles past the end
            if KEY:
                s = tl.max(tl.max(tl.reshape(amax, (16, 4, 2)), axis=2), axis=0) / 127.0 + 1e-7   # (4,)
                srow = tl.reshape(tl.broadcast_to(s[None, :, None], (16, 4, 2)), (ROWS,))
                tl.store(scale + b * ssb + h * ssh + blk * 4 + tl.arange(0, 4), s,
                         mask=tl.full((4,), 1, tl.int1) & live)
            else:
                s = tl.max(tl.reshape(amax, (4, 2, 8)), axis=1) / 127.0 + 1e-7                   # (4, 8)
                srow = tl.reshape(tl.broadcast_to(s[:, None, :], (4, 2, 8)), (ROWS,))
                tl.store(scale + b * ssb + h * ssh + blk * 32 + tl.reshape(
                    tl.arange(0, 4)[:, None] * 8 + tl.arange(0, 8)[None, :], (32,)), tl.reshape(s, (32,)),
                    mask=tl.full((32,), 1, tl.int1) & live)
            qv = y / srow[:, None]
            qv = qv + tl.where(qv >= 0, 0.5, -0.5)       # round half away from zero, as SageAttention
            tl.store(out + b * sob + h * soh + rows[:, None] * son + cols[None, :], qv.to(tl.int8), mask=inb)

    @triton.jit
    def v_fp8(v, vscale, out, N, NP, svb, svn, svh, ssb, ssh, sob, soh,
              D: tl.constexpr):
        """One (b, h) and 128 tokens of V: / its per-channel scale, FP8 e4m3, transposed to
        (D, tokens) with the tokens of every 16 permuted as the kernel's FP8 MMA reads them
        (position p holds token (p // 2 % 2) * 8 + (p // 4) * 2 + p % 2); padding is 0."""
        blk, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        p = tl.arange(0, 128)
        q = p % 16
        tok = blk * 128 + p // 16 * 16 + (q // 2 % 2) * 8 + (q // 4) * 2 + q % 2
        cols = tl.arange(0, D)
        t = tl.load(v + b * svb + h * svh + tok[:, None] * svn + cols[None, :], mask=tok[:, None] < N,
                    other=0.0).to(tl.float32)
        s = tl.load(vscale + b * ssb + h * ssh + cols)
        t = tl.minimum(tl.maximum(t / s[None, :], -448.0), 448.0)
        tl.store(out + b * sob + h * soh + cols[:, None] * NP + (blk * 128 + p)[None, :],
                 tl.trans(t.to(tl.float8e4nv)))

    return kv_stats, rotate_quant, v_fp8


# Launch settings: (rows, warps) of a K/V statistics program, (tiles, warps) of a Q and a K rotation
# program. `python -m compiler.bench.quant8_probe` on an H200 (2026-11-28): the best or within
# 2.1 % of it at the Wan 1.3B and 14B shapes; two tiles a program (R loaded once for both) take the
# rotations from ~1.4 to ~1.75 TB/s (benchmarks/2026-11-28-quant8-h200.md).
STATS = (256, 8)
ROT_Q, ROT_K = (2, 4), (2, 4)


def quantize(q, k, v, stats=STATS, rot_q=ROT_Q, rot_k=ROT_K):
    """(B, N, H, D) x3 -> what the sm90 kernel takes: q8, k8 (B, N, H, D) int8 with their scales
    (B, H, ceil(N/64)*32) and (B, H, ceil(N/128)*4), v8 (B, H, D, N padded to 128) fp8 with its
    per-channel scales (B, H, D). Four passes over memory: K and V's statistics (K's mean over
    tokens, V's per-channel |max|, in one read), Q and K rotated and quantised, V quantised."""
    kv_stats, rotate_quant, v_fp8 = _kernels()
    b, n, h, d = q.shape
    r = signed_hadamard(d, str(q.device), q.dtype)
    rows, warps = stats
    nb = (n + rows - 1) // rows
    part = torch.empty(2, nb, b, h, d, dtype=torch.float32, device=q.device)   # K sums, V |max|
    kv_stats[(nb, h, b)](k, v, part[0], part[1], n, k.stride(0), k.stride(1), k.stride(2), v.stride(0),
                         v.stride(1), v.stride(2), part.stride(1), part.stride(2), part.stride(3),
                         D=d, ROWS=rows, num_warps=warps)
    km = (part[0].sum(0) * (1.0 / n)).to(k.dtype)                          # (B, H, D), as k.mean(1)
    vs = (part[1].amax(0) / 448.0).clamp_min(1e-12)                       # (B, H, D), fp32
    q8, k8 = torch.empty(q.shape, dtype=torch.int8, device=q.device), torch.empty(k.shape, dtype=torch.int8, device=q.device)
    qs = torch.empty(b, h, (n + 63) // 64 * 32, dtype=torch.float32, device=q.device)
    ks = torch.empty(b, h, (n + 127) // 128 * 4, dtype=torch.float32, device=q.device)
    for x, out, sc, rows, (tiles, warps), key in ((q, q8, qs, 64, rot_q, False), (k, k8, ks, 128, rot_k, True)):
        rotate_quant[((n + rows * tiles - 1) // (rows * tiles), h, b)](
            x, km, r, out, sc, n, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
            out.stride(2), sc.stride(0), sc.stride(1), km.stride(0), km.stride(1), d ** -0.5, D=d, KEY=key,
            TILES=tiles, num_warps=warps)
    np_ = (n + 127) // 128 * 128
    v8 = torch.empty(b, h, d, np_, dtype=torch.float8_e4m3fn, device=q.device)
    v_fp8[(np_ // 128, h, b)](v, vs, v8, n, np_, v.stride(0), v.stride(1), v.stride(2), vs.stride(0),
                              vs.stride(1), v8.stride(0), v8.stride(1), D=d, num_warps=8)
    return q8, qs, k8, ks, v8, vs


@torch.library.custom_op("diffcompiler::attention8", mutates_args=())
def attention8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, N, H, D) x3 -> (B, N, H, D): softmax(q k^T / sqrt(D)) v, INT8 QK / FP8 PV on sm90."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2).contiguous()
    q8, qs, k8, ks, v8, vs = quantize(q, k, v)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # v8 as (B, D, H, N): the kernel's NHD layout reads V's strides that way
    extension().qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(
        q8, k8, v8.permute(0, 2, 1, 3), o, qs, ks, vs, 0, 0, 3, q.shape[-1] ** -0.5, 0)
    return o


@attention8.register_fake
def _(q, k, v):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (B, N, H, D), as diffusers' WanAttnProcessor applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def fused_norm_rope(attn, q, k, cs_q, cs_k):
    """q, k (B, N, H*D) -> each RMS-normalised across heads (`attn.norm_q`, `norm_k`) and rotated
    by its (cos, sin) pair (each (N, D/2)), (B, N, H, D), in one Triton pass each
    (`qk_norm.qk_norm_rope`; on a CPU its reference, the same arithmetic); None in fp32, with a
    16-bit rotary table (a model cast whole with `.to()`: the modules then round after every
    product) or where the norms are not what that kernel computes: then the caller's own path
    (which Inductor compiles into looped reductions ~3x slower on an H200)."""
    from diffusers.models.normalization import RMSNorm
    wide = (torch.float32, torch.float64)
    pairs = cs_q[0].shape[-1]                        # D/2: the kernel's pair axis, a power of two
    if (q.dtype not in DTYPES or cs_q[0].shape[0] != q.shape[1] or pairs & (pairs - 1)
            or any(t.dtype not in wide for t in (*cs_q, *cs_k))):
        return None
    args = []
    for x, norm in ((q, attn.norm_q), (k, attn.norm_k)):
        if isinstance(norm, torch.nn.RMSNorm) and TORCH_RMS_ROUNDS_ONCE:
            round_first = False        # torch's: (x r w) rounded once
        elif isinstance(norm, RMSNorm) and norm.bias is None:
            round_first = True         # diffusers': (x r) rounded, then times w
        else:
            return None
        w = norm.weight
        if w is None or norm.eps is None or tuple(w.shape) != (x.shape[-1],) or w.dtype != x.dtype:
            return None
        args.append((x, w, float(norm.eps), round_first))
    return [qk_norm_rope(x, w, eps, c, s, first).unflatten(2, (attn.heads, -1))
            for (x, w, eps, first), (c, s) in zip(args, (cs_q, cs_k))]


def _qkv_cos_sin_rope(attn, hidden_states: torch.Tensor, rotary_emb=None):
    """Wan self-attention's q, k, v, each (B, N, H, D), as diffusers' WanAttnProcessor makes them:
    the (fused) projection, RMS norms across heads, the rotary embedding ((cos, sin))."""
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections
    q, k, v = _get_qkv_projections(attn, hidden_states, None)       # 3 x (B, N, H*D)
    if (rotary_emb is not None and rotary_emb[0].shape[0] == 1 and rotary_emb[0].shape[2] == 1
            and rotary_emb[0].dtype == rotary_emb[1].dtype == torch.float32):   # _rope's fp32 math
        cos, sin = rotary_emb                                        # 2 x (1, N, 1, D)
        cs = (cos[0, :, 0, 0::2], sin[0, :, 0, 1::2])                # pair i: cos[2i], sin[2i + 1]
        if (qk := fused_norm_rope(attn, q, k, cs, cs)) is not None:
            return (*qk, v.unflatten(2, (attn.heads, -1)))
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))   # 3 x (B, N, H, D)
    if rotary_emb is not None:
        q, k = _rope(q, *rotary_emb), _rope(k, *rotary_emb)
    return q, k, v


def complex_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """AnyFlow's `apply_rotary_emb` in real fp32 arithmetic: x (B, N, H, D) as D/2 interleaved
    (real, imaginary) pairs, each times its complex frequency (freqs (1, N, 1, D/2), complex128 or
    complex64). diffusers multiplies in complex128, which Inductor cannot generate: q and k went
    through fp64 copies in eager kernels on every layer and step (2-3 % of AnyFlow's 4-step video,
    benchmarks/2026-11-28-gpu-suite-2xh200-whole.md); here the rotation is plain pointwise math
    Inductor fuses into the kernel making q or k. fp32 against fp64 before the fp16 output:
    the same values but for a rare last-bit tie."""
    # out[2i] = x[2i] c_i - x[2i+1] s_i, out[2i+1] = x[2i+1] c_i + x[2i] s_i: x times (c, c) plus
    # x with each pair swapped times (-s, s), every term pointwise (no cat of halves, which
    # Inductor would write out in fp32 before the cast)
    c, s = torch.view_as_real(freqs).float().unbind(-1)              # 2 x (1, N, 1, D/2)
    c2, s2 = torch.stack((c, c), -1).flatten(-2), torch.stack((-s, s), -1).flatten(-2)   # (1, N, 1, D)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)           # (B, N, H, D)
    return (x.float() * c2 + swapped.float() * s2).type_as(x)


def _qkv_complex_rope(attn, hidden_states: torch.Tensor, rotary_emb=None):
    """AnyFlow self-attention's q, k, v, each (B, N, H, D), as diffusers' AnyFlowAttnProcessor
    makes them: `to_qkv` where `transforms.fuse_qkv` made one (one GEMM), else to_q/k/v; RMS
    norms across heads; the rotary embedding ({"query", "key"}: complex (1, 1, N, D/2)) as its
    module's own `apply_rotary_emb` rotates, in fp32 (`complex_rope`), its frequencies laid out
    for (B, N, H, D)."""
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    if rotary_emb is not None and rotary_emb["query"].shape[:2] == (1, 1) == rotary_emb["key"].shape[:2]:
        fq, fk = (torch.view_as_real(rotary_emb[n])[0, 0] for n in ("query", "key"))   # (N, D/2, 2)
        if (qk := fused_norm_rope(attn, q, k, fq.unbind(-1), fk.unbind(-1))) is not None:
            return (*qk, v.unflatten(2, (attn.heads, -1)))
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))   # 3 x (B, N, H, D)
    if rotary_emb is not None:
        q = complex_rope(q, rotary_emb["query"].transpose(1, 2))
        k = complex_rope(k, rotary_emb["key"].transpose(1, 2))
    return q, k, v


class FusedAnyFlowAttnProcessor:
    """diffusers' AnyFlowAttnProcessor reading the fused `to_qkv` (one GEMM; `transforms.fuse_qkv`
    installs it on AnyFlow's self-attentions, whose own processor never reads fused projections):
    the same q, k, v (the rotary embedding in fp32: `complex_rope`), the same
    `dispatch_attention_fn` call. Cross-attention calls go to
    diffusers' processor (unfused modules only)."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self):
        from diffusers.models.transformers.transformer_anyflow import AnyFlowAttnProcessor
        self.cross = AnyFlowAttnProcessor()     # made once, not on every call

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        if encoder_hidden_states is not None:
            return self.cross(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        q, k, v = _qkv_complex_rope(attn, hidden_states, rotary_emb)
        out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))


@functools.cache
def _kinds() -> dict:
    """The attentions `LongSelfAttnProcessor` takes: attention class -> (the processor class its
    calls outside the kernel go to, the function making its q, k, v, whether a module of it is a
    self-attention: Wan's says so itself, AnyFlow's by its processor, cross and causal ones
    having others)."""
    from diffusers.models.transformers.transformer_anyflow import AnyFlowAttention, AnyFlowAttnProcessor
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor
    self_procs = (AnyFlowAttnProcessor, FusedAnyFlowAttnProcessor, LongSelfAttnProcessor)
    return {WanAttention: (WanAttnProcessor, _qkv_cos_sin_rope, lambda m: not m.is_cross_attention),
            AnyFlowAttention: (FusedAnyFlowAttnProcessor, _qkv_complex_rope,
                               lambda m: isinstance(m.processor, self_procs))}


def _kind(attn) -> type | None:
    """The `_kinds` class `attn` is a self-attention of, or None."""
    return next((cls for cls, (_, _, is_self) in _kinds().items()
                 if isinstance(attn, cls) and is_self(attn)), None)


def self_attention_qkv(attn, hidden_states: torch.Tensor, rotary_emb=None):
    """A self-attention's q, k, v, each (B, N, H, D), as its own processor makes them (Wan's,
    AnyFlow's: the (fused) projection, RMS norms across heads, the rotary embedding), whatever
    processor it has now."""
    qkv = next(qkv for cls, (_, qkv, _) in _kinds().items() if isinstance(attn, cls))
    return qkv(attn, hidden_states, rotary_emb)


class LongSelfAttnProcessor:
    """Self-attention of >= `min_tokens` tokens through `attention8`; every other call goes to the
    attention class's own processor (`_kinds`: diffusers' `WanAttnProcessor`, or
    `FusedAnyFlowAttnProcessor`) unchanged. The choice is made per call shape (static under
    Dynamo: one graph per shape). `attn_cls`: the `_kinds` class it serves (Wan's by default)."""

    def __init__(self, min_tokens: int = MIN_TOKENS, attn_cls: type | None = None):
        from diffusers.models.transformers.transformer_wan import WanAttention
        fallback, self.qkv, _ = _kinds()[attn_cls or WanAttention]
        self.fallback = fallback()
        self.min_tokens = min_tokens

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        if (encoder_hidden_states is not None or attention_mask is not None
                or hidden_states.shape[1] < self.min_tokens
                or hidden_states.dtype not in DTYPES
                or attn.inner_dim // attn.heads not in HEAD_DIMS):
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        q, k, v = self.qkv(attn, hidden_states, rotary_emb)
        out = attention8(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def self_attentions(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Qualified name -> each self-attention of `module` this processor can take (`_kinds`: Wan's,
    not cross-attention; AnyFlow's, with its self-attention processor)."""
    return {n: m for n, m in module.named_modules() if _kind(m) is not None}


def has_long_attention(module: torch.nn.Module) -> bool:
    """Whether `module` has self-attentions this processor takes, without building anything."""
    return bool(self_attentions(module))


def _token_norm_width(norm) -> int | None:
    """How many channels `norm` normalises each token over, or None where it is not a per-token
    norm: torch's RMSNorm and LayerNorm (diffusers' FP32LayerNorm is one) and diffusers' RMSNorm
    give every token the same RMS over those channels, times weights every token shares."""
    from diffusers.models.normalization import RMSNorm
    if isinstance(norm, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
        shape = tuple(norm.normalized_shape)
    elif isinstance(norm, RMSNorm):
        shape = tuple(norm.dim)
    else:
        return None
    return shape[0] if len(shape) == 1 else None


def domain_miss(attn: torch.nn.Module) -> str | None:
    """Why `attn` is outside the kernel's domain, or None inside it. Inside: its q and k are each
    normalised per token (`norm_q`, `norm_k`: an RMS or layer norm over all heads' channels, as
    Wan's `rms_norm_across_heads`, or over one head's), read from the module itself.

    Why this rule: INT8 QK^T holds with channel outliers in Q or K (rotated away), a sharp softmax
    and outliers in V, each alone; but a few key tokens many times larger than the rest set their
    block's INT8 scale (32 key rows share one), and with K offsets and V outliers beside them the
    output drifts: cosine 0.989 (15 % error), 0.954 with all five perturbations (issue 61;
    tests/test_int8_attention.py). A per-token norm gives every key the same RMS: no such spike
    reaches the kernel."""
    widths = (attn.inner_dim, attn.inner_dim // attn.heads)
    for name in ("norm_q", "norm_k"):
        norm = getattr(attn, name, None)
        if _token_norm_width(norm) not in widths:
            return f"{name[-1]} not normalised per token ({name}: {type(norm).__name__})"
    return None


def outside_domain(module: torch.nn.Module) -> dict[str, str]:
    """Qualified name -> why, for each self-attention of `module` the kernel must not take."""
    return {n: why for n, a in self_attentions(module).items() if (why := domain_miss(a))}


def use_int8_attention(module: torch.nn.Module, min_tokens: int = MIN_TOKENS) -> int:
    """Give every Wan or AnyFlow self-attention of `module` inside the kernel's domain
    (`domain_miss`) the processor (one shared instance per attention class, so Dynamo sees the
    same object in every block); the others keep theirs. Returns how many got it."""
    procs: dict[type, LongSelfAttnProcessor] = {}
    n = 0
    for attn in self_attentions(module).values():
        if domain_miss(attn) is None:
            cls = _kind(attn)
            if cls not in procs:
                procs[cls] = LongSelfAttnProcessor(min_tokens, cls)
            attn.set_processor(procs[cls])
            n += 1
    return n
