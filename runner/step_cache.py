"""Step reuse: skip part of a denoising step by reusing what earlier steps computed (lossy).

Methods (`step_cache.method`, README "Step reuse"):
- `residual`: whole denoiser calls skipped on a fixed schedule. A computed step keeps what the
  blocks added to their input (the residual); a reused step runs only the embeddings and the final
  layer and adds the kept residual (TeaCache's reuse, on a LeMiCa-style fixed schedule instead of
  a threshold). Which steps compute depends only on the step index, the step count and the
  settings (`plan`), never on tensor values: no host sync per step, the same schedule for every
  item of a batch, and under `cudagraphs` two captured graphs (compute, reuse) replayed as the
  schedule says. The mechanism is the denoiser forward's `step_reuse=` argument (the family record's
`residual_forward` installs it; for block-pair video DiTs, `compiler/block_pairs.py`'s).
- `fastercache`, `pab`: diffusers' attention-level hooks (`FasterCacheConfig`,
  `PyramidAttentionBroadcastConfig`), deciding per attention call in Python.

Contract:
- `check(step_cache, family)` (in `prepare`): the method is offered for this model family,
  else `ConfigError` naming the families that have it. The parameters themselves are checked by
  `config.StepCacheSection`.
- `apply(pipe, step_cache)` (worker, after `compiler.compile_pipe`, on the pipeline's device):
  installs the method on `pipe.transformer`. Returns what it hooked (modules, or 1 for `residual`).
- `reset(pipe, guidance)` (before every pipeline call): per-call state (step counter, cached
  outputs) starts fresh, also after a call that raised, so an output depends on its seed and
  settings only, never on what ran before it. `guidance=False` (a row with guidance_scale <= 1,
  no CFG batch): FasterCache runs as for a guidance-distilled model.
- `prepare(job)` (driver): `check`, and for the hook methods `job["compile"]` without the
  `cudagraphs` step graph (see below), so workers, the compile cache key and the summary all see
  the mode that runs. `residual` keeps the mode whole.

How the hook methods compose with the compiler:
- eager: the hooks as diffusers ships them.
- per-block `torch.compile`: a hook decides in Python, per step, whether to compute or reuse,
  which Dynamo cannot trace in a full graph. So each hooked attention module becomes one opaque
  custom op inside the compiled block (`_hooked_attention`), and the module's class (not the
  instance's `forward`, which Dynamo would guard on per module: a recompile per block pair) is
  swapped for a subclass whose forward calls it. The rest of the block stays compiled and the
  blocks share their graphs. Measured (H100, BENCHMARKS.md): this barely pays; `residual` does.
- `cudagraphs` (O2, O3): a captured step would replay one fixed decision of the hooks on every
  step, so the step graph is dropped for them, with a log line.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from .config import ConfigError, StepCacheSection

log = logging.getLogger(__name__)

# Which methods a model family offers is its record's `step_reuse` (runner/families/). The hook
# methods need a diffusers `CacheMixin` transformer whose pipeline exposes `_current_timestep`;
# FasterCache's unconditional-branch skip needs the CFG batch in one denoiser call (Latte's
# pipeline: torch.cat([latents] * 2)); residual needs the block-pair forward of compiler/block_pairs.py.
HOOKS = ("fastercache", "pab")   # diffusers' attention hooks (decide in Python, per call)
DEFAULT_TIMESTEP_RANGE = {"fastercache": (-1, 681), "pab": (100, 800)}   # diffusers' defaults


def check(sc: StepCacheSection, family) -> None:
    """`family`: the model's `Family` record."""
    if sc.method == "none":
        return
    if sc.method not in family.step_reuse:
        from .families import FAMILIES
        offered = [f.name for f in FAMILIES.values() if sc.method in f.step_reuse]
        raise ConfigError(f"step_cache.method={sc.method!r} is not offered for {family.name} models; "
                          f"it is for: {offered} (or step_cache.method=none)")


def prepare(job: dict) -> None:
    """Driver (job, runner.warm), before Ray: check `job["step_cache"]` against the model and drop
    the step graph from `job["compile"]` when a step cache is on (one log line, on the driver)."""
    sc = job["step_cache"]
    check(sc, job["model"].family)
    options = compile_options(job["compile"].options, sc)
    if options is not job["compile"].options:
        job["compile"] = dataclasses.replace(job["compile"], options=options, mode=options.mode)


def compile_options(options, sc: StepCacheSection):
    """`options` (anything `compiler.parse_options` takes) as `CompileOptions`, without the
    `cudagraphs` flag when a hook method is on (module docstring)."""
    import compiler
    options = compiler.parse_options(options)
    if sc.method not in HOOKS or "cudagraphs" not in options.flags:
        return options
    runs = dataclasses.replace(options, flags=options.flags - {"cudagraphs"} or frozenset({"none"}))
    log.warning("step_cache.method=%s: compile.mode=%s runs without its cudagraphs step graph "
                "(as %s): a captured step cannot follow the cache's per-step decisions",
                sc.method, options.mode, runs.mode)
    return runs


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


def apply(pipe, sc: StepCacheSection, family) -> int:
    """Install the step cache on `pipe.transformer` (after compile_pipe: Latte's compiled forward
    replaces `transformer.forward`, which FasterCache's denoiser hook must wrap, not be replaced by;
    and after the pipeline is on its device and dtype: the opaque op finds each module by the
    address of its key buffer, which moving it would change)."""
    if sc.method == "none":
        return 0
    den = pipe.transformer
    if sc.method == "residual":
        return _apply_residual(pipe, sc, family)
    den.enable_cache(BUILDERS[sc.method](sc, _timestep_reader(pipe)))
    hooked = [m for name, m in den.named_modules()   # the attention modules with a hook
              if name and getattr(getattr(m, "_diffusers_hook", None), "_hook_order", None)]
    from .opaque_attention import make_opaque   # torch: worker side only
    for m in hooked:
        make_opaque(m)
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


# ---------------------------------------------------------------------------------------------
# residual: whole steps on a fixed schedule

def plan(steps: int, sc: StepCacheSection) -> tuple[bool, ...]:
    """Which of `steps` denoising steps are computed in full (True) or reuse the last computed
    step's residual (False). `compute_steps` as given (indices past the end ignored); else
    round(compute_ratio * steps) steps shaped as LeMiCa's published schedules are: the first ~40 %
    of the budget on the first steps (where the latents change most), the last two steps, and the
    rest evenly spread in between. Step 0 is always computed (there is nothing to reuse yet)."""
    if sc.compute_steps is not None:
        chosen = {i for i in sc.compute_steps if i < steps}
    else:
        budget = min(steps, max(1, round(sc.compute_ratio * steps)))
        head = min(budget, max(1, math.ceil(0.4 * budget)))
        tail = min(2, budget - head, steps - head)
        middle = budget - head - tail                       # spread over [head, steps - tail)
        span = steps - tail - head
        chosen = set(range(head)) | set(range(steps - tail, steps))
        chosen |= {head + int((j + 0.5) * span / middle) for j in range(middle)}
    return tuple(i == 0 or i in chosen for i in range(steps))


class Scheduled:
    """The transformer's forward, told for each call (one call = one denoising step: Latte's
    pipeline batches CFG into one call) whether it computes or reuses. The step count comes from
    the scheduler when a call begins (`pipe.scheduler.timesteps`, set before the first step)."""

    def __init__(self, inner, sc: StepCacheSection, pipe):
        self.inner, self.sc, self.pipe = inner, sc, pipe
        self.step, self.plan, self.reused = 0, (), 0

    def reset(self) -> None:
        self.step = 0

    def __call__(self, *args, **kwargs):
        if self.step == 0:
            self.plan = plan(len(self.pipe.scheduler.timesteps), self.sc)
        compute = self.plan[self.step] if self.step < len(self.plan) else True
        self.step = self.step + 1 if self.step + 1 < len(self.plan) else 0   # next call's step
        self.reused += not compute
        return self.inner(*args, step_reuse="compute" if compute else "reuse", **kwargs)


def _apply_residual(pipe, sc: StepCacheSection, family) -> int:
    den = pipe.transformer
    family.residual_forward(den)   # its forward now takes step_reuse= (compiled or not)
    den.forward = Scheduled(den.forward, sc, pipe)
    log.info("step cache residual: %s of %d steps computed at 50 steps",
             sum(plan(50, sc)), 50)
    return 1


def reset(pipe, guidance: bool = True) -> None:
    """Clear the hooks' state before a call. `guidance`: the call runs classifier-free guidance
    (guidance_scale > 1, one batch of unconditional + conditional); without it FasterCache treats
    the call as guidance-distilled: no branch to skip, attention reuse by schedule alone (its
    denoiser hook would otherwise split a batch that has no unconditional half)."""
    den = getattr(pipe, "transformer", None)
    if isinstance(getattr(den, "forward", None), Scheduled):
        den.forward.reset()
        return
    if not getattr(den, "is_cache_enabled", False):
        return
    den._reset_stateful_cache()
    for m in den.modules():
        for hook in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values():
            if hasattr(hook, "is_guidance_distilled"):
                hook.is_guidance_distilled = not guidance


def skipped(pipe) -> int:
    """Attention calls the hooks answered from the cache so far, or for `residual` the denoiser
    calls (steps) that reused (tests, benchmark, worker metrics)."""
    den = getattr(pipe, "transformer", None)
    if isinstance(getattr(den, "forward", None), Scheduled):
        return den.forward.reused
    return sum(getattr(m, "_step_cache_calls", 0) - getattr(m, "_step_cache_computed", 0)
               for m in den.modules()) if den is not None else 0
