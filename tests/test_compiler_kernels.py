"""The kernel-level transforms (GELU epilogue op, FP8 linears) on CPU: equivalence and traceability."""

import torch

from compiler.transforms import FP8Linear, fuse_gelu, fuse_qkv, linear_gelu_tanh, to_fp8
from runner.models import ModelSpec, build_pipeline


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


def test_rewritten_blocks_still_share_one_graph_per_shape():
    """The GELU rewrite must not make Dynamo specialise on each block instance: 12 Latte blocks
    (6 spatial + 6 temporal, all BasicTransformerBlock) compile to a few graphs, not 12+."""
    from diffusers import LatteTransformer3DModel
    from torch._dynamo.utils import counters
    from compiler.transforms import compile_blocks
    from runner.models import PRESETS, TINY_VIDEO_LENGTH, _dit_config

    cfg = dict(_dit_config(PRESETS["latte1"], tiny=True), num_layers=6)
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
