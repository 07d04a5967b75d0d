"""Everything the job writes, each file atomically: a temporary name in the same directory, then
`os.replace`. A reader (or a resumed job) therefore sees a complete file or none; a crash leaves at
most a `.tmp-*` file, never a half-written output under its final name.

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
import json
import os
import uuid
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yields a temporary path next to `path` (same suffix, so writers pick the right format);
    renamed onto `path` only if the block finishes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex[:8]}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


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
    """image: (H, W, 3) uint8, or floats in [0, 1]."""
    import imageio.v3 as iio
    with atomic_path(path) as tmp:
        iio.imwrite(tmp, to_uint8(image), extension=".png")


def write_mp4(path, frames: np.ndarray, fps: int) -> None:
    """frames: (F, H, W, 3) uint8, or floats in [0, 1] -> H.264 yuv420p mp4."""
    import imageio_ffmpeg
    frames = to_uint8(frames)
    _, h, w, _ = frames.shape
    with atomic_path(path) as tmp:
        # macro_block_size=1: sizes are already multiples of the model's factor; never rescale.
        writer = imageio_ffmpeg.write_frames(str(tmp), (w, h), fps=fps, codec="libx264",
                                             pix_fmt_out="yuv420p", macro_block_size=1,
                                             quality=None, bitrate=None,
                                             output_params=["-crf", "18"], ffmpeg_log_level="error")
        writer.send(None)
        for f in frames:
            writer.send(np.ascontiguousarray(f))
        writer.close()


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A plain fixed-width table (no extra dependency)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
