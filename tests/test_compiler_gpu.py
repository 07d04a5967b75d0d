"""Full-size checks on a CUDA GPU (random weights at the published size, fp16)."""

import pytest
import torch

from compiler import compile_pipe
from runner.models import ModelSpec, build_pipeline

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _call(pipe, steps, **kw):
    out = pipe(prompt="a red fox in the snow", num_inference_steps=steps, output_type="latent",
               generator=torch.Generator("cuda").manual_seed(0), **kw)
    return (out.frames if hasattr(out, "frames") else out.images).float()


@pytest.mark.parametrize("preset, kw", [
    ("pixart_alpha_1024", dict(height=1024, width=1024, clean_caption=False, use_resolution_binning=False)),
    ("sd21", dict(height=768, width=768)),
    ("latte1", dict(height=512, width=512, video_length=16)),
])
@pytest.mark.parametrize("mode", ["O2"])
def test_full_size_lossless_matches_eager(preset, kw, mode):
    pipe = build_pipeline(ModelSpec(preset, source="random", dtype="fp16", device="cuda"))
    ref = _call(pipe, 4, **kw)
    compile_pipe(pipe, {"mode": mode, "memory_format": "channels_last"})
    _call(pipe, 4, **kw)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = _call(pipe, 4, **kw)
    # fp16 kernels differ (fusion order, attention backend): half-precision tolerance, relative to scale
    scale = ref.abs().max().item()
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= 2e-2 * max(scale, 1.0)


@pytest.mark.parametrize("n, s, heads, d", [(2048, 16, 16, 72), (64, 5, 4, 64), (32, 33, 2, 40)])
def test_short_attention_kernel_matches_sdpa(n, s, heads, d):
    from compiler.short_attention import _reference, short_attention
    qkv = torch.randn(n, s, 3 * heads * d, device="cuda", dtype=torch.float16)
    ref = _reference(qkv.float(), heads)
    out = short_attention(qkv, heads)
    assert out.shape == (n, s, heads * d) and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    # a strided view (every other sequence) reads the same values
    torch.testing.assert_close(short_attention(qkv[::2], heads).float(), ref[::2], atol=2e-3, rtol=2e-3)


for _m in gpu:
    test_short_attention_kernel_matches_sdpa = _m(test_short_attention_kernel_matches_sdpa)
for _m in gpu:
    test_full_size_lossless_matches_eager = _m(test_full_size_lossless_matches_eager)
