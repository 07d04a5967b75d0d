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

from ..config import ModelSpec

__all__ = ["ModelSpec", "ModelLoadError", "build_pipeline", "check_gpu_memory", "check_pretrained",
           "hub_unreachable", "model_path", "pretrained_file", "video_length"]


class ModelLoadError(RuntimeError):
    pass


class GpuTooSmall(ModelLoadError):
    """This worker's GPU has too little memory for the preset (`check_gpu_memory`): the driver of
    an elastic pool places no more workers on that GPU type (`runner.driver.cluster`)."""


def video_length(spec: ModelSpec) -> int | None:
    """The one frame count the model takes (its family's `exact_frames`, read from the denoiser's
    config: Latte's temporal embedding), else None (image models, or any k * frame_step + 1)."""
    fam = spec.family
    if fam.exact_frames is None:
        return None
    if spec.source != "pretrained":
        return fam.exact_frames(fam.denoiser_config(spec.info, spec.source == "tiny"))
    cfg = pretrained_file(spec, "transformer/config.json")
    return fam.exact_frames(json.loads(Path(cfg).read_text()) if cfg else {})


HUB_PROBE_S = 3.0     # the hub's answer to one request, waited for this long (name lookup included)


def hub_unreachable(url: str | None = None, timeout_s: float = HUB_PROBE_S) -> str | None:
    """Why the Hugging Face hub (`url`, default its endpoint: HF_ENDPOINT or huggingface.co) cannot
    be reached now, or None if it answered (any HTTP status is an answer). One HEAD request
    through the environment's proxy settings, in a thread waited for `timeout_s`: a name lookup
    that hangs is bounded too. Without it, a machine with no network spent 24 s in the hub
    client's retries (22 log lines) before the error."""
    import threading
    import urllib.error
    import urllib.request
    if url is None:
        from huggingface_hub import constants
        url = constants.ENDPOINT
    why: list[str] = []

    def probe():
        try:
            # the socket's own timeout a second past the wait: a server that never answers is
            # always the wait's "no answer" below, not a race between the two timers
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"),
                                   timeout=timeout_s + 1).close()
        except urllib.error.HTTPError:
            pass                                  # an HTTP status is an answer: reachable
        except urllib.error.URLError as e:        # name lookup, connection refused, ...
            why.append(str(e.reason))
        except Exception as e:                    # a timeout, a reset connection
            why.append(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    t = threading.Thread(target=probe, name="hub-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return f"no answer from {url} in {timeout_s:.0f} s"
    return f"{url}: {why[0]}" if why else None


def _offline(spec: ModelSpec) -> bool:
    from huggingface_hub import constants
    return spec.local_files_only or constants.HF_HUB_OFFLINE


def _download_fix(spec: ModelSpec) -> str:
    return (f"Fix: download it where there is network (hf download {spec.info['hub_id']} "
            f"--local-dir DIR) and run with model.path=DIR, or use model.source=random|tiny to run "
            f"without weights.")


def check_pretrained(spec: ModelSpec) -> None:
    """Fail fast, on the driver, when `pretrained` weights cannot be found or are not the preset's
    (no GPU time spent), in one line: a hub that does not answer is found by `hub_unreachable`
    before any call of the hub client (which retries for ~24 s, logging each try); a checkpoint
    of another family, or one incomplete or damaged on disk, by `runner.serve.checkpoint`."""
    if spec.source != "pretrained":
        return
    path = model_path(spec)
    if spec.path and _path_like(path) and not os.path.isdir(path):
        # a hub id is "org/name", never absolute nor "./x": this one can only be a directory
        what = ("is a file, not a directory" if os.path.exists(path) else
                "this directory does not exist")
        raise ModelLoadError(f"model.path {spec.path!r}: {what}; give the directory of a diffusers "
                             f"pipeline (save_pretrained, or `hf download {spec.info['hub_id']} "
                             f"--local-dir DIR`), or a hub id")
    if os.path.isdir(path):
        if not (Path(path) / "model_index.json").is_file():
            raise ModelLoadError(f"model.path {path!r} is a directory without model_index.json: "
                                 f"not a diffusers pipeline (save one with save_pretrained, or "
                                 f"download {spec.info['hub_id']} into it)")
        return _check_index(spec, str(Path(path) / "model_index.json"), folder=path)
    # neither a directory here nor path-like: a hub id, or a relative directory that is not here
    not_here = (f" (nor a directory under {os.getcwd()!r})" if spec.path else "")
    if not _offline(spec):
        why = hub_unreachable()
        if why is not None:
            if pretrained_file(spec, "model_index.json", local_only=True) is not None:
                raise ModelLoadError(
                    f"cannot reach the Hugging Face hub ({why}); {path!r} is in the local hub "
                    f"cache: run with model.local_files_only=true (or HF_HUB_OFFLINE=1) to use it")
            raise ModelLoadError(f"cannot reach the Hugging Face hub ({why}) and {path!r} is not "
                                 f"in the local hub cache{not_here}. {_download_fix(spec)}")
    index = pretrained_file(spec, "model_index.json")
    if index is None:
        raise ModelLoadError(
            f"cannot find the pretrained model {path!r} (not a local directory{not_here}; "
            + ("not in the local hub cache, and model.local_files_only or HF_HUB_OFFLINE=1 forbid "
               "the network" if _offline(spec) else "not on the hub, or not readable with the "
               "credentials here (HF_TOKEN, hf auth login)") + f"). {_download_fix(spec)}")
    # offline, the hub cache's snapshot is what the workers load: checked as a directory is
    _check_index(spec, index, folder=os.path.dirname(index) if _offline(spec) else None)


def _check_index(spec: ModelSpec, index_file: str, folder: str | None) -> None:
    from .checkpoint import problem
    where = (f"model.path {spec.path!r}" if spec.path else f"{spec.info['hub_id']!r}") + (
        f" (the hub cache's copy in {folder})" if folder and not os.path.isdir(model_path(spec))
        else "")
    try:
        index = json.loads(Path(index_file).read_text())
        if not isinstance(index, dict):
            raise ValueError(f"a JSON {type(index).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{where}: its model_index.json is unreadable ({type(e).__name__}: "
                             f"{e}); not a diffusers pipeline, or damaged: save or download it "
                             f"again") from e
    why = problem(index, spec.preset, where, folder)
    if why:
        raise ModelLoadError(why)


def model_path(spec: ModelSpec) -> str:
    """What `from_pretrained` is given: model.path (`~` expanded: a hub id never starts with
    it) or the preset's hub id."""
    return os.path.expanduser(spec.path) if spec.path else spec.info["hub_id"]


def _path_like(path: str) -> bool:
    """A model.path that can only be a local directory: absolute, `./` or `../` (a hub id is
    `org/name`, or `name`)."""
    return os.path.isabs(path) or path.startswith(("./", "../"))


def pretrained_file(spec: ModelSpec, name: str, local_only: bool = False) -> str | None:
    """`name` of the pretrained model: from its directory, or the hub (through the local hub cache);
    with `local_only` (or offline settings) from the cache alone. The cache is read directly:
    `hf_hub_download(local_files_only=True)` still goes to the network (huggingface_hub 2.4
    fetches an "agent harnesses" list for its User-Agent, 3 s when the hub does not answer)."""
    path = model_path(spec)
    if os.path.isdir(path):
        p = Path(path) / name
        return str(p) if p.exists() else None
    try:
        if local_only or _offline(spec):
            from huggingface_hub import try_to_load_from_cache
            found = try_to_load_from_cache(path, name)
            return found if isinstance(found, str) else None
        from huggingface_hub import hf_hub_download
        return hf_hub_download(path, name)
    except Exception:
        return None


def check_gpu_memory(spec: ModelSpec, free_bytes: int | None = None, gpu: str = "this GPU",
                     fp8: bool = False, fp8_capable: bool | None = None) -> None:
    """Refuse a preset whose stated need (`gpu_gib`, for 16-bit weights; fp32 doubles it; with
    `fp8`, the compile mode's FP8 linears, `gpu_gib_fp8` where stated, on a GPU that runs them:
    `fp8_capable`, default: compute capability >= 8.9 as `compiler.transforms.fp8_supported` asks;
    elsewhere the weights stay 16-bit) exceeds the GPU's free memory (`free_bytes`, default: what
    CUDA reports now)."""
    spec = spec.resolved()
    if not spec.device.startswith("cuda"):
        return
    if fp8 and fp8_capable is None:
        import torch
        fp8_capable = torch.cuda.get_device_capability() >= (8, 9)
    need = spec.info.get("gpu_gib_fp8" if fp8 and fp8_capable and "gpu_gib_fp8" in spec.info
                         else "gpu_gib")
    if need is None:
        return
    if spec.dtype == "fp32":
        need *= 2
    if free_bytes is None:
        import torch
        free_bytes, _ = torch.cuda.mem_get_info()
        gpu = torch.cuda.get_device_name()
    free = free_bytes / 2**30
    if free < need:
        raise GpuTooSmall(
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
    if "sampler" in spec.info:          # a step-distilled preset: the sampler it was trained with
        from ..families.distill import scheduler
        pipe.scheduler = scheduler(**spec.info["sampler"])
    pipe = pipe.to(spec.device)
    if pipe.dtype != spec.torch_dtype:  # tiny models are built in fp32
        pipe = pipe.to(dtype=spec.torch_dtype)
    if spec.source == "pretrained":     # on the device: a GPU reads 64 GiB in ~0.1 s
        _check_finite(pipe, spec)
    pipe.set_progress_bar_config(disable=True)
    for c in pipe.components.values():
        if isinstance(c, torch.nn.Module):
            c.eval().requires_grad_(False)
    return pipe


def _load_pretrained(spec: ModelSpec):
    """`from_pretrained`, its errors as one line (the first of a worker's error is what the driver
    shows) naming the checkpoint, the cause and the fix."""
    import diffusers
    path = model_path(spec)
    cls = getattr(diffusers, spec.family.pipeline)
    try:
        pipe = cls.from_pretrained(path, dtype=spec.torch_dtype,
                                   local_files_only=spec.local_files_only, **spec.family.load_kwargs)
    except Exception as e:    # OSError, ValueError, safetensors' SafetensorError, AttributeError..
        # its files named within the directory: the driver shows ~300 characters of the line
        why = (str(e).strip().splitlines() or [""])[0].replace(path.rstrip("/") + "/", "")[:150]
        raise ModelLoadError(
            f"could not load {cls.__name__} from {_source(spec)}: {type(e).__name__}: {why}. "
            f"Fix: download it again (hf download {spec.info['hub_id']} --local-dir DIR, then "
            f"model.path=DIR) or model.source=random|tiny") from e
    return pipe


def _source(spec: ModelSpec) -> str:
    """The checkpoint as load errors name it: "local directory '/models/x'" or "hub id 'org/x'"."""
    path = model_path(spec)
    return f"{'local directory' if os.path.isdir(path) else 'hub id'} {path!r}"


def _check_finite(pipe, spec: ModelSpec) -> None:
    """Refuse weights that are inf or NaN as loaded: every output would be NaN (black frames), with
    no error. A checkpoint's values past fp16's range (65504; it was trained in bf16 or fp32)
    become inf in the cast; a damaged file can hold NaN. One flag per 64M values (a bool copy of
    a whole embedding would be GiBs), one device sync: ~0.1 s for 64 GiB on a GPU."""
    import torch
    where = _source(spec)
    dtype, names, params, flags = spec.dtype, [], [], []
    for cname, c in pipe.components.items():
        if isinstance(c, torch.nn.Module):
            for n, p in c.named_parameters():
                if p.is_floating_point():
                    names.append(f"{cname}.{n}")
                    params.append(p)
                    flags.append(torch.stack([torch.isfinite(x).all()
                                              for x in p.detach().reshape(-1).split(1 << 26)]).all())
    if not flags:
        return
    bad = (~torch.stack(flags)).nonzero().flatten().tolist()
    if not bad:
        return
    nan = any(bool(torch.isnan(params[i]).any()) for i in bad)
    # the cause and the fix first: the driver shows a worker's error to ~300 characters
    which = f"{len(bad)} tensors, the first {names[bad[0]]}"
    if dtype == "fp16" and not nan:
        raise ModelLoadError(f"{where}: weights past fp16's range (65504) become inf in "
                             f"model.dtype=fp16. Fix: model.dtype=bf16 (or fp32). {which}")
    raise ModelLoadError(f"{where} holds inf or NaN weights (damaged, or a training run that "
                         f"diverged). Fix: download it again (hf download {spec.info['hub_id']} "
                         f"--local-dir DIR) or use another checkpoint. {which}")
