"""`StepGraph`: one denoising step (the whole denoiser call) captured as a CUDA graph.

Contract: `StepGraph(fn)(*args, **kwargs)` returns what `fn` returns (cloned tensors). The first call
with a new input signature (tensor shapes/dtypes/strides/devices plus every non-tensor argument)
runs `fn` eagerly `warmup` times (this is where per-block torch.compile compiles), then captures one
call into a CUDA graph; every later call with that signature copies its inputs into the graph's
static buffers and replays it. So the 20-50 steps of a call launch one graph each instead of ~1-3k
kernels, and the eager glue between compiled blocks (embeddings, reshapes, final layer) is captured
too. All graphs share one memory pool, and warm-up and capture run on one side stream of their own:
cuBLAS keeps a workspace (32 MiB on Hopper) alive per stream it ran on, so every extra stream is
memory the eager pipeline does not hold.

Why not Inductor's cudagraph trees (`mode="reduce-overhead"`) on each block: that gives one graph per
block, still leaves the glue eager, and copies block outputs between graphs.

Requirements on `fn`: no host syncs and no data-dependent Python control flow (true for the
PixArt, Latte and SD UNet forwards with tensors on the GPU).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class StepGraph:
    def __init__(self, fn, warmup: int = 2):
        self.fn = fn
        self.warmup = warmup
        self.graphs: dict = {}
        self.pool = None
        self.stream = None  # one side stream for every warm-up and capture (see module docstring)
        self.share = None   # another StepGraph whose pool and stream this one uses (`wrap_step`)

    @staticmethod
    def _signature(leaves, spec):
        sig = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                sig.append((tuple(x.shape), x.dtype, x.device, x.stride()))
            else:
                sig.append(("const", repr(x)))
        return (str(spec), tuple(sig))

    def __call__(self, *args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        if not any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves):
            return self.fn(*args, **kwargs)
        key = self._signature(leaves, spec)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(leaves, spec)
        static_in, graph, out_leaves, out_spec = entry
        for s, x in zip(static_in, leaves):
            if s is not None:
                s.copy_(x)
        graph.replay()
        # Clone: the next replay overwrites the graph's output buffers, and schedulers keep outputs.
        return tree_unflatten([o.clone() if isinstance(o, torch.Tensor) else o for o in out_leaves], out_spec)

    def _capture(self, leaves, spec):
        static_in = [x.clone() if isinstance(x, torch.Tensor) else None for x in leaves]
        inputs = [s if s is not None else x for s, x in zip(static_in, leaves)]
        args, kwargs = tree_unflatten(inputs, spec)
        if self.stream is None:
            owner = self.share
            if owner is not None and owner.stream is None:
                owner.stream, owner.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
            self.stream = owner.stream if owner is not None else torch.cuda.Stream()
            self.pool = owner.pool if owner is not None else torch.cuda.graph_pool_handle()
        # Warm up on the side stream (CUDA graph rules); compiles happen here.
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Capture on the same stream (torch.cuda.graph would otherwise take a new one per capture).
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            out = self.fn(*args, **kwargs)
        out_leaves, out_spec = tree_flatten(out)
        return static_in, graph, out_leaves, out_spec


def wrap_step(module: torch.nn.Module, share: StepGraph | None = None) -> StepGraph:
    """Replace `module.forward` with a `StepGraph` of it (outermost wrapper). `share`: another
    module's StepGraph whose memory pool and side stream this one uses too (two denoisers that
    never run at once, Wan 2.2's experts: one pool of step activations, not two)."""
    step = StepGraph(module.forward)
    if share is not None:
        step.share = share
    module.forward = step
    return step
