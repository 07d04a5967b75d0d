"""LoRA adapters (`model.adapters`): named by the job, checked on the driver, fused into the weights
on the worker before anything is compiled.

Contract:
- `Adapter` (runner.config): one entry of the config list, parsed and checked there.
- `check(spec)` (driver, before any worker or GPU time): each adapter's file is found (a local file
  or directory, `s3://` / `gs://`, or a hub id with `weight_name`), is a whole safetensors file, its
  keys convert with diffusers' own `lora_state_dict` (diffusers/PEFT, original Wan
  `diffusion_model.*`, kohya/musubi `lora_unet_*` layouts), and every converted pair fits a Linear
  of the denoiser (built on the meta device: no weights read) with matching shapes. Wan's full
  differences (`.diff`, `.diff_b`, `diff_m` of the original layout: LightX2V's extracted LoRAs;
  `split`) are taken out before diffusers' conversion, which would drop most of them, and each
  must name a parameter of the denoiser of its shape. A key that does not fit, or that diffusers'
  converter would drop, is an `AdapterError` naming the adapter: never a silently ignored key.
- `Switch(pipe, per-row adapters)` (worker, before `compile_pipe`), then `use(name)` before each
  batch: a row's own adapter (`per_row: true`, named by its `adapter` column) written into the
  weights in place where the compiled step reads them; the same bits as a job of that adapter.
- `fuse(pipe, adapters, local_files_only)` (worker, before `compile_pipe`): each adapter loaded by diffusers'
  `load_lora_weights` (its key conversion and PEFT's scaling), its low-rank factors read from the
  PEFT layers, the layers removed again (`unload_lora_weights`), then W += scale * (s * B @ A + D)
  (D: the parameter's full difference, if any) in fp32, cast once, in place: the compiled graphs,
  CUDA graphs and FP8 weights are what they are without adapters (no runtime cost, no recompile).

The adapters' paths, weight names, scales and experts are output settings (`runner.driver.results`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from ..config import Adapter
from ..io.images import StoreUnreachable

__all__ = ["Adapter", "AdapterError", "Change", "Switch", "check", "fuse", "load", "apply", "fused",
           "local_file", "split"]

SMALL = 1 << 16        # tensors up to this many values are read on the driver (alphas, vectors)


class AdapterError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# Finding the file (driver and worker alike)

def local_file(a: Adapter, local_files_only: bool = False) -> str:
    """The adapter's safetensors file on this machine: a local file; a directory's `weight_name`
    (default: its one .safetensors file); a copy of an s3:// / gs:// object in the local cache;
    the hub's file through its cache (`weight_name` required)."""
    path = os.path.expanduser(a.path)
    if "://" in path:
        return _fetch_uri(a, path)
    if os.path.isfile(path):
        if a.weight_name:
            raise AdapterError(f"{a.shown}: path is a file; weight_name names a file inside a "
                               f"directory or hub repo: drop one")
        return path
    if os.path.isdir(path):
        if a.weight_name:
            f = os.path.join(path, a.weight_name)
            if not os.path.isfile(f):
                raise AdapterError(f"{a.shown}: {a.weight_name!r} is not a file in {path!r}")
            return f
        found = sorted(p.name for p in Path(path).glob("*.safetensors"))
        if len(found) != 1:
            raise AdapterError(f"{a.shown}: the directory holds {len(found)} .safetensors files "
                               f"({found[:5]}); name one with weight_name")
        return os.path.join(path, found[0])
    if os.path.exists(path):      # a FIFO, a device (/dev/zero), a socket: never read
        raise AdapterError(f"{a.shown}: not a regular file or directory ({_kind_of(path)}); "
                           f"give the adapter's .safetensors file")
    if os.path.isabs(path) or path.startswith(("./", "../", "~")) or path.endswith(".safetensors"):
        raise AdapterError(f"{a.shown}: no such file or directory")
    return _hub_file(a, local_files_only)


def _kind_of(path: str) -> str:
    """What a path that is neither a regular file nor a directory is, in words."""
    import stat
    mode = os.stat(path).st_mode
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device"
            if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def _hub_file(a: Adapter, local_files_only: bool) -> str:
    if not a.weight_name:
        raise AdapterError(f"{a.shown}: a hub id needs weight_name (the .safetensors file in the "
                           f"repo, e.g. loras/x.safetensors), or give a local file")
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    from .models import hub_unreachable
    offline = local_files_only or constants.HF_HUB_OFFLINE
    why = "offline" if offline else hub_unreachable()
    if why is not None:   # the hub's cache only
        found = try_to_load_from_cache(a.path, a.weight_name)
        if isinstance(found, str):
            return found
        raise AdapterError(f"{a.shown}: not a local file or directory, and not in the local hub "
                           f"cache ({why if offline else 'the hub cannot be reached: ' + why}). "
                           f"Fix: hf download {a.path} {a.weight_name} --local-dir DIR where "
                           f"there is network, then path: DIR/{a.weight_name}")
    try:
        return hf_hub_download(a.path, a.weight_name)
    except Exception as e:
        raise AdapterError(f"{a.shown}: cannot download from the hub ({type(e).__name__}: "
                           f"{(str(e).splitlines() or [''])[0][:150]})") from e


def _fetch_uri(a: Adapter, uri: str) -> str:
    """An object-store adapter copied once into `CACHE` (keyed by URI, size and modification
    time). A store that does not answer is `AdapterStoreUnreachable` (exit 3: not the input's
    fault); a cache that cannot take the copy names its directory and leaves no partial file."""
    import pyarrow.fs as pafs

    from ..io.storage import resolve
    full = uri.rstrip("/") + ("/" + a.weight_name if a.weight_name else "")
    parent, name = full.rsplit("/", 1)
    try:
        store = resolve(parent)
        info = store.info(name)
    except (OSError, ValueError) as e:
        raise _store_error(a, full, e) from e
    if info.type != pafs.FileType.File:
        raise AdapterError(f"{a.shown}: {full!r} is not an object (a missing key, or a prefix); "
                           f"give the .safetensors object, or weight_name inside the prefix")
    size = info.size
    # keyed by the object's modification time too: an adapter retrained and uploaded again under
    # its URI is as many bytes (the same ranks and shapes), and must not be the old copy
    key = hashlib.sha256(f"{full}:{size}:{info.mtime_ns}".encode()).hexdigest()[:16]
    dest = Path(os.path.expanduser(CACHE)) / key / name
    if not dest.is_file() or dest.stat().st_size != size:
        try:
            data = store.read_bytes(name)
        except (OSError, ValueError) as e:
            raise _store_error(a, full, e) from e
        _write_cached(a, dest, data)
    return str(dest)


CACHE = "~/.cache/runner/adapters"      # object-store adapters' local copies


class AdapterStoreUnreachable(StoreUnreachable):
    """An adapter's object store did not answer (exit 3, naming it, as an image store)."""


def _store_error(a: Adapter, full: str, e: BaseException) -> Exception:
    """The store's error as ours: unreachable (exit 3) or about this object (exit 2)."""
    from ..io.storage import unreachable
    why = unreachable(e)
    if why is not None:
        return AdapterStoreUnreachable(
            f"{a.shown}: the adapter's store {full.split('/', 3)[2]!r} {why}; check the store's "
            f"endpoint, the network and the store itself (docs/cloud.md), then rerun")
    return AdapterError(f"{a.shown}: cannot read {full!r} ({(str(e).splitlines() or [''])[0][:200]})")


def _write_cached(a: Adapter, dest: Path, data: bytes) -> None:
    """`data` as `dest` in the adapter cache, through a temporary file removed on any failure."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        import errno
        what = ("the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                else f"{type(e).__name__}: {e.strerror or e}")
        raise AdapterError(f"{a.shown}: cannot keep its {len(data)}-byte copy in the adapter cache "
                           f"{dest.parent.parent} ({what}); free space there or set HOME to a "
                           f"disk with room") from e


# ---------------------------------------------------------------------------------------------
# Wan's full differences: LightX2V's extracted LoRAs (driver and worker alike)
#
# LightX2V's LoRA extractor (tools/extract/lora_extractor.py) writes a weight matrix of at least
# 1e6 values as a LoRA pair (`lora_down` / `lora_up`, no alpha) and every other parameter's
# difference as it is: `<module>.diff` (a weight), `<module>.diff_b` (a bias), `blocks.N.diff_m` /
# `head.diff_m` (the modulation tables); its loader adds them times the strength. diffusers' Wan
# converter turns a Linear's `.diff_b` into a `lora_B` bias and `head.head.diff` into a LoRA with an
# identity `lora_B` (only when `head.head.diff_b` is there too), drops norm differences (a debug
# log: "just zeroed values"), drops every other `.diff`, `.diff_b` and `diff_m` (an info log), and
# fails on a small Linear's `.diff` where it expects a pair (text/time embeddings). All of them are
# taken out here and added to their parameters in the fuse step instead: one path for every kind.

def split(raw: dict, diffs) -> tuple[dict, dict]:
    """(the keys left to diffusers' LoRA loader, {key: (parameter, difference)} of the full
    differences: `diffs` (the family's `lora_diffs`) names each one's parameter, None for a key
    of another kind)."""
    lora, deltas = {}, {}
    for k, t in raw.items():
        name = diffs(k)
        if name is None:
            lora[k] = t
        else:
            deltas[k] = (name, t)
    return lora, deltas


def _of_linear(denoiser, name: str) -> bool:
    """Whether parameter `name` is a Linear's weight or bias (what a per-row switch writes)."""
    import torch
    path, _, attr = name.rpartition(".")
    m = denoiser.get_submodule(path) if path else denoiser
    return isinstance(m, torch.nn.Linear) and attr in ("weight", "bias")


def _check_unknown(a: Adapter, lora: dict) -> None:
    """What diffusers' Wan converter would still drop of the keys left to it (`split`): a
    `.diff`-like key of no kind applied here (its leftover check lets through any key holding
    `.diff`), and `time_projection` keys without a `time_projection` weight pair."""
    orig = [k for k in lora if k.startswith("diffusion_model.")]
    dropped = [k for k in orig if ".diff" in k]
    if not any(k.startswith("diffusion_model.time_projection") and k.endswith(".weight")
               for k in orig):
        dropped += [k for k in orig if "time_projection" in k]
    if dropped:
        raise AdapterError(f"{a.shown}: {len(dropped)} keys of an unknown kind diffusers' loader "
                           f"would ignore, e.g. {dropped[:3]}; applied are LoRA pairs and the "
                           f"full differences .diff, .diff_b, diff_m")


def _check_deltas(spec, a: Adapter, deltas: dict, denoiser) -> None:
    """Every full difference names a parameter of the denoiser and has its shape; a per-row
    adapter's are of Linears only (the weights a `Switch` writes)."""
    params = dict(denoiser.named_parameters())
    misfits = []
    for key, (name, t) in deltas.items():
        p = params.get(name)
        if p is None:
            misfits.append(f"{key}: no parameter {name} in the model")
        elif tuple(t.shape) != tuple(p.shape):
            misfits.append(f"{key}: a difference of shape {list(t.shape)} for {name} of shape "
                           f"{list(p.shape)}")
    if misfits:
        raise AdapterError(
            f"{a.shown}: {len(misfits)} of its {len(deltas)} full differences (.diff, .diff_b, "
            f"diff_m) do not fit {spec.preset}'s {a.expert} ({type(denoiser).__name__}; made for "
            f"another base model?), e.g. " + "; ".join(misfits[:2]))
    if a.per_row:
        _linears_only(a, [k for k, (name, _) in deltas.items() if not _of_linear(denoiser, name)])


def _linears_only(a: Adapter, other: list[str]) -> None:
    """A per-row adapter's full differences of weights other than Linears' (`other`, their keys or
    parameters) refused: a `Switch` writes Linear weights only (the driver's check and the
    worker's)."""
    if other:
        raise AdapterError(f"{a.shown}: a per-row adapter switches Linear weights only; its "
                           f"{len(other)} full differences of other weights (e.g. {other[0]}) "
                           f"apply to every row: give it without per_row")


# ---------------------------------------------------------------------------------------------
# The driver's check: the file, its layout, and every key against the denoiser on the meta device

def check(spec) -> list[str]:
    """Every adapter of `spec` (a `ModelSpec`) is a whole safetensors file whose every key fits
    its denoiser and whose values are finite and within range (`_check_values`); an
    `AdapterError` names the first that is not. Returns each adapter's content hash
    (`file_sha256`, in `spec.adapters`' order: what rows are made from, `row_hashes`). No weights
    of the model are read: the adapter's large tensors are meta tensors for the key checks."""
    if not spec.adapters:
        return []
    from .checkpoint import safetensors_problem
    denoisers = _meta_denoisers(spec, {a.expert for a in spec.adapters})
    diffs = spec.family.lora_diffs     # the family's full differences, where it has them
    hashes = []
    for a in spec.adapters:
        file = local_file(a, spec.local_files_only)
        why = safetensors_problem(Path(file), a.shown)
        if why:
            raise AdapterError(f"{why}: not an adapter file (a LoRA in safetensors format); "
                               f"download it again or give another file")
        raw = _meta_state_dict(a, file)
        if diffs:
            raw, deltas = split(raw, diffs)
            _check_unknown(a, raw)
            _check_deltas(spec, a, deltas, denoisers[a.expert])
        else:
            _check_dropped(a, raw)
            deltas = {}
        _check_fit(spec, a, _convert(spec, a, raw) if raw else {}, denoisers[a.expert], deltas)
        _check_values(a, file, spec.dtype)
        hashes.append(file_sha256(file))
    return hashes


_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _meta_state_dict(a: Adapter, file: str) -> dict:
    """The file's tensors: small ones read, the rest meta tensors of their shape and dtype. A
    header safetensors refuses (byte ranges that do not fit the shapes, an unknown dtype) is an
    `AdapterError` naming the file."""
    import math
    import torch
    from safetensors import safe_open
    out = {}
    try:
        with safe_open(file, "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                shape, dt = sl.get_shape(), sl.get_dtype()
                if math.prod(shape) <= SMALL:
                    out[k] = f.get_tensor(k)
                else:
                    out[k] = torch.empty(shape, dtype=getattr(torch, _DTYPES.get(dt, "float32")),
                                         device="meta")
    except Exception as e:     # safetensors' SafetensorError (no base class but Exception)
        raise AdapterError(f"{a.shown}: {file} is not a valid safetensors file ("
                           f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); "
                           f"download it again or give another file") from e
    return out


# A fused change of a weight past the square root of the model dtype's largest value makes the
# products of two activations it feeds (attention's q . k) overflow: every output NaN. No
# fine-tune moves a weight that far (the base weights are ~1e-2; a LoRA's change smaller still).
_RANGE = {"fp16": 65504.0 ** 0.5, "auto": 65504.0 ** 0.5}   # auto: fp16 on a GPU
_RANGE_WIDE = 3.4e38 ** 0.5                                  # bf16, fp32


def _check_values(a: Adapter, file: str, dtype: str) -> None:
    """Every tensor of the file finite, and each Linear's change bounded within `_RANGE` at the
    adapter's scale: |(B @ A)_ij| <= max_i |B_i| max_j |A_j| (Cauchy-Schwarz) times its
    alpha / rank, and a full difference's largest entry. Read one tensor at a time."""
    import torch
    from safetensors import safe_open
    norms, alphas = {}, {}    # a pair's prefix -> {"down"/"up": the largest row / column norm}
    worst, where = 0.0, ""
    with safe_open(file, "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if not t.is_floating_point():
                continue
            t = t.float()
            if not bool(torch.isfinite(t).all()):
                raise AdapterError(f"{a.shown}: {k} holds NaN or inf values (a training run "
                                   f"that diverged, or a damaged file); give another adapter")
            prefix, side = _pair_side(k)
            if side == "alpha":
                alphas[prefix] = float(t.reshape(-1)[0])
            elif side == "down":       # A (r, in): its columns' norms
                norms.setdefault(prefix, {})["down"] = (float(t.norm(dim=0).max()), t.shape[0])
            elif side == "up":         # B (out, r): its rows' norms
                norms.setdefault(prefix, {})["up"] = (float(t.norm(dim=1).max()), t.shape[1])
            elif t.numel() and float(t.abs().max()) > worst:    # a full difference (or a bias)
                worst, where = float(t.abs().max()), k
    for prefix, n in norms.items():
        if "down" in n and "up" in n:
            (na, r), (nb, _) = n["down"], n["up"]
            bound = na * nb * (alphas[prefix] / r if prefix in alphas else 1.0)
            if bound > worst:
                worst, where = bound, prefix
    limit = _RANGE.get(dtype, _RANGE_WIDE)
    if abs(a.scale) * worst > limit:
        raise AdapterError(f"{a.shown}: at scale {a.scale:g} it changes a weight by up to "
                           f"{abs(a.scale) * worst:.3g} ({where}), past {limit:.3g} where every "
                           f"output in model.dtype={dtype} is NaN or inf; give its scale as "
                           f"trained (about 1.0)")


def _pair_side(key: str) -> tuple[str, str | None]:
    """(the LoRA pair's prefix, "down" | "up" | "alpha") of a key in any layout, or (key, None)."""
    for tail, side in ((".lora_down.weight", "down"), (".lora_A.weight", "down"),
                       (".lora_up.weight", "up"), (".lora_B.weight", "up"), (".alpha", "alpha")):
        if key.endswith(tail):
            return key[:-len(tail)], side
    return key, None


# ---------------------------------------------------------------------------------------------
# What rows are made from: the adapters' contents (driver and worker alike)

_SHA: dict = {}      # a file's stat key -> its sha256: hashed once per process


def file_sha256(file: str) -> str:
    """The sha256 of the file's bytes, computed once per process for a file of the same inode,
    size, modification and change time (a file replaced or rewritten under its path, even to the
    same size and mtime, has another change time: hashed again)."""
    st = os.stat(file)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _SHA:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        _SHA[key] = h.hexdigest()
    return _SHA[key]


def row_hashes(adapters: tuple[Adapter, ...], hashes: list[str]) -> dict:
    """{a row's per-row adapter name, or None: one hash of the contents of every adapter its
    output is made from (the job-wide ones, then its own)}, None where it is made from none;
    `hashes`: `file_sha256` of each of `adapters`, in order. {} for a job without adapters."""
    if not adapters:
        return {}
    fixed = [h for a, h in zip(adapters, hashes) if not a.per_row]

    def one(parts):
        return hashlib.sha256("\n".join(parts).encode()).hexdigest() if parts else None
    out = {None: one(fixed)}
    for a, h in zip(adapters, hashes):
        if a.per_row:
            out[a.name] = one(fixed + [h])
    return out


def contents(adapters: tuple[Adapter, ...], local_files_only: bool = False) -> list[str]:
    """`file_sha256` of each adapter's file as found on this machine (the worker's own)."""
    return [file_sha256(local_file(a, local_files_only)) for a in adapters]


def _check_dropped(a: Adapter, raw: dict) -> None:
    """Another family's (not Wan's) full differences, which its converter may drop without an
    error: `.diff` of a Linear, non-zero norm differences. Wan's are applied (`split`)."""
    dropped = [k for k in raw if k.endswith(".diff") and "norm" not in k
               and not k.endswith("head.head.diff")]
    nonzero = [k for k in raw if k.endswith((".diff", ".diff_b")) and "norm" in k
               and (raw[k].is_meta or bool(raw[k].any()))]
    if dropped or nonzero:
        keys = (dropped + nonzero)[:3]
        raise AdapterError(f"{a.shown}: {len(dropped) + len(nonzero)} keys would be ignored by "
                           f"diffusers' loader (full-weight or non-zero norm differences), e.g. "
                           f"{keys}; this adapter cannot be applied as made")


def _convert(spec, a: Adapter, raw: dict) -> dict:
    """diffusers' own conversion of the file's layout to its own (`transformer.<module>.lora_A/B`)."""
    import diffusers
    cls = getattr(diffusers, spec.family.pipeline)
    if not hasattr(cls, "lora_state_dict"):
        raise AdapterError(f"{a.shown}: {cls.__name__} ({spec.preset}) has no LoRA loader in "
                           f"diffusers; adapters apply to the families whose pipeline loads LoRA "
                           f"(Wan, FLUX, SD 2.1)")
    try:
        return cls.lora_state_dict(dict(raw))
    except Exception as e:
        raise AdapterError(f"{a.shown}: its keys are not a LoRA layout diffusers' {cls.__name__} "
                           f"loads (diffusers/PEFT, original Wan `diffusion_model.*`, kohya "
                           f"`lora_unet_*`): {type(e).__name__}: {str(e)[:200]}") from e


def _meta_denoisers(spec, experts: set[str]) -> dict:
    """{expert: the denoiser with no storage}: from the checkpoint's config files, or one build
    of the preset's pipeline (both A14B experts from the same build)."""
    import torch
    if spec.source != "pretrained":
        with torch.device("meta"):
            pipe = spec.family.build(spec.info, spec.source == "tiny")
        return {e: getattr(pipe, e) for e in experts}
    import diffusers
    from .models import pretrained_file
    out = {}
    for e in experts:
        cfg_file = pretrained_file(spec, f"{e}/config.json")
        if cfg_file is None:
            raise AdapterError(f"model: {e}/config.json not found in the checkpoint")
        cfg = json.loads(Path(cfg_file).read_text())
        with torch.device("meta"):
            out[e] = getattr(diffusers, cfg["_class_name"]).from_config(cfg)
    return out


def _pairs(converted: dict, prefix: str) -> tuple[dict, list[str]]:
    """{module path: {"lora_A.weight": t, ...}} of the keys under `prefix.` (the denoiser's, as
    diffusers' loader names them: `transformer.` for either Wan 2.2 expert, `unet.`), and the
    other keys (the text encoder's, another layout's: never applied)."""
    pairs: dict = {}
    other = []
    for k, t in converted.items():
        head, _, rest = k.partition(".")
        for part in ("lora_A.weight", "lora_B.weight", "lora_B.bias"):
            if head == prefix and rest.endswith("." + part):
                pairs.setdefault(rest[:-len(part) - 1], {})[part] = t
                break
        else:
            other.append(k)
    return pairs, other


def _check_fit(spec, a: Adapter, converted: dict, denoiser, deltas: dict) -> None:
    import torch
    pairs, other = _pairs(converted, "unet" if a.expert == "unet" else "transformer")
    misfits = [f"{k}: not a LoRA factor of the denoiser" for k in other]
    modules = dict(denoiser.named_modules())
    for path, p in pairs.items():
        m, A, B = modules.get(path), p.get("lora_A.weight"), p.get("lora_B.weight")
        if A is None or B is None:
            misfits.append(f"{path}: lora_A or lora_B missing")
        elif not isinstance(m, torch.nn.Linear):
            misfits.append(f"{path}: no Linear of that name in the model")
        elif A.shape[1] != m.in_features or B.shape[0] != m.out_features or A.shape[0] != B.shape[1]:
            misfits.append(f"{path}: LoRA {B.shape[0]}x{A.shape[1]} (rank {A.shape[0]}) against "
                           f"a Linear {m.out_features}x{m.in_features}")
        elif "lora_B.bias" in p and (m.bias is None or p["lora_B.bias"].shape != m.bias.shape):
            misfits.append(f"{path}: a bias difference where the Linear has none of that size")
    if misfits:
        raise AdapterError(
            f"{a.shown}: {len(misfits)} of its {len(pairs) + len(other)} LoRA layers do not fit "
            f"{spec.preset}'s {a.expert} ({type(denoiser).__name__}; made for another base "
            f"model?), e.g. " + "; ".join(misfits[:2]))
    if not pairs and not deltas:
        raise AdapterError(f"{a.shown}: holds no LoRA layer for the denoiser")


# ---------------------------------------------------------------------------------------------
# The worker: fused before compiling

def fuse(pipe, adapters: tuple[Adapter, ...], local_files_only: bool = False,
         diffs=None) -> int:
    """Fuse each adapter into its denoiser's weights, in place; returns the Linears and other
    parameters changed. Per-row adapters (`per_row`) are left to a `Switch`. `diffs`: the
    family's `lora_diffs` (None: it has no full differences)."""
    n = 0
    for i, a in enumerate(a for a in adapters if not a.per_row):
        linears, params = load(pipe, a, local_file(a, local_files_only), f"runner_{i}", diffs)
        _finite(a, apply(getattr(pipe, a.expert), linears, params, a.scale))
        n += len(linears) + len(params)
    return n


def _finite(a: Adapter, bad: list[str]) -> None:
    """`bad`: the weights adapter `a` made inf or NaN (`apply`), refused naming it."""
    if bad:
        raise AdapterError(f"{a.shown}: fused at scale {a.scale:g} it makes {len(bad)} weights "
                           f"inf or NaN (the first {bad[0]}): every output would be NaN; give its "
                           f"scale as trained (about 1.0), or another adapter")


class Change(NamedTuple):
    """What an adapter adds to one Linear: W += scale * (s * B @ A + dw), b += scale * (s * bias +
    db); A (r, in) and B (out, r) from diffusers' PEFT layers (None: no LoRA pair on it), dw / db
    full differences (`.diff`, `.diff_b`)."""
    A: Any = None
    B: Any = None
    bias: Any = None
    s: float = 1.0
    dw: Any = None
    db: Any = None


def load(pipe, a: Adapter, file: str, name: str, diffs=None) -> tuple[dict, dict]:
    """({Linear path: Change}, {other parameter: its full difference}) of adapter `a`: the LoRA
    pairs as diffusers' `load_lora_weights` sets them up (its key conversion, PEFT's alpha / rank),
    read off the PEFT layers, which are then removed (the pipeline is as it was); a Wan adapter's
    full differences (`split`) beside them."""
    source, deltas = file, {}      # what diffusers loads: the file, or its keys but the deltas
    if diffs:
        from safetensors import safe_open
        with safe_open(file, "pt") as f:
            if any(diffs(k) for k in f.keys()):
                source, deltas = split({k: f.get_tensor(k) for k in f.keys()}, diffs)
    den = getattr(pipe, a.expert)
    linears = {} if not source else {
        path: Change(*f) for path, f in _lora_factors(pipe, a, source, name).items()}
    params = {}
    for key, (pname, t) in deltas.items():
        if not _of_linear(den, pname):
            params[pname] = t
            continue
        path, _, attr = pname.rpartition(".")
        field = "dw" if attr == "weight" else "db"
        linears[path] = linears.get(path, Change())._replace(**{field: t})
    return linears, params


def _lora_factors(pipe, a: Adapter, file, name: str) -> dict:
    """{module path: (A, B, bias or None, scaling)} as `load_lora_weights` sets the adapter up from
    `file` (a path, or a state dict), read off the PEFT layers, which are then removed."""
    from peft.tuners.lora import LoraLayer
    extra = {"load_into_transformer_2": True} if a.expert == "transformer_2" else {}
    pipe.load_lora_weights(file, adapter_name=name, **extra)
    out = {}
    try:
        for path, m in getattr(pipe, a.expert).named_modules():
            if isinstance(m, LoraLayer) and name in m.lora_A:
                if m.use_dora.get(name):
                    raise AdapterError(f"{a.shown}: a DoRA adapter; only plain LoRA is fused")
                B = m.lora_B[name]
                out[path] = (m.lora_A[name].weight.detach(), B.weight.detach(),
                             None if B.bias is None else B.bias.detach(), float(m.scaling[name]))
    finally:
        pipe.unload_lora_weights()
    return out


def apply(denoiser, linears: dict, params: dict, scale: float) -> list[str]:
    """Each Linear's `Change` (`fused`) and W += scale * D for the other parameters, in fp32,
    rounded once to the parameter's dtype, in place. Returns the names of the parameters that
    came out inf or NaN (one device sync for all of them)."""
    import torch
    names, flags = [], []
    with torch.no_grad():
        for path, change in linears.items():
            lin = denoiser.get_submodule(path)
            w, b = fused(lin.weight, lin.bias, change, scale)
            lin.weight.copy_(w)
            names.append(f"{path}.weight")
            flags.append(torch.isfinite(w).all())
            if b is not None:
                lin.bias.copy_(b)
                names.append(f"{path}.bias")
                flags.append(torch.isfinite(b).all())
        for name, d in params.items():
            p = denoiser.get_parameter(name)
            p.copy_((p.float() + d.to(p.device, torch.float32) * scale).to(p.dtype))
            names.append(name)
            flags.append(torch.isfinite(p).all())
    return _not_finite(names, flags)


def _not_finite(names: list[str], flags: list) -> list[str]:
    """The names whose flag (a 0-d bool tensor on the weights' device) is False: one sync."""
    import torch
    if not flags:
        return []
    ok = torch.stack(flags).cpu()
    return [names[i] for i in (~ok).nonzero().flatten().tolist()]


def fused(w, b, change: Change, scale: float) -> tuple:
    """(W + scale * (s * B @ A + dw), b + scale * (s * bias + db)) for one Linear: the sums in
    fp32, rounded once to W's dtype. One function for a job's fixed adapters and a worker's per-row
    switch, so a row's output is the same bits either way."""
    import torch
    A, B, bias, s, dw, db = change
    w32 = w.float()
    if A is not None:
        w32 = w32 + (B.to(w.device, torch.float32) @ A.to(w.device, torch.float32)) * (s * scale)
    if dw is not None:
        w32 = w32 + dw.to(w.device, torch.float32) * scale
    w = w32.to(w.dtype)
    if b is not None and (bias is not None or db is not None):
        b32 = b.float()
        if bias is not None:
            b32 = b32 + bias.to(b.device, torch.float32) * (s * scale)
        if db is not None:
            b32 = b32 + db.to(b.device, torch.float32) * scale
        b = b32.to(b.dtype)
    return w, b


class Switch:
    """A worker's per-row adapters (`per_row: true`): their changes loaded before compiling, the
    base weights of every Linear one of them changes kept on the host (pinned on a GPU worker:
    for a LoRA on all of a 14B's Linears, 26 GB of host memory), and `use(name)` writing base +
    that adapter's difference (or the base, for None) into the weights in place, wherever
    `compile_pipe` put them (`compiler.transforms.set_linear_weight`: fused QKV rows, FP8 rows).
    The compiled graphs and CUDA graphs read the same storage: no recompile, no re-capture.
    Full differences of other weights (norms, modulation) are refused here, as on the driver."""

    def __init__(self, pipe, adapters: tuple[Adapter, ...], local_files_only: bool = False,
                 diffs=None):
        self.pipe, self.current = pipe, None
        self.adapters = {}
        for i, a in enumerate(adapters):
            linears, params = load(pipe, a, local_file(a, local_files_only), f"row_{i}", diffs)
            _linears_only(a, list(params))
            self.adapters[a.name] = (a, linears)
        self.base = {}     # (expert, Linear path) -> its base (weight, bias) on the host
        for a, linears in self.adapters.values():
            for path in linears:
                lin = getattr(pipe, a.expert).get_submodule(path)
                self.base[a.expert, path] = (_host(lin.weight), _host(lin.bias))
        # each denoiser's device, read now: after compile_pipe its first parameter may be emptied
        self.device = {e: next(getattr(pipe, e).parameters()).device
                       for e in {a.expert for a, _ in self.adapters.values()}}

    def use(self, name: str | None) -> None:
        """The weights of adapter `name` (a per-row adapter's name, or None: the base)."""
        if name == self.current:
            return
        import torch

        from compiler.transforms import set_linear_weight
        a, linears = self.adapters[name] if name is not None else (None, {})
        # until every Linear is written the weights are neither adapter's: a switch that fails part
        # way (out of memory: the worker goes on) leaves `current` naming none, so the next `use`
        # rewrites them all, whichever adapter it asks for
        self.current = _PARTIAL
        names, flags = [], []
        with torch.no_grad():
            for (expert, path), (w, b) in self.base.items():
                den, device = getattr(self.pipe, expert), self.device[expert]
                w = w.to(device, non_blocking=True)
                b = None if b is None else b.to(device, non_blocking=True)
                if a is not None and a.expert == expert and path in linears:
                    w, b = fused(w, b, linears[path], a.scale)
                    names.append(path)
                    flags.append(torch.isfinite(w).all() & (
                        torch.isfinite(b).all() if b is not None else True))
                set_linear_weight(den, path, w)
                if b is not None:
                    den.get_submodule(path).bias.copy_(b)
        # one sync a switch: an adapter that overflows fails its own rows, naming it (`current`
        # stays partial: the next switch rewrites every weight)
        _finite(a, _not_finite(names, flags))
        self.current = name


_PARTIAL = object()     # `Switch.current` while (or after failing while) weights are written


def _host(t):
    """A copy of `t` in host memory (pinned for a CUDA tensor: copied back without a sync)."""
    if t is None:
        return None
    copy = t.detach().to("cpu", copy=True)
    return copy.pin_memory() if t.is_cuda else copy
