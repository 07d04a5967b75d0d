"""The media encoders and the small files and tables the job writes.

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

import json

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
    """image: (H, W, 3) uint8, or floats in [0, 1]. Written straight to `path` (see above)."""
    import imageio.v3 as iio
    iio.imwrite(path, to_uint8(image), extension=".png")


def write_mp4(path, frames: np.ndarray, fps: int) -> None:
    """frames: (F, H, W, 3) uint8, or floats in [0, 1] -> H.264 yuv420p mp4, written straight to
    `path` (see above)."""
    import imageio_ffmpeg
    frames = to_uint8(frames)
    _, h, w, _ = frames.shape
    # macro_block_size=1: sizes are already multiples of the model's factor; never rescale.
    writer = imageio_ffmpeg.write_frames(str(path), (w, h), fps=fps, codec="libx264",
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
