"""Wan 2.1 text-to-video (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, -14B-Diffusers): UMT5-XXL (512 tokens),
the Wan VAE (8x space, 4x time: 4k+1 frames), a DiT of 30 (1.3B) or 40 (14B) blocks with head dim
128; UniPC with flow sigmas (shift 3.0). Published: 480x832 (1.3B, also 720x1280 for 14B), 81
frames, 50 steps, guidance 5.0. WanPipeline runs the conditional and unconditional passes as two
denoiser calls per step.

The configs below are the hub checkpoints' config.json files (transformer, text encoder, scheduler;
the VAE's are `AutoencoderKLWan`'s defaults).
"""

from __future__ import annotations

from .parts import scheduler, t5_encoder, train_timesteps
from .record import Family

_TRANSFORMER = dict(patch_size=[1, 2, 2], attention_head_dim=128, in_channels=16, out_channels=16,
                    text_dim=4096, freq_dim=256, cross_attn_norm=True, eps=1e-06,
                    qk_norm="rms_norm_across_heads", image_dim=None, added_kv_proj_dim=None,
                    rope_max_seq_len=1024)
TRANSFORMERS = {"1.3b": dict(_TRANSFORMER, num_attention_heads=12, ffn_dim=8960, num_layers=30),
                "14b": dict(_TRANSFORMER, num_attention_heads=40, ffn_dim=13824, num_layers=40)}
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                num_decoder_layers=24, num_heads=64, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, dropout_rate=0.1, layer_norm_epsilon=1e-06,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False, is_encoder_decoder=False)
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                 solver_order=2, prediction_type="flow_prediction", thresholding=False,
                 sample_max_value=1.0, predict_x0=True, solver_type="bh2", lower_order_final=True,
                 disable_corrector=[], solver_p=None, use_flow_sigmas=True, flow_shift=3.0,
                 timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero")


def denoiser_config(preset: dict, tiny: bool) -> dict:
    cfg = dict(TRANSFORMERS[preset["size"]])
    if tiny:  # head dim 12: rotary embedding splits it 4/4/4 over time, height, width
        cfg.update(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=16,
                   ffn_dim=32, num_layers=2, rope_max_seq_len=64)
    return cfg


def vae(tiny: bool):
    from diffusers import AutoencoderKLWan
    # tiny: the same 8x spatial, 4x temporal factors and 16 latent channels, narrow
    return AutoencoderKLWan(base_dim=8, num_res_blocks=1) if tiny else AutoencoderKLWan()


def build(preset: dict, tiny: bool):
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel
    tok, te = t5_encoder(preset["max_tokens"], tiny, UMT5_XXL, UMT5Config, UMT5EncoderModel)
    return WanPipeline(tokenizer=tok, text_encoder=te, vae=vae(tiny),
                       transformer=WanTransformer3DModel.from_config(denoiser_config(preset, tiny)),
                       scheduler=scheduler(UniPCMultistepScheduler, SCHEDULER))


def encode(pipe, prompts: list[str], max_tokens: int):
    # WanPipeline's own: each embedding cut to its token count and zero-padded to max_tokens
    emb, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                max_sequence_length=max_tokens, device=pipe._execution_device)
    return emb, None


def call_args(pipe, num_frames: int | None) -> dict:
    return dict(num_frames=num_frames)


# A Wan block's Linears as diffusers names them -> the original Wan names of LoRA files
# (diffusers' _convert_non_diffusers_wan_lora_to_diffusers maps them back)
LORA_NAMES = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
              "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q",
              "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
              "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


# LoRA files' full differences (`runner.serve.adapters`, LightX2V's extractor): original Wan names ->
# WanTransformer3DModel's, replaced in this order: diffusers'
# scripts/convert_wan_to_diffusers.py, TRANSFORMER_KEYS_RENAME_DICT
_RENAME = (
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("head.modulation", "scale_shift_table"),
    ("head.head", "proj_out"),
    ("modulation", "scale_shift_table"),
    ("ffn.0", "ffn.net.0.proj"),
    ("ffn.2", "ffn.net.2"),
    ("norm2", "norm__placeholder"),        # the original block's norms run norm1, norm3, norm2
    ("norm3", "norm2"),
    ("norm__placeholder", "norm3"),
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    ("self_attn.q", "attn1.to_q"),
    ("self_attn.k", "attn1.to_k"),
    ("self_attn.v", "attn1.to_v"),
    ("self_attn.o", "attn1.to_out.0"),
    ("self_attn.norm_q", "attn1.norm_q"),
    ("self_attn.norm_k", "attn1.norm_k"),
    ("cross_attn.q", "attn2.to_q"),
    ("cross_attn.k", "attn2.to_k"),
    ("cross_attn.v", "attn2.to_v"),
    ("cross_attn.o", "attn2.to_out.0"),
    ("cross_attn.norm_q", "attn2.norm_q"),
    ("cross_attn.norm_k", "attn2.norm_k"),
    ("attn2.to_k_img", "attn2.add_k_proj"),
    ("attn2.to_v_img", "attn2.add_v_proj"),
    ("attn2.norm_k_img", "attn2.norm_added_k"),
)
_DIFF_KINDS = ((".diff_b", ".bias"), (".diff_m", ".modulation"), (".diff", ".weight"))


def diff_parameter(key: str) -> str | None:
    """The WanTransformer3DModel parameter a full difference of the original layout is for
    (`diffusion_model.blocks.0.norm3.diff` -> `blocks.0.norm2.weight`, `...blocks.0.diff_m` ->
    `blocks.0.scale_shift_table`, `...head.diff_m` -> `scale_shift_table`), or None for a key of
    another kind or layout."""
    if not key.startswith("diffusion_model."):
        return None
    for suffix, attr in _DIFF_KINDS:
        if key.endswith(suffix):
            name = key[len("diffusion_model."):-len(suffix)] + attr
            for old, new in _RENAME:
                name = name.replace(old, new)
            return name
    return None



def random_adapter(denoiser, layout: str = "original", rank: int = 64, seed: int = 0,
                   strength: float = 0.05, alpha: float | None = None, diffs: bool = False,
                   device: str = "cpu") -> dict:
    """A random LoRA of every block's attention and feed-forward Linears (A (r, in), B (out, r);
    B @ A * alpha / r about `strength` of a weight's typical entry), bf16, in a published layout:
    `original` (LightX2V's: `diffusion_model.blocks.N.self_attn.q.lora_down.weight`,
    `lora_up.weight`, `.alpha`), `kohya` (musubi-tuner's `lora_unet_blocks_N_self_attn_q...`) or
    `diffusers` (`transformer.blocks.N.attn1.to_q.lora_A.weight`, PEFT's scaling 1).

    `diffs` (original layout only): also every other parameter of the denoiser as LightX2V's LoRA
    extractor writes it (its distilled LoRAs' layout): a weight matrix of at least 1e6 values as a
    pair without alpha (the embeddings' Linears of a 14B), any other weight as `<module>.diff`
    (head.head, patch_embedding, norms, a small model's embeddings), a bias as `<module>.diff_b`,
    the modulation tables as `blocks.N.diff_m` / `head.diff_m`; each difference about `strength`
    over the square root of its fan-in. `device`: where the values are drawn (a seed gives other
    values on a GPU; "cuda" draws a 14B's 292 M in milliseconds, a CPU in seconds); the tensors
    returned are on the CPU, as `safetensors.torch.save_file` writes them."""
    import math

    import torch
    g = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)
    alpha = rank / 2 if alpha is None else alpha
    if diffs and layout != "original":
        raise ValueError(f"diffs: full differences are published in the original layout only, "
                         f"not {layout!r}")
    out = {}
    for i, blk in enumerate(denoiser.blocks):
        for sub, orig in LORA_NAMES.items():
            lin = blk.get_submodule(sub)
            a = randn(rank, lin.in_features) / lin.in_features ** 0.5
            b = randn(lin.out_features, rank) * strength / alpha * rank ** 0.5
            if layout == "diffusers":   # alpha / rank folded into B
                out[f"transformer.blocks.{i}.{sub}.lora_A.weight"] = a.bfloat16()
                out[f"transformer.blocks.{i}.{sub}.lora_B.weight"] = (b * alpha / rank).bfloat16()
                continue
            name = f"blocks.{i}.{orig}"
            key = f"diffusion_model.{name}" if layout == "original" else \
                "lora_unet_" + name.replace(".", "_")
            out[f"{key}.lora_down.weight"] = a.bfloat16()
            out[f"{key}.lora_up.weight"] = b.bfloat16()
            out[f"{key}.alpha"] = torch.tensor(float(alpha))
    if not diffs:
        return {k: t.cpu() for k, t in out.items()}

    def _small(shape, g, strength):     # a difference about strength / sqrt(fan-in), bf16
        fan_in = math.prod(shape[1:]) if len(shape) > 1 and shape[0] > 1 else shape[-1]
        return (randn(*shape) * strength / fan_in ** 0.5).bfloat16()

    # the original Wan names of the denoiser's other modules (diffusers' -> LightX2V's keys;
    # diffusers' scripts/convert_wan_to_diffusers.py maps them the other way)
    block_names = dict(LORA_NAMES, **{
        "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
        "attn2.norm_q": "cross_attn.norm_q", "attn2.norm_k": "cross_attn.norm_k", "norm2": "norm3",
        "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
        "attn2.norm_added_k": "cross_attn.norm_k_img"})
    top_names = {
        "patch_embedding": "patch_embedding", "proj_out": "head.head",
        "condition_embedder.time_embedder.linear_1": "time_embedding.0",
        "condition_embedder.time_embedder.linear_2": "time_embedding.2",
        "condition_embedder.time_proj": "time_projection.1",
        "condition_embedder.text_embedder.linear_1": "text_embedding.0",
        "condition_embedder.text_embedder.linear_2": "text_embedding.2",
        "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
        "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
        "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
        "condition_embedder.image_embedder.norm2": "img_emb.proj.4"}
    for pname, p in denoiser.named_parameters():
        module, _, attr = pname.rpartition(".")
        parts = module.split(".", 2)
        block, sub = (parts[1], parts[2] if len(parts) > 2 else "") if parts[0] == "blocks" else \
            (None, module)
        if attr == "scale_shift_table":     # the modulation tables
            out[f"diffusion_model.{'head' if block is None else f'blocks.{block}'}.diff_m"] = \
                _small(p.shape, g, strength)
            continue
        orig = (block_names if block is not None else top_names).get(sub)
        if orig is None or attr not in ("weight", "bias"):
            raise ValueError(f"{pname}: no original Wan name known for it")
        key = f"diffusion_model.{orig if block is None else f'blocks.{block}.{orig}'}"
        if attr == "bias":
            out[f"{key}.diff_b"] = _small(p.shape, g, strength)
        elif block is not None and sub in LORA_NAMES:
            continue                        # the LoRA pair above
        elif p.dim() == 2 and p.numel() >= 1_000_000:    # the extractor's pair, no alpha
            r = min(rank, *p.shape)
            out[f"{key}.lora_down.weight"] = (randn(r, p.shape[1]) / p.shape[1] ** 0.5).bfloat16()
            out[f"{key}.lora_up.weight"] = (randn(p.shape[0], r) * strength / r ** 0.5).bfloat16()
        else:
            out[f"{key}.diff"] = _small(p.shape, g, strength)
    return {k: t.cpu() for k, t in out.items()}


def _preset(size: str, hub: str) -> dict:
    return dict(hub_id=f"Wan-AI/Wan2.1-T2V-{hub}-Diffusers", size_factor=16, max_tokens=512,
                height=480, width=832, size=size)


# LightX2V's step and CFG distillation of the 14B (lightx2v/Wan2.1-T2V-14B-StepDistill-CfgDistill;
# the LoRA on the base checkpoint: conf/models/wan21_t2v_14b_lightx2v.yaml): 4 steps, guidance 1.0,
# its WanStepDistillScheduler (sample_shift 5, LCM-style re-noising: runner/families/distill.py)
LIGHTX2V = dict(shift=5.0, stochastic=True)

WAN21 = Family(
    name="wan21", kind="video", pipeline="WanPipeline",
    presets={"wan21_t2v_1_3b": _preset("1.3b", "1.3B"), "wan21_t2v_14b": _preset("14b", "14B"),
             "wan21_t2v_14b_lightx2v": dict(_preset("14b", "14B"), sampler=LIGHTX2V)},
    build=build, encode=encode, call_args=call_args, denoiser_config=denoiser_config,
    frame_step=4, step_reuse=("residual",), step_blocks="blocks", cfg_calls=True, long_attention=True,
    max_steps=train_timesteps(SCHEDULER), video_vae=vae, random_adapter=random_adapter, lora_diffs=diff_parameter,
    checkpoint={"transformer_2": False, "boundary_ratio": False, "expand_timesteps": False})
