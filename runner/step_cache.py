"""Step reuse: skip part of a denoising step by reusing what earlier steps computed (lossy).

Contract:
- `check(step_cache, family)` (in `prepare`): the method is offered for this model family,
  else `ConfigError` naming the families that have it. The parameters themselves are checked by
  `config.StepCacheSection`.
- `apply(pipe, step_cache)` (worker, after `compiler.compile_pipe`): installs diffusers' hooks
  (`FasterCacheConfig` / `PyramidAttentionBroadcastConfig`) on the denoiser, with
  `current_timestep_callback` reading the pipeline's `_current_timestep` (once per step). Returns
  how many attention modules are hooked.
- `reset(pipe, guidance)` (before every pipeline call): the hooks keep per-call state (step
  counter, cached attention outputs); diffusers clears it at the end of a call, but not after a
  call that raised, so the worker clears it before each call: an output depends on its seed and
  settings only, never on what ran before it. `guidance=False` (a row with guidance_scale <= 1,
  no CFG batch): FasterCache runs as for a guidance-distilled model.
- `prepare(job)` (driver): `check`, and `job["compile"]` without the `cudagraphs` step graph when
  a step cache is on (see below), so workers, the compile cache key and the summary all see the
  mode that runs.

How it composes with the compiler:
- eager: the hooks as diffusers ships them.
- per-block `torch.compile` (any mode that compiles; Latte's compiled block pairs): a hook decides
  in Python, per step, whether to compute or reuse, which Dynamo cannot trace in a full graph (it
  compares the timestep tensor with a bound). So each hooked attention module becomes one opaque
  custom op inside the compiled block (`_hooked_attention`): the compiled graph calls it, and it runs
  the hook (and the attention it may skip) eagerly. The rest of the block stays compiled, and the
  blocks still share their graphs (the op finds its module through a one-element buffer, a graph
  input, not through a Python constant Dynamo would specialise on, which would mean a graph per
  block).
- `cudagraphs` (O2, O3): a captured step replays one fixed decision (compute or reuse) on every
  step, which would be silently wrong. Until there is a graph per step kind, the step graph is
  dropped when a step cache is on, with a log line; the rest of the mode applies.
- `low-precision` (FP8 linears): inside and outside the hooked attention alike (not run on CPU).

Methods and their keys (`step_cache.*`, README "Step reuse"): a plain dict maps a method name to
the function that builds its diffusers config.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from .config import ConfigError, StepCacheSection

log = logging.getLogger(__name__)

# method -> model families it is offered for. Latte's transformer is a diffusers `CacheMixin` and
# its pipeline exposes `_current_timestep`; FasterCache's unconditional-branch skip needs the CFG
# batch in one denoiser call, which Latte's pipeline does (torch.cat([latents] * 2)). PixArt's
# transformer (diffusers 0.42) is no CacheMixin and its pipeline keeps no current timestep: not yet.
SUPPORTED = {"fastercache": ("latte",), "pab": ("latte",)}
DEFAULT_TIMESTEP_RANGE = {"fastercache": (-1, 681), "pab": (100, 800)}   # diffusers' defaults


def check(sc: StepCacheSection, family: str) -> None:
    if sc.method == "none":
        return
    if family not in SUPPORTED[sc.method]:
        raise ConfigError(f"step_cache.method={sc.method!r} is not offered for {family} models; "
                          f"it is for: {list(SUPPORTED[sc.method])} (or step_cache.method=none)")


def prepare(job: dict) -> None:
    """Driver (job, runner.warm), before Ray: check `job["step_cache"]` against the model and drop
    the step graph from `job["compile"]` when a step cache is on (one log line, on the driver)."""
    sc = job["step_cache"]
    check(sc, job["model"].info["family"])
    options = compile_options(job["compile"].options, sc)
    if options is not job["compile"].options:
        job["compile"] = dataclasses.replace(job["compile"], options=options)


def compile_options(options: dict, sc: StepCacheSection) -> dict:
    """`options` without the `cudagraphs` flag when a step cache is on (see the module docstring)."""
    if sc.method == "none":
        return options
    import compiler
    flags = compiler.parse_options(options).flags
    if "cudagraphs" not in flags:
        return options
    mode = ":".join(sorted(flags - {"cudagraphs"})) or "none"
    log.warning("step_cache.method=%s: compile.mode=%s runs without its cudagraphs step graph "
                "(as %s): a captured step cannot follow the cache's per-step decisions",
                sc.method, options.get("mode"), mode)
    return {**options, "mode": mode}


def _timestep_range(sc: StepCacheSection) -> tuple:
    return tuple(sc.timestep_range) if sc.timestep_range is not None \
        else DEFAULT_TIMESTEP_RANGE[sc.method]


def _fastercache(sc: StepCacheSection, timestep):
    from diffusers import FasterCacheConfig
    return FasterCacheConfig(
        spatial_attention_block_skip_range=sc.block_skip_range,
        spatial_attention_timestep_skip_range=_timestep_range(sc),
        unconditional_batch_skip_range=sc.uncond_skip_range,
        current_timestep_callback=timestep, tensor_format="BCFHW",   # Latte's latents
        attention_weight_callback=lambda _: 0.5)   # diffusers' default, set to keep its log quiet


def _pab(sc: StepCacheSection, timestep):
    # diffusers' spatial identifiers ("transformer_blocks") also match Latte's
    # temporal_transformer_blocks: PAB reuses both self-attentions of every block pair.
    from diffusers import PyramidAttentionBroadcastConfig
    return PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=sc.block_skip_range,
        spatial_attention_timestep_skip_range=_timestep_range(sc),
        current_timestep_callback=timestep)


BUILDERS = {"fastercache": _fastercache, "pab": _pab}


def apply(pipe, sc: StepCacheSection) -> int:
    """Install the step cache on `pipe.transformer` (after compile_pipe: Latte's compiled forward
    replaces `transformer.forward`, which FasterCache's denoiser hook must wrap, not be replaced by;
    and after the pipeline is on its device and dtype: the opaque op finds each module by the
    address of its key buffer, which moving it would change)."""
    if sc.method == "none":
        return 0
    den = pipe.transformer
    den.enable_cache(BUILDERS[sc.method](sc, _timestep_reader(pipe)))
    hooked = [m for name, m in den.named_modules()   # the attention modules with a hook
              if name and getattr(getattr(m, "_diffusers_hook", None), "_hook_order", None)]
    for m in hooked:
        _make_opaque(m)
    log.info("step cache %s on %d attention modules", sc.method, len(hooked))
    return len(hooked)


def _timestep_reader(pipe):
    """The pipeline's current timestep as a Python float, read once per step: every hooked
    attention compares it with its range, and comparing a CUDA tensor waits for the GPU (one wait
    per step instead of one per attention call)."""
    last = [None, None]   # the step's timestep object, its value

    def read():
        t = pipe._current_timestep
        if t is not last[0]:
            last[:] = [t, float(t) if t is not None else None]
        return last[1]
    return read


def reset(pipe, guidance: bool = True) -> None:
    """Clear the hooks' state before a call. `guidance`: the call runs classifier-free guidance
    (guidance_scale > 1, one batch of unconditional + conditional); without it FasterCache treats
    the call as guidance-distilled: no branch to skip, attention reuse by schedule alone (its
    denoiser hook would otherwise split a batch that has no unconditional half)."""
    den = getattr(pipe, "transformer", None)
    if not getattr(den, "is_cache_enabled", False):
        return
    den._reset_stateful_cache()
    for m in den.modules():
        for hook in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values():
            if hasattr(hook, "is_guidance_distilled"):
                hook.is_guidance_distilled = not guidance


def skipped(pipe) -> int:
    """Attention calls the hooks answered from the cache so far (tests, benchmark)."""
    den = getattr(pipe, "transformer", None)
    return sum(getattr(m, "_step_cache_calls", 0) - getattr(m, "_step_cache_computed", 0)
               for m in den.modules()) if den is not None else 0


# ---------------------------------------------------------------------------------------------
# A hooked attention module as one opaque op for Dynamo.

_MODULES: dict[int, torch.nn.Module] = {}   # key buffer's data_ptr -> hooked attention module


@torch.library.custom_op("runner_step_cache::hooked_attention", mutates_args=())
def _hooked_attention(key: torch.Tensor, hidden_states: torch.Tensor,
                      encoder_hidden_states: torch.Tensor | None,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
    m = _MODULES[key.data_ptr()]
    out = m._step_cache_forward(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                attention_mask=attention_mask)
    # A fresh tensor: the hook keeps `out` as its cache, and Inductor may reuse an op's output
    # buffer in place (the residual add after attention).
    return out.clone()


@_hooked_attention.register_fake
def _(key, hidden_states, encoder_hidden_states, attention_mask):
    return torch.empty_like(hidden_states)   # self-attention: out_proj maps back to the input width


def _opaque_forward(module, hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
    if kw:
        raise TypeError(f"step cache: unexpected attention arguments {sorted(kw)}")
    if torch.compiler.is_compiling():
        return _hooked_attention(module._step_cache_key, hidden_states, encoder_hidden_states,
                                 attention_mask)
    return module._step_cache_forward(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                      attention_mask=attention_mask)


def _make_opaque(m: torch.nn.Module) -> None:
    # Count calls, and the calls that ran the attention (the hook calls `original_forward` then),
    # so `skipped` can say how much the cache actually reused.
    ref = m._diffusers_hook._fn_refs[-1]
    original = ref.original_forward
    m._step_cache_calls = m._step_cache_computed = 0

    def computed(*a, **kw):
        m._step_cache_computed += 1
        return original(*a, **kw)

    hooked = m.forward   # diffusers' hook chain

    def counted(*a, **kw):
        m._step_cache_calls += 1
        return hooked(*a, **kw)

    ref.original_forward = computed
    m._step_cache_forward = counted
    m.register_buffer("_step_cache_key", torch.zeros(1, device=next(m.parameters()).device),
                      persistent=False)
    _MODULES[m._step_cache_key.data_ptr()] = m
    m.forward = functools.partial(_opaque_forward, m)
