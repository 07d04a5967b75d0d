"""The family record: everything the runner needs to know about one model family, in one value.

A family module (`runner/families/<name>.py`) builds one `Family` (or two, for variants that share
the code, like PixArt-α and -Σ) from plain functions; `runner/families/__init__.py` holds them in a
dict. worker, job, text encoding, config, bench and vs_loop read the record; nothing else branches on
a family's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:   # the families import light: config lists their presets before torch loads
    import torch


def no_args(pipe, num_frames: int | None) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    name: str
    kind: str                       # "image" (png, (B, H, W, 3)) | "video" (mp4, (B, F, H, W, 3))
    pipeline: str                   # the diffusers pipeline class `from_pretrained` loads
    # preset -> published facts: hub_id, size_factor (height/width multiple), max_tokens (text
    # length the pipeline pads to), height/width (the preset's size), and what `build` reads;
    # optionally gpu_gib: the GPU memory a worker needs at the preset's published setting (its
    # weights, counted on the meta device, plus a call's activations), checked against the free
    # memory before the model is loaded (`runner.serve.models.check_gpu_memory`)
    presets: dict[str, dict]
    # (preset facts, tiny) -> the pipeline with random weights: the published architecture at full
    # size (tiny=False; built under the caller's device and dtype) or a small config for CPU tests
    build: Callable[[dict, bool], Any]
    # (pipe, prompts, max_tokens) -> embeddings (N, T, D) and attention mask (N, T) or None, and
    # for pipelines that also take a pooled embedding a third element, (N, P) (FLUX's CLIP pooled
    # output): one call of the text encoder(s); padded to max_tokens, so a prompt's embedding
    # ignores its batch-mates
    encode: Callable[[Any, list[str], int], tuple]
    # (pipe, num_frames) -> the family's own `pipe(...)` arguments besides prompts/embeddings,
    # size, steps, guidance, generator, output type (e.g. Latte's `video_length=`)
    call_args: Callable[[Any, int | None], dict] = no_args
    # the denoiser's config for a random build: (preset facts, tiny) -> dict (reads frame counts)
    denoiser_config: Callable[[dict, bool], dict] | None = None
    # video: the one frame count the model takes, from its denoiser config (Latte's video_length)
    exact_frames: Callable[[dict], int] | None = None
    # video: frame counts k * frame_step + 1 only (a VAE that compresses time by frame_step)
    frame_step: int | None = None
    min_steps: int = 1              # fewer steps fail in the pipeline (PixArt-α's 1-step branch)
    # the most steps its pipeline runs with the scheduler of its random and tiny builds (the hub
    # checkpoint's own): computed from that scheduler config by a `parts` function that says why
    # (`parts.train_timesteps`, ...); a row asking for more is refused before any model is built
    max_steps: int | None = None
    # text embeddings trimmed to the prompt's token count (Latte's mask_feature): batch-mates must
    # share it (`runner.serve.text`)
    trim_text: bool = False
    step_reuse: tuple[str, ...] = ()   # step_cache methods offered (`runner.serve.step_cache`)
    # the pipeline runs classifier-free guidance as two denoiser calls per step, the conditional
    # one first, each inside the denoiser's `cache_context("cond"/"uncond")` (diffusers' Wan
    # pipelines): `step_cache.cfg_reuse` can skip the second call (PixArt, Latte and SD batch both
    # branches into one call; FLUX.1-dev has no guidance pass)
    cfg_calls: bool = False
    # `residual` step reuse: the denoiser's block stack, the attribute holding its ModuleList of
    # blocks (hidden states in and out, walked in order by the model's forward: Wan's `blocks`,
    # PixArt's `transformer_blocks`); `compiler.step_reuse` reuses what it adds on a reused step
    # FLUX: several lists walked one after the other, a tuple of their attributes
    step_blocks: str | tuple[str, ...] | None = None
    # what its blocks return, as the block inputs they replace (`compiler.step_reuse.install`):
    # hidden states alone, or FLUX's (encoder_hidden_states, hidden_states) pair
    step_outputs: tuple[str, ...] = ("hidden_states",)
    # the depth of that stack from the denoiser's config (`step_cache.first_blocks` is checked
    # against it before any model is built)
    stack_depth: Callable[[dict], int | None] = lambda cfg: cfg.get("num_layers")
    # or, for a denoiser whose compiled forward has the reuse built in (Latte's block pairs,
    # `compiler.video.block_pairs`): (denoiser, first_blocks) -> None, making its forward take
    # `step_reuse=` and `branch=` (unless compile_pipe already installed that forward)
    residual_forward: Callable[[Any, int], None] | None = None
    load_kwargs: dict = field(default_factory=dict)   # extra `from_pretrained` arguments
    # model_index.json entries that tell this family's checkpoints from another family's of the
    # same pipeline class (Wan 2.1 T2V, Wan 2.2 A14B and TI2V-5B are all WanPipeline): entry ->
    # set (a component, a true flag, a value) or not (absent, null, false). `runner.serve.checkpoint`
    # checks a pretrained checkpoint against it on the driver, before a worker loads it
    checkpoint: dict[str, bool] = field(default_factory=dict)
    # the pipeline runs a negative-prompt branch (classifier-free guidance); False for a
    # guidance-distilled model (FLUX.1-dev: guidance_scale is an embedding, no second pass), whose
    # rows' negative_prompt is not encoded
    negative_prompt: bool = True
    # the denoiser's self-attention is what compile flag `int8-attention` takes (Wan's, at video
    # sizes): its outputs then change, so the flag is part of the job's output settings
    long_attention: bool = False
    # the pipeline attribute of the tokenizer whose length is `max_tokens` (FLUX: `tokenizer_2`,
    # the T5's; its `tokenizer` is CLIP's 77)
    tokenizer: str = "tokenizer"
    # image-to-video: None (text only), "required" (every row animates its `image`: Wan 2.1 I2V) or
    # "optional" (rows with an image are animated from it, rows without are text-to-video: Wan 2.2
    # TI2V-5B); `runner.io.images` reads and fits the image, `runner.serve.worker` passes it as `image=`
    image: str | None = None
    # (pipe) -> the pipeline a row with an image is run by, sharing `pipe`'s modules (TI2V-5B:
    # WanImageToVideoPipeline beside the text-to-video WanPipeline); None: `pipe` itself
    image_pipeline: Callable[[Any], Any] | None = None
    # the pipeline attributes of its denoisers, the first the one every step runs (Wan 2.2 A14B:
    # the low-noise expert `transformer_2` too): where `model.adapters` may go (`runner.serve.adapters`)
    experts: tuple[str, ...] = ("transformer",)
    # (denoiser, layout, rank, seed) -> a random LoRA adapter's tensors in one of the family's
    # published key layouts (`runner.bench.lora`, tests: no adapter can be downloaded here)
    random_adapter: Callable[..., dict] | None = None
    # (an adapter file's key) -> the denoiser parameter a full difference of the family's layout
    # adds to (`.diff`, `.diff_b`, `diff_m`), None for other keys; None: the family has none
    # (`runner.serve.adapters` refuses them then)
    lora_diffs: Callable[[str], str | None] | None = None
    # video with a causal video VAE (Wan's `AutoencoderKLWan`): (tiny) -> that VAE alone, random
    # weights, at full size (tiny=False; under the caller's device) or small; `runner.bench.decode`
    video_vae: Callable[[bool], Any] | None = None
