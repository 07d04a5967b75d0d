"""The batch job, top to bottom: load config, check prompts and plan shards, start workers,
stream results, summarize. `main(argv)` is what `python -m runner` runs.

Everything that can be wrong with the input is checked before Ray starts or any model is built.
Shards are handed out dynamically: each worker holds at most `INFLIGHT` shards, and a worker that
finishes takes the next one from the queue. Results stream back to the driver, which rewrites
`results.parquet` atomically as they arrive (at most every `output.results_every_s`) and at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque

from omegaconf import OmegaConf

from .config import ConfigError, load_config, split
from .outputs import format_table, write_json, write_parquet, write_text
from .prompts import Constraints, PromptError, check_prompts, plan_shards

log = logging.getLogger("runner")
INFLIGHT = 2   # shards queued per worker: the next is ready the moment one finishes


class JobError(RuntimeError):
    pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__ + "\nusage: python -m runner job=NAME [key=value ...]\n"
              "keys: see conf/defaults.yaml; jobs: see jobs/")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        summary = run(argv)
    except (ConfigError, PromptError, JobError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if summary["failed"] == 0 else 1


def run(argv: list[str]) -> dict:
    # 1. Config: merged, checked, split into typed pieces.
    cfg = load_config(argv)
    job = split(cfg)
    model, out = job["model"], job["output"]

    # 2. Prompts: read and validate all of them, plan shards (no model, no Ray yet).
    limits = _constraints(model)
    files, rows_per_file, items = check_prompts(job["prompts"].paths, job["generation"], limits,
                                                job["prompts"].on_empty)
    shards = plan_shards(rows_per_file, job["run"].shard_size)
    _prepare_output_dir(out.job_dir)
    write_text(os.path.join(out.job_dir, "config.yaml"), OmegaConf.to_yaml(cfg, resolve=True))
    log.info("%d prompts in %d files -> %d shards; outputs in %s", len(items), len(files),
             len(shards), out.job_dir)

    # 3. Workers: one Ray actor per GPU (or cpu_workers CPU actors), each loads and warms once.
    import ray
    from .worker import Worker, WorkerConfig
    _ray_init(job["ray"])
    gpus = int(ray.cluster_resources().get("GPU", 0)) if model.device != "cpu" else 0
    n = job["ray"].num_workers or (gpus or job["ray"].cpu_workers)
    if gpus:
        actor_opts = dict(num_gpus=1, num_cpus=1)
    else:
        actor_opts = dict(num_cpus=job["ray"].cpus_per_worker)
    wcfg = WorkerConfig(model=model, generation=job["generation"], limits=limits,
                        on_empty=job["prompts"].on_empty, job_dir=os.path.abspath(out.job_dir),
                        batch_size=job["run"].batch_size, warmup_steps=job["run"].warmup_steps,
                        fps=out.fps, compile=job["compile"],
                        num_threads=None if gpus else job["ray"].cpus_per_worker)
    RemoteWorker = ray.remote(Worker).options(
        max_concurrency=1, scheduling_strategy="SPREAD", **actor_opts)
    t_start = time.perf_counter()
    workers = [RemoteWorker.remote(k, wcfg) for k in range(n)]
    log.info("starting %d %s workers", n, "GPU" if gpus else "CPU")
    ready = _wait_all([w.warmup.remote() for w in workers], "worker start-up")
    t_ready = time.perf_counter()

    # 4. Stream: dynamic hand-out, results recorded as they arrive.
    results = _stream(workers, shards, len(items), out)
    t_done = time.perf_counter()

    # 5. Summarize.
    metrics = _wait_all([w.metrics.remote() for w in workers], "worker metrics")
    for m in metrics:
        write_json(os.path.join(out.job_dir, "metrics", f"worker-{m['rank']}.json"), m)
    summary = _summarize(job, results, metrics, ready, t_ready - t_start, t_done - t_ready)
    for w in workers:
        ray.kill(w)
    return summary


def _constraints(model) -> Constraints:
    from .models import ModelLoadError, check_pretrained, video_length
    try:
        check_pretrained(model)
    except ModelLoadError as e:
        raise JobError(str(e)) from e
    info = model.info
    # DPM-Solver's 1-step branch fails in the PixArt pipelines.
    return Constraints(size_factor=info["size_factor"], video_length=video_length(model),
                       min_steps=2 if info["family"].startswith("pixart") else 1)


def _prepare_output_dir(job_dir: str) -> None:
    for p in (os.path.dirname(job_dir) or ".", job_dir):
        if os.path.exists(p) and not os.path.isdir(p):
            raise JobError(f"output directory {p!r} exists and is a file; set output.dir to a "
                           f"directory (or remove the file)")
    os.makedirs(os.path.join(job_dir, "media"), exist_ok=True)


def _ray_init(opts) -> None:
    import ray
    if ray.is_initialized():
        return
    address = opts.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        # Embedded local Ray: enough CPU slots for the CPU workers even on a small machine.
        need = (opts.num_workers or opts.cpu_workers) * opts.cpus_per_worker
        ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                 logging_level=logging.WARNING)


def _wait_all(refs, what: str):
    import ray
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as e:
        raise JobError(f"{what} failed: {e}") from e


def _stream(workers, shards, total: int, out) -> list[dict]:
    import ray
    from tqdm import tqdm
    queue = deque(shards)
    inflight = {}   # ObjectRef -> (worker index, shard)
    results: list[dict] = []
    last_write = time.monotonic()
    path = os.path.join(out.job_dir, "results.parquet")

    def submit(k):
        if queue:
            shard = queue.popleft()
            inflight[workers[k].run_shard.remote(shard)] = (k, shard)

    for k in range(len(workers)):
        for _ in range(INFLIGHT):
            submit(k)
    with tqdm(total=total, unit="item", desc="generating", smoothing=0.1) as bar:
        while inflight:
            done, _ = ray.wait(list(inflight), num_returns=1)
            k, shard = inflight.pop(done[0])
            try:
                rows = ray.get(done[0])
            except ray.exceptions.RayError as e:
                raise JobError(f"worker {k} failed on shard {shard.file}[{shard.start}:{shard.stop}]: "
                               f"{e}") from e
            results += rows
            bar.update(len(rows))
            submit(k)
            if time.monotonic() - last_write >= out.results_every_s:
                write_parquet(path, results)
                last_write = time.monotonic()
    write_parquet(path, results)
    return results


def _summarize(job, results, metrics, ready, startup_s, gen_s) -> dict:
    out = job["output"]
    ok = [r for r in results if r["status"] == "ok"]
    summary = dict(
        job=job["name"], model=job["model"].preset, source=job["model"].source,
        compile_mode=job["compile"].options["mode"], workers=len(metrics), items=len(results),
        ok=len(ok), failed=len(results) - len(ok), startup_s=startup_s, generate_s=gen_s,
        items_per_s=len(ok) / gen_s if gen_s else None,
        steps_per_s=sum(m["steps"] for m in metrics) / gen_s if gen_s else None,
        workers_detail=[{k: m.get(k) for k in ("rank", "host", "gpu_name", "items",
                                                "model_load_s", "warmup_s", "steady_it_s",
                                                "e2e_mean_s", "e2e_p95_s", "peak_mem_gb",
                                                "busy_fraction")} for m in metrics],
    )
    write_json(os.path.join(out.job_dir, "summary.json"), summary)
    table = format_table(summary["workers_detail"],
                         ["rank", "host", "items", "model_load_s", "warmup_s", "steady_it_s",
                          "e2e_mean_s", "e2e_p95_s", "peak_mem_gb", "busy_fraction"])
    text = (f"job {summary['job']}: {summary['ok']}/{summary['items']} ok, {summary['failed']} failed, "
            f"model {summary['model']} ({summary['source']}), compile {summary['compile_mode']}\n"
            f"{summary['workers']} workers ready in {startup_s:.1f} s; generated in {gen_s:.1f} s "
            f"= {summary['items_per_s']:.3g} items/s\n\n{table}\n")
    write_text(os.path.join(out.job_dir, "summary.txt"), text)
    print("\n" + text)
    return summary
