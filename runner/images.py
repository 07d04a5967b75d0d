"""Per-row input images (image-to-video rows): where they are, the driver's cheap checks, reading,
decoding and fitting on the workers, and their content hash.

Contract:
- A row's `image` cell (the Parquet column `image`) is a local path (absolute, or relative to the
  Parquet file that names it), a `file://`, `s3://` or `gs://` URI, or the image file's bytes (a
  binary column). `attach(table, file, items, family_image, bad)` (driver, per Parquet file, in
  `prompts`) checks the column's type, each cell's scheme and null cells against the model
  (`Family.image`: "required", "optional" or None), reporting each bad row as "file:row: reason"
  through `bad`, and returns the items with `image` set to where workers read it (an absolute path
  or a URI; "bytes:<sha256>" for a bytes cell, whose bytes travel in `image_bytes` and whose hash
  is known at once).
- `check_sample(items)` (driver, once per job): looks up to `SAMPLE` distinct images up (one stat
  each); a `PromptError` (exit 2) when none of them exists, which is a wrong base path, bucket or
  mount rather than a missing file; missing ones among existing ones are logged (those rows will
  fail). Every image is not looked up: a million-row job would spend its start in stats.
- `read(item) -> (bytes, sha256 hex)`, `fit(data, width, height) -> PIL.Image` (worker): raise
  `ImageError` naming the image and why (not found, unreadable, not a decodable image). The image
  is resized to cover width x height (Lanczos) and center-cropped to it: no distortion, the
  row's own size (the crop of diffusers' Wan docs, `center_crop_resize`, and of Wan 2.2's own
  image-to-video code). A missing or undecodable image fails its row only (`runner.worker`).
- The content hash is what an output was made from (`prompts.Item.image_sha256`, one of
  `prompts.PARAMS`): the worker records the hash of the bytes it read; on a rerun
  `fill_hashes(items, rows)` (driver, before the resume plan) hashes the current image of every
  row that has a recorded result, so an edited image (same path) is regenerated and an unchanged
  one (even at a new path) is not. Unreadable now: None, so the row is redone (and fails, named).
  This reads those images once per rerun, in `HASH_THREADS` threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from . import storage

log = logging.getLogger("runner")

SCHEMES = ("s3", "gs", "file")
SAMPLE = 16              # images the driver looks up before a job starts
HASH_THREADS = 16        # reads in flight when hashing images for a rerun's plan
BYTES = "bytes:"         # prefix of the `image` of a bytes cell: "bytes:<sha256 hex>"


class ImageError(ValueError):
    """An image that cannot be used: fails its row, with this message as the reason."""


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def _base(file: str) -> str:
    """Where relative image paths of `file` start: the Parquet file's directory (or prefix)."""
    if "://" in file:
        return file.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(file))


def locate(cell: str, file: str) -> str:
    """The image a text cell names, as workers read it (raises ValueError naming what is wrong)."""
    text = cell.strip()
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme not in SCHEMES:
            raise ValueError(f"image {text!r}: scheme {scheme!r} is not read here; use a local "
                             f"path, file://, s3:// or gs:// (copy web images to a bucket first)")
        return text
    text = os.path.expanduser(text)
    if os.path.isabs(text):
        return text
    base = _base(file)
    return f"{base}/{text}" if "://" in base else os.path.normpath(os.path.join(base, text))


def attach(table: pa.Table, file: str, first_row: int, items: list, need: str | None, bad) -> list:
    """`items` (of `table`, whose row 0 is the file's row `first_row`) with their images; bad cells
    reported through `bad` (and those items left out)."""
    has = "image" in table.column_names
    if not has:
        if need == "required":
            bad(f"{file}: no 'image' column; this model animates an image per row: add a column "
                f"'image' of paths, s3:// or gs:// URIs, or image bytes")
            return []
        return items
    col = table.column("image")
    if not (_is_text(col.type) or _is_binary(col.type) or pa.types.is_null(col.type)):
        bad(f"{file}: column 'image' has type {col.type}; it must hold text (a path or an s3:// or "
            f"gs:// URI) or the image's bytes (binary)")
        return []
    cells = col.to_pylist()
    if need is None:
        given = sum(not _empty(c) for c in cells)
        if given:
            bad(f"{file}: column 'image' names {given} images, but this model takes text only "
                f"(no image): use an image-to-video preset ({', '.join(image_presets())}; "
                f"docs/models.md) or drop the column")
            return []
        return items
    out = []
    for it in items:
        cell = cells[it.row - first_row]
        try:
            out.append(_with_image(it, cell, need))
        except ValueError as e:
            bad(f"{it.source}: {e}")
    return out


def _empty(cell) -> bool:
    return cell is None or (isinstance(cell, str) and not cell.strip()) or cell == b""


def image_presets() -> list[str]:
    """The presets whose model takes an image (for messages)."""
    from .families import PRESETS
    return sorted(p for p, f in PRESETS.items() if f.image)


def _with_image(item, cell, need: str):
    if _empty(cell):
        if need == "required":
            raise ValueError("image is empty; this model animates an image per row (a path, an "
                             "s3:// or gs:// URI, or the image's bytes)")
        return item
    if isinstance(cell, (bytes, bytearray)):
        sha = hashlib.sha256(cell).hexdigest()
        return dataclasses.replace(item, image=BYTES + sha, image_sha256=sha, image_bytes=bytes(cell))
    return dataclasses.replace(item, image=locate(str(cell), item.file))


def _store(ref: str, stores: dict) -> storage.Store:
    """The Store of one object URI; one filesystem per bucket in `stores` (a caller's cache: an
    S3 filesystem is made once, not once per image)."""
    scheme, rest = ref.split("://", 1)
    if scheme.lower() == "file":
        return storage.resolve(ref)
    bucket, _, key = rest.partition("/")
    root = f"{scheme}://{bucket}"
    if root not in stores:
        stores[root] = storage.resolve(root)
    return stores[root].join(key)


def _prepare(refs: list[str], stores: dict) -> None:
    """Make each bucket's filesystem once, on this thread, before threads read through them."""
    for r in refs:
        if "://" in r:
            try:
                _store(r, stores)
            except (OSError, ValueError):
                pass        # the read itself reports it


def _read_ref(ref: str, stores: dict) -> bytes:
    if "://" in ref:
        return _store(ref, stores).read_bytes("")
    with open(ref, "rb") as f:
        return f.read()


def _exists(ref: str, stores: dict) -> bool:
    try:
        if "://" not in ref:
            return os.path.isfile(ref)
        return _store(ref, stores).exists("")
    except (OSError, ValueError):
        return False


def check_sample(items: list, error) -> None:
    """Up to SAMPLE distinct images, spread over the job, looked up; `error` (an exception class)
    raised when none exists. Missing ones among existing ones are logged."""
    first: dict[str, object] = {}
    for it in items:
        if it.image is not None and not it.image.startswith(BYTES):
            first.setdefault(it.image, it)
    if not first:
        return
    refs = list(first)
    picked = [refs[i * len(refs) // SAMPLE] for i in range(SAMPLE)] if len(refs) > SAMPLE else refs
    picked = list(dict.fromkeys(picked))
    stores: dict = {}
    _prepare(picked, stores)
    with ThreadPoolExecutor(min(len(picked), HASH_THREADS)) as pool:
        found = pool.map(lambda r: _exists(r, stores), picked)
        missing = [r for r, ok in zip(picked, found) if not ok]
    if len(missing) == len(picked):
        listed = "\n  ".join(f"{first[r].source}: {r}" for r in missing[:5])
        raise error(f"none of the {len(picked)} images looked up exists (of {len(refs)} named), "
                    f"e.g.\n  {listed}\nrelative paths are relative to the Parquet file that "
                    f"names them; check the paths, the bucket and the credentials")
    for r in missing:
        log.warning("%s: image %s does not exist: that row will fail", first[r].source, r)


def read(item, stores: dict | None = None) -> tuple[bytes, str]:
    """The image's bytes and their sha256 (`stores`: filesystems by bucket, kept by the caller)."""
    if item.image_bytes is not None:
        data = item.image_bytes
    else:
        ref = item.image
        try:
            data = _read_ref(ref, {} if stores is None else stores)
        except FileNotFoundError:
            raise ImageError(f"image {ref}: not found") from None
        except (OSError, ValueError) as e:
            raise ImageError(f"image {ref}: cannot read it ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]})") from None
    return data, hashlib.sha256(data).hexdigest()


def fit(data: bytes, width: int, height: int, name: str = "image"):
    """The decoded image, RGB, resized to cover (width, height) and center-cropped to it."""
    from PIL import Image, UnidentifiedImageError
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{name}: not a decodable image ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'})") from None
    img = img.convert("RGB")
    scale = max(width / img.width, height / img.height)
    size = (max(width, round(img.width * scale)), max(height, round(img.height * scale)))
    img = img.resize(size, Image.LANCZOS)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return img.crop((left, top, left + width, top + height))


def label(item) -> str:
    """How messages name the item's image."""
    return f"image {item.image}" if item.image_bytes is None else "image (bytes)"


def load(item, stores: dict | None = None) -> tuple[object, str]:
    """(fitted PIL image at the item's size, sha256 of its bytes); ImageError if unusable."""
    data, sha = read(item, stores)
    return fit(data, item.width, item.height, label(item)), sha


def placeholder(width: int, height: int):
    """A mid-grey image (the warm-up call of a model that needs one)."""
    from PIL import Image
    return Image.new("RGB", (width, height), (128, 128, 128))


def _hash(ref: str, stores: dict) -> str | None:
    try:
        return hashlib.sha256(_read_ref(ref, stores)).hexdigest()
    except (OSError, ValueError):
        return None


def fill_hashes(items: list, rows: dict) -> list:
    """`items` with `image_sha256` set, for each item with an image (not bytes, already hashed)
    and a recorded row, to its image's current content hash (None if unreadable)."""
    todo = [k for k, it in enumerate(items) if it.image is not None and it.image_sha256 is None
            and it.id in rows]
    if not todo:
        return items
    refs = list(dict.fromkeys(items[k].image for k in todo))
    stores: dict = {}
    _prepare(refs, stores)
    with ThreadPoolExecutor(min(len(refs), HASH_THREADS)) as pool:
        sha = dict(zip(refs, pool.map(lambda r: _hash(r, stores), refs)))
    out = list(items)
    for k in todo:
        out[k] = dataclasses.replace(items[k], image_sha256=sha[items[k].image])
    return out
