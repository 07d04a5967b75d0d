"""Latte-1 text-to-video (maxin-cn/Latte-1): T5-XXL, SD VAE, a DiT of 28 spatial/temporal block
pairs; 16 frames (the temporal embedding's length: the only frame count it takes), 512x512, DDIM.

LattePipeline trims a single prompt's embedding to its token count (`mask_feature`), so batch-mates
share their token count (`trim_text`, see `runner.serve.text`).
"""

from __future__ import annotations

from .parts import PUBLISHED, ddim_leading, scheduler, sd_vae, t5_encoder, tokens
from .record import Family

TINY_VIDEO_LENGTH = 4   # frames the tiny Latte is built with (the published model has 16)


def denoiser_config(preset: dict, tiny: bool) -> dict:
    cfg = dict(PUBLISHED[preset["transformer"]])
    if tiny:  # cross_attention_dim must equal heads * head_dim
        cfg.update(num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                   caption_channels=32, num_layers=2, sample_size=8, video_length=TINY_VIDEO_LENGTH)
    return cfg


def build(preset: dict, tiny: bool):
    from diffusers import DDIMScheduler, LattePipeline, LatteTransformer3DModel
    tok, te = t5_encoder(preset["max_tokens"], tiny)
    return LattePipeline(tokenizer=tok, text_encoder=te, vae=sd_vae(preset["vae"], tiny),
                         transformer=LatteTransformer3DModel.from_config(denoiser_config(preset, tiny)),
                         scheduler=scheduler(DDIMScheduler, PUBLISHED["latte1_scheduler"]))


def encode(pipe, prompts: list[str], max_tokens: int):
    # T5 with the attention mask, as LattePipeline.encode_prompt does
    tok = tokens(pipe, prompts, max_tokens)
    dev = pipe._execution_device
    emb = pipe.text_encoder(tok.input_ids.to(dev), attention_mask=tok.attention_mask.to(dev))[0]
    return emb.to(pipe.text_encoder.dtype), None


def call_args(pipe, num_frames: int | None) -> dict:
    # embeddings are given: the pipeline's own mask_feature trimming does not apply (runner.serve.text)
    return dict(video_length=num_frames, clean_caption=False)


def residual_forward(den, first_blocks: int) -> None:
    from compiler.video import block_pairs
    if not block_pairs.has_pair_forward(den):   # eager: the same forward, pairs not compiled
        block_pairs.compile_pairs(den, None)
    block_pairs.set_first_pairs(den, first_blocks)


LATTE = Family(
    name="latte", kind="video", pipeline="LattePipeline",
    presets={"latte1": dict(hub_id="maxin-cn/Latte-1", size_factor=16, max_tokens=120,
                            height=512, width=512, transformer="latte1_transformer", vae="sd_vae")},
    build=build, encode=encode, call_args=call_args, denoiser_config=denoiser_config,
    exact_frames=lambda cfg: cfg.get("video_length", 16), trim_text=True,
    max_steps=ddim_leading(PUBLISHED["latte1_scheduler"]),   # 1000: DDIM raises past it
    # Latte's transformer is a diffusers CacheMixin and runs the cond/uncond batch in one call
    step_reuse=("residual", "fastercache", "pab"), residual_forward=residual_forward)

