"""NVIDIA AnyFlow on Wan 2.1 T2V 1.3B (nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers): a flow-map
distillation that runs any step count (1-32) with classifier-free guidance baked in (its training's
fuse_guidance_scale 3.0), so one denoiser call a step at guidance 1.0.

diffusers 0.42's `AnyFlowPipeline`: UMT5-XXL (512 tokens), the Wan 2.1 VAE, and
`AnyFlowTransformer3DModel`, Wan 2.1 1.3B's DiT (30 blocks, 12 heads x 128, ffn 8960) whose timestep
embedder also embeds the step's target time r (`gate_value` 0.25 mixes the two, `deltatime_type`
"r"); `FlowMapEulerDiscreteScheduler` at shift 5.0: sigmas linspace(1, 0, N+1)[:-1] shifted (4
steps: timesteps 1000, 937.5, 833.3, 625), each step z_r = z_t - (s_t - s_r) u, no re-noising.
Published: 480x832, 81 frames at 16 fps, 4 steps, guidance 1.0 (the diffusers docs' example, the
NVlabs/AnyFlow README and its test options for the 1.3B).

Sources: diffusers' scripts/convert_anyflow_to_diffusers.py (the transformer config is Wan 2.1
1.3B's plus gate_value and deltatime_type; the scheduler FlowMapEulerDiscreteScheduler(shift=5.0);
VAE, text encoder and tokenizer those of Wan-AI/Wan2.1-T2V-1.3B-Diffusers). The hub repos' JSON
files named NVlabs' own classes as of diffusers PR #13745 (2026-05-20): `from_pretrained` of the
published repo with stock diffusers may need `model.path` to a copy saved with diffusers' classes.
"""

from __future__ import annotations

from .parts import scheduler, t5_encoder, train_timesteps
from .record import Family
from .wan import TRANSFORMERS, UMT5_XXL, call_args, diff_parameter, encode, random_adapter, vae

SCHEDULER = dict(num_train_timesteps=1000, shift=5.0)
TINY = dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=16, ffn_dim=32,
            num_layers=2, rope_max_seq_len=64)   # head dim 12: rotary 4/4/4 over time, height, width


def denoiser_config(preset: dict, tiny: bool) -> dict:
    cfg = {k: v for k, v in TRANSFORMERS["1.3b"].items()
           if k not in ("qk_norm", "added_kv_proj_dim")}    # not AnyFlowTransformer3DModel's
    cfg.update(gate_value=0.25, deltatime_type="r")
    return {**cfg, **TINY} if tiny else cfg


def build(preset: dict, tiny: bool):
    from diffusers import AnyFlowPipeline, AnyFlowTransformer3DModel, FlowMapEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel
    tok, te = t5_encoder(preset["max_tokens"], tiny, UMT5_XXL, UMT5Config, UMT5EncoderModel)
    return AnyFlowPipeline(
        tokenizer=tok, text_encoder=te, vae=vae(tiny),
        transformer=AnyFlowTransformer3DModel.from_config(denoiser_config(preset, tiny)),
        scheduler=scheduler(FlowMapEulerDiscreteScheduler, SCHEDULER))


ANYFLOW = Family(
    name="anyflow", kind="video", pipeline="AnyFlowPipeline",
    presets={"anyflow_wan21_t2v_1_3b": dict(hub_id="nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers",
                                            size_factor=16, max_tokens=512, height=480,
                                            width=832, distilled=True,
                                            # the step counts it is distilled for (its model
                                            # card: 1-32); more is refused (exit 2)
                                            max_steps=32)},
    build=build, encode=encode, call_args=call_args, denoiser_config=denoiser_config,
    frame_step=4, max_steps=train_timesteps(SCHEDULER), random_adapter=random_adapter, lora_diffs=diff_parameter,
    long_attention=True)
