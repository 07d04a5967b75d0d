"""Stable Diffusion 2.1 (stabilityai/stable-diffusion-2-1): OpenCLIP-H text encoder (77 tokens), a
UNet, v-prediction DDIM, 768x768. Loaded without the safety checker (a batch runner's outputs are
checked downstream, and the checkpoint ships none).
"""

from __future__ import annotations

from .parts import PUBLISHED, clip_tokenizer, ddim_leading, scheduler, sd_vae
from .record import Family


def _tiny_unet():
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, norm_num_groups=4, cross_attention_dim=16, attention_head_dim=(2, 4),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), use_linear_projection=True)


def build(preset: dict, tiny: bool):
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    tok = clip_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    if tiny:
        unet = _tiny_unet()
        clip = CLIPTextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                              projection_dim=16, **ids)
    else:
        unet = UNet2DConditionModel.from_config(PUBLISHED[preset["unet"]])
        clip = CLIPTextConfig(**{**PUBLISHED["sd21_clip"], **ids})
    return StableDiffusionPipeline(vae=sd_vae(preset["vae"], tiny), text_encoder=CLIPTextModel(clip),
                                   tokenizer=tok, unet=unet,
                                   scheduler=scheduler(DDIMScheduler, PUBLISHED["sd21_scheduler"]),
                                   safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def encode(pipe, prompts: list[str], max_tokens: int):
    emb, _ = pipe.encode_prompt(prompts, pipe._execution_device, 1, False)
    return emb, None


SD21 = Family(
    name="sd21", kind="image", pipeline="StableDiffusionPipeline",
    presets={"sd21": dict(hub_id="stabilityai/stable-diffusion-2-1", size_factor=8, max_tokens=77,
                          height=768, width=768, unet="sd21_unet", vae="sd21_vae")},
    build=build, encode=encode, experts=("unet",),
    max_steps=ddim_leading(PUBLISHED["sd21_scheduler"]),   # 999: steps_offset 1
    load_kwargs=dict(safety_checker=None, requires_safety_checker=False))
