"""Driver-side cost of a large prompt file, no Ray, no model (BENCHMARKS.md "Scale").

    python -m runner.bench.scale rows=1000000 done=500000 dir=/tmp/scale

Writes `dir/prompts-<rows>.parquet` (~60-character prompts, made once), then measures, each in a
fresh process (so RSS is that step's peak): `dry` the dry run (config, prompt checks, plan; what
`run.dry_run=true` does), and with `done` > 0, `resume` the resume planning of a job directory
whose record says the first `done` rows are finished (their media are 1-byte files, made once):
record load, one media listing, plan, shards. Also `shard` the driver's cost of planning one shard
of 8 rows with its items (what a worker gets with its shard) for `rows`. Prints one JSON line per
step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from . import parse_args


def _prompts(path: str, rows: int) -> None:
    if os.path.exists(path):
        return
    import pyarrow as pa
    import pyarrow.parquet as pq
    words = "a cat a dog on a hill under the sea at dawn in the rain painted by hand".split()
    prompts = [" ".join(words[(i * 7 + k) % len(words)] for k in range(12))[:60] + f" {i}"
               for i in range(rows)]
    pq.write_table(pa.table({"prompt": prompts}), path)


def _job_args(prompts: str, out: str) -> list[str]:
    return ["job=demo_image", f"prompts.path={prompts}", f"output.dir={out}", "job.name=j",
            "run.dry_run=true"]


def _record(prompts: str, out: str, done: int) -> None:
    """A job directory whose record holds the first `done` rows as finished (made once)."""
    from ..config import load_config, split
    from ..driver.checks import constraints
    from ..io.prompts import check_prompts
    from ..driver.results import Results, settings_id
    from ..io.storage import resolve
    job_dir = os.path.join(out, "j")
    if os.path.isdir(os.path.join(job_dir, "records")):
        return
    cfg = load_config(_job_args(prompts, out))
    job = split(cfg)
    _, _, items = check_prompts(job["prompts"].paths, job["generation"], constraints(job["model"]), "error")
    store = resolve(job_dir)
    store.write_text("config.yaml", __import__("omegaconf").OmegaConf.to_yaml(cfg, resolve=True))
    os.makedirs(os.path.join(job_dir, "media"), exist_ok=True)
    r = Results(store, settings_id(cfg))
    for k in range(0, done, 1000):         # shards of 1000 rows, as a finished run leaves them
        chunk = items[k:min(done, k + 1000)]
        for it in chunk:
            with open(os.path.join(job_dir, "media", f"{it.id}.png"), "wb") as f:
                f.write(b"x")
        r.add([{**it.params(), "status": "ok", "error": None, "output": f"media/{it.id}.png",
                "worker": 0, "batch_size": 1, "e2e_s": 1.0, "denoise_it_s": 1.0} for it in chunk])
    r.compact()


def _step(step: str, prompts: str, out: str) -> dict:
    t0 = time.perf_counter()
    if step == "shard":
        from ..config import load_config, split
        from ..driver.checks import constraints
        from ..io.prompts import check_prompts, plan_shards
        job = split(load_config(_job_args(prompts, out)))
        _, _, items = check_prompts(job["prompts"].paths, job["generation"],
                                    constraints(job["model"]), "error")
        t = time.perf_counter()
        shards = plan_shards(items, 8)       # each shard holds its items: nothing to look up later
        return dict(step=step, per_shard_ms=(time.perf_counter() - t) / len(shards) * 1e3,
                    rss_mb=_peak_rss_mb())
    from ..driver.job import run
    summary = run(_job_args(prompts, out))
    return dict(step=step, seconds=time.perf_counter() - t0, done=summary["done"],
                to_run=summary["to_run"], shards=summary["shards"],
                rss_mb=_peak_rss_mb())


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: reset by exec, unlike ru_maxrss, which a child inherits
    from the forking parent)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def main(argv: list[str]) -> int:
    args, _ = parse_args(argv, {"rows": "1000000", "done": "0", "dir": "/tmp/runner-scale",
                                "step": None, "prompts": None, "out": None},
                         "python -m runner.bench.scale [rows=N] [done=N] [dir=DIR]")
    if args["step"]:                     # the child process of one step
        print(json.dumps(_step(args["step"], args["prompts"], args["out"])))
        return 0
    rows, done, d = int(args["rows"]), int(args["done"]), args["dir"]
    os.makedirs(d, exist_ok=True)
    prompts = os.path.join(d, f"prompts-{rows}.parquet")
    _prompts(prompts, rows)
    steps = [("dry", os.path.join(d, f"empty-{rows}")), ("shard", os.path.join(d, f"empty-{rows}"))]
    if done:
        out = os.path.join(d, f"done-{rows}-{done}")
        _record(prompts, out, done)
        steps.append(("resume", out))
    for step, out in steps:
        r = subprocess.run([sys.executable, "-m", "runner.bench.scale", f"step={step}",
                            f"prompts={prompts}", f"out={out}"], capture_output=True, text=True)
        line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 else r.stderr[-2000:]
        print(json.dumps({"rows": rows, **json.loads(line)}) if r.returncode == 0 else line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
