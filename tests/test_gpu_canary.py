"""What the canary costs on a GPU (skipped without CUDA; run on the device):

    python3 -m pytest -m gpu tests/test_gpu_canary.py -s

PixArt-α 1024², 20 steps, O3 (the job `pixart_batch` at full size, random weights), one worker
built from the job's own config (`runner.job.worker_config`), batch 1, shards of 8 as the job
hands them out. It times 48 items through the pipelined worker (shards submitted together, as
the driver keeps them in flight), then 5 canaries in turn with them, and prints one JSON line:
seconds per item, per canary and for the reference made at ready, whether each canary matched
(and how closely), and the overhead of the default setting, a canary batch per
`config.CANARY_BATCHES` batches: canary seconds / (CANARY_BATCHES x batch x item seconds).
"""
import json
import statistics
import time

import pytest

pytestmark = pytest.mark.gpu


def test_the_canary_costs_at_most_1_percent_on_the_pixart_o3_job(tmp_path):
    from runner import job
    from runner.config import CANARY_BATCHES, load_config, split
    from runner.prompts import Item
    from runner.worker import Worker
    j = split(load_config(["job=pixart_batch", "model.source=random", "compile.mode=O3",
                           f"output.dir={tmp_path}"]))
    cfg = job.worker_config(j, job.constraints(j["model"]), on_gpu=True)
    assert cfg.canary and not cfg.compile.options.lossless      # on by default; O3 is lossy
    w = Worker(0, cfg)
    ready = w.warmup()
    g = cfg.generation
    its = [Item(id=f"i{k:02d}", prompt=f"a photo of a lighthouse number {k}", negative_prompt="",
                seed=k, height=g.height, width=g.width, num_frames=None,
                num_inference_steps=g.num_inference_steps, guidance_scale=g.guidance_scale,
                file="p", row=k) for k in range(56)]
    w.run_shard(its[:8])                                   # first shard: settles the allocator
    t0 = time.perf_counter()
    runs = [w.submit(its[k:k + 8]) for k in range(8, 56, 8)]
    assert all(r["status"] == "ok" for run in runs for r in run.wait_rows())
    item_s = (time.perf_counter() - t0) / 48
    verdicts = [w.canary(seq) for seq in range(5)]
    canary_s = statistics.median(v["s"] for v in verdicts)
    overhead = canary_s / (CANARY_BATCHES * cfg.batch_size * item_s)
    print(json.dumps(dict(
        device=ready["device"], item_s=round(item_s, 4), items_per_s=round(1 / item_s, 3),
        canary_s=[round(v["s"], 4) for v in verdicts], reference_s=round(w.m["canary_ref_s"], 4),
        matched=[v["ok"] for v in verdicts], max_abs=[v["max_abs"] for v in verdicts],
        psnr_db=[v["psnr_db"] for v in verdicts], rule=verdicts[0]["rule"],
        canary_batches=CANARY_BATCHES, overhead_default=round(overhead, 5))))
    assert all(v["ok"] for v in verdicts), verdicts
    assert overhead <= 0.01
