"""Measurement tools, apart from the job's own modules. Each is `python -m runner.bench.<tool>`:

- `compiled`: eager vs compiled pipelines side by side (the compiler applied to the models);
- `vs_loop`: the job against plain diffusers loops, eager and `torch.compile`, and the peer stack
  (cache-dit's step cache + `torch.compile`);
- `scaling`: the same job with 1..N workers (table, JSON, plots);
- `decode`: the VAE decoder alone, eager vs compiled, contiguous vs channels_last, cudnn.benchmark;
- `tuning`: what Inductor's kernel tuning costs and buys on one model;
- `canary`: what the canary costs, one worker through a window of one canary period, on and off;
- `scale`: the driver's cost on a million-prompt file (dry run, sharding, resume planning);
- `simulate`: the real job over thousands of simulated workers: does one driver keep up.

They share one argument convention, `key=value`, parsed by `parse_args`, and `release_gpu` between
the arms they run in one process.
"""

from __future__ import annotations


def parse_args(argv: list[str], defaults: dict, usage: str,
               passthrough: bool = False) -> tuple[dict, list[str]]:
    """`key=value` arguments: the tool's own keys (those of `defaults`) into a copy of `defaults`;
    the others returned in order (`passthrough`: job overrides for the job's own parser) or an
    error naming the valid keys. A value stays a string; the tool converts it."""
    opts, rest = dict(defaults), []
    for a in argv:
        k, eq, v = a.partition("=")
        if not eq:
            raise SystemExit(f"arguments are key=value, got {a!r}\nusage: {usage}")
        if k in opts:
            opts[k] = v
        elif passthrough:
            rest.append(a)
        else:
            raise SystemExit(f"unknown argument {k!r}; valid: {', '.join(sorted(opts))}\n"
                             f"usage: {usage}")
    return opts, rest


def release_gpu() -> None:
    """Give this process's cached GPU memory back (a finished or failed arm's pipeline), so the
    next arm, or another process on the GPU, finds it as the first arm did."""
    import gc
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
