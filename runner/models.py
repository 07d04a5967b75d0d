"""Model specs and pipeline loading; what each family is lives in `runner/families/`.

Contract: `build_pipeline(ModelSpec) -> DiffusionPipeline` on `spec.device` in `spec.dtype`, from one
of three weight sources:

- `pretrained`: `from_pretrained(spec.path)` (hub id or local directory, the real users' path);
- `random`:     the published architecture at full size with random weights, built directly on the
                target device in half precision (benchmarks; the compute is identical);
- `tiny`:       small random configs that run a 2-step call on a CPU in about a second (tests, demo).

`spec.family` is the preset's `Family` record, `spec.info` its published facts.

`check_gpu_memory(spec)` (worker, before loading): a preset that states the GPU memory a worker
needs (`gpu_gib`, docs/models.md) is refused with a `ModelLoadError` naming the need and the free
memory when the GPU has less, instead of running out of memory minutes into loading.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from .config import ModelSpec

__all__ = ["ModelSpec", "ModelLoadError", "build_pipeline", "check_gpu_memory", "check_pretrained",
           "video_length"]


class ModelLoadError(RuntimeError):
    pass


def video_length(spec: ModelSpec) -> int | None:
    """The one frame count the model takes (its family's `exact_frames`, read from the denoiser's
    config: Latte's temporal embedding), else None (image models, or any k * frame_step + 1)."""
    fam = spec.family
    if fam.exact_frames is None:
        return None
    if spec.source != "pretrained":
        return fam.exact_frames(fam.denoiser_config(spec.info, spec.source == "tiny"))
    cfg = _pretrained_file(spec, "transformer/config.json")
    return fam.exact_frames(json.loads(Path(cfg).read_text()) if cfg else {})


def check_pretrained(spec: ModelSpec) -> None:
    """Fail fast, on the driver, when `pretrained` weights cannot be found (no GPU time spent)."""
    if spec.source != "pretrained":
        return
    path = spec.path or spec.info["hub_id"]
    if os.path.isdir(path):
        if not (Path(path) / "model_index.json").is_file():
            raise ModelLoadError(f"model.path {path!r} is a directory without model_index.json: "
                                 f"not a diffusers pipeline (save one with save_pretrained, or "
                                 f"download {spec.info['hub_id']} into it)")
        return
    if _pretrained_file(spec, "model_index.json") is None:
        raise ModelLoadError(
            f"cannot find the pretrained model {path!r} (not a local directory; not reachable on the "
            f"hub or not in the local hub cache). Fix: download it where there is network "
            f"(huggingface-cli download {spec.info['hub_id']} --local-dir DIR) and run with "
            f"model.path=DIR, or use model.source=random|tiny to run without weights.")


def _pretrained_file(spec: ModelSpec, name: str) -> str | None:
    path = spec.path or spec.info["hub_id"]
    if os.path.isdir(path):
        p = Path(path) / name
        return str(p) if p.exists() else None
    try:
        from huggingface_hub import hf_hub_download
        return hf_hub_download(path, name, local_files_only=spec.local_files_only)
    except Exception:
        return None


def check_gpu_memory(spec: ModelSpec, free_bytes: int | None = None, gpu: str = "this GPU") -> None:
    """Refuse a preset whose stated need (`gpu_gib`, for 16-bit weights; fp32 doubles it) exceeds
    the GPU's free memory (`free_bytes`, default: what CUDA reports now)."""
    need = spec.info.get("gpu_gib")
    spec = spec.resolved()
    if need is None or not spec.device.startswith("cuda"):
        return
    if spec.dtype == "fp32":
        need *= 2
    if free_bytes is None:
        import torch
        free_bytes, _ = torch.cuda.mem_get_info()
        gpu = torch.cuda.get_device_name()
    free = free_bytes / 2**30
    if free < need:
        raise ModelLoadError(
            f"model.preset={spec.preset} ({spec.dtype}) needs about {need:.0f} GiB of GPU memory "
            f"(its weights and one call at the published size: docs/models.md, GPU memory); "
            f"{gpu} has {free:.1f} GiB free. Fix: run it on GPUs with more memory (an H200 has "
            f"141 GB), free the GPU of other processes, or pick a smaller preset (docs/models.md)")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_pipeline(spec: ModelSpec):
    """Build (or load) the pipeline for `spec`, on its device, in its dtype, in eval mode."""
    import torch     # here, not at the top: the driver's checks (check_pretrained, video_length) need none
    spec = spec.resolved()
    if spec.source == "pretrained":
        pipe = _load_pretrained(spec)
    else:
        tiny = spec.source == "tiny"
        # Seeded so every worker builds identical random weights (same outputs on any worker).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            if tiny:
                pipe = spec.family.build(spec.info, True)
            else:
                # Full size: allocate straight on the target device in half precision; building
                # T5-XXL in fp32 on a CPU would take 19 GB and minutes.
                with torch.device(spec.device), _default_dtype(spec.torch_dtype):
                    pipe = spec.family.build(spec.info, False)
    pipe = pipe.to(spec.device)
    if pipe.dtype != spec.torch_dtype:  # tiny models are built in fp32
        pipe = pipe.to(dtype=spec.torch_dtype)
    pipe.set_progress_bar_config(disable=True)
    for c in pipe.components.values():
        if isinstance(c, torch.nn.Module):
            c.eval().requires_grad_(False)
    return pipe


def _load_pretrained(spec: ModelSpec):
    import diffusers
    path = spec.path or spec.info["hub_id"]
    cls = getattr(diffusers, spec.family.pipeline)
    try:
        return cls.from_pretrained(path, dtype=spec.torch_dtype,
                                   local_files_only=spec.local_files_only, **spec.family.load_kwargs)
    except (OSError, ValueError) as e:
        where = "local directory" if os.path.isdir(path) else "hub id"
        raise ModelLoadError(
            f"could not load {cls.__name__} from {where} {path!r}: {e}\n"
            f"Fix: download the weights once (huggingface-cli download {spec.info['hub_id']} "
            f"--local-dir DIR) and run with model.path=DIR, or set model.source=random/tiny "
            f"for a run without weights.") from e
