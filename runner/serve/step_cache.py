"""Step reuse: skip part of a denoising step by reusing what earlier steps computed (lossy).

Methods (`step_cache.method`, docs/compiler.md "Step reuse"):
- `residual`: the denoiser's block stack skipped on a fixed schedule, for every family whose
  record names its stack (`step_blocks`: Wan, PixArt-α/Σ, FLUX's two lists) or whose compiled
  forward has it built in (Latte's block pairs). A pipeline with a second expert (Wan 2.2 A14B's
  `transformer_2`) gets it on both, each with its own kept residuals and `Scheduled` wrapper; the
  step index is the pipeline's, so the plan is one over the whole call, and each expert's first
  call (the second's comes mid-schedule, at the boundary) is computed. A computed step keeps what the blocks after the first `first_blocks`
  added to their input (the residual); a reused step runs the embeddings, those first blocks and
  the final layer and adds the kept residual (TeaCache's and LeMiCa's reuse with first_blocks=0,
  cache-dit's F1B0 with 1). Which steps compute depends only on the step index, the step count
  and the settings (`plan`), never on tensor values: no host sync per step, the same schedule for
  every item of a batch, and under `cudagraphs` one captured graph per (compute or reuse,
  guidance branch) replayed as the schedule says. The mechanism is `compiler.step_reuse`: the
  denoiser's forward takes `step_reuse=` and `branch=`; `Scheduled` below decides them.
- `fastercache`, `pab`: diffusers' attention-level hooks (`FasterCacheConfig`,
  `PyramidAttentionBroadcastConfig`), deciding per attention call in Python.

The unconditional branch reused (`step_cache.cfg_reuse=fastercache`, with `residual` or alone):
for families whose pipeline runs classifier-free guidance as two denoiser calls per step, the
conditional one first (`Family.cfg_calls`: the Wan pipelines), the unconditional call is skipped on
a fixed schedule (`uncond_plan`: a step-index window, one call every `cfg_interval` steps inside
it; FasterCache's CFG-Cache with maxdiffusion's Wan 2.1 setting by default) and its output taken
as this step's conditional output plus the two branches' difference at their last call, frequency
weighted (`compiler.step_reuse.UncondReuse`). `Scheduled` decides it with the residual schedule:
a skipped call runs no denoiser and no captured graph; a call that runs is computed or reused as
`plan` says. A denoiser's first unconditional call of a pipeline call always runs.

Contract:
- `check(step_cache, family)` (in `prepare`): the method, and `cfg_reuse`, are offered for this
  model family, else `ConfigError` naming the families that have it. The parameters themselves
  are checked by `config.StepCacheSection`; `check_steps(step_cache, items)` (driver, once the
  prompts are read) checks `compute_steps` and `uncond_steps` against every row's step count.
- `apply(pipe, step_cache)` (worker, after `compiler.compile_pipe`, on the pipeline's device):
  installs the method on `pipe.transformer` (`residual` and `cfg_reuse`: and `pipe.transformer_2`).
  Returns what it hooked (modules, or the number of denoisers for `residual` and `cfg_reuse`).
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

import contextlib
import dataclasses
import logging
import math

from ..config import ConfigError, StepCacheSection

log = logging.getLogger(__name__)

# Which methods a model family offers is its record's `step_reuse` (runner/families/). The hook
# methods need a diffusers `CacheMixin` transformer whose pipeline exposes `_current_timestep`;
# FasterCache's unconditional-branch skip needs the CFG batch in one denoiser call (Latte's
# pipeline: torch.cat([latents] * 2)); residual needs the block-pair forward of compiler/video/block_pairs.py.
HOOKS = ("fastercache", "pab")   # diffusers' attention hooks (decide in Python, per call)
DEFAULT_TIMESTEP_RANGE = {"fastercache": (-1, 681), "pab": (100, 800)}   # diffusers' defaults


def check(sc: StepCacheSection, family) -> None:
    """`family`: the model's `Family` record."""
    from ..families import FAMILIES
    if sc.method != "none" and sc.method not in family.step_reuse:
        offered = [f.name for f in FAMILIES.values() if sc.method in f.step_reuse]
        raise ConfigError(f"step_cache.method={sc.method!r} is not offered for {family.name} models; "
                          f"it is for: {offered} (or step_cache.method=none)")
    if sc.cfg_reuse != "none" and not family.cfg_calls:
        offered = [f.name for f in FAMILIES.values() if f.cfg_calls]
        why = ("it runs no unconditional pass (guidance-distilled)" if not family.negative_prompt
               else "its pipeline batches both guidance branches into one denoiser call, so no "
                    "call can be skipped")
        raise ConfigError(f"step_cache.cfg_reuse={sc.cfg_reuse!r} is not offered for {family.name} "
                          f"models: {why}; it is for: {offered} (or step_cache.cfg_reuse=none)")


def check_first_blocks(sc: StepCacheSection, model) -> None:
    """`first_blocks` leaves blocks to reuse: checked against the denoiser's depth where the
    driver knows it without loading weights (random and tiny builds; a pretrained model's is
    checked by the worker, `compiler.step_reuse.install`)."""
    fam = model.family
    if sc.method != "residual" or not sc.first_blocks or model.source == "pretrained" \
            or fam.denoiser_config is None:
        return
    layers = fam.stack_depth(fam.denoiser_config(model.info, model.source == "tiny"))
    if layers is not None and sc.first_blocks >= layers:
        raise ConfigError(f"step_cache.first_blocks={sc.first_blocks} leaves no block to reuse: "
                          f"this {model.preset} denoiser ({model.source}) has {layers} blocks; "
                          f"set it to at most {layers - 1}")


def check_steps(sc: StepCacheSection, items) -> None:
    """Driver, after the prompts are read: `compute_steps` and `uncond_steps` against every row's
    step count. `plan` and `uncond_plan` ignore an index past a row's last step, so such a
    schedule would silently not be the one asked for: `ConfigError` naming the rows (file:row)."""
    _check_applies(sc, items)
    if sc.method == "residual" and sc.compute_steps is not None:
        _check_list("compute_steps", sc.compute_steps, "compute_ratio", items)
    if sc.cfg_reuse != "none" and sc.uncond_steps is not None:
        _check_list("uncond_steps", sc.uncond_steps, "cfg_window", items)


def _check_applies(sc: StepCacheSection, items) -> None:
    """cfg reuse on rows that run no unconditional branch (guidance <= 1): nothing to reuse."""
    plain = [it for it in items if it.guidance_scale <= 1]
    if sc.cfg_reuse != "none" and plain:
        rows = ", ".join(it.source for it in plain[:3]) + (", ..." if len(plain) > 3 else "")
        raise ConfigError(f"step_cache.cfg_reuse={sc.cfg_reuse!r} on {len(plain)} rows with "
                          f"guidance_scale <= 1 ({rows}): they run no unconditional branch to "
                          f"reuse; set step_cache.cfg_reuse=none")


def check_distilled(sc: StepCacheSection, model) -> None:
    """A step-distilled preset (its own few-step sampler) takes no step reuse: each of its 3-4
    steps moves the latents far, so a reused step is no small error, and none is to spare."""
    if sc.on and "sampler" in model.info:
        raise ConfigError(f"step_cache.method={sc.method!r}, step_cache.cfg_reuse={sc.cfg_reuse!r}: "
                          f"{model.preset} is step-distilled (a few-step sampler); "
                          f"step reuse has no step to spare there: set step_cache.method=none "
                          f"and step_cache.cfg_reuse=none")


def _check_list(name: str, steps: list, instead: str, items) -> None:
    last = max(steps)
    short = [it for it in items if it.num_inference_steps <= last]
    if short:
        rows = ", ".join(f"{it.source} ({it.num_inference_steps} steps)" for it in short[:5])
        raise ConfigError(
            f"step_cache.{name}={list(steps)} names step {last}, past the last "
            f"step of {len(short)} prompt row{'s' if len(short) > 1 else ''} ({rows}"
            f"{', ...' if len(short) > 5 else ''}); step indices run from 0 to "
            f"num_inference_steps - 1 (the column, or generation.num_inference_steps): drop the "
            f"indices past the end, or use step_cache.{instead} (it scales with each row's "
            f"step count)")


def prepare(job: dict) -> None:
    """Driver (job, runner.driver.warm), before Ray: check `job["step_cache"]` against the model and drop
    the step graph from `job["compile"]` when a step cache is on (one log line, on the driver)."""
    sc = job["step_cache"]
    check(sc, job["model"].family)
    check_distilled(sc, job["model"])
    check_first_blocks(sc, job["model"])
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
    if not sc.on:
        return 0
    check(sc, family)
    den = pipe.transformer
    if sc.method in ("residual", "none"):      # "none": cfg_reuse alone
        return _apply_scheduled(pipe, sc, family)
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


def uncond_plan(steps: int, sc: StepCacheSection) -> tuple[bool, ...]:
    """Which of `steps` steps run the unconditional branch's denoiser call (True) or skip it,
    estimating its output (False; `cfg_reuse`). `uncond_steps` as given (indices past the end
    ignored); else every step outside `cfg_window` ([floor(start * steps), floor(end * steps)))
    and inside it the window's first step and every `cfg_interval`-th after: at 50 steps with the
    defaults, steps 0-16, 21, 26, 31, 36, 41, 46, 48, 49 run (25 of 50), as maxdiffusion's Wan 2.1
    480p CFG cache (first third full, then every 5th, the last 2 full). Step 0 always runs."""
    if sc.uncond_steps is not None:
        runs = {i for i in sc.uncond_steps if i < steps}
    else:
        lo, hi = (int(f * steps + 1e-9) for f in sc.cfg_window)   # 0.96 * 50 is 47.99999...
        runs = {i for i in range(steps) if not lo <= i < hi or (i - lo) % sc.cfg_interval == 0}
    return tuple(i == 0 or i in runs for i in range(steps))


def computed_calls(steps: int, sc: StepCacheSection) -> dict:
    """Denoiser calls per pipeline call of a one-denoiser pipeline with two guidance calls a step:
    `cond` and `uncond` computed in full (the rest reuse a residual or, for uncond, are skipped),
    and `uncond_skipped` (bench rows, docs: what the schedules save)."""
    full = plan(steps, sc) if sc.method == "residual" else (True,) * steps
    runs = uncond_plan(steps, sc) if sc.cfg_reuse != "none" else (True,) * steps
    return dict(cond=sum(full), uncond=sum(f and r for f, r in zip(full, runs)),
                uncond_skipped=steps - sum(runs))


def warmup_steps(sc: StepCacheSection, steps: int, most: int = 8) -> int:
    """The fewest steps >= `steps` (at most `most`) whose plan reuses a step, so that a warm-up
    call of that length also captures the reuse step's graph (`steps` when none does)."""
    if sc.method != "residual":
        return steps
    return next((n for n in range(steps, max(steps, most) + 1) if not all(plan(n, sc))), steps)


class Scheduled:
    """The denoiser's forward, told for each call whether it computes or reuses, and which kept
    residual (`branch`) it reads and writes (`residual`); and whether an unconditional call runs
    at all (`cfg_reuse`).

    A step is one denoiser call (PixArt and Latte batch the guidance branches into one call), or
    one call per branch where the pipeline runs them as separate calls inside the denoiser's
    `cache_context(name, step_index=...)` (diffusers' Wan and FLUX pipelines: "cond", "uncond"):
    there the branch is the context's name, and the step its `step_index` when given, else a new
    step begins when the first branch comes again. The step count comes from the scheduler when a
    pipeline call's first denoiser call begins. A branch's first call in a pipeline call is always
    computed (there is nothing of this call to reuse yet: a second expert's first step, say).
    An "uncond" call that `uncond_plan` skips returns `UncondReuse.estimate` instead of calling the
    denoiser, once this denoiser has a kept difference and this step's "cond" output; `paused`
    (the worker's warm-up: `warming`) runs every call, so that warm-up captures the same graphs."""

    def __init__(self, inner, sc: StepCacheSection, pipe, den):
        self.inner, self.sc, self.pipe = inner, sc, pipe
        self.residual = sc.method == "residual"
        self.cfg = None
        if sc.cfg_reuse != "none":
            from compiler.step_reuse import UncondReuse   # torch: worker side only
            self.cfg = UncondReuse(sc.cfg_alpha)
        self.reused = self.uncond_skipped = 0
        self.paused = False
        self.reset()
        context = getattr(den, "cache_context", None)
        if context is not None:      # diffusers' CacheMixin: names each guidance branch's call
            den.cache_context = self._context(context)

    def _context(self, original):
        @contextlib.contextmanager
        def context(name, **kwargs):
            self.branch, self.step_index = name, kwargs.get("step_index")
            with original(name, **kwargs):
                yield
        return context

    def reset(self) -> None:
        """Before each pipeline call (`runner.serve.step_cache.reset`)."""
        self.calls, self.step, self.first_branch, self.computed = 0, 0, None, set()
        self.branch = self.step_index = None      # set by the context of each call that has one
        if self.cfg is not None:
            self.cfg.reset()

    def __call__(self, *args, **kwargs):
        if self.calls == 0:
            steps = len(self.pipe.scheduler.timesteps)
            self.plan = plan(steps, self.sc) if self.residual else None
            self.runs = uncond_plan(steps, self.sc) if self.cfg and not self.paused else None
            self.first_branch = self.branch
        elif self.step_index is None and self.branch == self.first_branch:
            self.step += 1
        step = self.step_index if self.step_index is not None else self.step
        self.calls += 1
        if self.runs is not None and self.branch == "uncond" and step < len(self.runs) \
                and not self.runs[step] and self.cfg.ready(step):
            self.uncond_skipped += 1
            return self.cfg.estimate(late=step >= len(self.runs) // 2)
        out = self._call(step, args, kwargs)
        if self.runs is not None and self.branch in ("cond", "uncond"):
            getattr(self.cfg, self.branch)(out, step)
        return out

    def _call(self, step: int, args, kwargs):
        if not self.residual:
            return self.inner(*args, **kwargs)
        compute = (self.plan[step] if step < len(self.plan) else True) or self.branch not in self.computed
        self.computed.add(self.branch)
        self.reused += not compute
        return self.inner(*args, step_reuse="compute" if compute else "reuse", branch=self.branch,
                          **kwargs)


def denoisers(pipe) -> list:
    """The pipeline's denoiser and its second expert, if it has one (`transformer_2`)."""
    return [d for d in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None))
            if d is not None]


def _apply_scheduled(pipe, sc: StepCacheSection, family) -> int:
    """`residual` and/or `cfg_reuse`: a `Scheduled` forward on each denoiser, beneath it (with
    `residual`) the block stack's reuse."""
    dens = denoisers(pipe)
    reused = 0
    for den in dens:
        if sc.method == "residual":
            reused = _install_residual(den, sc, family)
        den.forward = Scheduled(den.forward, sc, pipe, den)
    calls = computed_calls(50, sc)
    log.info("step cache %s%s: %d blocks reused on a reused step (%d denoisers); at 50 steps %d "
             "conditional and %d unconditional calls computed, %d unconditional calls skipped",
             sc.method, f" + cfg_reuse={sc.cfg_reuse}" if sc.cfg_reuse != "none" else "", reused,
             len(dens), calls["cond"], calls["uncond"], calls["uncond_skipped"])
    return len(dens)


def _install_residual(den, sc: StepCacheSection, family) -> int:
    """The block stack's reuse on `den`; returns how many blocks a reused step skips."""
    if family.residual_forward is not None:   # its forward has the reuse built in (Latte's pairs)
        family.residual_forward(den, sc.first_blocks)
        return len(den.transformer_blocks) - sc.first_blocks
    from compiler.step_reuse import install   # beneath compile_pipe's step graph, if any
    return install(den, family.step_blocks, sc.first_blocks, family.step_outputs)


def reset(pipe, guidance: bool = True) -> None:
    """Clear the hooks' state before a call. `guidance`: the call runs classifier-free guidance
    (guidance_scale > 1, one batch of unconditional + conditional); without it FasterCache treats
    the call as guidance-distilled: no branch to skip, attention reuse by schedule alone (its
    denoiser hook would otherwise split a batch that has no unconditional half)."""
    den = getattr(pipe, "transformer", None)
    if isinstance(getattr(den, "forward", None), Scheduled):
        for d in denoisers(pipe):
            d.forward.reset()
        return
    if not getattr(den, "is_cache_enabled", False):
        return
    den._reset_stateful_cache()
    for m in den.modules():
        for hook in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values():
            if hasattr(hook, "is_guidance_distilled"):
                hook.is_guidance_distilled = not guidance


def uncond_skipped(pipe) -> int:
    """Unconditional denoiser calls skipped by `cfg_reuse` so far (worker metrics, tests)."""
    den = getattr(pipe, "transformer", None)
    if not isinstance(getattr(den, "forward", None), Scheduled):
        return 0
    return sum(d.forward.uncond_skipped for d in denoisers(pipe))


@contextlib.contextmanager
def warming(pipe):
    """The worker's warm-up call: every unconditional call runs (`Scheduled.paused`), so that the
    warm-up captures each (compute or reuse, branch) step graph whatever `cfg_reuse` skips."""
    scheds = [d.forward for d in denoisers(pipe) if isinstance(d.forward, Scheduled)]
    for sc in scheds:
        sc.paused = True
    try:
        yield
    finally:
        for sc in scheds:
            sc.paused = False


def skipped(pipe) -> int:
    """Attention calls the hooks answered from the cache so far, or for `residual` the denoiser
    calls (steps) that reused (tests, benchmark, worker metrics)."""
    den = getattr(pipe, "transformer", None)
    if isinstance(getattr(den, "forward", None), Scheduled):
        return sum(d.forward.reused for d in denoisers(pipe))
    return sum(getattr(m, "_step_cache_calls", 0) - getattr(m, "_step_cache_computed", 0)
               for m in den.modules()) if den is not None else 0
