"""compile_pipe on tiny models on CPU: eager-vs-compiled match, QKV fusion equivalence, no recompiles.

Each compile on 2 CPU cores takes ~10-40 s cold (Inductor's C++ codegen), so each model is built
and compiled once, in one test that makes every check on it.
"""

import copy

import pytest
import torch

from compiler import compile_pipe, parse_options
from compiler.transforms import fuse_qkv
from runner.serve.models import ModelSpec, build_pipeline

H = W = 64


def call_kwargs(preset: str, steps: int = 3, height: int = H, width: int = W) -> dict:
    kw = dict(prompt="a cat walking in the city", num_inference_steps=steps, output_type="pt",
              height=height, width=width)
    if preset.startswith("pixart"):
        kw.update(use_resolution_binning=False, clean_caption=False)
    if preset == "latte1":
        kw.update(video_length=4, clean_caption=False)
    return kw


def generate(pipe, preset: str, **kw) -> torch.Tensor:
    out = pipe(**call_kwargs(preset, **kw), generator=torch.Generator().manual_seed(0))
    return out.frames if hasattr(out, "frames") else out.images


@pytest.mark.parametrize("preset", ["pixart_alpha_512", "latte1"])
def test_compiled_matches_eager_shares_graphs_and_never_recompiles(preset):
    """One lossless mode that runs on CPU, one compile per model (in one test, so that pytest -n
    never compiles the same model cold on two workers at once): the compiled pipeline's output
    matches eager; its blocks of one type share one graph; more steps recompile nothing."""
    from diffusers.models.attention import BasicTransformerBlock
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters
    from compiler.video import block_pairs
    torch._dynamo.reset()  # fresh Dynamo caches: other modules' compiles must not leak in
    counters.clear()       # graph counts below are this pipeline's alone
    pipe = build_pipeline(ModelSpec(preset, source="tiny"))
    ref = generate(pipe, preset)
    # cudagraphs is a no-op on CPU; fusion + per-block compile. The text encoder and VAE compile
    # (the same T5 and AutoencoderKL classes in both families) is checked on PixArt only: ~20 CPU-s
    # less on the 2-core CI machine.
    opts = {"mode": "O2"} if preset != "latte1" else {
        "mode": "O2", "compile_text_encoder": False, "compile_vae": False}
    compile_pipe(pipe, opts)

    out = generate(pipe, preset)
    assert sum(pipe._compile_report["compiled_blocks"].values()) >= 2
    # compile_vae's and compile_text_encoder's default: compiled with the mode
    if preset != "latte1":
        assert pipe._compile_report.get("vae_blocks") and pipe._compile_report.get("text_encoder_blocks")
    else:
        assert not pipe._compile_report.get("vae_blocks")         # the options reach the compiler
    assert pipe._compile_report["fused_attention"] > 0
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)  # fp32 here; fp16 tolerance on GPU

    # Dynamo's graphs for the denoiser's compiled code: PixArt's 2 blocks share one graph; Latte's
    # 2 (spatial, temporal) pairs share one graph of the pair function. Never one per instance.
    code = (block_pairs._pair if preset == "latte1" else BasicTransformerBlock.forward).__code__
    assert len(_debug_get_cache_entry_list(code)) == 1

    # no recompiles across steps
    generate(pipe, preset, steps=2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        generate(pipe, preset, steps=5)


@pytest.mark.parametrize("preset", ["latte1", "pixart_alpha_512", "sd21"])
def test_qkv_fusion_is_numerically_equal(preset):
    pipe = build_pipeline(ModelSpec(preset, source="tiny"))
    ref = generate(pipe, preset, steps=2)
    den = pipe.transformer if hasattr(pipe, "transformer") else pipe.unet
    params_before = sum(p.numel() for p in den.parameters())
    n = fuse_qkv(den)
    assert n > 0
    out = generate(pipe, preset, steps=2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the unfused projections are views into the fused weights: no second copy
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in den.parameters()}
    assert sum(storages.values()) <= params_before * 4


def test_eager_mode_compiles_nothing():
    pipe = build_pipeline(ModelSpec("pixart_alpha_512", source="tiny"))
    compile_pipe(pipe, "none", fuse_qkv_projections=False)
    assert "compiled_blocks" not in pipe._compile_report and "fused_attention" not in pipe._compile_report
    assert pipe._compile_options == parse_options("none")


def test_dynamic_serves_several_resolutions_without_recompiling():
    torch._dynamo.reset()
    preset = "pixart_alpha_512"
    pipe = build_pipeline(ModelSpec(preset, source="tiny"))
    eager = copy.deepcopy(pipe)
    # the text encoder's shapes do not depend on the resolution: left eager here
    compile_pipe(pipe, {"mode": "O2", "dynamic": True, "compile_text_encoder": False})
    generate(pipe, preset, steps=2, height=64, width=96)  # non-square first (nexfort's advice)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for h, w in [(96, 64), (128, 128)]:
            out = generate(pipe, preset, steps=2, height=h, width=w)
            torch.testing.assert_close(out, generate(eager, preset, steps=2, height=h, width=w),
                                       atol=1e-3, rtol=1e-3)


def test_compile_twice_is_a_noop_or_an_error():
    pipe = build_pipeline(ModelSpec("pixart_alpha_512", source="tiny"))
    compile_pipe(pipe, "none")
    assert compile_pipe(pipe, {"mode": "none"}) is pipe
    with pytest.raises(ValueError, match="already compiled"):
        compile_pipe(pipe, "O2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_cuda_graph_matches_eager_across_shapes_on_gpu():
    preset = "pixart_alpha_512"
    pipe = build_pipeline(ModelSpec(preset, source="tiny", device="cuda"))
    eager = copy.deepcopy(pipe)
    # the denoiser's step graph is what is checked: the text encoder and the VAE stay eager. Compiled,
    # they were 14 of the 16 graphs this test compiled (counted on a CPU), most of its 29 s on an
    # H200; their compile on a GPU, a recompile per shape included, is the full-size PixArt-α tests'
    # (tests/test_gpu_runner.py: 3 text and 2 VAE batch shapes; test_compiler_gpu.py's O3 with
    # decode), on a CPU the test above's
    compile_pipe(pipe, {"mode": "O2", "compile_text_encoder": False, "compile_vae": False})
    for h, w in [(64, 64), (64, 96), (64, 64)]:  # a new shape captures a second graph; the first replays
        kw = call_kwargs(preset, steps=3, height=h, width=w)
        out = pipe(**kw, generator=torch.Generator("cuda").manual_seed(0)).images
        ref = eager(**kw, generator=torch.Generator("cuda").manual_seed(0)).images
        # the tiny model runs in fp16 on CUDA: half-precision tolerance for images in [0, 1]
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    assert len(pipe.transformer.forward.graphs) == 2
