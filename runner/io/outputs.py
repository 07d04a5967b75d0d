"""The media encoders, the small files and tables the job writes, and the row of an item that
produced no output (`failed_row`: the worker's and the driver's).

`write_png` and `write_mp4` write straight to the path they are given: the worker hands them a
temporary name (`storage.Store.atomic_local`), so an output appears under its final name only once
complete. `write_text`/`write_json` are atomic themselves, through `storage.atomic_path` (the one
local atomic write: a `.tmp-*` name in the same directory, then `os.replace`), re-exported here for
the report and the benches. A reader (or a resumed job) sees a complete file or none; a crash leaves
at most a `.tmp-*` file, never a half-written output under its final name.

Layout under `<output.dir>/<job name>/`:
    media/<id>.mp4 | media/<id>.png   one per prompt (H.264 mp4 through imageio-ffmpeg)
    results.parquet                   one row per prompt
    metrics/worker-<k>.json           per-worker performance figures
    summary.json, summary.txt         totals and the human-readable table
    report.html, report/              the page to look at (report.py)
    config.yaml                       the resolved config
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np

from .storage import atomic_path   # noqa: F401  (re-exported: the one atomic write)


def write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def to_uint8(x: np.ndarray) -> np.ndarray:
    """[0, 1] floats (diffusers' output_type="np") -> uint8; uint8 (the worker's) passes through."""
    if x.dtype == np.uint8:
        return x
    return (np.clip(x, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def write_png(path, image: np.ndarray) -> None:
    """image: (H, W, 3) uint8, or floats in [0, 1]. Written straight to `path` (see above),
    encoded in memory first: when imageio writes a file itself and the disk is full, it keeps the
    file open, and closing it in its `__del__` fails again, printed as "Exception ignored in
    PluginV3.__del__" long after this call raised. Here a full disk raises in this call, once, and
    nothing is left at `path`."""
    import imageio.v3 as iio
    data = iio.imwrite("<bytes>", to_uint8(image), extension=".png")
    with _removed_on_error(path):
        Path(path).write_bytes(data)


def write_mp4(path, frames: np.ndarray, fps: int) -> None:
    """frames: (F, H, W, 3) uint8, or floats in [0, 1] -> H.264 yuv420p mp4 (CRF 18), written
    straight to `path` (see above), through the ffmpeg that imageio-ffmpeg ships, run here rather
    than through `imageio_ffmpeg.write_frames`: that ignores ffmpeg's exit status (a full disk gave
    a truncated file, published as the output) and lets ffmpeg print to the worker's stderr. Here
    a failure raises `OSError` with ffmpeg's message (`[Errno 28] No space left on device` when it
    is that), ffmpeg prints nothing, and nothing is left at `path`."""
    import imageio_ffmpeg
    frames = np.ascontiguousarray(to_uint8(frames))
    _, h, w, _ = frames.shape
    # imageio_ffmpeg.write_frames' command for these settings (macro_block_size=1: sizes are
    # already multiples of the model's factor, never rescaled)
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-f", "rawvideo", "-vcodec", "rawvideo",
           "-s", f"{w}x{h}", "-pix_fmt", "rgb24", "-r", str(Fraction(fps).limit_denominator()),
           "-i", "-", "-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p", "-v", "error",
           "-crf", "18"]
    with _removed_on_error(path):
        proc = subprocess.run([*cmd, str(path)], input=memoryview(frames).cast("B"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if proc.returncode:
            said = proc.stderr.decode(errors="replace").replace(str(path), "<output>").strip()
            if "No space left on device" in said:      # as a full disk reads from Python's writes
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            last = said.splitlines()[-1] if said else "no message"
            raise OSError(f"ffmpeg could not write the video (exit status {proc.returncode}): {last}")


@contextlib.contextmanager
def _removed_on_error(path):
    """A write that fails leaves no partial file at `path` (the caller's temporary name)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def failed_row(item, error: str, worker: int | None = None) -> dict:
    """The result row of an item that produced no output (same columns as a worker's ok rows)."""
    return {**item.params(), "status": "failed", "error": error[:2000], "output": None,
            "worker": worker, "batch_size": 1 if worker is not None else None, "e2e_s": None,
            "started_at": None, "denoise_it_s": None}


def format_table(rows: list[dict], columns: list[str], width: int | None = None) -> str:
    """A plain fixed-width table (no extra dependency). With `width`, a table wider than that is
    cut into blocks of columns, one under the other, each led by the first column (the rows'
    key), so that no line is wider than `width` (unless one column alone is). No columns (no
    worker served: a job that waited for GPUs in vain): an empty table."""
    if not columns:
        return ""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    blocks, block = [], [0]
    for i in range(1, len(columns)):
        if width is not None and sum(widths[j] + 2 for j in block) + widths[i] > width:
            blocks.append(block)
            block = [0]
        block.append(i)
    blocks.append(block)
    out = []
    for block in blocks:
        out += ["" if out else None]
        out += ["  ".join(columns[i].ljust(widths[i]) for i in block).rstrip(),
                "  ".join("-" * widths[i] for i in block)]
        out += ["  ".join(row[i].rjust(widths[i]) for i in block) for row in cells]
    return "\n".join(line for line in out if line is not None)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def plural(n: int, word: str, many: str | None = None) -> str:
    """`n` and `word`, in the plural unless `n` is 1: "1 shard", "4 shards" (`many` for a word
    whose plural is not word + "s")."""
    return f"{n} {word if n == 1 else many or word + 's'}"
