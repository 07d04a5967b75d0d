"""Wan's causal video VAE decoder, run over chunks of frames with its causal caches as plain tensors.

Contract: `chunked_decode(vae, chunk=None, compile_kwargs=None, channels_last=False)` replaces
`vae._decode` of a diffusers `AutoencoderKLWan` with the Wan 2.1 decoder (`decoder.up_blocks` of
`WanUpBlock`; `supported(vae)` says whether it is one) so that `vae.decode(z)` decodes latent
frame 0 alone, then the other latent frames `chunk` at a time, and returns what diffusers' decode
returns: the same causal convolutions over the same frames, grouped differently, so equal up to
the rounding of the convolution kernels (fp16 tolerance; tests/test_video_vae.py). Tiled decoding
(`vae.enable_tiling()`) keeps diffusers' own path. Returns the number of blocks per compiled
function, by name (`compile_kwargs=None`: eager).

Why: diffusers decodes one latent frame per decoder pass (4 video frames; 21 passes for 81
frames), every causal convolution taking its 2-frame cache from a Python list that also holds the
marker string "Rep", indexed by a counter in another list. Per-frame passes keep the
low-resolution convolutions small (60x104 latents: 6,240 positions per pass), and the list, the
string and the counter are Python state that Dynamo would guard on (one recompile per block
index). Here each block is a function (module, x, caches) -> (x, new caches): one compiled graph
per block shape and chunk length, shared by every block of that shape, with RMS norm, SiLU and
the cache concatenation fused around cuDNN's convolutions. Caches start as zeros, which is what
the causal padding was. `channels_last`: the decoder's weights and activations in
`torch.channels_last_3d`, the layout cuDNN's tensor-core kernels for 3-D convolutions read
natively (measured against the default in BENCHMARKS).

Shapes (Wan 2.1, 480x832, 81 frames): latents (B, 16, 21, 60, 104) -> video (B, 3, 81, 480, 832);
275 TFLOP of convolutions, 96.6 of them at full resolution with 96 channels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CACHE_T = 2   # frames of a causal convolution's input kept for the next chunk (time kernel 3)
# What compile_pipe installs (measured, `python -m runner.bench.decode model=wan21_t2v_1_3b` in
# BENCHMARKS: 81 frames at 480x832 on an H100, diffusers 2066 ms; chunks of 4, compiled: 1065 ms
# contiguous, 875 ms channels_last_3d, peak 18.6 GiB): latent frames per decoder pass after the
# first at 480x832, scaled down for larger frames so that a pass's activations stay that size
# (`chunk_for`), and the CUDA layout.
CHUNK = 4
CHANNELS_LAST = True


def chunk_for(height: int, width: int, chunk: int = CHUNK) -> int:
    """Latent frames per pass for (height, width) video frames: `chunk` at 480x832, fewer for
    larger frames (720x1280: 1), at least 1."""
    return max(1, chunk * 480 * 832 // (height * width))


def supported(vae) -> bool:
    """A Wan 2.1-style causal video VAE (not the residual decoder of Wan 2.2's 48-channel VAE)."""
    dec = getattr(vae, "decoder", None)
    ups = getattr(dec, "up_blocks", None)
    return (type(vae).__name__ == "AutoencoderKLWan" and ups is not None
            and all(type(u).__name__ == "WanUpBlock" for u in ups))


def _cconv(conv, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A WanCausalConv3d over (B, Ci, T, H, W) after its (B, Ci, 2, H, W) cache: (B, Co, T, H, W)
    and the new cache (the last 2 frames of cache + input). Spatial zero padding is the
    convolution's own (no padded copy); the time padding is the cache."""
    x = torch.cat([cache, x], 2)
    pad = conv._padding                                   # (w, w, h, h, 2 * t, 0) as diffusers keeps it
    y = F.conv3d(x, conv.weight, conv.bias, conv.stride, (0, pad[2], pad[0]))
    return y, x[:, :, -CACHE_T:].clone()


def resblock(block, x, c1, c2):
    """WanResidualBlock: (B, Ci, T, H, W) -> (B, Co, T, H, W) and its two convolutions' caches."""
    h = block.conv_shortcut(x)                            # identity, or a 1x1x1 conv (no cache)
    y = block.nonlinearity(block.norm1(x))
    y, c1 = _cconv(block.conv1, y, c1)
    y = block.nonlinearity(block.norm2(y))                # (dropout: eval, none)
    y, c2 = _cconv(block.conv2, y, c2)
    return y + h, c1, c2


def upsample(up, x, cache, first: bool):
    """WanResample upsample2d / upsample3d: (B, C, T, H, W) -> (B, C/2, T', 2H, 2W), T' = 2T for
    upsample3d except on the first chunk (frame 0 stays one frame: diffusers' "Rep")."""
    b, c, t, h, w = x.shape
    if up.mode == "upsample3d" and not first:
        y, cache = _cconv(up.time_conv, x, cache)         # (B, 2C, T, H, W): each frame's two halves
        x = y.reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        t = 2 * t
    y = up.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))   # per frame, 2-D
    return y.view(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4), cache


def head(dec, x, cache):
    """The decoder's RMS norm, SiLU and output convolution: (B, 96, T, H, W) -> (B, 3, T, H, W)."""
    return _cconv(dec.conv_out, dec.nonlinearity(dec.norm_out(x)), cache)


def stem(dec, x, cache):
    """The decoder's input convolution: (B, 16, T, h, w) latents -> (B, 384, T, h, w)."""
    return _cconv(dec.conv_in, x, cache)


def attention(attn, x):
    """The middle block's per-frame spatial self-attention (no time cache)."""
    return attn(x)


FUNCTIONS = {f.__name__: f for f in (stem, resblock, attention, upsample, head)}


class _Caches:
    """The causal caches of one decode, in call order: zeros before the first chunk (what the
    causal padding was), each call's new cache in place of its old one."""

    def __init__(self, memory_format):
        self.k, self.slots, self.format = 0, [], memory_format

    def take(self, like: torch.Tensor, channels: int | None = None) -> torch.Tensor:
        """The next cache: for an input like `like` (B, C, T, H, W), with `channels` if given."""
        if self.k == len(self.slots):
            b, c, _, h, w = like.shape
            self.slots.append(like.new_zeros(b, channels or c, CACHE_T, h, w).contiguous(
                memory_format=self.format))
        self.k += 1
        return self.slots[self.k - 1]

    def put(self, *new: torch.Tensor) -> None:
        """The new caches of the last len(new) taken."""
        self.slots[self.k - len(new):self.k] = list(new)


def _chunk(fns: dict, dec, x: torch.Tensor, caches: _Caches, first: bool) -> torch.Tensor:
    """One decoder pass over a chunk of latent frames, as WanDecoder3d.forward with its caches."""
    caches.k = 0
    x, c = fns["stem"](dec, x, caches.take(x))
    caches.put(c)
    mid = dec.mid_block
    blocks = [("resblock", mid.resnets[0])]
    for attn, res in zip(mid.attentions, mid.resnets[1:]):
        blocks += [("attention", attn), ("resblock", res)]
    for up in dec.up_blocks:
        blocks += [("resblock", r) for r in up.resnets]
        if up.upsamplers is not None:
            blocks.append(("upsample", up.upsamplers[0]))
    for kind, m in blocks:
        if kind == "attention":
            x = fns["attention"](m, x)
        elif kind == "resblock":
            # the second convolution's input has the block's output channels
            c1, c2 = caches.take(x), caches.take(x, m.conv2.in_channels)
            x, c1, c2 = fns["resblock"](m, x, c1, c2)
            caches.put(c1, c2)
        elif m.mode == "upsample3d":
            x, c = fns["upsample"](m, x, caches.take(x), first)
            caches.put(c)
        else:
            x, _ = fns["upsample"](m, x, None, first)
    x, c = fns["head"](dec, x, caches.take(x))
    caches.put(c)
    return x


def _decode(vae, fns: dict, chunk: int | None, channels_last: bool, original, z: torch.Tensor,
            return_dict: bool = True):
    """`vae._decode` (diffusers' signature): (B, 16, F, h, w) latents -> (B, 3, 4(F-1)+1, 8h, 8w)
    in [-1, 1]. `chunk` None: `chunk_for` the frame size."""
    from diffusers.models.autoencoders.vae import DecoderOutput
    _, _, frames, height, width = z.shape
    if vae.use_tiling and (width > vae.tile_sample_min_width // vae.spatial_compression_ratio
                           or height > vae.tile_sample_min_height // vae.spatial_compression_ratio):
        return original(z, return_dict=return_dict)
    x = vae.post_quant_conv(z)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    chunk = chunk or chunk_for(height * vae.spatial_compression_ratio, width * vae.spatial_compression_ratio)
    caches = _Caches(torch.channels_last_3d if channels_last else torch.contiguous_format)
    out = []
    starts = [0, *range(1, frames, chunk)]
    for i, s in enumerate(starts):
        e = 1 if i == 0 else min(s + chunk, frames)
        out.append(_chunk(fns, vae.decoder, x[:, :, s:e], caches, first=i == 0))
    out = torch.clamp(torch.cat(out, 2), min=-1.0, max=1.0)
    return DecoderOutput(sample=out) if return_dict else (out,)


def chunked_decode(vae, chunk: int | None = None, compile_kwargs: dict | None = None,
                   channels_last: bool = False) -> dict[str, int]:
    """Install the chunked decode on `vae` (module docstring). `chunk`: latent frames per pass
    after the first (None: `chunk_for` each call's frame size). `compile_kwargs`: torch.compile's
    arguments for each block function (None: eager)."""
    if not supported(vae):
        raise ValueError(f"{type(vae).__name__}: not a Wan 2.1-style causal video VAE")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk={chunk}: latent frames per decoder pass must be >= 1")
    if channels_last:   # convolution weights in the activations' layout (3-D and the 2-D resamples)
        for m in vae.decoder.modules():
            if isinstance(m, (torch.nn.Conv3d, torch.nn.Conv2d)):
                fmt = torch.channels_last_3d if m.weight.dim() == 5 else torch.channels_last
                m.weight.data = m.weight.data.contiguous(memory_format=fmt)
    fns = dict(FUNCTIONS)
    if compile_kwargs is not None:
        fns = {k: torch.compile(f, **compile_kwargs) for k, f in fns.items()}
    original = vae._decode
    vae._decode = functools.partial(_decode, vae, fns, chunk, channels_last, original)
    dec = vae.decoder
    counts = {"resblock": len(dec.mid_block.resnets) + sum(len(u.resnets) for u in dec.up_blocks),
              "attention": len(dec.mid_block.attentions),
              "upsample": sum(u.upsamplers is not None for u in dec.up_blocks), "stem": 1, "head": 1}
    return counts if compile_kwargs is not None else {}
