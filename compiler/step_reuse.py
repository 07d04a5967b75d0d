"""Step reuse over a denoiser's block stack: what the blocks added on a computed step is added
again, without running them, on a reused step (lossy; TeaCache's and LeMiCa's reuse, cache-dit's
DBCache "F<n>B0").

Contract: `install(denoiser, blocks, first=0, outputs=("hidden_states",))` makes `denoiser(...)`
take two more keyword arguments and returns how many blocks a reused step skips:
- `step_reuse`: None (the model's own forward, untouched), `"compute"` or `"reuse"`;
- `branch`: which kept residual a call reads and writes (any hashable; one per classifier-free
  guidance branch for pipelines that run the conditional and unconditional passes as two calls).
`blocks` names the block stack: one attribute of `denoiser` holding an `nn.ModuleList` (Wan's
`blocks`, PixArt's `transformer_blocks`), or several walked one after the other by the model's
forward, the stack being their concatenation (FLUX's 19 `transformer_blocks` then 38
`single_transformer_blocks`). `outputs` names what a block returns, as the block inputs they
replace: `("hidden_states",)` for a block mapping hidden states (B, N, C) to the same shape,
`("encoder_hidden_states", "hidden_states")` for FLUX's blocks, which return the pair
((B, T, C) text, (B, N, C) image) in that order. The blocks of a stack share their forward's
parameter order (how a positional input is found by name). On a call with `step_reuse`:
- `"compute"`: every block runs; the residual of blocks[first:] (their outputs minus their inputs,
  one tensor per output) is kept in one fixed buffer per (branch, output, shape, dtype, device);
- `"reuse"`: blocks[:first] run (their output is this step's own: cache-dit's "first block(s)
  computed", F1B0 for first=1), the rest are skipped and the kept residuals are added instead.
`first` counts over the whole stack (FLUX: 19 is the first single block). The embeddings before
the stack and the final layer after it run on every step, with the step's own timestep.

Why this shape: the decision is a Python argument, never read from a tensor, so there is no host
sync per step and a whole-step CUDA graph (`compiler.cudagraph.StepGraph`, which keys its graphs
on non-tensor arguments) captures each (step_reuse, branch) once, reading and writing the same
buffer on every replay. The block lists keep their modules (parameters, state_dict, per-block
compilation and FP8 transforms are untouched): only their iteration during such a call changes,
through a subclass swapped in as their `__class__`. Installed after `compile_pipe`, the argument
handling goes beneath the step graph (`StepGraph.fn`), so the graph sees the arguments.

`UncondReuse` (below) is the other reuse, across guidance branches rather than steps: for
pipelines that run the unconditional branch as its own denoiser call, a skipped call's output is
estimated from this step's conditional output and the branches' difference at their last call
(FasterCache's CFG-Cache). The caller decides which calls are skipped; a skipped call runs no
denoiser and no graph, only a few elementwise kernels.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from .cudagraph import StepGraph


class _Stack:
    """What the lists of one installed stack share: `first` (over the whole stack), the block
    inputs its outputs are, this call's mode (None, or (kind, branch)), the inputs at
    blocks[first] on a computed step; the residual buffers are kept by the first list (`owner`,
    in its __dict__ as `_step_residual`: {(branch or (branch, output), shape, dtype, device):
    tensor})."""

    def __init__(self, lists: list[nn.ModuleList], first: int, outputs: tuple[str, ...]):
        self.lists, self.first, self.outputs = lists, first, outputs
        self.total = sum(len(l) for l in lists)
        names = list(inspect.signature(type(lists[0][0]).forward).parameters)[1:]   # without self
        self.position = {n: names.index(n) for n in outputs if n in names}
        self.mode = None
        self.entry = None
        self.owner = lists[0]          # keeps the residual buffers (`residual`)

    def values(self, args, kwargs) -> list[torch.Tensor]:
        """The block inputs that its outputs replace, in output order."""
        return [kwargs[n] if n in kwargs else args[self.position[n]] for n in self.outputs]

    def result(self, values: list[torch.Tensor]):
        """What a block returns: the tensor, or the tuple for several outputs."""
        return values[0] if len(values) == 1 else tuple(values)

    def key(self, branch, i: int):
        return branch if len(self.outputs) == 1 else (branch, i)

    def walk(self, blocks: ReusableBlocks) -> list:
        """The iteration of one of the stack's lists during a call with `step_reuse`."""
        kind, branch = self.mode
        out = []
        for k, block in enumerate(blocks._modules.values(), blocks.__dict__["_reuse_offset"]):
            if k == self.first:
                out.append(_Enter(self) if kind == "compute" else _Reuse(self, branch))
            if kind == "reuse" and k >= self.first:
                break                  # this list's (and every later list's) rest is skipped
            out.append(block)
        if kind == "compute" and blocks is self.lists[-1]:
            out.append(_Leave(self, branch))
        return out


class ReusableBlocks(nn.ModuleList):
    """A block list whose iteration, during a call with `step_reuse`, runs its part of the stack
    as the module docstring says. `_reuse` (the `_Stack`) and `_reuse_offset` (the global index of
    its first block) live in the instance's __dict__."""

    def __iter__(self):
        stack = self.__dict__.get("_reuse")
        if stack is None or stack.mode is None:
            return super().__iter__()
        return iter(stack.walk(self))


class _Enter:
    """Stands in the stack before blocks[first]: notes their inputs, returns them unchanged."""

    def __init__(self, stack: _Stack):
        self.stack = stack

    def __call__(self, *args, **kwargs):
        self.stack.entry = self.stack.values(args, kwargs)
        return self.stack.result(self.stack.entry)


class _Leave:
    """Stands after the last block: keeps output - input of blocks[first:] in the branch's buffers."""

    def __init__(self, stack: _Stack, branch):
        self.stack, self.branch = stack, branch

    def __call__(self, *args, **kwargs):
        st = self.stack
        out, entry = st.values(args, kwargs), st.entry
        st.entry = None
        for i, (h, h_in) in enumerate(zip(out, entry)):
            torch.sub(h, h_in, out=residual(st.owner, st.key(self.branch, i), h, create=True))
        return st.result(out)


class _Reuse:
    """Stands for blocks[first:] on a reused step: their kept residuals added to their inputs."""

    def __init__(self, stack: _Stack, branch):
        self.stack, self.branch = stack, branch

    def __call__(self, *args, **kwargs):
        st = self.stack
        return st.result([h + residual(st.owner, st.key(self.branch, i), h, create=False)
                          for i, h in enumerate(st.values(args, kwargs))])


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


def _forward(stack: _Stack, inner, *args, step_reuse: str | None = None, branch=None, **kwargs):
    """The denoiser's forward with the two arguments of `install` (the stack's mode is set for
    this call only)."""
    if step_reuse not in (None, "compute", "reuse"):
        raise ValueError(f"step_reuse={step_reuse!r}: expected None, 'compute' or 'reuse'")
    if step_reuse is None:
        return inner(*args, **kwargs)
    stack.mode = (step_reuse, branch)
    try:
        return inner(*args, **kwargs)
    finally:
        stack.mode = stack.entry = None


def _lists(denoiser: nn.Module, blocks: str | tuple[str, ...]) -> list[nn.ModuleList]:
    names = (blocks,) if isinstance(blocks, str) else tuple(blocks)
    lists = [getattr(denoiser, n, None) for n in names]
    for n, l in zip(names, lists):
        if not isinstance(l, nn.ModuleList) or not len(l):
            raise ValueError(f"{type(denoiser).__name__}.{n} is not a non-empty ModuleList of blocks")
    return lists


def install(denoiser: nn.Module, blocks: str | tuple[str, ...], first: int = 0,
            outputs: tuple[str, ...] = ("hidden_states",)) -> int:
    """Make `denoiser`'s calls take `step_reuse=` and `branch=` (module docstring); returns the
    number of blocks a reused step skips. Idempotent for the same `blocks` and `first`."""
    lists = _lists(denoiser, blocks)
    total = sum(len(l) for l in lists)
    if not 0 <= first < total:
        raise ValueError(f"step reuse: first={first} must be in [0, {total - 1}] "
                         f"({type(denoiser).__name__} has {total} blocks)")
    if isinstance(lists[0], ReusableBlocks):
        done = lists[0].__dict__["_reuse"]
        if done.first != first:
            raise ValueError(f"step reuse already installed with first={done.first}")
        return total - first
    stack = _Stack(lists, first, tuple(outputs))
    offset = 0
    for l in lists:
        l.__class__ = ReusableBlocks
        l.__dict__.update(_reuse=stack, _reuse_offset=offset)
        offset += len(l)
    # Beneath a whole-step CUDA graph, so that its signature includes the two arguments.
    owner = denoiser.forward if isinstance(denoiser.forward, StepGraph) else None
    inner = owner.fn if owner is not None else denoiser.forward
    fwd = functools.partial(_forward, stack, inner)
    if owner is not None:
        owner.fn = fwd
    else:
        denoiser.forward = fwd
    return total - first


def installed(denoiser: nn.Module) -> bool:
    """Whether some block list of `denoiser` has `install`'s reuse (tests, the runner's checks)."""
    return any(isinstance(m, ReusableBlocks) for m in denoiser.children())


# ---------------------------------------------------------------------------------------------
# The unconditional guidance branch reused (FasterCache's CFG-Cache, arXiv 2410.19355)

class UncondReuse:
    """For a pipeline that runs classifier-free guidance as two denoiser calls per step, the
    conditional one first (diffusers' Wan pipelines): what a skipped unconditional call returns.

    At a step whose two calls both ran, the difference d = uncond - cond (float32, one buffer
    allocated once per shape and device) is kept; at a later step whose unconditional call is
    skipped, its output is this step's conditional output plus d, with d's low-frequency part (a
    disc of radius min(H, W) // 5 around the centre of the shifted 2-D spectrum over the last two
    dims, H and W, per frame and channel: FasterCache's split) weighted 1 + alpha in the first
    half of the steps and its high-frequency part weighted 1 + alpha in the second (`late`), as
    maxdiffusion's Wan CFG cache does. alpha = 0 is the plain difference (no FFT). Everything is
    elementwise on tensors already on the device: no graph, no host sync. The low-pass of d is
    computed once per kept difference, at its first use.

    `cond(out, step)` and `uncond(out, step)` note the two calls' outputs (the denoiser's return
    value: a tensor, a tuple whose first element is the output, or an output object with
    `sample`); `ready(step)`: a kept difference and this step's conditional output exist;
    `estimate(late)`: the skipped call's return value, structured like the conditional one's."""

    def __init__(self, alpha: float):
        self.alpha = float(alpha)
        self.delta = self.low = None   # (B, C, F, H, W) float32 buffers
        self.reset()

    def reset(self) -> None:
        """Before each pipeline call: nothing of an earlier call is reused."""
        self.out = self.x = self.step = None
        self.kept = self.low_fresh = False

    def cond(self, out, step: int) -> None:
        # a reference, not a copy: the denoiser's outputs are fresh tensors (StepGraph clones)
        self.out, self.x, self.step = out, _sample(out), step

    def uncond(self, out, step: int) -> None:
        self.kept = self.step == step
        if not self.kept:               # no conditional output of this step: no difference
            return
        u = _sample(out)
        if self.delta is None or self.delta.shape != u.shape or self.delta.device != u.device:
            self.delta = torch.empty(u.shape, dtype=torch.float32, device=u.device)
            self.low = torch.empty_like(self.delta)
        self.delta.copy_(u).sub_(self.x)
        self.low_fresh = False

    def ready(self, step: int) -> bool:
        return self.kept and self.step == step

    def estimate(self, late: bool):
        d = self.delta
        if self.alpha:
            low = self._low_pass()
            # w_low * low + w_high * (d - low) with (w_low, w_high) = (1 + a, 1), late (1, 1 + a)
            d = torch.add(d, d - low if late else low, alpha=self.alpha)
        x = torch.add(self.x, d).to(self.x.dtype)
        out = self.out
        if isinstance(out, torch.Tensor):
            return x
        if isinstance(out, tuple):
            return (x, *out[1:])
        return type(out)(**{**out, "sample": x})

    def _low_pass(self) -> torch.Tensor:
        if not self.low_fresh:
            h, w = self.delta.shape[-2:]
            y = torch.arange(h, device=self.delta.device)[:, None] - h // 2
            x = torch.arange(w, device=self.delta.device)[None, :] - w // 2
            # FasterCache's disc on the centred spectrum, moved to the unshifted one
            mask = torch.fft.ifftshift(y * y + x * x <= (min(h, w) // 5) ** 2)
            self.low.copy_(torch.fft.ifft2(torch.fft.fft2(self.delta) * mask).real)
            self.low_fresh = True
        return self.low


def _sample(out) -> torch.Tensor:
    """The denoiser's output tensor in its return value (tensor, tuple or output object)."""
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, tuple) else out.sample
