"""The families of issue 38: Wan 2.2 T2V-A14B (two experts), Wan 2.2 TI2V-5B (text or image to
video, 48-channel VAE), Wan 2.1 I2V 14B (CLIP image encoder), FLUX.1-dev (T5 + CLIP pooled,
guidance embedding). The published architectures are built on the meta device (no memory) and
checked against the published configs; behaviour runs on the tiny builds, in-process."""
import numpy as np
import pytest
import torch
from PIL import Image

from runner.families import FAMILIES, PRESETS
from runner.io.images import placeholder
from runner.serve.models import ModelLoadError, ModelSpec, build_pipeline, check_gpu_memory
from runner.io.prompts import Item
from runner.serve.text import TextCache
from runner.serve.worker import generate

NEW = ["wan22_t2v_a14b", "wan22_t2v_a14b_480p", "wan22_ti2v_5b", "wan21_i2v_14b_480p",
       "wan21_i2v_14b_720p", "flux1_dev"]


def meta_build(preset):
    fam = PRESETS[preset]
    with torch.device("meta"):
        return fam.build(fam.presets[preset], False)


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def item(i=0, seed=1, frames=5, size=64, image=None, steps=2, guidance=5.0, prompt="a cat on the moon"):
    return Item(id=f"x{i}", prompt=prompt, negative_prompt="", seed=seed, height=size, width=size,
                num_frames=frames, num_inference_steps=steps, guidance_scale=guidance, file="t",
                row=i, image=image)


def picture(color, size=64):
    rng = np.random.default_rng(sum(color))
    noise = rng.integers(0, 60, (size, size, 3))
    return Image.fromarray(np.clip(np.array(color) + noise, 0, 255).astype(np.uint8))


# ---------------------------------------------------------------------------------------------
# The published architectures (meta device)

def test_wan22_a14b_is_two_published_14b_experts_switched_at_0_875():
    pipe = meta_build("wan22_t2v_a14b")
    for den in (pipe.transformer, pipe.transformer_2):
        c = den.config
        assert (c.num_layers, c.num_attention_heads, c.attention_head_dim, c.ffn_dim, c.in_channels) \
            == (40, 40, 128, 13824, 16)
        assert 14.2e9 < params(den) < 14.4e9                     # "14B" each: 14.29 B
    assert pipe.transformer is not pipe.transformer_2
    assert pipe.config.boundary_ratio == 0.875 and pipe.scheduler.config.flow_shift == 3.0
    assert pipe.text_encoder.config.d_model == 4096 and pipe.vae.config.z_dim == 16


def test_wan22_ti2v_5b_has_its_48_channel_vae_and_expanded_timesteps():
    pipe = meta_build("wan22_ti2v_5b")
    c = pipe.transformer.config
    assert (c.num_layers, c.num_attention_heads, c.ffn_dim, c.in_channels, c.out_channels) == \
        (30, 24, 14336, 48, 48)
    assert 4.9e9 < params(pipe.transformer) < 5.1e9
    v = pipe.vae.config
    assert (v.z_dim, v.is_residual, v.base_dim, v.decoder_base_dim, v.patch_size,
            v.scale_factor_spatial, v.scale_factor_temporal) == (48, True, 160, 256, 2, 16, 4)
    assert len(v.latents_mean) == len(v.latents_std) == 48
    assert v.latents_mean[:2] == [-0.2289, -0.0052] and v.latents_std[-1] == 0.7744
    assert pipe.config.expand_timesteps and pipe.scheduler.config.flow_shift == 5.0
    assert PRESETS["wan22_ti2v_5b"].presets["wan22_ti2v_5b"]["size_factor"] == 16 * 2  # VAE x patch


@pytest.mark.parametrize("preset", ["wan21_i2v_14b_480p", "wan21_i2v_14b_720p"])
def test_wan21_i2v_has_the_clip_h14_image_encoder_and_image_projections(preset):
    pipe = meta_build(preset)
    c = pipe.transformer.config
    assert (c.in_channels, c.image_dim, c.added_kv_proj_dim, c.num_layers) == (36, 1280, 5120, 40)
    v = pipe.image_encoder.config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size,
            v.patch_size, v.image_size) == (1280, 32, 16, 5120, 14, 224)
    assert pipe.image_processor.crop_size == {"height": 224, "width": 224}
    assert 16.3e9 < params(pipe.transformer) < 16.5e9        # 14B + the image cross-attention


def test_flux1_dev_is_19_double_and_38_single_blocks_with_guidance_embedding():
    pipe = meta_build("flux1_dev")
    c = pipe.transformer.config
    assert (c.num_layers, c.num_single_layers, c.num_attention_heads, c.attention_head_dim,
            c.joint_attention_dim, c.pooled_projection_dim, c.guidance_embeds, c.in_channels) == \
        (19, 38, 24, 128, 4096, 768, True, 64)
    assert 11.8e9 < params(pipe.transformer) < 12.0e9        # "12B": 11.90 B
    assert (pipe.vae.config.latent_channels, pipe.vae.config.scaling_factor,
            pipe.vae.config.shift_factor) == (16, 0.3611, 0.1159)
    s = pipe.scheduler.config
    assert s.use_dynamic_shifting and (s.base_shift, s.max_shift, s.base_image_seq_len,
                                       s.max_image_seq_len) == (0.5, 1.15, 256, 4096)
    assert pipe.text_encoder.config.hidden_size == 768 and pipe.text_encoder_2.config.d_model == 4096
    assert FAMILIES["flux1"].stack_depth(c) == 57


@pytest.mark.parametrize("preset", NEW)
def test_stated_gpu_memory_covers_the_weights_counted_on_the_meta_device(preset):
    pipe = meta_build(preset)
    gib = sum(params(m) for m in pipe.components.values() if isinstance(m, torch.nn.Module)) * 2 / 2**30
    need = PRESETS[preset].presets[preset]["gpu_gib"]
    assert gib + 2 < need < gib + 20, (preset, gib, need)   # weights + activations, a stated margin


def test_a_preset_that_does_not_fit_is_refused_before_loading_naming_need_and_free():
    spec = ModelSpec("wan22_t2v_a14b", source="random", device="cuda", dtype="fp16")
    with pytest.raises(ModelLoadError) as e:
        check_gpu_memory(spec, free_bytes=79 * 2**30, gpu="NVIDIA H100 80GB HBM3")
    msg = str(e.value)
    assert "model.preset=wan22_t2v_a14b" in msg and "81 GiB" in msg and "79.0 GiB free" in msg
    assert "docs/models.md" in msg
    check_gpu_memory(ModelSpec("wan22_t2v_a14b_480p", device="cuda", dtype="fp16"),
                     free_bytes=79 * 2**30)                  # 480p fits one 80 GB GPU
    check_gpu_memory(ModelSpec("wan22_t2v_a14b", device="cpu"), free_bytes=0)   # CPU: no check
    # O3's FP8 linears (68 GiB stated): one 80 GB GPU, where it runs them (an H100: sm_90); an
    # A100 keeps 16-bit weights, so the 16-bit need holds there
    for preset in ("wan22_t2v_a14b", "wan22_i2v_a14b", "wan22_t2v_a14b_lightning"):
        spec = ModelSpec(preset, source="random", device="cuda", dtype="fp16")
        check_gpu_memory(spec, free_bytes=79 * 2**30, fp8=True, fp8_capable=True)
        with pytest.raises(ModelLoadError, match="81 GiB"):
            check_gpu_memory(spec, free_bytes=79 * 2**30, fp8=True, fp8_capable=False)


# ---------------------------------------------------------------------------------------------
# Behaviour (tiny builds)

def test_a14b_runs_the_high_noise_expert_above_the_boundary_and_the_low_noise_one_below():
    spec = ModelSpec("wan22_t2v_a14b", source="tiny")
    pipe = build_pipeline(spec)
    seen = {"transformer": [], "transformer_2": []}
    for name in seen:
        getattr(pipe, name).register_forward_pre_hook(
            lambda m, a, kw, name=name: seen[name].append(float(kw["timestep"][0])), with_kwargs=True)
    out = generate(pipe, spec.family, [item(steps=6)], "cpu")
    assert out.shape == (1, 5, 64, 64, 3) and np.isfinite(out).all()
    assert seen["transformer"] and seen["transformer_2"]          # both experts, cond + uncond
    assert min(seen["transformer"]) >= 875 > max(seen["transformer_2"])
    assert pipe._guidance_scale == 5.0 and pipe._guidance_scale_2 == 3.0


def test_ti2v_animates_the_image_from_its_first_frame_and_runs_text_rows_without_one():
    spec = ModelSpec("wan22_ti2v_5b", source="tiny")
    pipe, fam = build_pipeline(spec), spec.family
    i2v = fam.image_pipeline(pipe)
    assert i2v is fam.image_pipeline(pipe) and i2v.transformer is pipe.transformer  # shared modules
    red, blue = picture((200, 30, 30)), picture((30, 30, 200))
    text = generate(pipe, fam, [item(seed=1)], "cpu")
    a = generate(pipe, fam, [item(seed=1, image="red")], "cpu", image=red)
    b = generate(pipe, fam, [item(seed=2, image="red", prompt="a dog")], "cpu", image=red)
    c = generate(pipe, fam, [item(seed=1, image="blue")], "cpu", image=blue)
    # the image is the first latent frame, kept clean (expand_timesteps): frame 0 decodes from it
    # alone, whatever the seed and prompt; later frames are generated
    np.testing.assert_allclose(a[0, 0], b[0, 0], atol=1e-5)
    assert not np.allclose(a[0, 1:], b[0, 1:], atol=1e-3)
    assert not np.allclose(a[0, 0], c[0, 0], atol=1e-3) and not np.allclose(a, text, atol=1e-3)
    pair = generate(pipe, fam, [item(1, seed=2, image="red", prompt="a dog"), item(seed=1, image="red")],
                    "cpu", image=red)                          # batch-mates share the image
    np.testing.assert_allclose(pair[1], a[0], atol=1e-4)


def test_wan21_i2v_items_sharing_an_image_are_independent_of_their_batch_mates():
    spec = ModelSpec("wan21_i2v_14b_480p", source="tiny")
    pipe, fam = build_pipeline(spec), spec.family
    red, blue = picture((200, 30, 30)), picture((30, 30, 200))
    alone = generate(pipe, fam, [item(seed=1, image="red")], "cpu", image=red)
    pair = generate(pipe, fam, [item(1, seed=4, image="red"), item(seed=1, image="red")], "cpu", image=red)
    np.testing.assert_allclose(pair[1], alone[0], atol=1e-4)
    assert not np.allclose(pair[0], pair[1], atol=1e-3)
    other = generate(pipe, fam, [item(seed=1, image="blue")], "cpu", image=blue)
    assert not np.allclose(other, alone, atol=1e-3)            # the image conditions the video
    with pytest.raises(ValueError, match="image"):             # this model needs an image
        generate(pipe, fam, [item(seed=1)], "cpu")


def test_flux_gets_pooled_clip_embeddings_and_no_negative_branch():
    spec = ModelSpec("flux1_dev", source="tiny")
    pipe, fam = build_pipeline(spec), spec.family
    text = TextCache.of(pipe, fam)
    assert text.tokenizer is pipe.tokenizer_2 and text.max_tokens == 512
    items = [item(0, seed=1, frames=None, guidance=3.5), item(1, seed=2, frames=None, guidance=3.5,
                                                              prompt="a red fox")]
    emb = text.encode(items)
    assert emb["x0"].prompt.shape == (512, 32) and emb["x0"].pooled.shape == (16,)
    assert not torch.equal(emb["x0"].pooled, emb["x1"].pooled)
    kw = text.call_kwargs(items, emb)
    assert kw["pooled_prompt_embeds"].shape == (2, 16)
    assert not any(k.startswith("negative") for k in kw) and not text.negatives
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(k["guidance"]),
                                               with_kwargs=True)
    pair = generate(pipe, fam, items, "cpu", embeds=emb)
    assert len(calls) == 2 and float(calls[0][0]) == 3.5         # one call a step, guidance embedded
    alone = generate(pipe, fam, items[1:], "cpu")
    np.testing.assert_allclose(pair[1], alone[0], atol=1e-4)


def test_ti2v_vae_decodes_in_compiled_chunks_as_wan21s_does():
    """Wan 2.2's residual 48-channel VAE (TI2V-5B) gets compiler.video.video_vae's chunked, compiled
    decode wherever the pipeline's VAE is compiled, as Wan 2.1's does (A14B's Wan 2.1 VAE too);
    `compile_vae: false` keeps diffusers' decode."""
    import compiler
    from compiler.video import video_vae
    ti2v = build_pipeline(ModelSpec("wan22_ti2v_5b", source="tiny"))
    a14b = build_pipeline(ModelSpec("wan22_t2v_a14b", source="tiny"))
    assert video_vae.supported(ti2v.vae) and video_vae.supported(a14b.vae)
    compiler.compile_pipe(ti2v, {"mode": "O2", "compile_text_encoder": False})  # compiles lazily
    # the tiny decoder: middle 2 + 4 up blocks x 2 residual blocks; three upsamplers
    assert ti2v._compile_report["vae_blocks"] == {"resblock": 10, "attention": 1, "upsample": 3,
                                                  "stem": 1, "head": 1}
    assert ti2v.vae._decode.func is video_vae._decode
    compiler.compile_pipe(a14b, {"mode": "O2", "compile_text_encoder": False, "compile_vae": False})
    assert "vae_blocks" not in a14b._compile_report
    assert a14b.vae._decode.__func__ is type(a14b.vae)._decode


def test_a_worker_checks_gpu_memory_before_it_loads_anything(tmp_path, monkeypatch):
    """The worker's first act: a GPU with less free memory than the preset needs stops it with the
    named error, before any weights are built."""
    import runner.serve.worker as worker
    from runner.config import GenerationDefaults
    from runner.io.prompts import Constraints
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (59.5 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "the test GPU")
    monkeypatch.setattr(worker, "build_pipeline", lambda spec: pytest.fail("loaded a model"))
    cfg = worker.WorkerConfig(model=ModelSpec("wan21_i2v_14b_720p", source="random", device="cuda"),
                              generation=GenerationDefaults(), limits=Constraints(size_factor=16),
                              on_empty="error", job_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"needs about 60 GiB .* the test GPU has 59.5 GiB free"):
        worker.Worker(0, cfg)
