"""The canary: a fixed batch a worker regenerates now and then, to catch a GPU that computes wrong.

A card with a fault, or a bit flipped in the weights it holds, writes wrong outputs under good
names, and nothing else in the job would notice. So each worker, when it becomes ready, generates
its canary batch (`items`: the warm-up's prompt and seeds, at the job's default size, frames,
steps and guidance, `run.batch_size` of them, so that it runs the very graphs the job's batches of
that shape run and compiles nothing new; a grey image for a model that needs one) and keeps the uint8 result as its
reference. When the driver asks (`Worker.canary`, every `run.canary_every_items` items or
`run.canary_every_s` seconds, in order with its shards on the model thread), it generates the
batch again and compares (`compare`): bit for bit under a lossless compile mode (the same graphs on
the same GPU give the same bits), at least `run.canary_min_psnr_db` under a lossy one (O3's FP8
and low-precision kernels are not promised to be deterministic). The driver acts on the verdict
(`runner.driver.dispatch`): a failed canary stops the worker, and the outputs it made since its last
good canary are marked `suspect`.

Each worker is its own reference: comparing across workers would flag GPUs that differ in the
last bit for legitimate reasons (models, drivers, kernel choices), and a card that is wrong
from the start, consistently, is not caught. The verdict names the device (`device`: host, Ray
node, CUDA device index as the node numbers it, UUID, name) so that someone can take the card out.
"""

from __future__ import annotations

import math
import os
import socket

import numpy as np

from ..io.prompts import Item

# The warm-up's prompt too (`Worker._warmup_call`): a model that trims text embeddings to the
# prompt's token count (Latte) sees the shapes the warm-up compiled, so the canary compiles nothing.
PROMPT = "warm up"
FILE = "canary"            # `Item.file` of canary items (fault injection and logs tell them apart)


def items(generation, num_frames: int | None, batch_size: int) -> list[Item]:
    """The canary batch: the job's default shape and steps (`generation`: GenerationDefaults)."""
    g = generation
    return [Item(id=f"canary-{k}", prompt=PROMPT, negative_prompt=g.negative_prompt, seed=k,
                 height=g.height, width=g.width, num_frames=num_frames,
                 num_inference_steps=g.num_inference_steps, guidance_scale=g.guidance_scale,
                 file=FILE, row=k) for k in range(batch_size)]


def compare(reference: np.ndarray, out: np.ndarray, finite: bool, exact: bool,
            min_psnr_db: float) -> dict:
    """A canary's uint8 output (B, H, W, 3) or (B, F, H, W, 3) against the reference: `ok`, the
    rule, and the figures (share of values that differ, largest difference, PSNR in dB)."""
    rule = "bit for bit" if exact else f"PSNR >= {min_psnr_db:g} dB"
    if not finite or out.shape != reference.shape:
        why = "non-finite values" if not finite else f"shape {out.shape} != {reference.shape}"
        return dict(ok=False, rule=rule, why=why, differing=1.0, max_abs=255, psnr_db=0.0)
    diff = np.abs(out.astype(np.int16) - reference.astype(np.int16))
    mse = float(np.mean(diff.astype(np.float64) ** 2))
    psnr = math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)
    ok = not diff.any() if exact else psnr >= min_psnr_db
    return dict(ok=bool(ok), rule=rule, differing=float(np.count_nonzero(diff)) / diff.size,
                max_abs=int(diff.max()), psnr_db=psnr)


def describe(v: dict) -> str:
    """A verdict's figures in a few words."""
    if v.get("why"):
        return f"{v['rule']}: {v['why']}"
    psnr = "identical" if math.isinf(v["psnr_db"]) else f"PSNR {v['psnr_db']:.1f} dB"
    return (f"{v['rule']}: {100 * v['differing']:.3g} % of values differ, largest by "
            f"{v['max_abs']}, {psnr}")


def device(cuda: bool, node_id: str | None) -> dict:
    """The worker's device as someone taking a card out needs it: host, Ray node, pid; on CUDA
    the device index as the node numbers it (Ray's CUDA_VISIBLE_DEVICES maps the worker's
    device 0 to it), its UUID and name."""
    d = dict(host=socket.gethostname(), node_id=node_id, pid=os.getpid(), gpu_index=None,
             gpu_uuid=None, gpu_name=None)
    if cuda:
        import torch
        i = torch.cuda.current_device()
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        props = torch.cuda.get_device_properties(i)
        uuid = str(getattr(props, "uuid", "") or "") or None
        d.update(gpu_index=visible[i] if i < len(visible) else str(i), gpu_name=props.name,
                 gpu_uuid=uuid if uuid is None or uuid.startswith("GPU-") else f"GPU-{uuid}")
    return d


def where(d: dict) -> str:
    """`device`'s dict in one phrase: host, node, GPU (index on its node, name, UUID), pid."""
    gpu = ("GPU " + " ".join(str(d[k]) for k in ("gpu_index", "gpu_name", "gpu_uuid") if d.get(k))
           if d.get("gpu_index") is not None else "CPU")
    parts = [f"host {d.get('host')}", d.get("node_id") and f"node {d['node_id'][:12]}", gpu,
             d.get("pid") and f"pid {d['pid']}"]
    return ", ".join(p for p in parts if p)
