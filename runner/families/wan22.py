"""Wan 2.2: text-to-video A14B (two 14B experts), image-to-video A14B and text/image-to-video
TI2V-5B.

T2V-A14B (Wan-AI/Wan2.2-T2V-A14B-Diffusers): WanPipeline with `transformer` (the high-noise
expert) and `transformer_2` (the low-noise expert), each a Wan 2.1 14B-shaped DiT (40 blocks, 40
heads x 128, ffn 13824); the pipeline calls `transformer` while the timestep is >= boundary_ratio
x 1000 = 875 and `transformer_2` after, each with its own guidance scale (guidance_scale 4.0, then
guidance_scale_2 3.0). Both experts are loaded once per worker and compiled (one graph per block
class, shared: `compiler.compile_pipe`); step reuse runs on both (`runner.serve.step_cache`), the second
expert's first call always computed. UMT5-XXL, the Wan 2.1 VAE (16 channels, 8x space, 4x time).
Published: 720x1280 (and 480x832), 81 frames, 16 fps, 40 UniPC steps.

I2V-A14B (Wan-AI/Wan2.2-I2V-A14B-Diffusers): WanImageToVideoPipeline over the same two experts'
blocks on 36 input channels (16 noise + 16 of the image's latents as the first frame of a
conditioning video + a 4-channel first-frame mask), switched at boundary_ratio 0.9, no CLIP image
encoder (the pipeline skips it where boundary_ratio is set). Published (Wan-Video/Wan2.2
`wan/configs/wan_i2v_A14B.py`): 81 frames, 16 fps, 40 steps, boundary 0.900, guidance (3.5, 3.5),
sample_shift 5.0, which the random builds here use; 720x1280. The diffusers checkpoint is what
diffusers' conversion script writes for "Wan2.2-I2V-14B-720p" (in_channels 36, no image encoder,
boundary_ratio 0.9, UniPC at flow_shift 3.0: a pretrained load uses the hub's scheduler).

TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers): one 30-block DiT (24 heads x 128, ffn 14336) on the
48-channel latents of Wan 2.2's VAE (16x space, 4x time: `patch_size` 2 folds 2x2 pixels into
channels before a residual encoder), `expand_timesteps` (a timestep per latent patch, so the first
frame of an image-to-video row stays clean). Rows without an image run WanPipeline (text-to-video),
rows with one WanImageToVideoPipeline over the same modules (no CLIP image encoder: the image is
the first latent frame). UniPC with flow shift 5.0. Published: 704x1280, 121 frames, 24 fps, 50
steps, guidance 5.0. Its VAE decodes in chunks, compiled, as Wan 2.1's does (`compiler.video.video_vae`,
wherever `compile_pipe` compiles the VAE: `compile.compile_vae`).

Sources: the transformer configs, the TI2V VAE config (latents_mean/std) and the schedulers'
flow_shift (3.0 for T2V-A14B, 5.0 for TI2V) and boundary_ratio 0.875 are those
diffusers/scripts/convert_wan_to_diffusers.py writes into the hub checkpoints (`Wan2.2-T2V-A14B`,
`Wan2.2-TI2V-5B`; the hub's transformer_2/config.json reads the same); the settings (A14B: 40
steps, guidance 4.0 / 3.0, 81 frames at 16 fps; TI2V: 704x1280, 121 frames at 24 fps, 50 steps,
guidance 5.0) are the model cards' examples.
"""

from __future__ import annotations

from .parts import scheduler, t5_encoder, train_timesteps, unipc_flow_first_step
from .record import Family
from .wan import (SCHEDULER, TRANSFORMERS, UMT5_XXL, call_args as wan_call_args, diff_parameter,
                  encode, random_adapter, vae as wan21_vae)
from .wan_i2v import encode as i2v_encode

BOUNDARY_RATIO = 0.875      # A14B: transformer for t >= 875, transformer_2 below
GUIDANCE_2 = 3.0            # A14B: the low-noise expert's guidance scale (the row's is the first's)
A14B_SCHEDULER = dict(SCHEDULER, flow_shift=3.0)
# I2V-A14B: Wan2.2's sample_shift 5.0 (wan_i2v_A14B.py); diffusers' conversion script writes 3.0
# into the hub's scheduler config, which a pretrained load uses: the step bound is 5.0's (the lower)
I2V_SCHEDULER = dict(SCHEDULER, flow_shift=5.0)
TI2V_SCHEDULER = dict(SCHEDULER, flow_shift=5.0)

# I2V-A14B's experts: Wan 2.1 14B's blocks on 36 input channels (16 noise + 16 latents of the
# conditioning video + a 4-channel first-frame mask), no image projections (no CLIP encoder)
I2V_TRANSFORMER = dict(TRANSFORMERS["14b"], in_channels=36)
I2V_BOUNDARY_RATIO = 0.9    # I2V-A14B: transformer for t >= 900, transformer_2 below
TI2V_TRANSFORMER = dict(TRANSFORMERS["14b"], num_attention_heads=24, ffn_dim=14336, num_layers=30,
                        in_channels=48, out_channels=48)
# Wan 2.2's VAE (convert_wan_to_diffusers.py: vae22_diffusers_config; its `clip_output: False` is a
# key of later diffusers versions, 0.42's AutoencoderKLWan has no such argument)
TI2V_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
    scale_factor_temporal=4, scale_factor_spatial=16, patch_size=2,
    latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382,
                  0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207,
                  -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109,
                  0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
                  -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573,
                  -0.0548, -0.1681, -0.0667],
    latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344,
                 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804,
                 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999,
                 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744])
TINY = dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=16, ffn_dim=32,
            num_layers=2, rope_max_seq_len=64)   # head dim 12: rotary 4/4/4 over time, height, width


def denoiser_config(preset: dict, tiny: bool) -> dict:
    cfg = dict({"5b": TI2V_TRANSFORMER, "i2v": I2V_TRANSFORMER}.get(preset["size"],
                                                                  TRANSFORMERS["14b"]))
    return {**cfg, **TINY} if tiny else cfg


def ti2v_vae(tiny: bool):
    # tiny: the same 16x spatial (2x2 patches, three 2x downsamplings), 4x temporal and 48 latent
    # channels (the transformer's in_channels, and latents_mean/std's length), narrow
    from diffusers import AutoencoderKLWan
    return AutoencoderKLWan(**{**TI2V_VAE, **(dict(base_dim=8, decoder_base_dim=8, num_res_blocks=1)
                                              if tiny else {})})


def _parts(preset: dict, tiny: bool, scheduler_config: dict):
    from diffusers import UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel
    tok, te = t5_encoder(preset["max_tokens"], tiny, UMT5_XXL, UMT5Config, UMT5EncoderModel)
    cfg = denoiser_config(preset, tiny)
    return dict(tokenizer=tok, text_encoder=te, transformer=WanTransformer3DModel.from_config(cfg),
                scheduler=scheduler(UniPCMultistepScheduler, scheduler_config)), cfg


def build_a14b(preset: dict, tiny: bool):
    from diffusers import WanPipeline, WanTransformer3DModel
    parts, cfg = _parts(preset, tiny, A14B_SCHEDULER)
    # the low-noise expert: the same architecture, its own weights
    return WanPipeline(**parts, vae=wan21_vae(tiny), boundary_ratio=BOUNDARY_RATIO,
                       transformer_2=WanTransformer3DModel.from_config(cfg))


def build_i2v_a14b(preset: dict, tiny: bool):
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    parts, cfg = _parts(preset, tiny, I2V_SCHEDULER)
    # no image encoder: with boundary_ratio set the pipeline conditions on the image's latents only
    return WanImageToVideoPipeline(**parts, vae=wan21_vae(tiny), image_encoder=None,
                                   image_processor=None, boundary_ratio=I2V_BOUNDARY_RATIO,
                                   transformer_2=WanTransformer3DModel.from_config(cfg))


def build_ti2v(preset: dict, tiny: bool):
    from diffusers import WanPipeline
    parts, _ = _parts(preset, tiny, TI2V_SCHEDULER)
    return WanPipeline(**parts, vae=ti2v_vae(tiny), expand_timesteps=True)


def image_pipeline(pipe):
    """TI2V's image-to-video pipeline over `pipe`'s modules (made once, kept on `pipe`): the same
    transformer, VAE, text encoder and scheduler objects, so what `compile_pipe` and the step cache
    did to them holds for both."""
    i2v = pipe.__dict__.get("_image_pipeline")
    if i2v is None:
        from diffusers import WanImageToVideoPipeline
        i2v = WanImageToVideoPipeline(
            tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
            scheduler=pipe.scheduler, transformer=pipe.transformer, image_encoder=None,
            image_processor=None, expand_timesteps=True)
        i2v.set_progress_bar_config(disable=True)
        pipe.__dict__["_image_pipeline"] = i2v
    return i2v


def a14b_call_args(pipe, num_frames: int | None) -> dict:
    return dict(wan_call_args(pipe, num_frames), guidance_scale_2=GUIDANCE_2)


def _a14b(height: int, width: int, gpu_gib: float) -> dict:
    return dict(hub_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers", size_factor=16, max_tokens=512,
                height=height, width=width, size="14b", gpu_gib=gpu_gib)


# gpu_gib (docs/models.md, "GPU memory"): the weights counted on the meta device in 16 bits (A14B:
# 34.39 B parameters, 64.0 GiB; TI2V-5B: 11.39 B, 21.2 GiB) plus estimates of what a call at the
# preset's size adds: the step activations a CUDA-graph pool keeps (A14B 720p ~5, 480p ~2.2 GiB) and
# diffusers' per-frame VAE decode (5.1 GiB measured at 480x832, scaled by pixels: ~11.7 at 720p).
# The A14B presets keep the VAE uncompiled (conf/models): compiler.video.video_vae's chunked decode
# peaks at 18.6 GiB at 480x832, which one 80 GB GPU does not have left beside two experts.
WAN22_A14B = Family(
    name="wan22_a14b", kind="video", pipeline="WanPipeline",
    # 720p with O3's FP8 linears: the Lightning preset's measured need (gpu_gib_fp8, below): the
    # same weights, and a step's memory is the same at any step count (CFG's two calls run apart)
    presets={"wan22_t2v_a14b": dict(_a14b(720, 1280, 81.0), gpu_gib_fp8=68.0),
             "wan22_t2v_a14b_480p": _a14b(480, 832, 72.0),
             # Wan2.2-Lightning (lightx2v/Wan2.2-Lightning, T2V-A14B 4 steps): the base checkpoint
             # with a LoRA per expert (conf/models/), 4 Euler steps at shift 5 (its
             # wan/utils/fm_solvers_euler.py: timesteps 1000, 937.5 | 833.3, 625: two on each side
             # of the 875 boundary), guidance 1.0 on both experts (a row at guidance <= 1 runs no
             # CFG on either: runner.serve.worker.generate), 81 frames at 16 fps, 720x1280.
             # gpu_gib_fp8: with O3's FP8 linears the serving peak is both experts' 26.2 G block
             # weights in 8 bits beside UMT5-XXL (10.6 GiB) and a 720p call, 48.2 GiB measured
             # with diffusers' decode; but the experts are built (or loaded) in 16 bits before
             # FP8: a start-up peak of 65.7 GiB measured (benchmarks/2026-11-28-distill-h100-gpu-
             # suite.md), the need stated here with the compiled 720p decode's margin
             "wan22_t2v_a14b_lightning": dict(_a14b(720, 1280, 81.0), gpu_gib_fp8=68.0,
                                              sampler=dict(shift=5.0, stochastic=False))},
    build=build_a14b, encode=encode, call_args=a14b_call_args, denoiser_config=denoiser_config,
    frame_step=4, step_reuse=("residual",), step_blocks="blocks", cfg_calls=True, long_attention=True,
    max_steps=train_timesteps(A14B_SCHEDULER), video_vae=wan21_vae, random_adapter=random_adapter, lora_diffs=diff_parameter,
    experts=("transformer", "transformer_2"),
    checkpoint={"transformer_2": True, "boundary_ratio": True})

# I2V-A14B (Wan-AI/Wan2.2-I2V-A14B-Diffusers): every row animates its `image`, A14B's two experts
# (boundary 900) on the image's latents; 720x1280 (or 480x832) x 81 frames at 16 fps, 40 steps,
# guidance 3.5 on both experts. gpu_gib as T2V-A14B's (the same 34.4 B parameters but 4 x 20
# input weights; diffusers' pipeline VAE-encodes the whole conditioning video, the image then
# zeros, in chunks, below the decode's peak: not measured)
WAN22_I2V_A14B = Family(
    name="wan22_i2v_a14b", kind="video", pipeline="WanImageToVideoPipeline",
    presets={"wan22_i2v_a14b": dict(_a14b(720, 1280, 81.0), size="i2v", gpu_gib_fp8=68.0,
                                    hub_id="Wan-AI/Wan2.2-I2V-A14B-Diffusers"),
             "wan22_i2v_a14b_480p": dict(_a14b(480, 832, 72.0), size="i2v",
                                        hub_id="Wan-AI/Wan2.2-I2V-A14B-Diffusers"),
             # Wan2.2-Lightning's I2V LoRAs (lightx2v/Wan2.2-Lightning, I2V-A14B 4 steps): the
             # T2V preset's sampler (1000, 937.5 | 833.3, 625: two on each side of 900 too)
             "wan22_i2v_a14b_lightning": dict(_a14b(720, 1280, 81.0), size="i2v",
                                              hub_id="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
                                              gpu_gib_fp8=68.0,
                                              sampler=dict(shift=5.0, stochastic=False))},
    # no guidance_scale_2: the pipeline gives the low-noise expert the row's guidance (3.5 both)
    build=build_i2v_a14b, encode=i2v_encode, call_args=wan_call_args,
    denoiser_config=denoiser_config, frame_step=4, step_reuse=("residual",), step_blocks="blocks",
    cfg_calls=True, long_attention=True, image="required", video_vae=wan21_vae,
    random_adapter=random_adapter, lora_diffs=diff_parameter,
    experts=("transformer", "transformer_2"),
    max_steps=unipc_flow_first_step(I2V_SCHEDULER),    # 200 (WanImageToVideoPipeline, shift 5.0)
    checkpoint={"transformer_2": True, "boundary_ratio": True, "image_encoder": False})

WAN22_TI2V = Family(
    name="wan22_ti2v", kind="video", pipeline="WanPipeline",
    presets={"wan22_ti2v_5b": dict(hub_id="Wan-AI/Wan2.2-TI2V-5B-Diffusers", size_factor=32,
                                   max_tokens=512, height=704, width=1280, size="5b",
                                   gpu_gib=38.0),
             # FastVideo's DMD distillation (FastVideo/FastWan2.2-TI2V-5B-FullAttn-Diffusers, the
             # base transformer's keys): 3 steps at its dmd_denoising_steps 1000, 757, 522,
             # re-noised between steps (its DmdDenoisingStage), no CFG; 704x1280x121 at 24 fps
             "wan22_ti2v_5b_fastwan": dict(
                 hub_id="FastVideo/FastWan2.2-TI2V-5B-FullAttn-Diffusers", size_factor=32,
                 max_tokens=512, height=704, width=1280, size="5b", gpu_gib=38.0,
                 sampler=dict(shift=1.0, stochastic=True, sigmas=[1.0, 0.757, 0.522]),
                 min_steps=3, max_steps=3)},
    build=build_ti2v, encode=encode, call_args=wan_call_args, denoiser_config=denoiser_config,
    frame_step=4, step_reuse=("residual",), step_blocks="blocks", cfg_calls=True,
    long_attention=True, image="optional", image_pipeline=image_pipeline, video_vae=ti2v_vae,
    random_adapter=random_adapter, lora_diffs=diff_parameter,
    # 200: its image rows' WanImageToVideoPipeline at shift 5.0 (text rows would run 1000); one
    # bound for all its rows, 4x the published 50, rather than a second one for text rows
    max_steps=unipc_flow_first_step(TI2V_SCHEDULER),
    checkpoint={"transformer_2": False, "expand_timesteps": True})
