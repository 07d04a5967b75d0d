"""PixArt-α and PixArt-Σ text-to-image: T5-XXL (120 tokens for α, 300 for Σ), an SD/SDXL VAE, a DiT
of 28 blocks; DPM-Solver++ (PixArtAlphaPipeline's 1-step branch reads a second output DPM-Solver
does not return: α takes at least 2 steps; PixArtSigmaPipeline has no such branch).
"""

from __future__ import annotations

from .parts import PUBLISHED, dpm_solver_linspace, scheduler, sd_vae, t5_encoder
from .record import Family


def denoiser_config(preset: dict, tiny: bool) -> dict:
    cfg = dict(PUBLISHED[preset["transformer"]])
    if tiny:  # cross_attention_dim must equal heads * head_dim
        cfg.update(num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                   caption_channels=32, num_layers=2, sample_size=8)
    return cfg


def _builder(pipeline: str):
    def build(preset: dict, tiny: bool):
        import diffusers
        from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel
        tok, te = t5_encoder(preset["max_tokens"], tiny)
        den = PixArtTransformer2DModel.from_config(denoiser_config(preset, tiny))
        return getattr(diffusers, pipeline)(
            tokenizer=tok, text_encoder=te, vae=sd_vae(preset["vae"], tiny), transformer=den,
            scheduler=scheduler(DPMSolverMultistepScheduler, PUBLISHED["pixart_scheduler"]))
    return build


def encode(pipe, prompts: list[str], max_tokens: int):
    emb, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                         device=pipe._execution_device, clean_caption=False,
                                         max_sequence_length=max_tokens)
    return emb, mask


def call_args(pipe, num_frames: int | None) -> dict:
    # Resolution binning and the size conditions only apply to the 128-latent (1024) checkpoints.
    return dict(clean_caption=False,
                use_resolution_binning=pipe.transformer.config.sample_size in (32, 64, 128))


def _preset(hub_id: str, size: int, transformer: str, vae: str, max_tokens: int) -> dict:
    return dict(hub_id=hub_id, size_factor=16, max_tokens=max_tokens, height=size, width=size,
                transformer=transformer, vae=vae)


# DPM-Solver++ over linspace timesteps: 999 (1000 steps repeat one: NaN images)
MAX_STEPS = dpm_solver_linspace(PUBLISHED["pixart_scheduler"])

ALPHA = Family(
    name="pixart_alpha", kind="image", pipeline="PixArtAlphaPipeline",
    presets={"pixart_alpha_1024": _preset("PixArt-alpha/PixArt-XL-2-1024-MS", 1024,
                                          "pixart_alpha_1024", "sd_vae", 120),
             "pixart_alpha_512": _preset("PixArt-alpha/PixArt-XL-2-512x512", 512,
                                         "pixart_alpha_512", "sd_vae", 120)},
    build=_builder("PixArtAlphaPipeline"), encode=encode, call_args=call_args,
    denoiser_config=denoiser_config, min_steps=2, max_steps=MAX_STEPS, step_reuse=("residual",),
    step_blocks="transformer_blocks")

SIGMA = Family(
    name="pixart_sigma", kind="image", pipeline="PixArtSigmaPipeline",
    presets={"pixart_sigma_1024": _preset("PixArt-alpha/PixArt-Sigma-XL-2-1024-MS", 1024,
                                          "pixart_sigma_1024", "sdxl_vae", 300)},
    build=_builder("PixArtSigmaPipeline"), encode=encode, call_args=call_args,
    denoiser_config=denoiser_config, max_steps=MAX_STEPS, step_reuse=("residual",),
    step_blocks="transformer_blocks")
