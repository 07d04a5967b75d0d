"""Step reuse over a denoiser's block stack: what the blocks added on a computed step is added
again, without running them, on a reused step (lossy; TeaCache's and LeMiCa's reuse, cache-dit's
DBCache "F<n>B0").

Contract: `install(denoiser, blocks, first=0)` makes `denoiser(...)` take two more keyword
arguments and returns how many blocks a reused step skips:
- `step_reuse`: None (the model's own forward, untouched), `"compute"` or `"reuse"`;
- `branch`: which kept residual a call reads and writes (any hashable; one per classifier-free
  guidance branch for pipelines that run the conditional and unconditional passes as two calls).
`denoiser.<blocks>` is the block stack: an `nn.ModuleList` that the model's forward walks as
`hidden = block(hidden, ...)`, each block mapping hidden states (B, N, C) to the same shape
(diffusers' DiTs: `blocks` in Wan, `transformer_blocks` in PixArt). On a call with `step_reuse`:
- `"compute"`: every block runs; the residual of blocks[first:] (their output minus their input,
  (B, N, C)) is kept in one fixed buffer per (branch, shape, dtype, device);
- `"reuse"`: blocks[:first] run (their output is this step's own: cache-dit's "first block(s)
  computed", F1B0 for first=1), the rest are skipped and the kept residual is added instead.
The embeddings before the stack and the final layer after it run on every step, with the step's
own timestep.

Why this shape: the decision is a Python argument, never read from a tensor, so there is no host
sync per step and a whole-step CUDA graph (`compiler.cudagraph.StepGraph`, which keys its graphs
on non-tensor arguments) captures each (step_reuse, branch) once, reading and writing the same
buffer on every replay. The block list keeps its modules (parameters, state_dict, per-block
compilation and FP8 transforms are untouched): only its iteration during such a call changes,
through a subclass swapped in as its `__class__`. Installed after `compile_pipe`, the argument
handling goes beneath the step graph (`StepGraph.fn`), so the graph sees the arguments.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .cudagraph import StepGraph


class ReusableBlocks(nn.ModuleList):
    """A block list whose iteration, during a call with `step_reuse`, runs the stack as the module
    docstring says. `_reuse_first` and `_reuse_mode` live in the instance's __dict__."""

    def __iter__(self):
        mode = self.__dict__.get("_reuse_mode")
        if mode is None:
            return super().__iter__()
        kind, branch = mode
        blocks = list(self._modules.values())
        first = self.__dict__["_reuse_first"]
        if kind == "compute":
            return iter([*blocks[:first], _Enter(self), *blocks[first:], _Leave(self, branch)])
        return iter([*blocks[:first], _Reuse(self, branch)])


def _hidden(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _Enter:
    """Stands in the stack before blocks[first]: notes their input, returns it unchanged."""

    def __init__(self, stack):
        self.stack = stack

    def __call__(self, *args, **kwargs):
        h = _hidden(args, kwargs)
        self.stack.__dict__["_reuse_input"] = h
        return h


class _Leave:
    """Stands after the last block: keeps output - input of blocks[first:] in the branch's buffer."""

    def __init__(self, stack, branch):
        self.stack, self.branch = stack, branch

    def __call__(self, *args, **kwargs):
        h = _hidden(args, kwargs)
        h_in = self.stack.__dict__.pop("_reuse_input")
        torch.sub(h, h_in, out=residual(self.stack, self.branch, h, create=True))
        return h


class _Reuse:
    """Stands for blocks[first:] on a reused step: their kept residual added to the input."""

    def __init__(self, stack, branch):
        self.stack, self.branch = stack, branch

    def __call__(self, *args, **kwargs):
        h = _hidden(args, kwargs)
        return h + residual(self.stack, self.branch, h, create=False)


def residual(owner: nn.Module, branch, like: torch.Tensor, create: bool) -> torch.Tensor:
    """The kept residual of `branch` for `like`'s shape: one fixed buffer per (branch, shape,
    dtype, device) in `owner`'s __dict__ (its address is what a captured graph writes and reads).
    `create=False`: it must exist (a call's first step is computed)."""
    store = owner.__dict__.setdefault("_step_residual", {})
    key = (branch, tuple(like.shape), like.dtype, like.device)
    buf = store.get(key)
    if buf is None:
        if not create:
            raise RuntimeError(f"step reuse: no computed step of shape {tuple(like.shape)} (branch "
                               f"{branch!r}) to reuse: a call's first step must be computed")
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            # allocated here it would live in the graph's private pool, shared with other graphs
            raise RuntimeError("step reuse: residual buffer first needed during CUDA graph capture")
        buf = store[key] = torch.empty_like(like)
    return buf


def _forward(stack: ReusableBlocks, inner, *args, step_reuse: str | None = None, branch=None,
             **kwargs):
    """The denoiser's forward with the two arguments of `install` (the stack's mode is set for
    this call only)."""
    if step_reuse not in (None, "compute", "reuse"):
        raise ValueError(f"step_reuse={step_reuse!r}: expected None, 'compute' or 'reuse'")
    if step_reuse is None:
        return inner(*args, **kwargs)
    stack.__dict__["_reuse_mode"] = (step_reuse, branch)
    try:
        return inner(*args, **kwargs)
    finally:
        stack.__dict__["_reuse_mode"] = None
        stack.__dict__.pop("_reuse_input", None)


def install(denoiser: nn.Module, blocks: str, first: int = 0) -> int:
    """Make `denoiser`'s calls take `step_reuse=` and `branch=` (module docstring); returns the
    number of blocks a reused step skips. Idempotent for the same `blocks` and `first`."""
    stack = getattr(denoiser, blocks, None)
    if not isinstance(stack, nn.ModuleList) or not len(stack):
        raise ValueError(f"{type(denoiser).__name__}.{blocks} is not a non-empty ModuleList of blocks")
    if not 0 <= first < len(stack):
        raise ValueError(f"step reuse: first={first} must be in [0, {len(stack) - 1}] "
                         f"({type(denoiser).__name__} has {len(stack)} blocks)")
    if isinstance(stack, ReusableBlocks):
        if stack.__dict__["_reuse_first"] != first:
            raise ValueError(f"step reuse already installed with first={stack.__dict__['_reuse_first']}")
        return len(stack) - first
    stack.__class__ = ReusableBlocks
    stack.__dict__.update(_reuse_first=first, _reuse_mode=None)
    # Beneath a whole-step CUDA graph, so that its signature includes the two arguments.
    owner = denoiser.forward if isinstance(denoiser.forward, StepGraph) else None
    inner = owner.fn if owner is not None else denoiser.forward
    fwd = functools.partial(_forward, stack, inner)
    if owner is not None:
        owner.fn = fwd
    else:
        denoiser.forward = fwd
    return len(stack) - first


def installed(denoiser: nn.Module) -> bool:
    """Whether some block list of `denoiser` has `install`'s reuse (tests, the runner's checks)."""
    return any(isinstance(m, ReusableBlocks) for m in denoiser.children())
