"""The kernel-level transforms (GELU epilogue op, FP8 linears) on CPU: equivalence and traceability."""

import torch

from compiler.transforms import FP8Linear, fuse_gelu, fuse_qkv, linear_gelu_tanh, to_fp8
from runner.serve.models import ModelSpec, build_pipeline


def test_linear_gelu_op_matches_and_compiles():
    x, w, b = torch.randn(2, 5, 16), torch.randn(32, 16), torch.randn(32)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")
    torch.testing.assert_close(linear_gelu_tanh(x, w, b), ref)
    f = torch.compile(lambda x: linear_gelu_tanh(x, w, b) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(x), ref * 2)


def test_fuse_gelu_on_pixart_is_exact():
    pipe = build_pipeline(ModelSpec("pixart_alpha_512", source="tiny"))
    den = pipe.transformer
    x = torch.randn(1, 4, 8, 8)
    kw = dict(encoder_hidden_states=torch.randn(1, 6, 32), timestep=torch.tensor([10]),
              added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)
    ref = den(x, **kw)[0]
    assert fuse_gelu(den) == 2  # one per block
    torch.testing.assert_close(den(x, **kw)[0], ref)


def test_fp8_linear_error_is_small_and_only_used_linears_convert():
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(3, 7, 64)
    rel = (FP8Linear(lin)(x) - lin(x)).abs().max() / lin(x).abs().max()
    assert rel < 0.08  # e4m3: 3 mantissa bits
    pipe = build_pipeline(ModelSpec("pixart_alpha_512", source="tiny"))
    den = pipe.transformer
    fuse_qkv(den)
    n = to_fp8(den, ("BasicTransformerBlock",))
    # per block: to_qkv, to_out (self); to_q, to_kv, to_out (cross); ff in/out  -> 7
    assert n == 2 * 7
    attn1 = den.transformer_blocks[0].attn1
    assert type(attn1.to_q) is torch.nn.Linear and isinstance(attn1.to_qkv, FP8Linear)
    # the projections feeding attention add their bias in the GEMM; the others leave it to Inductor
    blk = den.transformer_blocks[0]
    assert attn1.to_qkv.bias_in_gemm and blk.attn2.to_q.bias_in_gemm and blk.attn2.to_kv.bias_in_gemm
    assert not attn1.to_out[0].bias_in_gemm and not blk.ff.net[2].bias_in_gemm


def test_fp8_linear_bias_in_gemm_matches_bias_after():
    """Same weights and quantisation, bias added by the GEMM vs after it: same result to the
    output dtype's rounding, in the layer's own dtype either way."""
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    lin.bias.data.normal_(0, 4)   # a bias that matters next to the product
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16)
    inside, after = FP8Linear(lin, bias_in_gemm=True), FP8Linear(lin)
    assert inside.bias_in_gemm and not after.bias_in_gemm
    y = inside(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 7, 48)
    torch.testing.assert_close(y, after(x), atol=0.05, rtol=0.02)
    assert (y - lin(x)).abs().max() > 0  # FP8 is lossy: the check above compared the two FP8 paths


def test_rewritten_blocks_still_share_one_graph_per_shape():
    """The GELU rewrite must not make Dynamo specialise on each block instance: 12 Latte blocks
    (6 spatial + 6 temporal, all BasicTransformerBlock) compile to a few graphs, not 12+."""
    from diffusers import LatteTransformer3DModel
    from torch._dynamo.utils import counters
    from compiler.transforms import compile_blocks
    from runner.families.latte import LATTE, TINY_VIDEO_LENGTH, denoiser_config

    cfg = dict(denoiser_config(LATTE.presets["latte1"], tiny=True), num_layers=6)
    den = LatteTransformer3DModel.from_config(cfg).eval()
    x = torch.randn(1, 4, TINY_VIDEO_LENGTH, 8, 8)
    kw = dict(encoder_hidden_states=torch.randn(1, 6, 32), timestep=torch.tensor([10]), return_dict=False)
    with torch.no_grad():
        ref = den(x, **kw)[0]
        fuse_qkv(den)
        assert fuse_gelu(den) == 12
        torch._dynamo.reset()
        counters.clear()
        assert compile_blocks(den, dict(fullgraph=True, backend="aot_eager")) == {"BasicTransformerBlock": 12}
        out = den(x, **kw)[0]
    # spatial and temporal shapes, plus the first temporal block's strided input: 3, whatever the depth
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _tiny_latte(num_layers=4):
    from diffusers import LatteTransformer3DModel
    from runner.families.latte import LATTE, TINY_VIDEO_LENGTH, denoiser_config
    cfg = dict(denoiser_config(LATTE.presets["latte1"], tiny=True), num_layers=num_layers)
    den = LatteTransformer3DModel.from_config(cfg).eval()
    x = torch.randn(2, 4, TINY_VIDEO_LENGTH, 8, 8)
    kw = dict(encoder_hidden_states=torch.randn(2, 6, 32), timestep=torch.tensor([10, 10]), return_dict=False)
    return den, x, kw


def test_latte_pair_forward_is_diffusers_forward_in_eager():
    from compiler.video.block_pairs import compile_pairs, has_block_pairs
    from compiler.transforms import block_classes
    from diffusers import PixArtTransformer2DModel
    from runner.families.pixart import ALPHA
    den, x, kw = _tiny_latte()
    # found by structure (no class names): the pairs, and the block class of DiTs that declare none
    assert has_block_pairs(den) and block_classes(den) == ("BasicTransformerBlock",)
    pixart = PixArtTransformer2DModel.from_config(
        ALPHA.denoiser_config(ALPHA.presets["pixart_alpha_512"], tiny=True))
    assert not has_block_pairs(pixart) and block_classes(pixart) == ("BasicTransformerBlock",)
    with torch.no_grad():
        ref = den(x, **kw)[0]
        assert compile_pairs(den, None) == {"BlockPair": 4}
        torch.testing.assert_close(den(x, **kw)[0], ref, atol=0, rtol=0)
        # what it does not cover goes to diffusers' own forward
        torch.testing.assert_close(den(x, enable_temporal_attentions=False, **kw)[0],
                                   type(den).forward(den, x, enable_temporal_attentions=False, **kw)[0])


def test_latte_pairs_compile_to_one_graph():
    """All (spatial, temporal) pairs share one graph, with the layout changes inside it; the first
    pair's temporal position embedding is an input (zeros for the others), not a second graph."""
    from torch._dynamo.utils import counters
    from compiler.video.block_pairs import compile_pairs, has_block_pairs
    den, x, kw = _tiny_latte(num_layers=6)
    with torch.no_grad():
        ref = den(x, **kw)[0]
        fuse_qkv(den)
        fuse_gelu(den)
        torch._dynamo.reset()
        counters.clear()
        compile_pairs(den, dict(fullgraph=True, backend="aot_eager"))
        out = den(x, **kw)[0]
        den(x, **kw)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_gelu_quant_dequantizes_to_gelu():
    from compiler.kernels.quant import gelu_quant
    h, b = (torch.randn(6, 300) * 4).to(torch.bfloat16), torch.randn(300).half()
    q, s = gelu_quant(h, b)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (6, 300) and s.shape == (6, 1)
    g = torch.nn.functional.gelu(h.float() + b.float(), approximate="tanh")
    torch.testing.assert_close(s, g.abs().amax(1, keepdim=True) / 448.0)
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of its magnitude (+ a floor for tiny ones)
    assert ((q.float() * s - g).abs() <= g.abs() / 16 + s).all()


def test_gelu_quant_row_chunks_cover_the_row_once():
    """The kernel's two power-of-two chunks: the first inside the row, both together covering it,
    and no idle lanes at the DiT widths (4608 = 4096 + 512, 1152 = 1024 + 128)."""
    from compiler.kernels.quant import row_chunks
    for n in (*range(1, 70), 1024, 1152, 4096, 4608, 5120):
        b0, b1 = row_chunks(n)
        assert b0 & (b0 - 1) == 0 and b1 & (b1 - 1) == 0 and (b0 < n or n == 1) and n <= b0 + b1 < n + max(b1, 2)
    assert row_chunks(4608) == (4096, 512) and row_chunks(1152) == (1024, 128)


def test_fp8_feedforward_matches_fp8_linears_and_traces():
    from compiler.kernels.quant import FP8FeedForward, fp8_feedforward
    pipe = build_pipeline(ModelSpec("pixart_alpha_512", source="tiny"))
    den = pipe.transformer
    fuse_qkv(den)
    to_fp8(den, ("BasicTransformerBlock",))
    blk = den.transformer_blocks[0]
    x = torch.randn(2, 10, blk.ff.net[0].proj.in_features)
    with torch.no_grad():
        ref = blk.ff(x)
        assert fp8_feedforward(den) == 2
        assert isinstance(blk.ff, FP8FeedForward)
        out = blk.ff(x)
        # same quantised GEMMs; only the hidden activation's rounding differs (fp32 GELU, no fp16 hop)
        assert ((out - ref).abs().max() / ref.abs().max()) < 0.05
        f = torch.compile(blk.ff, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(f(x), out)


def test_latte_pairs_serve_every_prompt_length_with_one_graph():
    """LattePipeline trims the text embeddings to each prompt's token count: with static shapes
    (dynamic=False, what the presets use) that must still not recompile per length."""
    from compiler.video.block_pairs import compile_pairs, has_block_pairs
    den, x, kw = _tiny_latte(num_layers=2)
    torch._dynamo.reset()
    with torch.no_grad():
        refs = {n: den(x, **{**kw, "encoder_hidden_states": torch.randn(2, n, 32, generator=torch.Generator().manual_seed(n))})[0]
                for n in (6, 9, 13)}
        compile_pairs(den, dict(fullgraph=True, backend="aot_eager", dynamic=False))
        for n, ref in refs.items():
            enc = torch.randn(2, n, 32, generator=torch.Generator().manual_seed(n))
            with torch._dynamo.config.patch(error_on_recompile=n != 6):
                torch.testing.assert_close(den(x, **{**kw, "encoder_hidden_states": enc})[0], ref, atol=1e-4, rtol=1e-4)


def test_short_cross_attention_processor_falls_back_on_cpu_and_matches_sdpa():
    """The cross-attention processor: on CPU (and for anything the kernel does not take) diffusers'
    fused processor, bit for bit; its own path (forced here, the op's CPU reference) reads the
    key-padding bias as the DiT passes it and gives the same output; the op traces whole."""
    from compiler.kernels.cross_attention import (ShortKVCrossAttnProcessor, head_tiles, short_cross_attention,
                                          use_short_cross_attention)
    pipe = build_pipeline(ModelSpec("pixart_alpha_512", source="tiny"))
    den = pipe.transformer
    fuse_qkv(den)
    x = torch.randn(2, 4, 8, 8)
    mask = torch.ones(2, 6)
    mask[0, 3:] = 0   # the first prompt's last 3 tokens are padding
    kw = dict(encoder_hidden_states=torch.randn(2, 6, 32), encoder_attention_mask=mask,
              timestep=torch.tensor([10, 10]), added_cond_kwargs={"resolution": None, "aspect_ratio": None},
              return_dict=False)
    with torch.no_grad():
        ref = den(x, **kw)[0]
        assert use_short_cross_attention(den) == 2   # the cross-attention of each block
        proc = den.transformer_blocks[0].attn2.processor
        assert isinstance(proc, ShortKVCrossAttnProcessor) and den.transformer_blocks[1].attn2.processor is proc
        assert type(den.transformer_blocks[0].attn1.processor) is not ShortKVCrossAttnProcessor
        torch.testing.assert_close(den(x, **kw)[0], ref, atol=0, rtol=0)   # CPU: the fallback
        proc.fits = lambda *a: True                                        # the op's own path
        torch.testing.assert_close(den(x, **kw)[0], ref, atol=1e-5, rtol=1e-5)
        without = den(x, **{**kw, "encoder_attention_mask": None})[0]
        assert (without - ref).abs().max() > 1e-3   # the mask mattered
    # the op against plain math, with a bias of batch 1 and none; traced whole by Dynamo
    q, kv = torch.randn(2, 5, 4 * 24), torch.randn(2, 7, 2 * 4 * 24)
    bias = torch.tensor([0.0] * 5 + [-10000.0] * 2).view(1, 1, 7)
    k, v = (t.view(2, 7, 4, 24).transpose(1, 2) for t in kv.split(96, -1))
    s = q.view(2, 5, 4, 24).transpose(1, 2) @ k.transpose(-1, -2) / 24 ** 0.5 + bias[:, None]
    want = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 96)
    torch.testing.assert_close(short_cross_attention(q, kv, bias, 4), want, atol=1e-5, rtol=1e-5)
    f = torch.compile(lambda q, kv, b: short_cross_attention(q, kv, b, 4) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(q, kv, bias), want * 2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f(q, kv, None), short_cross_attention(q, kv, None, 4) * 2)
    assert [head_tiles(d) for d in (72, 64, 128, 40, 96)] == [(64, 16), (64, 0), (128, 0), (32, 16), (64, 32)]


def _anyflow16(dtype=torch.float16):
    """The family's tiny AnyFlow denoiser with Linears 16 wide or more (what `to_fp8` converts)."""
    from diffusers import AnyFlowTransformer3DModel
    from runner.families.anyflow import denoiser_config
    torch.manual_seed(0)
    cfg = dict(denoiser_config({}, True), num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32)
    return AnyFlowTransformer3DModel.from_config(cfg).to(dtype).eval()


def test_anyflow_fp8_after_fusion_converts_every_used_projection_and_drops_the_views():
    """AnyFlow after `fuse_qkv` + `to_fp8`: the self-attention's `to_qkv` (read by our fused
    processor) is FP8 and its q/k/v views emptied; the cross-attention, whose processor reads
    to_q/k/v, keeps them (FP8), not a fused copy nothing reads."""
    from compiler.kernels.int8_attention import FusedAnyFlowAttnProcessor
    den = _anyflow16()
    assert fuse_qkv(den) == len(den.blocks)
    # a block: to_qkv, to_out (self); to_q, to_k, to_v, to_out (cross); the two feed-forward linears
    assert to_fp8(den, (type(den.blocks[0]).__name__,)) == 8 * len(den.blocks)
    for b in den.blocks:
        assert isinstance(b.attn1.processor, FusedAnyFlowAttnProcessor) and isinstance(b.attn1.to_qkv, FP8Linear)
        assert all(getattr(b.attn1, n).weight.numel() == 0 for n in ("to_q", "to_k", "to_v"))
        assert not hasattr(b.attn2, "to_qkv") and not b.attn2.fused_projections
        assert all(isinstance(getattr(b.attn2, n), FP8Linear) for n in ("to_q", "to_k", "to_v"))


def test_anyflow_weight_written_after_fusion_is_what_fusing_it_before_gives():
    """The per-row adapter path (`set_linear_weight`, named as before any transform) on AnyFlow:
    a fused self-attention's to_q/to_k/to_v is written into its rows of `to_qkv`, in place; in
    fp32 the model then computes what the model given those weights before fusing computes, and
    after FP8 its buffers are those of converting that model, bit for bit (as Wan's in
    tests/test_adapters.py). A write into the wrong rows is caught by the same comparisons."""
    from compiler.kernels.quant import fp8_feedforward
    from compiler.transforms import set_linear_weight
    frames = 2
    args = (torch.randn(1, frames, 16, 8, 8), torch.full((1, frames), 500.0), torch.full((1, frames), 250.0),
            torch.randn(1, 5, 32))
    paths = ("blocks.0.attn1.to_q", "blocks.1.attn1.to_v", "blocks.1.attn2.to_k", "blocks.0.ffn.net.2")
    for dtype in (torch.float32, torch.float16):
        before, after = _anyflow16(dtype), _anyflow16(dtype)
        new = {}
        for path in paths:
            w = before.get_submodule(path).weight
            new[path] = (w.float() * 1.5 + 0.01).to(dtype)
            before.get_submodule(path).weight.data.copy_(new[path])
        for m in (before, after):
            fuse_qkv(m)
            if dtype == torch.float16:
                to_fp8(m, (type(m.blocks[0]).__name__,))
                fp8_feedforward(m)
        fused = after.blocks[0].attn1.to_qkv
        storage = {n: t.data_ptr() for n, t in [*after.named_parameters(), *after.named_buffers()]}
        for path, w in new.items():
            set_linear_weight(after, path, w)
        assert {n: t.data_ptr() for n, t in [*after.named_parameters(), *after.named_buffers()]} == storage
        if dtype == torch.float32:
            torch.testing.assert_close(fused.weight[:32], new["blocks.0.attn1.to_q"], rtol=0, atol=0)
            with torch.no_grad():
                torch.testing.assert_close(after(*args).sample, before(*args).sample, rtol=1e-5, atol=1e-6)
                set_linear_weight(after, "blocks.0.attn1.to_k", new["blocks.0.attn1.to_q"])   # wrong rows
                assert (after(*args).sample - before(*args).sample).abs().max() > 1e-3
        else:
            assert isinstance(fused, FP8Linear)
            for (n, b1), (_, b2) in zip(before.named_buffers(), after.named_buffers()):
                assert torch.equal(b1.float(), b2.float()), n
            set_linear_weight(after, "blocks.0.attn1.to_q", new["blocks.1.attn1.to_v"][:32])
            assert not torch.equal(before.blocks[0].attn1.to_qkv.w8.float(), fused.w8.float())
