"""Wan 2.1 image-to-video 14B (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers, -720P-Diffusers): every row
animates its `image`.

WanImageToVideoPipeline: the image is (1) encoded by a CLIP ViT-H/14 vision tower (laion
CLIP-ViT-H-14, 32 layers of width 1280 at 224x224: 257 tokens; the pipeline reads its second-last
hidden states, (1, 257, 1280)), which every block attends to through extra key/value projections
(`added_kv_proj_dim` 5120, `image_dim` 1280), and (2) VAE-encoded as the first frame of a
conditioning video (zeros after it), whose 16 latent channels and a 4-channel first-frame mask are
concatenated to the 16 noise channels: in_channels 36. Otherwise Wan 2.1 14B (40 blocks, 40 heads x
128, ffn 13824), UMT5-XXL, the Wan 2.1 VAE, UniPC with flow shift 3.0; guidance 5.0, 81 frames at 16
fps, 50 steps; 480x832 (480P checkpoint) or 720x1280 (720P checkpoint), the row's image resized to
cover the row's size and center-cropped (`runner.io.images.fit`).

Batching: the pipeline encodes one image per call and repeats it over the batch, so a batch is rows
that share their image (the worker groups them: `runner.serve.worker`), each with its own prompt and seed.

Sources: the transformer config is diffusers/scripts/convert_wan_to_diffusers.py's
"Wan-I2V-14B-480p"/"-720p" (the hub's transformer/config.json), which also takes the image encoder
and its processor from laion/CLIP-ViT-H-14-laion2B-s32B-b79K (its vision config and OpenAI-CLIP
preprocessing are written below). The script loads it as `CLIPVisionModelWithProjection`; the hub
checkpoints' model_index.json name `CLIPVisionModel` (the pipeline's annotation too, and it reads
hidden states, never the projection), which is what is built here; the settings are the
diffusers Wan docs' I2V example (guidance 5.0, 81 frames, fps 16) and the model cards (50 steps).
"""

from __future__ import annotations

from .parts import scheduler, t5_encoder, unipc_flow_first_step
from .record import Family
from .wan import (SCHEDULER, TRANSFORMERS, UMT5_XXL, call_args, diff_parameter, random_adapter,
                  vae as wan21_vae)

TRANSFORMER = dict(TRANSFORMERS["14b"], in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
CLIP_VISION_H14 = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                       num_attention_heads=16, patch_size=14, image_size=224, projection_dim=1024,
                       hidden_act="gelu", layer_norm_eps=1e-05)
# OpenAI CLIP's preprocessing (laion's preprocessor_config.json): shortest side 224, center crop
PROCESSOR = dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                 resample=3, image_mean=[0.48145466, 0.4578275, 0.40821073],
                 image_std=[0.26862954, 0.26130258, 0.27577711])
TINY_IMAGE = 28        # tiny CLIP: 28x28 images in 14x14 patches, 4 + 1 tokens


def denoiser_config(preset: dict, tiny: bool) -> dict:
    cfg = dict(TRANSFORMER)
    if tiny:  # head dim 12: rotary embedding splits it 4/4/4; the image tokens are the tiny CLIP's
        cfg.update(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=16,
                   ffn_dim=32, num_layers=2, rope_max_seq_len=64, image_dim=16, added_kv_proj_dim=24)
    return cfg


def _image_encoder(tiny: bool):
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel
    cfg = dict(CLIP_VISION_H14)
    proc = dict(PROCESSOR)
    if tiny:
        cfg.update(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   image_size=TINY_IMAGE, projection_dim=16)
        proc.update(size={"shortest_edge": TINY_IMAGE},
                    crop_size={"height": TINY_IMAGE, "width": TINY_IMAGE})
    # the PIL processor: transformers 5's CLIPImageProcessor wants torchvision, which we do not ship
    return CLIPVisionModel(CLIPVisionConfig(**cfg)), CLIPImageProcessorPil(**proc)


def encode(pipe, prompts: list[str], max_tokens: int):
    # WanPipeline's T5 encoding (each embedding cut to its token count, zero-padded to max_tokens),
    # the same as the I2V pipeline's own copy, which calls ftfy even where it is not installed
    from diffusers import WanPipeline
    emb = WanPipeline._get_t5_prompt_embeds(pipe, prompts, max_sequence_length=max_tokens,
                                            device=pipe._execution_device)
    return emb, None


def build(preset: dict, tiny: bool):
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel
    tok, te = t5_encoder(preset["max_tokens"], tiny, UMT5_XXL, UMT5Config, UMT5EncoderModel)
    encoder, processor = _image_encoder(tiny)
    return WanImageToVideoPipeline(
        tokenizer=tok, text_encoder=te, vae=wan21_vae(tiny), image_encoder=encoder,
        image_processor=processor,
        transformer=WanTransformer3DModel.from_config(denoiser_config(preset, tiny)),
        scheduler=scheduler(UniPCMultistepScheduler, SCHEDULER))


def _preset(res: str, height: int, width: int, gpu_gib: float) -> dict:
    return dict(hub_id=f"Wan-AI/Wan2.1-I2V-14B-{res}-Diffusers", size_factor=16, max_tokens=512,
                height=height, width=width, gpu_gib=gpu_gib)


# gpu_gib (docs/models.md, "GPU memory"): the weights counted on the meta device in 16 bits (22.84 B
# parameters, 42.5 GiB: the transformer is 16.4 B with its image projections) plus estimates of a
# call's step activations and diffusers' per-frame VAE decode (5.1 GiB at 480x832, ~11.7 at 720p)
WAN21_I2V = Family(
    name="wan21_i2v", kind="video", pipeline="WanImageToVideoPipeline",
    presets={"wan21_i2v_14b_480p": _preset("480P", 480, 832, 50.0),
             "wan21_i2v_14b_720p": _preset("720P", 720, 1280, 60.0)},
    build=build, encode=encode, call_args=call_args, denoiser_config=denoiser_config,
    frame_step=4, step_reuse=("residual",), step_blocks="blocks", cfg_calls=True,
    long_attention=True, image="required", video_vae=wan21_vae, random_adapter=random_adapter, lora_diffs=diff_parameter,
    max_steps=unipc_flow_first_step(SCHEDULER),   # 333 (WanImageToVideoPipeline, shift 3.0)
    # Wan 2.2 I2V-A14B is a WanImageToVideoPipeline too: two experts, no CLIP image encoder
    checkpoint={"image_encoder": True, "transformer_2": False})
