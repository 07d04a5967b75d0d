"""Compile cache that workers share: a configured directory plus portable, verified artifacts.

Contract:
- `configure_cache_dir(path)`: Inductor's and Triton's on-disk caches go under `path`, Inductor's
  precompiled C++ headers too (call it before the first compile of the process, in every process
  that compiles: the environment it sets does not move the headers; a second process on the same
  directory warms from it).
- `cache_key(pipe, options, shapes) -> str`: a file-name-safe key that changes whenever anything a
  compiled artifact depends on changes: torch, triton, CUDA and diffusers versions, this compiler's
  own source files, GPU name, the config of every model in the pipeline, dtype, shapes, compile mode
  and options.
- `pack_artifact(key) -> bytes | None`: `torch.compiler.save_cache_artifacts()` of this process,
  wrapped in a header (magic, format version, key, payload length, sha256 of the payload). None when
  there is nothing to save.
- `unpack_and_load(blob, expected_key) -> bool`: verifies magic, version, key, length and hash
  BEFORE handing the payload to `torch.compiler.load_cache_artifacts`. Any corruption, truncation or
  mismatch (or a failing load) logs a warning and returns False, so the caller compiles instead.
  Never raises, never loads unverified bytes.
- `write_artifact(dir, key, blob)` (atomic: temp file + os.replace; mode 0644, readable by other
  users of a shared directory) and `read_artifact(dir, key)` (None when missing; any other
  OSError is the caller's: `runner.serve.compile_cache` logs it and compiles).

Header layout (big-endian): MAGIC (8 bytes) | version u16 | key length u16 | key (utf-8) |
payload length u64 | sha256(payload) (32 bytes) | payload.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"DIFFCC\x00\x01"
FORMAT_VERSION = 1
_HEAD = struct.Struct(">8sHH")
_TAIL = struct.Struct(">Q32s")
SOURCE = Path(__file__).parent     # this compiler's sources: its transforms decide the graphs


def configure_cache_dir(path: str | os.PathLike) -> Path:
    path = Path(path).resolve()
    (path / "inductor").mkdir(parents=True, exist_ok=True)
    (path / "triton").mkdir(parents=True, exist_ok=True)
    # Both are read when a compile needs them, so setting them before the first compile is enough.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    _precompiled_headers_in(path / "inductor" / "precompiled_headers")
    return path


def _precompiled_headers_in(directory: Path) -> None:
    """Inductor precompiles the C++ header of its CPU kernels (150 MB on the 2-core CI box, ~6 s
    of g++ once; a test's tiny-model compiles there took 41 CPU-s with it, 62 without) into a
    directory fixed when `torch._inductor.codecache` is imported, whatever TORCHINDUCTOR_CACHE_DIR
    says: `<temp folder>/torchinductor_<user>/precompiled_headers`, left there. Put under the
    cache directory with the rest of a compile: in this process only (the environment does not
    carry it), so a process that inherits TORCHINDUCTOR_CACHE_DIR calls this too. The headers
    this process made before are forgotten (`_precompile_header` remembers their paths)."""
    from torch._inductor import codecache
    if not hasattr(codecache, "_HEADER_DIR"):          # a torch that precompiles none
        return
    codecache._HEADER_DIR = str(directory)
    codecache._HEADER_LOCK_DIR = str(directory / "locks")
    codecache._precompile_header.cache_clear()


# ---------------------------------------------------------------------------------------------
# Keys

@functools.cache
def source_digest() -> str:
    """sha256 of the compiler's Python sources: an edit to a transform makes other graphs."""
    h = hashlib.sha256()
    for f in sorted(SOURCE.rglob("*.py")):
        h.update(str(f.relative_to(SOURCE)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def environment() -> dict:
    """The software/hardware a compiled artifact is only valid for. diffusers: the models' forward
    code, which Dynamo traces (transformers' version is in its models' configs already)."""
    import diffusers
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    # the GPU's name and architecture: an elastic cluster mixes GPU types (an A100 must never load
    # an H100's kernels: sm_80 against sm_90a), and names alone may not tell two apart
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    arch = "sm_%d%d" % torch.cuda.get_device_capability() if cuda else None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda, "gpu": gpu,
            "arch": arch, "diffusers": diffusers.__version__, "compiler": source_digest()}


def _config_dict(module) -> dict | None:
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    if hasattr(cfg, "to_dict"):  # transformers PretrainedConfig
        cfg = cfg.to_dict()
    return {k: v for k, v in dict(cfg).items() if not k.startswith("_")}  # drop _name_or_path etc.


def model_fingerprint(pipe) -> dict:
    """Class and config of every model in the pipeline, plus the denoiser's dtype."""
    out = {"pipeline": type(pipe).__name__}
    for name, comp in sorted(getattr(pipe, "components", {}).items()):
        if isinstance(comp, torch.nn.Module):
            out[name] = {"class": type(comp).__name__, "config": _config_dict(comp),
                         "dtype": str(next(comp.parameters()).dtype) if any(True for _ in comp.parameters()) else None}
    return out


def cache_key(pipe, options, shapes: dict) -> str:
    from .options import parse_options
    opts = parse_options(options)
    material = {"format": FORMAT_VERSION, "env": environment(), "model": model_fingerprint(pipe),
                "shapes": shapes, "options": opts.to_dict()}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()
    prefix = re.sub(r"[^A-Za-z0-9]+", "", type(pipe).__name__)[:40] or "pipe"
    return f"{prefix}-{digest[:40]}"


# ---------------------------------------------------------------------------------------------
# Artifacts

def pack_artifact(key: str) -> bytes | None:
    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return None
    payload = saved[0]
    if not payload:
        return None
    k = key.encode()
    return (_HEAD.pack(MAGIC, FORMAT_VERSION, len(k)) + k
            + _TAIL.pack(len(payload), hashlib.sha256(payload).digest()) + payload)


def verify(blob: bytes, expected_key: str) -> bytes:
    """The payload of `blob` if it is intact and for `expected_key`; raises ValueError otherwise."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ValueError(f"artifact is {type(blob).__name__}, not bytes")
    blob = bytes(blob)
    if len(blob) < _HEAD.size:
        raise ValueError(f"truncated header ({len(blob)} bytes)")
    magic, version, klen = _HEAD.unpack_from(blob, 0)
    if magic != MAGIC:
        raise ValueError("bad magic: not a compiler cache artifact")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, expected {FORMAT_VERSION}")
    pos = _HEAD.size
    if len(blob) < pos + klen + _TAIL.size:
        raise ValueError("truncated header")
    key = blob[pos:pos + klen].decode("utf-8", errors="replace")
    if key != expected_key:
        raise ValueError(f"key mismatch: artifact is for {key!r}, expected {expected_key!r}")
    length, digest = _TAIL.unpack_from(blob, pos + klen)
    payload = blob[pos + klen + _TAIL.size:]
    if len(payload) != length:
        raise ValueError(f"payload is {len(payload)} bytes, header says {length} (truncated or padded)")
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("sha256 mismatch: payload corrupted")
    return payload


def unpack_and_load(blob, expected_key: str) -> bool:
    try:
        payload = verify(blob, expected_key)
    except Exception as e:
        log.warning("compile cache artifact rejected (%s); compiling instead", e)
        return False
    try:
        torch.compiler.load_cache_artifacts(payload)
    except Exception as e:  # verified bytes from another torch build, say: still never fatal
        log.warning("compile cache artifact failed to load (%s: %s); compiling instead", type(e).__name__, e)
        return False
    return True


def artifact_path(directory: str | os.PathLike, key: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", key):
        raise ValueError(f"cache key {key!r} is not file-name safe")
    return Path(directory) / f"{key}.artifact"


def write_artifact(directory: str | os.PathLike, key: str, blob: bytes) -> Path:
    path = artifact_path(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
    try:
        # mkstemp's 0600 would keep the artifact from the jobs of other users of a shared
        # cache directory (a PermissionError at their warm-up); it holds compiled kernels only
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the whole new one, never a partial one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_artifact(directory: str | os.PathLike, key: str) -> bytes | None:
    try:
        return artifact_path(directory, key).read_bytes()
    except (FileNotFoundError, ValueError):
        return None
