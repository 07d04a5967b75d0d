"""What Inductor's kernel tuning costs and buys on one model: `python -m runner.bench.tuning`.

    python -m runner.bench.tuning model=latte1 variant=cdt|mapw|nocdt cache_dir=DIR [steps=4] [out=x.json]

Compiles the model with O3 on `cache_dir` (run twice with the same directory to see the warm
start) with the variant's Inductor setting: `cdt` coordinate_descent_tuning, `mapw`
max_autotune_pointwise (what `max-optimize` uses), `nocdt` neither. Reports the first call's time,
the it/s after it, Inductor's counters (benchmarks run, cache hits) and, per kernel that coordinate
descent tuned, its time and start/best configs. This is how `max-optimize` was chosen (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from compiler import cache, compile_pipe

from ..families import DEFAULT_PRESET
from .compiled import build, measure, parse_argv, run_call

VARIANTS = {"cdt": {"coordinate_descent_tuning": True, "max_autotune_pointwise": False},
            "mapw": {"coordinate_descent_tuning": False, "max_autotune_pointwise": True},
            "nocdt": {"coordinate_descent_tuning": False, "max_autotune_pointwise": False}}


def main(argv: list[str]) -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor.runtime import triton_heuristics as th
    opts = dict(a.split("=", 1) for a in argv)
    variant, cache_dir = opts.pop("variant", "mapw"), opts.pop("cache_dir")
    out, steps = opts.pop("out", None), int(opts.pop("steps", 4))
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; valid: {sorted(VARIANTS)}")
    cache.configure_cache_dir(cache_dir)
    tuned = []
    orig = th.CachingAutotuner.coordinate_descent_tuning

    def timed(self, launcher, *a, **k):  # per-kernel record of the descent
        t0 = time.perf_counter()
        best = orig(self, launcher, *a, **k)
        tuned.append(dict(kernel=self.inductor_meta.get("kernel_name"), s=round(time.perf_counter() - t0, 3),
                          start=str(launcher.config), best=str(best.config)))
        return best
    th.CachingAutotuner.coordinate_descent_tuning = timed

    args = parse_argv([f"{k}={v}" for k, v in {"model": DEFAULT_PRESET, **opts}.items()] + [f"steps={steps}"])
    pipe, spec = build(args)
    compile_pipe(pipe, {"mode": "O3", "options": VARIANTS[variant]})
    t0 = time.perf_counter()
    run_call(pipe, spec, args, steps)
    res = {"variant": variant, "first_call_s": time.perf_counter() - t0,
           "inductor_counters": dict(counters["inductor"])}
    m, _ = measure(pipe, spec, args, max(steps, 6))
    res.update(its=m["its"], tuned=tuned, tuning_total_s=sum(t["s"] for t in tuned))
    print(json.dumps({k: v for k, v in res.items() if k != "tuned"}, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
