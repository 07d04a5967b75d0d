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
    # length the pipeline pads to), height/width (the preset's size), and what `build` reads
    presets: dict[str, dict]
    # (preset facts, tiny) -> the pipeline with random weights: the published architecture at full
    # size (tiny=False; built under the caller's device and dtype) or a small config for CPU tests
    build: Callable[[dict, bool], Any]
    # (pipe, prompts, max_tokens) -> embeddings (N, T, D) and attention mask (N, T) or None: one
    # text-encoder call; padded to max_tokens, so a prompt's embedding ignores its batch-mates
    encode: Callable[[Any, list[str], int], tuple[torch.Tensor, torch.Tensor | None]]
    # (pipe, num_frames) -> the family's own `pipe(...)` arguments besides prompts/embeddings,
    # size, steps, guidance, generator, output type (e.g. Latte's `video_length=`)
    call_args: Callable[[Any, int | None], dict] = no_args
    # the denoiser's config for a random build: (preset facts, tiny) -> dict (reads frame counts)
    denoiser_config: Callable[[dict, bool], dict] | None = None
    # video: the one frame count the model takes, from its denoiser config (Latte's video_length)
    exact_frames: Callable[[dict], int] | None = None
    # video: frame counts k * frame_step + 1 only (a VAE that compresses time by frame_step)
    frame_step: int | None = None
    min_steps: int = 1              # fewer steps fail in the pipeline (PixArt's DPM-Solver)
    # text embeddings trimmed to the prompt's token count (Latte's mask_feature): batch-mates must
    # share it (`runner.text`)
    trim_text: bool = False
    step_reuse: tuple[str, ...] = ()   # step_cache methods offered (`runner.step_cache`)
    # `residual` step reuse: the denoiser's block stack, the attribute holding its ModuleList of
    # blocks (hidden states in and out, walked in order by the model's forward: Wan's `blocks`,
    # PixArt's `transformer_blocks`); `compiler.step_reuse` reuses what it adds on a reused step
    step_blocks: str | None = None
    # or, for a denoiser whose compiled forward has the reuse built in (Latte's block pairs,
    # `compiler.block_pairs`): (denoiser, first_blocks) -> None, making its forward take
    # `step_reuse=` and `branch=` (unless compile_pipe already installed that forward)
    residual_forward: Callable[[Any, int], None] | None = None
    load_kwargs: dict = field(default_factory=dict)   # extra `from_pretrained` arguments
