"""The few-step samplers step-distilled Wan models were trained with, as a diffusers scheduler.

A distilled preset (`sampler` in its facts: `runner.serve.models.build_pipeline` swaps it in) runs:
- sigmas linspace(1, 0, N+1)[:-1] shifted once, s' = shift * s / (1 + (shift - 1) * s): at shift 5
  and 4 steps [1, 0.9375, 0.8333, 0.625], timesteps [1000, 937.5, 833.3, 625] (LightX2V's
  `denoising_step_list` [1000, 750, 500, 250] through its `sample_shift` 5; Wan2.2-Lightning's
  EulerScheduler); or the preset's fixed list (FastWan: [1.0, 0.757, 0.522], its
  `dmd_denoising_steps` [1000, 757, 522]);
- a step either deterministic Euler, x' = x + (s_next - s) v (Wan2.2-Lightning), or LCM-style
  (`stochastic`: LightX2V's WanStepDistillScheduler, FastVideo's DMD stage): x0 = x - s v, then
  x' = (1 - s_next) x0 + s_next * fresh noise, x0 itself after the last step.

Stock diffusers schedulers do not reach these timesteps (FlowMatchEulerDiscreteScheduler(shift=5)
at 4 steps: [1000, 910, 717, 24]; UniPC(flow_shift=5) within ~1 of them, another solver). The
fresh noise is drawn from each row's own generator (`generators`, set per call by
`runner.serve.worker.generate`), so an output depends on its seed, never on its batch-mates.
"""

from __future__ import annotations


import functools


def scheduler(shift: float, stochastic: bool, sigmas: list[float] | None = None):
    """The sampler of a distilled preset (`sampler` facts: shift, stochastic, sigmas)."""
    out = _scheduler_class()(shift=shift, stochastic_sampling=stochastic)
    out.fixed_sigmas = list(sigmas) if sigmas else None
    return out


def __getattr__(name: str):
    # `from_pretrained` of a pipeline saved with this sampler imports it by name from this module;
    # the class itself is made on first use (the families import without diffusers or torch)
    if name == "DistilledFlowScheduler":
        return _scheduler_class()
    raise AttributeError(name)


@functools.cache
def _scheduler_class():
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteSchedulerOutput)

    class DistilledFlowScheduler(FlowMatchEulerDiscreteScheduler):
        fixed_sigmas: list[float] | None = None
        generators: list | None = None      # the call's per-row generators

        def set_timesteps(self, num_inference_steps=None, device=None, **kw):
            n = num_inference_steps
            s = self.fixed_sigmas or [1 - i / n for i in range(n)]
            if self.fixed_sigmas and n != len(s):
                raise ValueError(f"this sampler runs exactly {len(s)} steps, not {n}")
            super().set_timesteps(sigmas=s, device=device)

        def step(self, model_output, timestep, sample, generator=None, return_dict=True, **kw):
            if self.step_index is None:
                self._init_step_index(timestep)
            s, s_next = self.sigmas[self.step_index], self.sigmas[self.step_index + 1]
            x, v = sample.float(), model_output.float()
            if not self.config.stochastic_sampling:
                out = x + (s_next - s) * v
            elif s_next > 0:
                out = (1 - s_next) * (x - s * v) + s_next * self._noise(sample, generator)
            else:
                out = x - s * v
            self._step_index += 1
            out = out.to(model_output.dtype)
            return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=out) if return_dict else (out,)

        def _noise(self, sample, generator):
            gens = generator if generator is not None else self.generators
            if gens is None:
                raise RuntimeError("DistilledFlowScheduler: no generators for the re-noising step")
            gens = gens if isinstance(gens, list) else [gens]
            if len(gens) != sample.shape[0]:
                raise RuntimeError(f"{len(gens)} generators for a batch of {sample.shape[0]}")
            return torch.stack([torch.randn(sample.shape[1:], generator=g, device=g.device,
                                            dtype=torch.float32) for g in gens]).to(sample.device)

    DistilledFlowScheduler.__module__ = __name__
    return DistilledFlowScheduler
