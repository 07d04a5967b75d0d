"""Video DiTs of spatial + temporal block pairs: compile each pair with the layout changes between them.

Which models: those with `transformer_blocks` and `temporal_transformer_blocks` of equal length
(`has_block_pairs`; in diffusers 0.42, `LatteTransformer3DModel`, whose forward this copies).
Contract: `compile_pairs(transformer, compile_kwargs) -> {"BlockPair": n}` gives such a
transformer a forward that runs its n (28 at full size) block pairs through ONE
`torch.compile`d function (one graph, shared by every pair), and is otherwise diffusers' forward
(0.42) line for line. In eager mode the result is identical to diffusers'; it falls back to
diffusers' forward for what it does not cover (`enable_temporal_attentions=False`, gradient
checkpointing during training).

Step reuse (`step_reuse=`, the caller's choice per denoising step; runner/serve/step_cache.py decides it
from a fixed schedule), as `compiler.step_reuse` does for a plain block stack: `"compute"` runs the
blocks and keeps their residual (what the pairs after the first `set_first_pairs` ones (default 0)
add, (B*F, HW, C)) in a buffer of the transformer per `branch`; `"reuse"` runs only those first
pairs and adds the kept residual instead (the embeddings and the final layer still run, with this
step's timestep), as TeaCache and LeMiCa reuse a step. The decision is a Python argument, never read from
a tensor: no host sync, and under `cudagraphs` each kind of step is its own captured graph
(`StepGraph` keys on non-tensor arguments), reading and writing the same fixed buffer.

Why: between the blocks diffusers re-lays the activations out twice per pair,
(B*F, H*W, C) -> (B*H*W, F, C) and back, as eager permute copies. At Latte-1's 512² x 16 frames with
CFG that is 2 x 28 copies of a 32768 x 1152 fp16 tensor (75 MB) per step, ~0.2 ms each on an H100
(~11 ms of a ~160 ms compiled step). Inside one compiled graph Inductor folds each permute into the
kernels next to it (the residual add that ends one block, the LayerNorm that starts the next).
"""

from __future__ import annotations

import functools

import torch

from ..step_reuse import residual


def _pair(spatial, temporal, hidden_states, enc_spatial, enc_mask, t_spatial, t_temp, temp_pos, batch_size: int):
    """One spatial block, (B*F, HW, C) -> (B*HW, F, C), + temporal position (zeros after pair 0),
    one temporal block, and back. Shapes as in diffusers' LatteTransformer3DModel.forward."""
    h = spatial(hidden_states, None, enc_spatial, enc_mask, t_spatial, None, None)
    h = h.reshape(batch_size, -1, h.shape[-2], h.shape[-1]).permute(0, 2, 1, 3)
    h = h.reshape(-1, h.shape[-2], h.shape[-1])
    h = h + temp_pos
    h = temporal(h, None, None, None, t_temp, None, None)
    h = h.reshape(batch_size, -1, h.shape[-2], h.shape[-1]).permute(0, 2, 1, 3)
    return h.reshape(-1, h.shape[-2], h.shape[-1])


def forward(self, pair, hidden_states, timestep=None, encoder_hidden_states=None, encoder_attention_mask=None,
            enable_temporal_attentions: bool = True, return_dict: bool = True, step_reuse: str | None = None,
            branch=None):
    """diffusers 0.42 `LatteTransformer3DModel.forward` with the block loop calling `pair`;
    `step_reuse`: None | "compute" | "reuse", `branch`: which kept residual (module docstring)."""
    if not enable_temporal_attentions or (torch.is_grad_enabled() and self.gradient_checkpointing):
        if step_reuse is not None:
            raise ValueError("step reuse needs the pair forward (temporal attention on, no gradient checkpointing)")
        return type(self).forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                                  enable_temporal_attentions, return_dict)
    batch_size, channels, num_frame, height, width = hidden_states.shape
    hidden_states = hidden_states.permute(0, 2, 1, 3, 4).reshape(-1, channels, height, width)
    height, width = hidden_states.shape[-2] // self.config.patch_size, hidden_states.shape[-1] // self.config.patch_size
    num_patches = height * width
    # PatchEmbed returns a transposed view; every later pair gets a contiguous tensor: one layout, one graph
    hidden_states = self.pos_embed(hidden_states).contiguous()

    added_cond_kwargs = {"resolution": None, "aspect_ratio": None}
    timestep, embedded_timestep = self.adaln_single(
        timestep, added_cond_kwargs=added_cond_kwargs, batch_size=batch_size, hidden_dtype=hidden_states.dtype)
    hidden_states = _blocks(self, pair, hidden_states, encoder_hidden_states, encoder_attention_mask,
                            timestep, num_frame, num_patches, batch_size, step_reuse, branch)
    return _final_layer(self, hidden_states, embedded_timestep, num_frame, height, width, batch_size, return_dict)


def _blocks(self, pair, hidden_states, encoder_hidden_states, encoder_attention_mask, timestep,
            num_frame: int, num_patches: int, batch_size: int, step_reuse: str | None, branch):
    """The 28 block pairs, (B*F, HW, C) -> (B*F, HW, C). Step reuse: the first `first` pairs
    always run; "compute" runs the rest and keeps what they added, "reuse" adds that instead."""
    first = self.__dict__.get("_reuse_first", 0)
    encoder_hidden_states = self.caption_projection(encoder_hidden_states)
    enc_spatial = encoder_hidden_states.repeat_interleave(
        num_frame, dim=0, output_size=encoder_hidden_states.shape[0] * num_frame
    ).view(-1, encoder_hidden_states.shape[-2], encoder_hidden_states.shape[-1])
    # The text length varies per prompt when the pipeline trims the embeddings (LattePipeline's
    # default mask_feature=True): a symbolic dim, so a job's prompts share one graph instead of one
    # compile per token count (and Dynamo's recompile limit after a few dozen).
    torch._dynamo.maybe_mark_dynamic(enc_spatial, 1)
    t_spatial = timestep.repeat_interleave(num_frame, dim=0, output_size=timestep.shape[0] * num_frame
                                           ).view(-1, timestep.shape[-1])
    t_temp = timestep.repeat_interleave(num_patches, dim=0, output_size=timestep.shape[0] * num_patches
                                        ).view(-1, timestep.shape[-1])
    # diffusers adds the temporal position embedding before the first temporal block only (and only
    # for more than one frame); every other pair adds zeros, so all pairs share one graph.
    if num_frame > 1:
        temp_pos = self.temp_pos_embed.to(hidden_states.dtype)                 # (1, F, C)
    else:
        temp_pos = hidden_states.new_zeros(1, 1, hidden_states.shape[-1])
    no_pos = torch.zeros_like(temp_pos)
    pairs = list(zip(self.transformer_blocks, self.temporal_transformer_blocks))
    stop = first if step_reuse == "reuse" else len(pairs)
    blocks_in = hidden_states
    for i, (spatial, temporal) in enumerate(pairs[:stop]):
        if i == first:
            blocks_in = hidden_states
        hidden_states = pair(spatial, temporal, hidden_states, enc_spatial, encoder_attention_mask,
                             t_spatial, t_temp, temp_pos if i == 0 else no_pos, batch_size)
    # The kept residual (B*F, HW, C), batch items in the order of the call: one fixed buffer per
    # branch and shape (its address is what a captured graph writes and reads).
    if step_reuse == "reuse":
        hidden_states = hidden_states + residual(self, branch, hidden_states, create=False)
    elif step_reuse == "compute":
        torch.sub(hidden_states, blocks_in, out=residual(self, branch, hidden_states, create=True))
    return hidden_states


def _final_layer(self, hidden_states, embedded_timestep, num_frame: int, height: int, width: int,
                 batch_size: int, return_dict: bool):
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    embedded_timestep = embedded_timestep.repeat_interleave(
        num_frame, dim=0, output_size=embedded_timestep.shape[0] * num_frame).view(-1, embedded_timestep.shape[-1])
    shift, scale = (self.scale_shift_table[None] + embedded_timestep[:, None]).chunk(2, dim=1)
    hidden_states = self.norm_out(hidden_states)
    hidden_states = hidden_states * (1 + scale) + shift
    hidden_states = self.proj_out(hidden_states)

    p = self.config.patch_size
    hidden_states = hidden_states.reshape(shape=(-1, height, width, p, p, self.out_channels))
    hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
    output = hidden_states.reshape(shape=(-1, self.out_channels, height * p, width * p))
    output = output.reshape(batch_size, -1, output.shape[-3], output.shape[-2], output.shape[-1]).permute(0, 2, 1, 3, 4)
    if not return_dict:
        return (output,)
    return Transformer2DModelOutput(sample=output)


def has_block_pairs(module: torch.nn.Module) -> bool:
    """Structure, not a class name: spatial and temporal block lists of equal length."""
    spatial = getattr(module, "transformer_blocks", None)
    temporal = getattr(module, "temporal_transformer_blocks", None)
    return isinstance(spatial, torch.nn.ModuleList) and isinstance(temporal, torch.nn.ModuleList) \
        and len(spatial) == len(temporal) > 0


def compile_pairs(transformer: torch.nn.Module, compile_kwargs: dict | None) -> dict[str, int]:
    """Install the pair forward on `transformer` (compiled with `compile_kwargs`; None: eager)."""
    pair = torch.compile(_pair, **compile_kwargs) if compile_kwargs is not None else _pair
    transformer.forward = functools.partial(forward, transformer, pair)
    transformer._pair_forward = True   # wrappers added later (SDPA priority, StepGraph) pass kwargs on
    return {"BlockPair": len(transformer.transformer_blocks)}


def set_first_pairs(transformer: torch.nn.Module, first: int) -> None:
    """Step reuse: the leading pairs run on every step, reused ones too (`first` < pair count)."""
    n = len(transformer.transformer_blocks)
    if not 0 <= first < n:
        raise ValueError(f"step reuse: first={first} must be in [0, {n - 1}] ({n} block pairs)")
    transformer.__dict__["_reuse_first"] = first


def has_pair_forward(transformer: torch.nn.Module) -> bool:
    """Whether `compile_pairs` installed the forward above (so calls take `step_reuse=`)."""
    return transformer.__dict__.get("_pair_forward", False)
