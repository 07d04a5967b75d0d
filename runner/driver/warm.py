"""`python -m runner.driver.warm job=NAME [key=value ...]`: fill the compile cache ahead of a job.

Builds the job's pipeline once in this process (this machine's GPU, else the CPU), compiles it with
the job's compile options, runs the warm-up call at the job's default shape and batch size, and
writes the portable artifact to `compile.cache_dir`. The job's first worker then loads it instead of
compiling. The artifact only serves workers with the same GPU model and torch/triton/CUDA versions
(all part of its cache key): run this on the kind of machine the job will use. The compile mode
must include `cache-all` (O2 and O3 do).
"""

from __future__ import annotations

import json
import logging
import sys

from ..serve import step_cache
from ..config import ConfigError, load_config, split
from .checks import JobError, check_warmup, constraints
from .job import worker_config
from ..io.prompts import PromptError


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        job = split(load_config(argv))
        limits = constraints(job["model"])
        step_cache.prepare(job)
        check_warmup(job, limits)
        if not job["compile"].options.has("cache"):
            raise ConfigError(f"compile.mode={job['compile'].mode!r} does not keep a "
                              f"cache: use a mode with cache-all (or O2 / O3)")
    except (ConfigError, PromptError, JobError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch
    from ..serve.worker import Worker
    on_gpu = job["model"].device != "cpu" and torch.cuda.is_available()
    worker = Worker(0, worker_config(job, limits, on_gpu=on_gpu))
    worker.warmup()
    keys = ("cache_hit", "cache_source", "warmup_with_compile_s", "warmup_with_cache_s",
            "artifact_bytes", "model_load_s")
    report = {k: worker.m.get(k) for k in keys} | {"cache_dir": job["compile"].cache_dir}
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
