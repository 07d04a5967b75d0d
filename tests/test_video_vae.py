"""Wan's causal video VAE decoded in chunks (`compiler.video_vae`): the same video as diffusers'
one-latent-frame-per-pass decode, on CPU with a narrow VAE, and on the GPU at the published size
compiled as `compile_pipe` installs it.

What could break: a chunk boundary that drops or repeats a frame, or reads the wrong cache (the
first chunk's frame 0 stays one frame; later chunks double in time); a frame count that is not
1 + a multiple of the chunk; the channels_last_3d layout changing values; the tiled path."""

import copy

import pytest
import torch

from compiler import video_vae


def _vae():
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, num_res_blocks=1).eval()


@pytest.mark.parametrize("frames", [1, 2, 6, 9])
@pytest.mark.parametrize("chunk, channels_last", [(1, False), (4, False), (3, True)])
def test_chunked_decode_is_diffusers_decode(frames, chunk, channels_last):
    vae = _vae()
    z = torch.randn(2, 16, frames, 8, 6)
    with torch.no_grad():
        ref = vae.decode(z).sample
        chunked = copy.deepcopy(vae)
        assert video_vae.supported(chunked)
        assert video_vae.chunked_decode(chunked, chunk, channels_last=channels_last) == {}  # eager
        out = chunked.decode(z).sample
    assert out.shape == ref.shape == (2, 3, 4 * (frames - 1) + 1, 64, 48)
    tol = 0 if chunk == 1 and not channels_last else 1e-5    # same kernels per frame: bit-equal
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_tiled_decode_keeps_diffusers_path_and_bad_chunk_is_an_error():
    vae = _vae()
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32)
    z = torch.randn(1, 16, 2, 8, 6)
    with torch.no_grad():
        ref = vae.decode(z).sample
        video_vae.chunked_decode(vae, 4)
        torch.testing.assert_close(vae.decode(z).sample, ref, atol=0, rtol=0)
    with pytest.raises(ValueError, match="chunk=0"):
        video_vae.chunked_decode(_vae(), 0)


def test_chunk_shrinks_with_the_frame_size():
    assert video_vae.chunk_for(480, 832) == video_vae.CHUNK == 4
    assert video_vae.chunk_for(720, 1280) == 1 and video_vae.chunk_for(704, 1280) == 1
    assert video_vae.chunk_for(240, 416) == 16 and video_vae.chunk_for(4000, 4000) == 1


def test_compile_pipe_installs_it_for_wan_and_not_for_a_2d_vae():
    import compiler
    from runner.models import ModelSpec, build_pipeline
    pipe = build_pipeline(ModelSpec("wan21_t2v_1_3b", source="tiny"))
    assert video_vae.supported(pipe.vae)
    # dynamic: the chunks run eager (no per-resolution recompiles), the decode is still chunked
    compiler.compile_pipe(pipe, {"mode": "O2", "dynamic": True, "compile_text_encoder": False})
    assert pipe._compile_report["vae_blocks"] == {}
    assert pipe.vae._decode.func is video_vae._decode
    assert not video_vae.supported(build_pipeline(ModelSpec("pixart_alpha_512", source="tiny")).vae)


@pytest.mark.gpu
@pytest.mark.parametrize("frames", [33])
def test_full_size_compiled_chunked_decode_matches_eager(frames):
    """The published Wan VAE (random weights, fp16) at 480x832: the decode compile_pipe installs
    (compiled blocks, chunks, CUDA layout) against diffusers' eager decode, within fp16 tolerance
    on [-1, 1] outputs, and no recompile on a second latent."""
    import compiler
    from diffusers import AutoencoderKLWan
    with torch.device("cuda"):
        vae = AutoencoderKLWan().to(torch.float16).eval()
    z = torch.randn(1, 16, (frames - 1) // 4 + 1, 60, 104, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        ref = vae.decode(z).sample.float()
        fast = copy.deepcopy(vae)
        torch._dynamo.config.recompile_limit = 64
        counts = video_vae.chunked_decode(fast, None, compiler.compile_kwargs(
            compiler.parse_options("O2"), denoiser=False), channels_last=video_vae.CHANNELS_LAST)
        assert counts["resblock"] == 14          # middle 2, up blocks 3 x 4
        out = fast.decode(z).sample.float()
        with torch._dynamo.config.patch(error_on_recompile=True):
            fast.decode(torch.randn_like(z))
    err = (out - ref).abs().max().item()
    print(f"Wan VAE {frames} frames, compiled chunked vs diffusers eager: max abs {err:.3g}")
    assert out.shape == ref.shape and torch.isfinite(out).all() and err <= 3e-2
