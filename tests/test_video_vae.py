"""Wan's causal video VAEs (2.1's, and 2.2's residual one of TI2V-5B) decoded in chunks
(`compiler.video.video_vae`): the same video as diffusers' one-latent-frame-per-pass decode, on CPU with
narrow VAEs, and on the GPU at the published sizes compiled as `compile_pipe` installs it.

What could break: a chunk boundary that drops or repeats a frame, or reads the wrong cache (the
first chunk's frame 0 stays one frame; later chunks double in time); a frame count that is not
1 + a multiple of the chunk; the channels_last_3d layout changing values; the tiled path; Wan
2.2's shortcut (its first-chunk frame drop), its 2x2 patches, its chunk size; the four-phase
upsampling's phases (odd sizes, borders)."""

import copy
import time

import pytest
import torch
import torch.nn.functional as F

from compiler.video import video_vae


def _vae():
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, num_res_blocks=1).eval()


def _vae22():
    """Wan 2.2's VAE as TI2V-5B has it (48 latent channels, residual blocks, 2x2 patches, 16x
    space), narrow."""
    from runner.families import PRESETS
    torch.manual_seed(0)
    return PRESETS["wan22_ti2v_5b"].video_vae(True).eval()


# `compiler.kernels.winograd_triton`'s custom ops: what the fused residual block (`_fused_resblock`) calls.
FUSED_OPS = ("compiler::winograd_in", "compiler::winograd_mid", "compiler::winograd_out")


def fused_calls(fn):
    """fn()'s result, and how many times each of FUSED_OPS ran in it, read from the profiler's
    op events (compiled code calls the ops through the dispatcher too): whether the fused path
    ran, without a hook in the library. (It falls back quietly where `_fusable` is false, and a
    test comparing it with the reference would then compare the reference with itself.)"""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    names = [e.name for e in prof.events()]
    return out, {op: names.count(op) for op in FUSED_OPS}


@pytest.mark.parametrize("frames", [1, 2, 6, 9])
@pytest.mark.parametrize("chunk, channels_last, subpixel", [(1, False, False), (4, False, False),
                                                            (3, True, True)])
def test_chunked_decode_is_diffusers_decode(frames, chunk, channels_last, subpixel):
    """(The channels-last case also with the output convolution as `_taps_conv`.)"""
    vae = _vae()
    z = torch.randn(2, 16, frames, 8, 6)
    with torch.no_grad():
        ref = vae.decode(z).sample
        chunked = copy.deepcopy(vae)
        assert video_vae.supported(chunked)
        assert video_vae.chunked_decode(chunked, chunk, channels_last=channels_last,
                                        subpixel=subpixel, taps=channels_last) == {}  # eager
        assert hasattr(chunked.decoder.conv_out, "taps") == channels_last
        out = chunked.decode(z).sample
    assert out.shape == ref.shape == (2, 3, 4 * (frames - 1) + 1, 64, 48)
    tol = 0 if chunk == 1 and not channels_last else 1e-5    # same kernels per frame: bit-equal
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("frames", [1, 5, 9, 13])
def test_wan22_chunked_decode_is_diffusers_decode(frames):
    """Wan 2.2's decoder, fp32: per frame (bit-equal), in chunks of 4 (a shorter last chunk at 5
    and 13 latent frames), and in chunks of 3 in channels_last_3d with the four-phase upsampling
    (1e-5: the summed kernels round differently)."""
    vae = _vae22()
    assert vae.config.patch_size == 2 and vae.spatial_compression_ratio == 16
    z = torch.randn(1, 48, frames, 6, 5)
    with torch.no_grad():
        ref = vae.decode(z).sample
        assert ref.shape == (1, 3, 4 * (frames - 1) + 1, 96, 80)
        assert ref.abs().max() <= 1 and (ref.abs() < 0.99).float().mean() > 0.9   # not clipped away
        for chunk, channels_last, subpixel, tol in [(1, False, False, 0), (4, False, False, 1e-5),
                                                    (3, True, True, 1e-5)]:
            chunked = copy.deepcopy(vae)
            assert video_vae.supported(chunked)
            video_vae.chunked_decode(chunked, chunk, channels_last=channels_last, subpixel=subpixel)
            torch.testing.assert_close(chunked.decode(z).sample, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("t", [1, 2, 4, 6, 8])
@pytest.mark.parametrize("pad_hw", [(1, 1), (1, 0)])
def test_time_winograd_conv_is_the_causal_conv(m, t, pad_hw):
    """F(m, 3) along time over t frames after the 2-frame cache = diffusers' WanCausalConv3d over
    them (float64: transform errors show; t not a multiple of m: the direct convolution; batch 2
    of two tiles where t = 2m; H != W and padded apart: `_padding`'s (w, w, h, h) order), the new
    cache the same; the kernels follow deepcopy though the weight requires grad; a 3x1x1 or
    grouped convolution gets no Winograd kernels."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
    torch.manual_seed(t)
    conv = WanCausalConv3d(5, 4, 3, padding=(1, *pad_hw)).double()
    x, cache = torch.randn(2, 5, t, 6, 3, dtype=torch.float64), torch.randn(2, 5, 2, 6, 3, dtype=torch.float64)
    with torch.no_grad():
        ref, ref_cache = conv(x, cache_x=cache), torch.cat([cache, x], 2)[:, :, -2:]
    video_vae.winograd_weights(conv, m)
    assert hasattr(conv, f"winograd{m}") and conv.winograd2.shape == (4, 4, 5, 3, 3)
    assert "winograd2" not in conv.state_dict()                   # not saved with the weights
    assert conv.weight.requires_grad and not conv.winograd2.requires_grad
    conv = copy.deepcopy(conv)
    with torch.no_grad():
        out, new_cache = video_vae._cconv(conv, x, cache)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert torch.equal(new_cache, ref_cache)
    grouped = torch.nn.Conv3d(4, 4, 3, groups=2)
    video_vae.winograd_weights(grouped, 4)
    assert not hasattr(grouped, "winograd2")
    time_only = torch.nn.Conv3d(5, 10, (3, 1, 1))
    video_vae.winograd_weights(time_only, 4)
    assert not hasattr(time_only, "winograd2")
    with pytest.raises(ValueError, match="winograd=3"):
        video_vae.chunked_decode(_vae(), 1, winograd=3)


@pytest.mark.parametrize("t", [1, 4, 5])
@pytest.mark.parametrize("pad_hw", [(1, 1), (1, 0)])
def test_taps_conv_is_the_causal_conv(t, pad_hw):
    """A 3x3x3 convolution to few channels as one GEMM to its 27 taps and their shifted sum
    (`_taps_conv`) = diffusers' WanCausalConv3d over t frames after the cache (float64; batch 2,
    H != W, padded apart), the new cache the same; only 3x3x3 convolutions (stride 1, one group)
    to fewer than `NARROW` channels get the kernel, not saved with the weights."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
    torch.manual_seed(t)
    conv = WanCausalConv3d(7, 12, 3, padding=(1, *pad_hw)).double()
    x, cache = torch.randn(2, 7, t, 6, 5, dtype=torch.float64), torch.randn(2, 7, 2, 6, 5, dtype=torch.float64)
    with torch.no_grad():
        ref, ref_cache = conv(x, cache_x=cache), torch.cat([cache, x], 2)[:, :, -2:]
    k = video_vae.taps_weight(conv)
    assert k.shape == (7, 27 * 12)
    conv.register_buffer("taps", k, persistent=False)
    assert "taps" not in conv.state_dict()
    with torch.no_grad():
        out, new_cache = video_vae._cconv(conv, x, cache)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert torch.equal(new_cache, ref_cache)
    wide = torch.nn.Conv3d(7, video_vae.NARROW, 3)
    assert video_vae.taps_weight(wide) is None
    assert video_vae.taps_weight(torch.nn.Conv3d(7, 12, (3, 1, 1))) is None
    assert video_vae.taps_weight(torch.nn.Conv3d(8, 12, 3, groups=2)) is None


def test_wan22_decode_with_time_winograd(monkeypatch):
    """Wan 2.2's decoder, fp32, in chunks of 2 in channels_last_3d (convolutions over 1, 2, 4
    and 8 frames: direct, F(2, 3), F(4, 3) and two F(4, 3) tiles) with F(4, 3), the output
    convolution as the others or as `_taps_conv` (`NARROW` above its 12 channels only: this
    narrow decoder's others have 8 and more): diffusers' video within 1e-4 (the compiled path:
    the gpu test at the published size)."""
    monkeypatch.setattr(video_vae, "NARROW", 13)
    vae = _vae22()
    z = torch.randn(1, 48, 5, 6, 5)
    with torch.no_grad():
        ref = vae.decode(z).sample
        for taps in (False, True):
            fast = copy.deepcopy(vae)
            video_vae.chunked_decode(fast, 2, channels_last=True, subpixel=True, winograd=4,
                                     taps=taps)
            assert sum(hasattr(m, "winograd4") for m in fast.decoder.modules()) >= 10
            conv_out = fast.decoder.conv_out                    # 12 channels: taps, no Winograd
            assert hasattr(conv_out, "taps") == taps != hasattr(conv_out, "winograd4")
            torch.testing.assert_close(fast.decode(z).sample, ref, atol=1e-4, rtol=1e-4)


def test_winograd_decodes_at_least_winograd_chunk_frames_a_pass(monkeypatch):
    """`chunk=None` with time Winograd and its Triton passes: `chunk_for`'s one latent frame a
    pass at a wide frame becomes `WINOGRAD_CHUNK` (F(2, 3) / F(4, 3) in the low-resolution
    blocks); with Inductor's passes or without Winograd it stays `chunk_for`'s. (The Triton
    kernels themselves: the gpu tests; here `_fusable` is off so the blocks run on the CPU.)
    The four-phase kernels are buffers, not saved with the weights."""
    seen = []
    real = video_vae._chunk
    monkeypatch.setattr(video_vae, "_chunk", lambda fns, dec, x, *a: seen.append(x.shape[2])
                        or real(fns, dec, x, *a))
    monkeypatch.setattr(video_vae, "chunk_for", lambda *a, **k: 1)
    monkeypatch.setattr(video_vae, "WINOGRAD_CHUNK", 2)
    monkeypatch.setattr(video_vae, "triton_available", lambda: True)
    monkeypatch.setattr(video_vae, "_fusable", lambda block, m: False)
    z = torch.randn(1, 48, 6, 4, 4)
    for winograd, triton, passes in ((4, True, [1, 2, 2, 1]), (4, False, [1] * 6),
                                     (0, False, [1] * 6)):
        vae = _vae22()
        video_vae.chunked_decode(vae, None, subpixel=True, winograd=winograd, triton=triton)
        seen.clear()
        with torch.no_grad():
            vae.decode(z)
        assert seen == passes, (winograd, triton, seen)
    convs = [u.resample[1] for u, _ in map(video_vae._sampler, vae.decoder.up_blocks) if u]
    assert all(hasattr(c, "subpixel") and c.subpixel.shape == (4 * c.out_channels, c.in_channels, 2, 2)
               for c in convs)
    assert not any(k.endswith("subpixel") for k in vae.state_dict())
    with pytest.raises(ValueError, match="needs winograd=2 or 4"):
        video_vae.chunked_decode(_vae22(), 1, triton=True)
    monkeypatch.setattr(video_vae, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="triton=True: Triton does not import"):
        video_vae.chunked_decode(_vae22(), 1, winograd=4, triton=True)


@pytest.mark.parametrize("h, w, channels_last", [(5, 7, False), (4, 4, True), (1, 3, False)])
def test_four_phase_upsampling_is_the_upsample_then_the_conv(h, w, channels_last):
    """A 3x3 convolution of the 2x nearest upsampling = the 2x2 four-phase convolution of the
    frame itself (borders included: odd sizes, one row)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample
    torch.manual_seed(0)
    up = WanResample(6, "upsample2d", upsample_out_dim=5).eval()
    x = torch.randn(3, 6, h, w)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = up.resample(x)
        out = video_vae._up2x_conv(up.resample[1], x)
    assert video_vae._plain_up2x(up) and out.shape == ref.shape == (3, 5, 2 * h, 2 * w)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


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


def test_chunk_shrinks_with_the_frame_size_and_the_decoders_width():
    from diffusers import AutoencoderKLWan
    from runner.families.wan22 import TI2V_VAE
    assert video_vae.chunk_for(480, 832) == video_vae.CHUNK == 4
    assert video_vae.chunk_for(720, 1280) == 1 and video_vae.chunk_for(704, 1280) == 1
    assert video_vae.chunk_for(240, 416) == 16 and video_vae.chunk_for(4000, 4000) == 1
    with torch.device("meta"):          # the published decoders: 96 channels a pixel, and 512 on 2x2
        assert video_vae.widest_of(AutoencoderKLWan()) == video_vae.WIDEST == 96
        assert video_vae.widest_of(AutoencoderKLWan(**TI2V_VAE)) == 128
    assert video_vae.chunk_for(480, 832, widest=128) == 3
    assert video_vae.chunk_for(704, 1280, widest=128) == 1


def test_compile_pipe_installs_it_for_wan_and_not_for_a_2d_vae():
    import compiler
    from compiler.pipeline import _compile_vae
    from runner.serve.models import ModelSpec, build_pipeline
    pipe = build_pipeline(ModelSpec("wan21_t2v_1_3b", source="tiny"))
    assert video_vae.supported(pipe.vae)
    # dynamic: the chunks run eager (no per-resolution recompiles), the decode is still chunked
    compiler.compile_pipe(pipe, {"mode": "O2", "dynamic": True, "compile_text_encoder": False})
    assert pipe._compile_report["vae_blocks"] == {}
    assert pipe.vae._decode.func is video_vae._decode
    vae22 = _vae22()                                # on a CPU: Wan 2.2's decoder keeps direct convs
    _compile_vae(vae22, compiler.parse_options({"mode": "O2", "dynamic": True}), {}, "cpu")
    assert vae22._decode.func is video_vae._decode
    assert not any(hasattr(m, "winograd2") for m in vae22.decoder.modules())
    assert not video_vae.supported(build_pipeline(ModelSpec("pixart_alpha_512", source="tiny")).vae)


def test_missing_triton_is_one_line_and_the_decode_without_it(monkeypatch, caplog):
    """Where the Winograd passes' Triton kernels cannot run (Triton not importable: patched so
    on a GPU machine too; or no GPU) compile_pipe's VAE step says so in one line and installs
    the Winograd decode without them (eager here: `dynamic`), which decodes; with `TRITON` off
    it says nothing."""
    import sys

    import compiler
    from compiler.pipeline import _compile_vae
    monkeypatch.setitem(sys.modules, "triton", None)              # import triton -> ImportError
    monkeypatch.setattr(video_vae, "NARROW", 13)          # taps for conv_out (12) only, as at full size
    assert not video_vae.triton_available()
    opts = compiler.parse_options({"mode": "O2", "dynamic": True})
    for on, lines in ((True, 1), (False, 0)):
        monkeypatch.setattr(video_vae, "TRITON", on)
        caplog.clear()
        vae = _vae22()
        with caplog.at_level("WARNING"):
            _compile_vae(vae, opts, {}, "cuda")                # the CUDA settings, on this CPU
        said = [r.getMessage() for r in caplog.records if "Triton" in r.getMessage()]
        assert len(said) == lines, said
        assert sum(hasattr(m, "winograd4") for m in vae.decoder.modules()) >= 10
        assert vae._decode.args[5] is False                     # chunked_decode's triton
        z = torch.randn(1, 48, 3, 4, 4)
        with torch.no_grad():
            assert torch.isfinite(vae.decode(z).sample).all()


@pytest.mark.gpu
@pytest.mark.parametrize("frames", [33])
def test_full_size_compiled_chunked_decode_matches_eager(frames):
    """The published Wan VAE (random weights, fp16) at 480x832: the decode compile_pipe installs
    (compiled blocks, chunks, CUDA layout, `SUBPIXEL`) against diffusers' eager decode, within
    fp16 tolerance on [-1, 1] outputs, and no recompile on a second latent."""
    import compiler
    from compiler.pipeline import _compile_vae
    from diffusers import AutoencoderKLWan
    with torch.device("cuda"):
        vae = AutoencoderKLWan().to(torch.float16).eval()
    z = torch.randn(1, 16, (frames - 1) // 4 + 1, 60, 104, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        ref = vae.decode(z).sample.float()
        fast = copy.deepcopy(vae)
        torch._dynamo.config.recompile_limit = 64
        opts = compiler.parse_options("O2")
        counts = _compile_vae(fast, opts, compiler.compile_kwargs(opts, denoiser=False), "cuda")
        assert counts["resblock"] == 14          # middle 2, up blocks 3 x 4
        out = fast.decode(z).sample.float()
        with torch._dynamo.config.patch(error_on_recompile=True):
            _, ran = fused_calls(lambda: fast.decode(torch.randn_like(z)))
    # time Winograd and its Triton passes are on for CUDA (`WINOGRAD`, `TRITON`): the fused blocks ran
    assert video_vae.WINOGRAD and video_vae.TRITON and len(set(ran.values())) == 1 and ran[FUSED_OPS[0]] > 0, ran
    err = (out - ref).abs().max().item()
    print(f"Wan VAE {frames} frames, compiled chunked vs diffusers eager: max abs {err:.3g}")
    assert out.shape == ref.shape and torch.isfinite(out).all() and err <= 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bs, ci, co, t, h, w, m, layout", [
    (1, 1024, 512, 4, 176, 320, 4, "cl"), (1, 512, 256, 4, 352, 640, 4, "cl"),
    (1, 256, 256, 4, 352, 640, 4, "cl"), (1, 1024, 1024, 2, 88, 160, 2, "cl"),
    (2, 512, 256, 8, 352, 640, 4, "cl"),        # offsets past 2^31 (int64 indexing)
    (1, 256, 256, 8, 45, 81, 4, "cl"), (1, 512, 512, 4, 23, 37, 2, "cl"),
    (2, 96, 100, 4, 9, 13, 2, "contiguous"), (3, 100, 96, 8, 7, 5, 4, "contiguous")])
def test_triton_winograd_resblock_matches_the_reference(bs, ci, co, t, h, w, m, layout,
                                                        monkeypatch):
    """`resblock(triton=True)` (`compiler.kernels.winograd_triton`'s kernels around cuDNN's products) at
    the TI2V-5B decoder's residual-block shapes (one and two tiles: the middle kernel takes a
    tile's first frames from the tile before), two videos at the widest (offsets past 2^31),
    and odd sizes with channels that are not powers of two (the two-pass form), batches of 2-3
    and inputs in the contiguous layout; fp16, input with outlier channels (offsets 20x the std
    on 4 channels): its error against the fp32 direct convolution (TF32 off) within 1.5x that of
    the PyTorch Winograd path in fp16, the caches as well."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock
    torch.manual_seed(0)
    with torch.device("cuda"):
        exact = WanResidualBlock(ci, co).eval()
        for n in (exact.norm1, exact.norm2):
            n.gamma.data.uniform_(0.5, 1.5)
        cl = dict(memory_format=torch.channels_last_3d)
        x = torch.randn(bs, ci, t, h, w)
        x[:, :4] += 20                                         # outlier channels
        c1, c2 = torch.randn(bs, ci, 2, h, w).sigmoid(), torch.randn(bs, co, 2, h, w).sigmoid()
    half = copy.deepcopy(exact).half()
    for conv in (half.conv1, half.conv2):
        conv.weight.data = conv.weight.data.contiguous(**cl)
        video_vae.winograd_weights(conv, m)
    fmt = cl if layout == "cl" else dict(memory_format=torch.contiguous_format)
    args = [a.half().contiguous(**fmt) for a in (x, c1, c2)]
    with torch.no_grad():
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)   # fp32, not TF32
        truth = video_vae.resblock(exact, x, c1, c2)
        monkeypatch.undo()
        ref = video_vae.resblock(half, *args)
        got, ran = fused_calls(lambda: video_vae.resblock(half, *args, triton=True))
    assert ran == dict.fromkeys(FUSED_OPS, 1), ran           # the fused path, not the fallback
    for name, tr, r, g in zip(("out", "cache1", "cache2"), truth, ref, got):
        assert g.shape == r.shape and g.is_contiguous(**cl), name
        e_ref, e_got = (r.float() - tr).abs().max().item(), (g.float() - tr).abs().max().item()
        print(f"{bs} x {ci}->{co} x {t} frames {h}x{w} ({layout}) F({m}, 3) {name}: max abs "
              f"vs fp32 direct: triton {e_got:.3g}, pytorch {e_ref:.3g} (of {tr.abs().max().item():.3g})")
        assert e_got <= 1.5 * e_ref + 1e-3, name


@pytest.mark.gpu
def test_the_fused_path_check_sees_a_skipped_fused_path(monkeypatch):
    """With `_fusable` false (a block the kernels do not compute) `resblock(triton=True)` falls
    back to the reference path quietly: `fused_calls` reads no fused op, so the tests above that
    assert the fused path ran fail on such a fallback."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock
    with torch.device("cuda"):
        block = WanResidualBlock(96, 100).eval().half()
        x = torch.randn(1, 96, 4, 9, 13, dtype=torch.float16)
        c1, c2 = torch.randn(1, 96, 2, 9, 13, dtype=torch.float16), torch.randn(1, 100, 2, 9, 13, dtype=torch.float16)
    for conv in (block.conv1, block.conv2):
        video_vae.winograd_weights(conv, 2)
    with torch.no_grad():
        _, ran = fused_calls(lambda: video_vae.resblock(block, x, c1, c2, triton=True))
        assert ran == dict.fromkeys(FUSED_OPS, 1), ran
        monkeypatch.setattr(video_vae, "_fusable", lambda block, m: False)
        _, ran = fused_calls(lambda: video_vae.resblock(block, x, c1, c2, triton=True))
    assert ran == dict.fromkeys(FUSED_OPS, 0), ran


@pytest.mark.gpu
@pytest.mark.parametrize("ci, co, t, h, w", [(256, 12, 8, 352, 640), (256, 12, 1, 352, 640),
                                             (96, 3, 16, 480, 832), (100, 5, 3, 7, 9)])
def test_taps_conv_matches_the_reference(ci, co, t, h, w, monkeypatch):
    """`_taps_conv` at both decoders' output convolutions (TI2V-5B: 256 -> 12 at 352x640 over
    8 frames and the first chunk's 1; Wan 2.1: 96 -> 3 at 480x832 over 16) and an odd one, fp16
    channels_last_3d, its input the head's SiLU of frames with outlier channels (offsets 20x the
    std on 4 channels): its error against the fp32 convolution (TF32 off) within 4x that of
    cuDNN's fp16 convolution (the contributions round to fp16 before their sum) + 1e-3."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
    torch.manual_seed(0)
    cl = dict(memory_format=torch.channels_last_3d)
    with torch.device("cuda"):
        conv = WanCausalConv3d(ci, co, 3, padding=1).eval()
        x = torch.randn(1, ci, t, h, w)
        x[:, :4] += 20
        x, cache = F.silu(x), F.silu(torch.randn(1, ci, 2, h, w))
    half = copy.deepcopy(conv).half()
    half.weight.data = half.weight.data.contiguous(**cl)
    xh, ch = x.half().contiguous(**cl), cache.half().contiguous(**cl)
    with torch.no_grad():
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        truth = video_vae._cconv(conv, x, cache)[0]
        monkeypatch.undo()
        ref = video_vae._cconv(half, xh, ch)[0]
        half.register_buffer("taps", video_vae.taps_weight(half), persistent=False)
        got, new = video_vae._cconv(half, xh, ch)
    assert got.shape == ref.shape == truth.shape and got.is_contiguous(**cl)
    assert torch.equal(new, torch.cat([ch, xh], 2)[:, :, -2:])
    e_ref, e_got = (ref.float() - truth).abs().max().item(), (got.float() - truth).abs().max().item()
    print(f"taps conv {ci}->{co} x {t} frames {h}x{w}: max abs vs fp32: taps {e_got:.3g}, cuDNN "
          f"fp16 {e_ref:.3g} (of {truth.abs().max().item():.3g})")
    assert e_got <= 4 * e_ref + 1e-3


@pytest.mark.gpu
def test_full_size_wan22_chunked_decode_matches_diffusers():
    """TI2V-5B's VAE at the published size (random weights, fp16, 704x1280 x 121 frames: 31
    latent frames of 44x80): the decode `compile_pipe` installs (compiled blocks, `chunk_for`'s
    chunk, channels_last_3d, `SUBPIXEL`, `WINOGRAD`) against diffusers' eager decode: PSNR >= 40 dB on the
    uint8 frames, max abs <= 5e-2 on the [-1, 1] outputs (fp16 rounding of 2 PFLOP of
    convolutions grouped differently), no recompile on a second latent, the fused Triton passes
    run. Two compiled calls: the first compiles and makes the video compared, the second (another
    latent) shows no recompile and the fused passes. Prints one call's time of each (the figure is
    the bench's median: `python -m runner.bench.decode model=wan22_ti2v_5b frames=121
    variants=installed`). The settings
    `compile_pipe` installs (`video_vae.WINOGRAD`, `TRITON`, `WINOGRAD_CHUNK`); the other
    variants (Winograd off, Inductor's passes, other chunks) are the bench's
    (`variants=winograd`), their kernels checked at every production shape by
    `test_triton_winograd_resblock_matches_the_reference`."""
    import compiler
    from compiler.pipeline import _compile_vae
    from runner.bench.decode import psnr_uint8, time_decode
    from runner.families import PRESETS
    with torch.device("cuda"):
        vae = PRESETS["wan22_ti2v_5b"].video_vae(False).to(torch.float16).eval()
    z = torch.randn(1, 48, 31, 44, 80, device="cuda", dtype=torch.float16)
    t0 = time.perf_counter()     # where the test's seconds go, printed (one of the suite's longest)
    ms_ref, ref = time_decode(vae, z, iters=1, warmup=0)    # eager: one call, timed (6 s here)
    t_ref = time.perf_counter() - t0
    fast = copy.deepcopy(vae)
    opts = compiler.parse_options("O2")
    winograd, triton, least = video_vae.WINOGRAD, video_vae.TRITON, video_vae.WINOGRAD_CHUNK
    assert winograd and triton, "the production decode: time-Winograd with its Triton passes"
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64            # compile_pipe raises it by its block count
    counts = _compile_vae(fast, opts, compiler.compile_kwargs(opts, denoiser=False), "cuda")
    assert counts["resblock"] == 14 and counts["upsample"] == 3     # middle 2, up blocks 4 x 3
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fast.decode(z, return_dict=False)[0]       # the first call compiles: its video compared
    t_fast = time.perf_counter() - t0
    # the second call, on another latent: no recompile, the fused passes ran, and its time (under
    # the profiler, host events only: printed, not asserted; the bench's median is the figure)
    z2, (a, b) = torch.randn_like(z), [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        a.record()
        _, ran = fused_calls(lambda: fast.decode(z2))
        b.record()
    torch.cuda.synchronize()
    ms = a.elapsed_time(b)
    # each fused block calls the three ops once; with `triton` off none runs
    assert len(set(ran.values())) == 1 and (ran[FUSED_OPS[0]] > 0) == triton, ran
    err, psnr = (out.float() - ref.float()).abs().max().item(), psnr_uint8(out, ref)
    # the 3x3x3 convolutions but conv_out (12 channels: `_taps_conv`)
    assert sum(hasattr(m, "winograd4") for m in fast.decoder.modules()) == (29 if winograd else 0)
    assert hasattr(fast.decoder.conv_out, "taps") == video_vae.TAPS
    print(f"Wan 2.2 VAE 704x1280x121, compiled chunked (winograd {winograd}, triton {triton}, "
          f"chunk >= {least}) "
          f"vs diffusers: max abs {err:.3g}, PSNR "
          f"{psnr} dB; one call {ms:.0f} ms (profiled) vs {ms_ref:.0f} ms, peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(f"seconds: diffusers' call {t_ref:.1f}, the compile and first call {t_fast:.1f}")
    assert out.shape == ref.shape == (1, 3, 121, 704, 1280) and torch.isfinite(out).all()
    assert psnr >= 40 and err <= 5e-2

