"""Prompts in: Parquet files -> validated `Item`s, and the shard plan.

Contract:
- Input is one .parquet file, several, or directories of them (sorted, so the plan is stable;
  a directory named `*.parquet`, Spark's output, is a directory),
  local or on an object store (`s3://`, `gs://`: read on the driver through `runner.io.storage`).
- `Item` is the one definition of a row: its fields' metadata say which are Parquet columns, which
  are integers and which are the parameters an output is made from (`PARAMS`); the column lists,
  the result rows and resume's "made from" comparison derive from it.
- Column `prompt` is required. Optional: `id`, `negative_prompt`, `seed`, `height`, `width`,
  `num_frames`, `num_inference_steps`, `guidance_scale`; absent columns (and null cells) take the
  job's `generation` defaults. `image` (image-to-video models): a path, URI or the image's bytes,
  checked and located by `runner.io.images` (its content hash, `image_sha256`, is what an output is
  made from). Unknown columns are named in one warning line, with the closest
  known name (a misspelt `seeds` would otherwise silently run every row with the default seed);
  with `strict` they are an error. A pandas index written into the file is not a column.
- Text columns (`id`, `prompt`, `negative_prompt`) must be of a string type, or binary holding
  UTF-8, decoded strictly (a row that is not valid UTF-8 is an error naming it): never
  stringified, which would give `b'...'` names. Numbers must be finite: NaN or infinity in any
  cell is an error (a null cell is what takes the default); `guidance_scale` must be >= 0;
  integers must fit int64 (< 2**63: the results table's columns). `num_inference_steps` must be
  within what the model's pipeline runs (`Constraints.min_steps`, `max_steps`: `Family`'s).
- A missing `id` becomes `<file stem>-<row>` (row number within its file): stable across reruns.
  Ids are sanitized into file names (`[A-Za-z0-9._-]`, no leading dot); two rows whose sanitized ids
  collide are an error, so no output can overwrite another. Ids that differ only in case
  (`case_collisions`) are an error only where output.dir folds case (checked by `runner.driver.job`,
  which knows the directory).
- `check_prompts` reads every file once on the driver and raises `PromptError` for anything that
  would fail later (before any model is built): one error listing every bad row (the first
  `MAX_LISTED` as file:row: reason, and the count), so a 50k-row file is fixed in one pass.
  The `prompt` column must be of a string type (an integer column is an error, not stringified).
- A shard is up to `shard_size` consecutive rows of one file still to do, holding their validated
  items: the driver sends them with it, so workers never read the Parquet files.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from . import storage
from ..config import GenerationDefaults, did_you_mean

log = logging.getLogger("runner")
_ID_BAD = re.compile(r"[^A-Za-z0-9._-]")
MAX_ID_LEN = 150
MAX_LISTED = 20          # bad rows shown in one PromptError (all are counted)


class PromptError(ValueError):
    pass


# A row may ask at most this many times the latent positions (size x frames) of its preset's
# published setting: 2x the side of an image, or 4x a video's frames at its size. Past that a row
# runs a GPU out of memory or for hours (issue 60: a 16384x16384 row, 256x PixArt-1024's, held its
# worker until it was killed from outside).
WORK_FACTOR = 4


@dataclass(frozen=True)
class Constraints:
    """What the model accepts, known before it is built."""
    size_factor: int                 # height and width must be multiples of this
    video_length: int | None = None  # video models: the only valid num_frames (Latte)
    frame_step: int | None = None    # video models: num_frames = k * frame_step + 1 (Wan)
    min_steps: int = 1
    max_steps: int | None = None     # the most steps its pipeline runs (`Family.max_steps`)
    image: str | None = None         # image-to-video: "required" | "optional" (`Family.image`)
    # the preset's published (height, width, num_frames or None): a row's work is bounded by it
    published: tuple[int, int, int | None] | None = None
    adapters: tuple[str, ...] = ()   # the names a row's `adapter` may take (per-row adapters)
    # (per-row adapter name or None, `Item.adapters_sha256` of its rows) (`adapters.row_hashes`)
    adapter_hashes: tuple[tuple[str | None, str | None], ...] = ()
    # a step- or guidance-distilled preset's (name, published steps, published guidance): rows
    # asking otherwise run, with a warning (`distilled_warning`)
    distilled: tuple[str, int, float] | None = None

    @property
    def video(self) -> bool:
        """Rows have num_frames (None for image models)."""
        return self.video_length is not None or self.frame_step is not None

    def latents(self, height: int, width: int, frames: int | None) -> int:
        """Latent positions of a row (the denoiser's tokens times its patch area): what its
        memory and time grow with, over its steps."""
        f = self.size_factor
        t = 1
        if self.video and frames:
            t = (frames - 1) // self.frame_step + 1 if self.frame_step else frames
        return max(1, height // f) * max(1, width // f) * t

    @property
    def max_latents(self) -> int | None:
        """The most latent positions a row may ask: `WORK_FACTOR` x the preset's published
        setting's (None: no published setting known)."""
        return WORK_FACTOR * self.latents(*self.published) if self.published else None

    def work_error(self, height: int, width: int, frames: int | None) -> str | None:
        """Why a row of this size is more work than the preset is for, or None."""
        bound = self.max_latents
        if bound is None or self.latents(height, width, frames) <= bound:
            return None
        ph, pw, pf = self.published
        ratio = self.latents(height, width, frames) / self.latents(ph, pw, pf)
        frames_txt = lambda n: f" x {n} frames" if self.video and n else ""   # noqa: E731
        return (f"{height}x{width}{frames_txt(frames)} is {ratio:,.0f}x the work of this model's "
                f"published setting ({ph}x{pw}{frames_txt(pf)}); a row may ask at most "
                f"{WORK_FACTOR}x (it would run a GPU out of memory or for hours, and nothing stops "
                f"a row once it runs): lower height, width" + (" or num_frames (split a long "
                f"video into clips)" if self.video else "") + ", or pick a larger preset")

    def frames_error(self, n: int) -> str | None:
        """Why `n` frames is not valid for this model, or None."""
        if self.video_length is not None and n != self.video_length:
            return f"this model generates exactly {self.video_length} frames (its video_length)"
        if self.frame_step and (n < 1 or (n - 1) % self.frame_step):
            return (f"this model takes k * {self.frame_step} + 1 frames (e.g. "
                    f"{max(1, (n - 1) // self.frame_step * self.frame_step + 1)} or "
                    f"{max(1, (n - 1) // self.frame_step * self.frame_step + 1) + self.frame_step})")
        return None


def _col(kind: str = "param"):
    """An Item field read from a Parquet column: `param` (an output is made from it; absent or null
    cells take the `generation` default of the same name), `int` (a param that must be an
    integer), `text` (a param that must be text), `id` (a text column, not a param)."""
    return field(metadata={"column": True, "param": kind != "id", "int": kind == "int",
                           "text": kind in ("text", "id")})


@dataclass(frozen=True)
class Item:
    """One prompt row, validated. Adding a per-row parameter is adding a field here (and its
    default in config.GenerationDefaults)."""
    id: str = _col("id")
    prompt: str = _col("text")
    negative_prompt: str = _col("text")
    seed: int = _col("int")
    height: int = _col("int")
    width: int = _col("int")
    num_frames: int | None = _col("int")       # None for image models
    num_inference_steps: int = _col("int")
    guidance_scale: float = _col()
    file: str                                  # where the row came from (errors, the results table)
    row: int
    # image-to-video (`runner.io.images`; last, with defaults: text rows leave them out): where the
    # row's image is read from (a column, not a parameter: a moved but unchanged image is the same
    # input), the sha256 of its bytes (the parameter: known on the driver for bytes cells and on a
    # rerun, else filled in by the worker that read it), and a bytes cell's bytes (not in rows)
    image: str | None = field(default=None, metadata={"column": True})
    image_sha256: str | None = field(default=None, metadata={"param": True})
    image_bytes: bytes | None = field(default=None, repr=False, metadata={"row": False})
    # the row's own adapter: the name of one of `model.adapters` with `per_row: true`, fused for
    # this row only (`runner.serve.adapters.Switch`); None: none of them
    adapter: str | None = field(default=None, metadata={"column": True, "param": True})
    # one sha256 of the contents of every adapter the output is made from (`adapters.row_hashes`:
    # the job-wide ones and the row's own), None without adapters: an adapter file replaced under
    # its path remakes the rows made from it, as a changed image does; filled on the driver, and
    # by the worker from the files it fused (a worker that loaded another file says so)
    adapters_sha256: str | None = field(default=None, metadata={"param": True})

    @property
    def source(self) -> str:
        return f"{self.file}:{self.row}"

    def shape_key(self) -> tuple:
        """Items with equal keys can share one batched pipeline call."""
        return (self.height, self.width, self.num_frames, self.num_inference_steps, self.guidance_scale)

    def params(self) -> dict:
        """Every field (but a bytes cell's bytes): the start of this item's result row."""
        return {k: v for k, v in asdict(self).items() if k not in _NOT_IN_ROW}

    def made_from(self) -> tuple:
        """What its output is made from (compared with a recorded row's `PARAMS` on resume)."""
        return tuple(getattr(self, k) for k in PARAMS)


PARAMS = tuple(f.name for f in fields(Item) if f.metadata.get("param"))
OPTIONAL_COLUMNS = tuple(f.name for f in fields(Item)
                         if f.metadata.get("column") and f.name != "prompt")
_INT_COLUMNS = tuple(f.name for f in fields(Item) if f.metadata.get("int"))
_TEXT_COLUMNS = tuple(f.name for f in fields(Item) if f.metadata.get("text"))
KNOWN_COLUMNS = ("prompt", *OPTIONAL_COLUMNS)
_NOT_IN_ROW = tuple(f.name for f in fields(Item) if f.metadata.get("row") is False)


@dataclass(frozen=True, eq=False)
class Shard:
    """Rows of one file in order (consecutive but where rows of another per-row adapter come
    between: `plan_shards`), with their items: what a worker is sent (no lookup back from rows
    to items). `index` numbers it for retries (split rows get new ones)."""
    index: int
    items: tuple[Item, ...]

    @property
    def file(self) -> str:
        return self.items[0].file

    @property
    def start(self) -> int:
        return self.items[0].row

    @property
    def stop(self) -> int:
        return self.items[-1].row + 1

    def __len__(self):
        return len(self.items)


def list_files(paths: tuple[str, ...]) -> list[str]:
    files: list[str] = []
    for p in paths:
        storage.check_or(p, PromptError, "prompts.path")
        if "://" in p:
            files += _list_uri(p)
            continue
        if os.path.isdir(p):
            files += _walk(p)
        elif os.path.isfile(p):
            files.append(p)
        elif os.path.exists(p):      # /dev/zero, a FIFO, a socket: it exists, and is no file
            raise PromptError(f"prompts.path {p!r} is {_kind(p)}, not a Parquet file or a "
                              f"directory of them; set prompts.path to a .parquet file or a "
                              f"directory")
        else:
            raise PromptError(f"prompts.path {p!r} does not exist (relative paths are relative "
                              f"to the current directory {os.getcwd()!r})")
    if len(set(map(os.path.abspath, files))) != len(files):
        raise PromptError(f"prompts.path lists a file twice: {files}")
    return files


def _walk(p: str) -> list[str]:
    """The .parquet files under directory `p`. Files only: a directory named x.parquet (Spark's
    output) is walked, not read whole. Hidden ones (a name starting with "."; macOS writes a
    `._x.parquet` of metadata beside each file copied to a foreign disk) are left out, in one
    line: one such file refused the whole directory (issue 60)."""
    found, hidden = [], []
    for f in sorted(Path(p).rglob("*.parquet")):
        if f.is_file():
            (hidden if any(part.startswith(".") for part in f.relative_to(p).parts)
             else found).append(str(f))
    if hidden:
        log.warning("prompts.path %s: %d hidden .parquet files left out (names starting with "
                    "'.', e.g. macOS's ._* metadata): %s", p, len(hidden), ", ".join(hidden[:3]))
    if not found:
        raise PromptError(f"prompts.path directory {p!r} has no .parquet files"
                          + (f" (only hidden ones: {hidden[0]} ...)" if hidden else ""))
    return [str(f) for f in found]


def _kind(p: str) -> str:
    """What a path that is neither a file nor a directory is, in words."""
    import stat
    mode = os.stat(p).st_mode
    return ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def _list_uri(p: str) -> list[str]:
    """The .parquet files at an s3:// or gs:// location (one object, or every one under a prefix)."""
    try:
        store = storage.resolve(p)
        kind = store.fs.get_file_info(store.base).type
        if kind == pafs.FileType.File:
            return [p]
        found = sorted(n for n in store.list() if n.endswith(".parquet") and not any(
            part.startswith(".") for part in n.split("/"))) \
            if kind == pafs.FileType.Directory else []
    except (OSError, ValueError) as e:
        raise PromptError(f"prompts.path {p!r}: cannot read it ({e}); check the URI and the "
                          f"credentials in the environment (docs/cloud.md)") from e
    if kind == pafs.FileType.NotFound:
        raise PromptError(f"prompts.path {p!r} does not exist")
    if not found:
        raise PromptError(f"prompts.path {p!r} has no .parquet files")
    return [store.uri(n) for n in found]


def _read_table(file: str) -> pa.Table:
    src, fs = file, None
    try:
        if "://" in file:
            store = storage.resolve(file)
            src, fs = store.base, store.fs
        return pq.read_table(src, filesystem=fs)
    except Exception as e:
        dup = _duplicate_columns(src, fs)     # read_table's own message names no fix
        if dup:
            raise PromptError(f"{file!r} has more than one column named {', '.join(dup)}: keep one "
                              f"of each and write the file again (pandas: "
                              f"df.loc[:, ~df.columns.duplicated()])") from e
        raise PromptError(f"cannot read Parquet file {file!r}: {e}") from e


def _duplicate_columns(src: str, fs) -> list[str]:
    """Column names that occur more than once in the file's schema ([] if it cannot be read)."""
    try:
        names = pq.read_schema(src, filesystem=fs).names
    except Exception:
        return []
    return sorted({repr(n) for n in names if names.count(n) > 1})


def sanitize_id(raw: str) -> str:
    """`raw` in file-name characters, at most `MAX_ID_LEN`. A longer id keeps its first
    characters and a hash of the whole: two long ids that differ only past the cut (a path, a
    URL with a query) stay two ids, not "the same id" (issue 60)."""
    s = _ID_BAD.sub("_", raw.strip()).lstrip(".")
    if len(s) <= MAX_ID_LEN:
        return s
    return f"{s[:MAX_ID_LEN - 13]}-{hashlib.sha256(s.encode()).hexdigest()[:12]}"


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t) or \
        (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))


def _is_binary(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or \
        pa.types.is_fixed_size_binary(t) or \
        (hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(t))


def _decode_text(table: pa.Table, file: str, first_row: int, bad) -> pa.Table | None:
    """`table` with its text columns as strings: binary ones decoded as UTF-8, strictly. None (each
    problem passed to `bad`) if a text column is of another type or holds bytes that are not
    UTF-8: stringifying would turn b"x" into the text "b'x'" (an id, a file name, a prompt)."""
    ok = True
    for c in _TEXT_COLUMNS:
        if c not in table.column_names:
            continue
        t = table.schema.field(c).type
        if _is_text(t):
            continue
        if not _is_binary(t):
            bad(f"{file}: column {c!r} has type {t}; it must be text (string, or binary holding "
                f"UTF-8){' (ids name the output files)' if c == 'id' else ''}; convert it, "
                f"e.g. df[{c!r}] = df[{c!r}].astype(str)")
            ok = False
            continue
        col = table.column(c)
        try:
            text = col.cast(pa.string())        # Arrow validates UTF-8 and raises on the first bad value
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            found = 0
            for i, v in enumerate(col.to_pylist()):
                try:
                    if v is not None:
                        bytes(v).decode("utf-8")
                except UnicodeDecodeError as e:
                    bad(f"{file}:{first_row + i}: column {c!r} is binary and this value is not "
                        f"UTF-8 text ({bytes(v)[:40]!r}: {e.reason} at byte {e.start}); write the "
                        f"column as strings")
                    found += 1
            if not found:                       # a type the cast does not handle: decode here
                text = pa.array([None if v is None else bytes(v).decode("utf-8")
                                 for v in col.to_pylist()], pa.string())
            else:
                ok = False
                continue
        table = table.set_column(table.schema.get_field_index(c), c, text)
    return table if ok else None


def _unknown_columns(table: pa.Table) -> list[str]:
    """Columns that are not an Item field. A pandas index stored in the file (`df.to_parquet` of
    a filtered frame writes `__index_level_0__`) is the writer's, not the user's."""
    index = set()
    meta = table.schema.pandas_metadata or {}
    for c in meta.get("index_columns", []):
        if isinstance(c, str):
            index.add(c)
    return [c for c in table.column_names if c not in KNOWN_COLUMNS and c not in index]


def _unknown_message(unknown: dict[str, list[str]]) -> str:
    """One line naming each unknown column, the closest known name and where it is."""
    def where(files):
        return files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"

    same = len({tuple(f) for f in unknown.values()}) == 1        # the usual case: one file
    parts = []
    for c, files in unknown.items():
        hint = difflib.get_close_matches(c, KNOWN_COLUMNS, n=1)
        parts.append(f"{c!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                     + ("" if same else f" in {where(files)}"))
    return (f"unknown prompt column{'s' if len(parts) > 1 else ''} "
            + (f"in {where(next(iter(unknown.values())))}: " if same else "")
            + f"{', '.join(parts)}; known columns: {', '.join(KNOWN_COLUMNS)}")


def _items_from_table(table: pa.Table, file: str, first_row: int, gen: GenerationDefaults,
                      limits: Constraints, on_empty: str, errors: list[str] | None = None) -> list[Item]:
    """The table's valid items. Bad rows raise `PromptError`, or, given `errors`, are appended to
    it as "file:row: reason" (the caller reports them all at once)."""
    def bad(msg: str):
        if errors is None:
            raise PromptError(msg)
        errors.append(msg)

    if "prompt" not in table.column_names:
        bad(f"{file}: no 'prompt' column (columns: {table.column_names}); "
            f"required: prompt; optional: {list(OPTIONAL_COLUMNS)}")
        return []
    table = _decode_text(table, file, first_row, bad)
    if table is None:
        return []
    fast = _fast_items(table, file, first_row, gen, limits, on_empty)
    if fast is not None:
        return _with_images(table, file, first_row, fast, limits, bad)
    cols = {c: table.column(c).to_pylist() for c in ("prompt", *OPTIONAL_COLUMNS)
            if c in table.column_names}
    stem = Path(file).stem
    items = []
    for i in range(table.num_rows):
        try:
            item = _row_item(cols, i, first_row + i, file, stem, gen, limits, on_empty)
        except PromptError as e:
            bad(str(e))
            continue
        if item is not None:
            items.append(item)
    return _with_images(table, file, first_row, items, limits, bad)


def _with_images(table, file, first_row, items, limits: Constraints, bad) -> list[Item]:
    items = _with_adapters(table, file, first_row, items, limits, bad)
    if "image" not in table.column_names and limits.image != "required":
        return items
    from . import images
    return images.attach(table, file, first_row, items, limits.image, bad)


def _with_adapters(table, file, first_row, items, limits: Constraints, bad) -> list[Item]:
    """The `adapter` column: each cell null or the name of a per-row adapter of the job; each
    item's `adapters_sha256` (`Constraints.adapter_hashes`)."""
    sha = dict(limits.adapter_hashes)
    if "adapter" not in table.column_names:
        return [replace(it, adapters_sha256=sha[None]) for it in items] if sha.get(None) else items
    cells = table.column("adapter").to_pylist()
    out = []
    for it in items:
        name = cells[it.row - first_row]
        if name is not None and name not in limits.adapters:
            bad(f"{file}:{it.row}: adapter={name!r} is not a per-row adapter of this job"
                f"{did_you_mean(name, limits.adapters)}; "
                f"model.adapters with per_row: true name {list(limits.adapters)} (null: none)")
            continue
        h = sha.get(name)
        out.append(replace(it, adapter=name, adapters_sha256=h)
                   if name is not None or h is not None else it)
    return out


def _fast_items(table: pa.Table, file: str, first_row: int, gen: GenerationDefaults,
                limits: Constraints, on_empty: str) -> list[Item] | None:
    """The same items as the row-by-row path, checked column-wise with pyarrow compute (a million
    rows in seconds, not tens of seconds). None if any row might be bad, or a column is of a type
    this path does not handle: the row-by-row path then finds (and words) every error."""
    import pyarrow.compute as pc
    n = table.num_rows
    if n == 0:
        return []
    names = set(table.column_names)

    def column(name, default, check_type):
        if name not in names:
            return pa.repeat(default, n) if default is not None else pa.nulls(n)
        c = table.column(name).combine_chunks()
        if not check_type(c.type):
            raise _Slow
        return c.fill_null(default) if default is not None else c

    try:
        prompt = column("prompt", None, _is_text)
        if prompt.null_count or not pc.all(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(
                prompt.cast(pa.string()))), 0)).as_py():
            raise _Slow                                   # null/empty prompts: skip or error
        ints = {c: column(c, getattr(gen, c), pa.types.is_integer) for c in _INT_COLUMNS}
        guidance = column("guidance_scale", float(gen.guidance_scale),
                          lambda t: pa.types.is_integer(t) or pa.types.is_floating(t))
        g = pc.cast(guidance, pa.float64())
        if not pc.all(pc.and_(pc.is_finite(g), pc.greater_equal(g, 0))).as_py():
            raise _Slow                                   # NaN, inf, negative: worded row by row
        if not isinstance(gen.negative_prompt, str):
            raise _Slow
        negative = column("negative_prompt", gen.negative_prompt, _is_text)
        raw_ids = column("id", None, _is_text) if "id" in names else None
        f = limits.size_factor
        ok = [pc.all(pc.and_(pc.greater(ints[k], 0), pc.equal(pc.bit_wise_and(ints[k], f - 1), 0)
                             if f & (f - 1) == 0 else pc.equal(pc.subtract(ints[k], pc.multiply(
                                 pc.divide(ints[k], f), f)), 0))) for k in ("height", "width")]
        ok.append(pc.all(pc.greater_equal(ints["num_inference_steps"], limits.min_steps)))
        if limits.max_steps is not None:
            ok.append(pc.all(pc.less_equal(ints["num_inference_steps"], limits.max_steps)))
        ok.append(pc.all(pc.greater_equal(ints["seed"], 0)))
        if limits.video:
            ok.append(pc.all(pc.greater(ints["num_frames"], 0)))
            if limits.video_length is not None:
                ok.append(pc.all(pc.equal(ints["num_frames"], limits.video_length)))
            if limits.frame_step:   # (n - 1) % step == 0
                left = pc.subtract(ints["num_frames"], 1)
                ok.append(pc.all(pc.equal(pc.subtract(left, pc.multiply(
                    pc.divide(left, limits.frame_step), limits.frame_step)), 0)))
        ok += [pc.all(pc.less(c, 2**63)) for c in ints.values() if pa.types.is_uint64(c.type)]
        if limits.max_latents is not None:   # the largest of each: a bound on every row's work
            big = [pc.max(ints[k]).as_py() for k in ("height", "width")]
            frames = pc.max(ints["num_frames"]).as_py() if limits.video else None
            ok.append(pa.scalar(limits.work_error(*big, frames) is None))
        if not all(x.as_py() for x in ok):
            raise _Slow
    except (_Slow, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    rows = range(first_row, first_row + n)
    if raw_ids is None:
        stem = Path(file).stem
        ids = [f"{stem}-{r:06d}" for r in rows]
    else:
        ids = []
        for raw in raw_ids.to_pylist():
            if raw is None:
                return None                               # mixed: the row-by-row path words it
            ids.append(sanitize_id(raw))
        if not all(ids):
            return None
    frames = ints["num_frames"].to_pylist() if limits.video else [None] * n
    columns = {"id": ids, "prompt": prompt.cast(pa.string()).to_pylist(),
               "negative_prompt": negative.cast(pa.string()).to_pylist(),
               "guidance_scale": pc.cast(guidance, pa.float64()).to_pylist(),
               **{k: ints[k].to_pylist() for k in _INT_COLUMNS}, "num_frames": frames,
               "file": [file] * n, "row": rows}
    # in field order; the image fields (last, with defaults) are set by _with_images
    return list(map(Item, *(columns[f.name] for f in fields(Item) if f.name in columns)))


class _Slow(Exception):
    """A column the fast path leaves to the row-by-row one."""


def _row_item(cols: dict, i: int, row: int, file: str, stem: str, gen: GenerationDefaults,
              limits: Constraints, on_empty: str) -> Item | None:
    """Row `i` of `cols` as an Item; None for a skipped empty prompt; PromptError if bad."""
    where = f"{file}:{row}"

    def get(col, default):
        v = cols[col][i] if col in cols else None
        return default if v is None else v       # null takes the default; NaN is an error (below)

    prompt = cols["prompt"][i]
    if prompt is None or not str(prompt).strip():
        if on_empty == "skip":
            return None
        raise PromptError(f"{where}: prompt is null or empty (set prompts.on_empty=skip to "
                          f"skip such rows)")
    raw_id = get("id", None)
    item_id = sanitize_id(str(raw_id)) if raw_id is not None else f"{stem}-{row:06d}"
    if not item_id:
        raise PromptError(f"{where}: id {raw_id!r} is empty after sanitizing to file-name "
                          f"characters [A-Za-z0-9._-]")
    values = {}
    for col in _INT_COLUMNS:
        v = get(col, getattr(gen, col))
        if isinstance(v, float) and not math.isfinite(v):
            raise PromptError(f"{where}: {col}={v} is not a finite number (a null cell takes "
                              f"generation.{col})")
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise PromptError(f"{where}: {col}={v!r} must be an integer")
        values[col] = v
    try:
        guidance = float(get("guidance_scale", gen.guidance_scale))
    except (TypeError, ValueError):
        raise PromptError(f"{where}: guidance_scale={cols['guidance_scale'][i]!r} is not a number")
    if not math.isfinite(guidance):
        raise PromptError(f"{where}: guidance_scale={guidance} is not a finite number (a null cell "
                          f"takes generation.guidance_scale)")
    item = Item(id=item_id, prompt=str(prompt), negative_prompt=str(get("negative_prompt", gen.negative_prompt)),
                seed=values["seed"], height=values["height"], width=values["width"],
                num_frames=values["num_frames"] if limits.video else None,
                num_inference_steps=values["num_inference_steps"], guidance_scale=guidance,
                file=file, row=row)
    _check_item(item, limits)
    return item


def _check_item(item: Item, limits: Constraints) -> None:
    where = item.source
    why = limits.work_error(item.height, item.width, item.num_frames)
    if why:     # first: a row of 10,000 frames is too long before it is a wrong frame count
        raise PromptError(f"{where} (id {item.id!r}): {why}")
    g = item.guidance_scale
    if not math.isfinite(g) or g < 0:
        raise PromptError(f"{where}: guidance_scale={g} must be a finite number >= 0 (<= 1: no "
                          f"classifier-free guidance)")
    for k in ("height", "width"):
        v = getattr(item, k)
        if v <= 0 or v % limits.size_factor:
            raise PromptError(f"{where}: {k}={v} must be a positive multiple of "
                              f"{limits.size_factor} for this model")
    why = limits.frames_error(item.num_frames) if limits.video else None
    if why:
        raise PromptError(f"{where}: num_frames={item.num_frames}, but {why}")
    if item.num_inference_steps < limits.min_steps:
        raise PromptError(f"{where}: num_inference_steps={item.num_inference_steps} must be >= "
                          f"{limits.min_steps} for this model")
    if limits.max_steps is not None and item.num_inference_steps > limits.max_steps:
        # the id too: a row past the bound is a typo, looked up by its id
        raise PromptError(f"{where} (id {item.id!r}): num_inference_steps={item.num_inference_steps} "
                          f"must be <= {limits.max_steps} for this model (its scheduler's limit: "
                          f"docs/models.md, \"Step limits\")")
    if not 0 <= item.seed < 2**63:
        raise PromptError(f"{where}: seed={item.seed} must be in [0, 2**63)")
    for k in ("height", "width", "num_frames", "num_inference_steps"):
        v = getattr(item, k)     # a uint64 or float cell: results.parquet's columns are int64
        if v is not None and v >= 2**63:
            raise PromptError(f"{where}: {k}={v} must be < 2**63")


def _check_defaults(gen: GenerationDefaults, limits: Constraints) -> None:
    """The config's `generation.*` defaults against the model, once: a bad default is the key's
    error, not one error per prompt row that uses it."""
    probe = Item(id="-", prompt="-", negative_prompt=gen.negative_prompt, seed=gen.seed,
                 height=gen.height, width=gen.width,
                 num_frames=gen.num_frames if limits.video else None,
                 num_inference_steps=gen.num_inference_steps, guidance_scale=gen.guidance_scale,
                 file="generation", row=0)
    try:
        _check_item(probe, limits)
    except PromptError as e:
        what = str(e).split(": ", 1)[-1]
        raise PromptError(f"generation.{what} (a default of the config, for prompt rows that leave "
                          f"that column out): set generation.{what.split('=')[0]} on the command "
                          f"line or in the job file") from None


def check_prompts(paths: tuple[str, ...], gen: GenerationDefaults, limits: Constraints,
                  on_empty: str, strict: bool = False, max_image_bytes: int = 64 << 20,
                  ) -> tuple[list[str], dict[str, int], list[Item]]:
    """Read and validate every prompt. Returns (files, raw row count per file, items). Unknown
    columns: one warning line, or with `strict` an error (`prompts.strict`). Image rows: a sample
    of the images looked up (`images.check_sample`: `images.StoreUnreachable` when their store
    does not answer)."""
    _check_defaults(gen, limits)
    files = list_files(paths)
    rows, items, seen, errors = {}, [], {}, []
    unknown: dict[str, list[str]] = {}
    for f in files:
        try:
            table = _read_table(f)
        except PromptError as e:
            errors.append(str(e))
            continue
        rows[f] = table.num_rows
        for c in _unknown_columns(table):
            unknown.setdefault(c, []).append(f)
        for item in _items_from_table(table, f, 0, gen, limits, on_empty, errors):
            if item.id in seen:
                errors.append(f"{item.source}: id {item.id!r} (after sanitizing) is also used by "
                              f"{seen[item.id].source}; ids must be unique, they name the output files")
                continue
            seen[item.id] = item
            items.append(item)
    if unknown and strict:
        errors.insert(0, f"{_unknown_message(unknown)}; rename or drop them, or set "
                         f"prompts.strict=false to ignore them with a warning")
    elif unknown:
        log.warning("%s; ignored (prompts.strict=true makes this an error)", _unknown_message(unknown))
    if len(errors) == 1:
        raise PromptError(errors[0])
    if errors:
        raise PromptError(f"{len(errors)} bad prompt rows or files (the first {min(len(errors), MAX_LISTED)} "
                          f"below); fix them and rerun:\n  " + "\n  ".join(errors[:MAX_LISTED]))
    if not items:
        raise PromptError(f"no prompts to run in {files}")
    if limits.image:
        from . import images
        images.check_sample(items, PromptError, max_image_bytes)
    why = distilled_warning(items, limits.distilled)
    if why:
        log.warning("%s", why)
    return files, rows, items


def distilled_warning(items: list[Item], distilled: tuple[str, int, float] | None) -> str | None:
    """Rows of a distilled preset asking for other steps or guidance, counted in one line."""
    if distilled is None:
        return None
    preset, steps, guidance = distilled
    other_steps = sum(it.num_inference_steps != steps for it in items)
    cfg = sum(it.guidance_scale > guidance for it in items)
    if not other_steps and not cfg:
        return None
    asked = [f"{other_steps} rows other than {steps} steps"] if other_steps else []
    asked += [f"{cfg} rows guidance above {guidance:g} (a second denoiser call a step)"] if cfg else []
    return (f"{preset} is distilled for {steps} steps at guidance {guidance:g}; "
            f"{' and '.join(asked)}: they run, but not as the model was trained (outputs "
            f"blurred or burnt, no better than at {steps} steps)")


def case_collisions(items: list[Item]) -> list[tuple[Item, Item]]:
    """Pairs of items whose ids differ only in case ("Fox", "fox"): (an earlier item, the later
    one), one pair per later item. One dict of folded ids, cheap for a million rows. Sanitized ids
    are ASCII, so folding here is what every case-insensitive filesystem does to them."""
    first: dict[str, Item] = {}
    pairs = []
    for it in items:
        seen = first.setdefault(it.id.casefold(), it)
        if seen is not it:
            pairs.append((seen, it))
    return pairs


def plan_shards(items: list[Item], shard_size: int, done: set[str] = frozenset()) -> list[Shard]:
    """Shards over each file's rows still to do (`done` ids are left out: resume), each holding
    its items: a file's rows of one per-row adapter (None: none) in order, up to `shard_size`,
    a done row ending a run. Rows interleaving adapters row by row still make full shards (a
    shard per adapter switch was 4.9x slower); each output is named by its row's id, never by
    its shard."""
    groups: dict[tuple, list[Item]] = {}     # (file, adapter) -> its rows, in order
    for it in items:
        groups.setdefault((it.file, it.adapter), []).append(it)
    runs: list[tuple[Item, ...]] = []
    for group in groups.values():
        run: list[Item] = []
        for it in group:
            if it.id in done:
                if run:              # a done row ends a run, as it always did
                    runs.append(tuple(run))
                    run = []
                continue
            if len(run) == shard_size:
                runs.append(tuple(run))
                run = []
            run.append(it)
        if run:
            runs.append(tuple(run))
    # shards of one per-row adapter handed out together: a worker switches adapters rarely
    runs.sort(key=lambda r: r[0].adapter or "")
    return [Shard(i, r) for i, r in enumerate(runs)]
