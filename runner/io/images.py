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
- `check_sample(items, error, max_bytes)` (driver, once per job): looks up to `SAMPLE` distinct
  images (one stat each, all at once, `LOOKUP_S` in all, a line after `WAIT_NOTE_S` naming the
  store waited for). A store that answers none of its lookups (timed out, refused, DNS:
  `storage.unreachable`) is `StoreUnreachable` (exit 3, naming the store); `error` (exit 2) when
  none of the images can be used, which is a wrong base path, bucket or mount rather than a
  missing file; unusable ones among usable ones are logged (those rows will fail). Every image
  is not looked up: a million-row job would spend its start in stats.
- Causes as they are, the same words at the lookup and the read: "not found" only for a missing
  file or object; a directory (an object store's prefix), a FIFO, a device (`/dev/zero`), a
  socket, a symlink loop, permission denied, an image over `max_bytes`
  (`prompts.max_image_mib`), the store not answering. Nothing is read into memory before its
  kind and size are known: a local file is opened without blocking and checked on the open
  descriptor; an object's size comes with the request that opens it.
- `read(item, stores, max_bytes) -> (bytes, sha256 hex)`, `fit(data, width, height) -> PIL.Image`
  (worker): raise `ImageError` naming the image and why (the causes above, not a decodable
  image), or `InputStoreFault` naming the store when the store itself did not answer (the job's
  fault, not the row's: the worker reports it so, and the job stops). The image
  is resized to cover width x height (Lanczos) and center-cropped to it: no distortion, the
  row's own size (the crop of diffusers' Wan docs, `center_crop_resize`, and of Wan 2.2's own
  image-to-video code). A missing or undecodable image fails its row only (`runner.serve.worker`).
- The content hash is what an output was made from (`prompts.Item.image_sha256`, one of
  `prompts.PARAMS`): the worker records the hash of the bytes it read; on a rerun
  `fill_hashes(items, rows)` (driver, before the resume plan) hashes the current image of every
  row that has a recorded result, so an edited image (same path) is regenerated and an unchanged
  one (even at a new path) is not. Unreadable now: None, so the row is redone (and fails, named).
  This reads those images once per rerun, in `HASH_THREADS` threads.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from . import storage

log = logging.getLogger("runner")

SCHEMES = ("s3", "gs", "file")
SAMPLE = 16              # images the driver looks up before a job starts
HASH_THREADS = 16        # reads in flight when hashing images for a rerun's plan
BYTES = "bytes:"         # prefix of the `image` of a bytes cell: "bytes:<sha256 hex>"
MAX_BYTES = 64 << 20     # the largest image read (prompts.max_image_mib's default)
LOOKUP_S = storage.OP_TIMEOUT_S   # the driver's lookups of a sample, at most, in all
WAIT_NOTE_S = 2.0        # a lookup slower than this: a line says what the job waits for
NO_ANSWER = f"the store did not answer in time (no answer in {LOOKUP_S:.0f} s)"
NO_ANSWER_LOCAL = f"no answer from the file system in {LOOKUP_S:.0f} s (a stalled mount?)"


class ImageError(ValueError):
    """An image that cannot be used: fails its row, with this message as the reason."""


class InputStoreFault(OSError):
    """The store an image is read from did not answer a worker's read (timed out, refused, a host
    name that does not resolve): the store's fault, not the row's. The worker hands it to the
    driver as such (`runner.serve.worker`), and the dispatcher stops the job (exit 3) instead of
    failing every row that reads from that store (issue 60: 36 of 40 rows burnt in 192 s)."""


# How a worker's row says its input store failed it (the start of the row's error): the
# dispatcher stops the job on such a row and records it not (`runner.driver.dispatch`).
INPUT_FAULT = f"{InputStoreFault.__name__}: "


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
    from ..families import PRESETS
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


def _is_object(ref: str) -> bool:
    """An s3:// or gs:// image (not a local path or file://)."""
    return "://" in ref and not ref.lower().startswith("file://")


def _local(ref: str) -> str:
    return urlsplit(ref).path if "://" in ref else ref


def _store(ref: str, stores: dict) -> storage.Store:
    """The Store of one object URI; one filesystem per bucket in `stores` (a caller's cache: an
    S3 filesystem is made once, not once per image)."""
    scheme, rest = ref.split("://", 1)
    bucket, _, key = rest.partition("/")
    root = f"{scheme}://{bucket}"
    if root not in stores:
        stores[root] = storage.resolve(root)
    return stores[root].join(key)


def _prepare(refs: list[str], stores: dict) -> None:
    """Make each bucket's filesystem once, on this thread, before threads read through them."""
    for r in refs:
        if _is_object(r):
            try:
                _store(r, stores)
            except (OSError, ValueError):
                pass        # the read itself reports it


def _mib(n: int) -> str:
    if n % 2**20 == 0:
        return f"{n >> 20} MiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 else f"{n} bytes"


def _too_large(size: int, max_bytes: int) -> str:
    """The cause of an image over the bound. Its size goes on a line of its own: failures group
    by their first line (`results.error_cause`), and each image's size differs."""
    return (f"larger than prompts.max_image_mib ({_mib(max_bytes)}): not read; shrink it or raise "
            f"the setting\nits size: {_mib(size)}" + (f" ({size} bytes)" if size >= 2**20 // 10 else ""))


def _not_a_file(mode: int) -> str | None:
    """Why a local path of this `st_mode` is not an image file, or None for a regular file: a
    read of a directory fails, of a FIFO waits for a writer, of /dev/zero never ends."""
    if stat.S_ISREG(mode):
        return None
    kind = ("a directory" if stat.S_ISDIR(mode) else
            "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else
            "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a file")
    return f"{kind}, not a regular file: not read"


def _os_cause(e: Exception) -> str:
    """A local lookup's or read's error in plain words ("not found" only for a missing file)."""
    if isinstance(e, FileNotFoundError):
        return "not found"
    if isinstance(e, PermissionError):
        return "permission denied (not readable by this process)"
    code = getattr(e, "errno", None)
    if code == errno.ELOOP:
        return "a symlink loop (too many levels of symbolic links)"
    if code == errno.ENOTDIR:
        return "not found (a part of its path is a file, not a directory)"
    return f"cannot read it ({type(e).__name__}: {getattr(e, 'strerror', None) or first_line(e)})"


def _store_cause(e: BaseException) -> str:
    """An object store's error in plain words: the store's own state (no answer, refused, DNS),
    or access denied, or what it said."""
    why = storage.unreachable(e)
    if why:
        return f"the store {why}"
    text = str(e)
    if isinstance(e, PermissionError) or "ACCESS_DENIED" in text or "AccessDenied" in text:
        return "access denied by the store (check the credentials)"
    return f"cannot read it ({type(e).__name__}: {first_line(e)})"


def first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:200]


def _read_local(ref: str, max_bytes: int) -> bytes:
    """A local file's bytes, refused before reading when it is not a regular file or is over
    `max_bytes`. Opened without blocking (a FIFO's open would wait for a writer), then checked
    on the open file: what is read is what was checked."""
    fd = os.open(ref, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        why = _not_a_file(st.st_mode) or (
            _too_large(st.st_size, max_bytes) if st.st_size > max_bytes else None)
        if why:
            raise ImageError(why)
        f = os.fdopen(fd, "rb")             # owns the descriptor from here
    except BaseException:
        os.close(fd)
        raise
    with f:
        data = f.read(max_bytes + 1)        # a file that grew since: still bounded
    if len(data) > max_bytes:
        raise ImageError(_too_large(len(data), max_bytes))
    return data


def _read_object(ref: str, stores: dict, max_bytes: int) -> bytes:
    store = _store(ref, stores)
    try:
        return store.read_bytes("", max_bytes)
    except storage.TooLarge as e:
        raise ImageError(_too_large(e.size, max_bytes)) from None
    except FileNotFoundError:
        # a missing key, or a prefix of other objects (S3 says "does not exist" for both)
        try:
            directory = store.info("").type == pafs.FileType.Directory
        except (OSError, ValueError):
            directory = False
        raise ImageError("a directory (a prefix of other objects), not an object: not read"
                         if directory else "not found") from None
    except (OSError, ValueError) as e:
        why = storage.unreachable(e)
        if why:
            raise InputStoreFault(f"the image store {_root(ref)}: {why}, reading {ref}") from None
        raise ImageError(_store_cause(e)) from None


def _read_ref(ref: str, stores: dict, max_bytes: int) -> bytes:
    """The bytes of the image at `ref`; `ImageError` saying why not (without the image's name)."""
    if _is_object(ref):
        return _read_object(ref, stores, max_bytes)
    try:
        return _read_local(_local(ref), max_bytes)
    except OSError as e:
        raise ImageError(_os_cause(e)) from None


def _look_up(ref: str, stores: dict, max_bytes: int) -> str | None:
    """None when the image at `ref` can be read as far as one stat tells (it exists, is a file,
    not over `max_bytes`); else why not, in the words of `read`'s errors."""
    try:
        if _is_object(ref):
            info = _store(ref, stores).info("")
            if info.type == pafs.FileType.NotFound:
                return "not found"
            if info.type == pafs.FileType.Directory:
                return "a directory (a prefix of other objects), not an object: not read"
            size = info.size or 0
        else:
            path = _local(ref)
            st = os.stat(path)
            why = _not_a_file(st.st_mode)
            if why:
                return why
            if not os.access(path, os.R_OK):
                return "permission denied (not readable by this process)"
            size = st.st_size
    except (OSError, ValueError) as e:
        return _store_cause(e) if _is_object(ref) else _os_cause(e)
    return _too_large(size, max_bytes) if size > max_bytes else None


def _root(ref: str) -> str:
    """The store an image is on: `scheme://bucket`, or "local files"."""
    if _is_object(ref):
        scheme, rest = ref.split("://", 1)
        return f"{scheme}://{rest.split('/', 1)[0]}"
    return "local files"


def _look_up_all(refs: list[str], max_bytes: int) -> dict[str, str | None]:
    """`_look_up` of each ref, at once on daemon threads, within `LOOKUP_S` in all: a ref with no
    answer by then has the cause `NO_ANSWER` (`NO_ANSWER_LOCAL` for a local file). The threads
    of a stalled store are left to end on their own (a call cannot be cancelled, as in
    `storage.call_within`). Past `WAIT_NOTE_S` a line says what is waited for."""
    stores: dict = {}
    _prepare(refs, stores)
    box: dict[str, str | None] = {}
    done = threading.Event()
    lock = threading.Lock()

    def one(ref):
        why = _look_up(ref, stores, max_bytes)
        with lock:
            box[ref] = why
            if len(box) == len(refs):
                done.set()

    for r in refs:
        threading.Thread(target=one, args=(r,), name="image-lookup", daemon=True).start()
    start = time.monotonic()
    if not done.wait(WAIT_NOTE_S):
        with lock:
            waiting = sorted({_root(r) for r in refs if r not in box})
        log.info("waiting for %s to answer the lookup of the job's images (up to %.0f s)",
                 ", ".join(waiting), LOOKUP_S)
        done.wait(max(0.0, LOOKUP_S - (time.monotonic() - start)))
    with lock:
        return {r: box[r] if r in box else NO_ANSWER if _is_object(r) else NO_ANSWER_LOCAL
                for r in refs}


class StoreUnreachable(RuntimeError):
    """The store of the job's images did not answer the driver's lookups (exit 3, naming it)."""


def check_sample(items: list, error, max_bytes: int = MAX_BYTES) -> None:
    """Up to SAMPLE distinct images, spread over the job, looked up (one stat each, `_look_up`):
    `StoreUnreachable` when a store answered none of its lookups (timed out, refused, DNS);
    `error` (an exception class) when none of the images can be read, each with its cause;
    otherwise each unusable one is logged with its cause (its row will fail)."""
    first: dict[str, object] = {}
    for it in items:
        if it.image is not None and not it.image.startswith(BYTES):
            first.setdefault(it.image, it)
    if not first:
        return
    refs = list(first)
    picked = [refs[i * len(refs) // SAMPLE] for i in range(SAMPLE)] if len(refs) > SAMPLE else refs
    picked = list(dict.fromkeys(picked))
    causes = _look_up_all(picked, max_bytes)
    for root in dict.fromkeys(map(_root, picked)):
        mine = [r for r in picked if _root(r) == root]
        down = [causes[r] for r in mine if (causes[r] or "").startswith("the store ")]
        if root != "local files" and len(down) == len(mine):
            raise StoreUnreachable(
                f"the image store {root}: {down[0][len('the store '):]} (looked up {len(mine)} "
                f"of the job's images there, e.g. {first[mine[0]].source}: {mine[0]}); check "
                f"the store's endpoint, the network and the store itself (docs/cloud.md), then "
                f"rerun")
    bad = [r for r in picked if causes[r] is not None]
    if len(bad) == len(picked):
        listed = "\n  ".join(f"{first[r].source}: image {r}: {causes[r].splitlines()[0]}"
                             for r in bad[:5])
        hint = ("; relative paths are relative to the Parquet file that names them: check the "
                "paths, the bucket and the credentials" if any(causes[r] == "not found" for r in bad)
                else "")
        raise error(f"none of the {len(picked)} images looked up can be read (of {len(refs)} "
                    f"named), e.g.\n  {listed}\nfix the images{hint}")
    _warn_grouped(bad, causes, first, len(picked))


def _warn_grouped(bad: list[str], causes: dict, first: dict, looked_up: int) -> None:
    """The unusable images of the sample, one line per cause (how many, the first few): 38
    missing images were 38 lines before the job started (issue 60)."""
    groups: dict[str, list[str]] = {}
    for r in bad:
        groups.setdefault(causes[r].splitlines()[0], []).append(r)
    for cause, refs in groups.items():
        shown = ", ".join(f"{first[r].source}: image {r}" for r in refs[:3])
        log.warning("%d of the %d images looked up: %s (their rows will fail): %s%s",
                    len(refs), looked_up, cause, shown, " ..." if len(refs) > 3 else "")


def read(item, stores: dict | None = None, max_bytes: int = MAX_BYTES) -> tuple[bytes, str]:
    """The image's bytes and their sha256 (`stores`: filesystems by bucket, kept by the caller);
    `ImageError` naming the image and why not (not found, a directory, too large, ...)."""
    if item.image_bytes is not None:
        data = item.image_bytes
        if len(data) > max_bytes:
            raise ImageError(f"image (bytes): {_too_large(len(data), max_bytes)}")
    else:
        try:
            data = _read_ref(item.image, {} if stores is None else stores, max_bytes)
        except ImageError as e:
            raise ImageError(f"image {item.image}: {e}") from None
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


def load(item, stores: dict | None = None, max_bytes: int = MAX_BYTES) -> tuple[object, str]:
    """(fitted PIL image at the item's size, sha256 of its bytes); ImageError if unusable."""
    data, sha = read(item, stores, max_bytes)
    return fit(data, item.width, item.height, label(item)), sha


def placeholder(width: int, height: int):
    """A mid-grey image (the warm-up call of a model that needs one)."""
    from PIL import Image
    return Image.new("RGB", (width, height), (128, 128, 128))


def _hash(ref: str, stores: dict, max_bytes: int) -> str | None:
    try:
        return hashlib.sha256(_read_ref(ref, stores, max_bytes)).hexdigest()
    except (OSError, ValueError):           # ImageError is a ValueError
        return None


def fill_hashes(items: list, rows: dict, max_bytes: int = MAX_BYTES) -> list:
    """`items` with `image_sha256` set, for each item with an image (not bytes, already hashed)
    and a recorded row, to its image's current content hash (None if unreadable or over
    `max_bytes`: the row is redone, and fails naming why)."""
    todo = [k for k, it in enumerate(items) if it.image is not None and it.image_sha256 is None
            and it.id in rows]
    if not todo:
        return items
    refs = list(dict.fromkeys(items[k].image for k in todo))
    stores: dict = {}
    _prepare(refs, stores)
    with ThreadPoolExecutor(min(len(refs), HASH_THREADS)) as pool:
        sha = dict(zip(refs, pool.map(lambda r: _hash(r, stores, max_bytes), refs)))
    out = list(items)
    for k in todo:
        out[k] = dataclasses.replace(items[k], image_sha256=sha[items[k].image])
    return out
