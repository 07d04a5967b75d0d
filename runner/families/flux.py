"""FLUX.1-dev text-to-image (black-forest-labs/FLUX.1-dev): FluxPipeline.

Two text encoders: CLIP ViT-L/14's text tower (77 tokens; only its pooled output, (N, 768), feeds
the timestep embedding) and T5-XXL v1.1 (512 tokens, (N, 512, 4096), the joint attention's text
stream, unmasked: every prompt padded to 512). A 12B MM-DiT: 19 double-stream blocks (text and image
streams with joint attention, each returning the pair (encoder_hidden_states, hidden_states)), then
38 single-stream blocks over the concatenated 512 + 4096 tokens (at 1024x1024: 128x128 latents in
2x2 patches), 24 heads x 128 = 3072 wide. Guidance-distilled: `guidance_scale` (3.5) enters as an
embedding, one denoiser call per step, no negative prompt (`negative_prompt=False`; the pipeline's
true CFG stays off). A 16-channel VAE (8x), FlowMatchEuler with the resolution-dependent shift
("dynamic shifting": mu from the image's token count, 0.5 at 256 tokens to 1.15 at 4096). Published:
1024x1024, 28 steps, guidance 3.5.

Step reuse (`residual`): the stack is both block lists, 57 blocks (`first_blocks` counts over both:
19 is the first single block); a reused step adds the kept residual of both streams.

Sources: the transformer config is FluxTransformer2DModel's defaults with guidance_embeds=True, as
diffusers/scripts/convert_flux_to_diffusers.py writes FLUX.1-dev (19 + 38 layers, guidance in the
checkpoint); the VAE is SD3's AutoencoderKL config with scaling_factor 0.3611 and shift_factor 0.1159
(the same script), no quant convs (the hub's vae/config.json); the scheduler_config.json
(FlowMatchEulerDiscreteScheduler: shift 3.0, use_dynamic_shifting, base/max_image_seq_len 256/4096,
base/max_shift 0.5/1.15); CLIP-L is openai/clip-vit-large-patch14's text config; the T5 is
google/t5-v1_1-xxl's (`parts.PUBLISHED["t5_xxl"]`); 28 steps and guidance 3.5 are FluxPipeline's
defaults (diffusers' FLUX docs run FLUX.1-dev at 3.5 with 50 steps in their example).
"""

from __future__ import annotations

from .parts import PUBLISHED, clip_tokenizer, scheduler, t5_encoder, train_timesteps
from .record import Family

TRANSFORMER = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19,
                   num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                   joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=[16, 56, 56])
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
           down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
           layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024,
           scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
           use_post_quant_conv=False, force_upcast=True, mid_block_add_attention=True)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                 base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
              projection_dim=768, layer_norm_eps=1e-05)


def denoiser_config(preset: dict, tiny: bool) -> dict:
    cfg = dict(TRANSFORMER)
    if tiny:  # rotary axes sum to the head dim; in_channels = the tiny VAE's 4 channels x 2x2 patches
        cfg.update(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                   axes_dims_rope=[4, 6, 6])
    return cfg


def _vae(tiny: bool):
    from diffusers import AutoencoderKL
    if tiny:  # four levels keep the 8x spatial factor
        return AutoencoderKL(**{**VAE, "block_out_channels": [8, 8, 8, 8], "layers_per_block": 1,
                                "norm_num_groups": 4, "latent_channels": 4})
    return AutoencoderKL(**VAE)


def _clip(tiny: bool):
    from transformers import CLIPTextConfig, CLIPTextModel
    tok = clip_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    cfg = dict(CLIP_L)
    if tiny:   # the in-memory tokenizer's ids (parts.clip_tokenizer) are all < len(tok)
        cfg.update(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   projection_dim=16)
    return tok, CLIPTextModel(CLIPTextConfig(**cfg, **ids))


def build(preset: dict, tiny: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    tok, clip = _clip(tiny)
    tok_2, t5 = t5_encoder(preset["max_tokens"], tiny, PUBLISHED["t5_xxl"])
    return FluxPipeline(scheduler=scheduler(FlowMatchEulerDiscreteScheduler, SCHEDULER),
                        vae=_vae(tiny), text_encoder=clip, tokenizer=tok, text_encoder_2=t5,
                        tokenizer_2=tok_2,
                        transformer=FluxTransformer2DModel.from_config(denoiser_config(preset, tiny)))


def encode(pipe, prompts: list[str], max_tokens: int):
    # FluxPipeline's own: T5 (N, max_tokens, 4096) padded to max_tokens, CLIP pooled (N, 768)
    emb, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, device=pipe._execution_device,
                                        max_sequence_length=max_tokens)
    return emb, None, pooled


FLUX1_DEV = Family(
    name="flux1", kind="image", pipeline="FluxPipeline",
    # gpu_gib (docs/models.md): the weights counted on the meta device in 16 bits (16.87 B
    # parameters, 31.4 GiB) plus an estimate of one 1024x1024 call (activations, VAE decode)
    presets={"flux1_dev": dict(hub_id="black-forest-labs/FLUX.1-dev", size_factor=16,
                               max_tokens=512, height=1024, width=1024, gpu_gib=36.0)},
    build=build, encode=encode, denoiser_config=denoiser_config,
    step_reuse=("residual",), step_blocks=("transformer_blocks", "single_transformer_blocks"),
    step_outputs=("encoder_hidden_states", "hidden_states"),
    stack_depth=lambda cfg: cfg["num_layers"] + cfg["num_single_layers"],
    negative_prompt=False, tokenizer="tokenizer_2", max_steps=train_timesteps(SCHEDULER))
