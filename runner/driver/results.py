"""The job's record of finished items, durable across driver crashes, and resume.

Contract:
- The record is a set of small objects under `records/` in the job directory (a local directory or
  an object store: one mechanism for both, since object stores cannot append or rename). When a
  shard's rows arrive, the driver writes them as ONE new JSONL object,
  `records/<run>-<seq>.jsonl`, atomically (`storage.Store.write_bytes_atomic`): a SIGKILLed driver
  loses nothing it was told, and a reader never sees half a record. `<run>` is a zero-padded
  nanosecond clock plus a random tag, so names sort in write order across runs: when an id has
  several rows, the last in name order wins. Names are never reused, so no write replaces rows of
  an earlier record.
- At the end of a run (`compact`), every row is written as one `records/<run>-compact.jsonl`
  (sorting after this run's records) and the records it replaces are deleted: a crash in between
  leaves duplicates, never a loss. A `journal.jsonl` of an older version is read first and
  compacted too.
- `results.parquet` is derived from the record: one row per prompt of the current prompt set (the
  latest row of an id wins), written atomically.
- Every row records what its output was made from: the row's parameters (`prompts.PARAMS`) and
  `settings`, a short hash of the job settings that shape every output (`settings_id`); a row
  whose worker could not run int8-attention's kernel (`int8_attention: false`) gets the id of the
  job's settings without it (`fallback_settings_id`), never the job's own.
- A row's `status`: `ok` (its output is `output`), `failed` (`error` says why), `changed`: its
  inputs changed since its output was made, and that output was removed before regenerating it
  (`Results.retire`, called before the changed rows are dispatched), so that no file made from
  old inputs stays under the row's name if the regeneration fails or never runs; or `suspect`:
  its output (still under `output`) was made by a worker after its last good canary, before one
  that failed (`runner.serve.canary`): not done, so a rerun regenerates it.
- Failure reasons group by cause (`group_errors`): the first line of `error`, with the paths and
  URIs it names, the row's own id and what differs per call masked.
- An item is done only when its latest row says ok, its media file exists (non-empty, found by one
  listing of `media/`, not a stat per row), and it was made from exactly the current row's
  parameters and settings, or its fallback settings (`Plan.fallback`: a driver with other work
  remakes those on workers that run the kernel, if any) (`Results.plan`); a rerun generates the
  rest: new rows, rows whose parameters changed, failed rows. Ids of the record that are no longer in the input keep their
  outputs and rows and are reported, never dropped silently.
- `fingerprint()` is the job-level part that must not change between runs into one directory
  (model, dtype, fps, lossy compilation and its lossy flags, step reuse, `generation.*` defaults): a change is refused unless
  `output.overwrite=true`, which starts the directory afresh.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from ..io.outputs import failed_row
from ..io.prompts import PARAMS
from ..io.storage import Store, resolve

JOURNAL = "journal.jsonl"   # the record of older versions (append-only, local only); still read
RECORDS = "records"
# Job settings that decide what every output looks like; anything else (workers, batch size,
# lossless compile modes) may change between a run and its resume.
OUTPUT_KEYS = ("model.preset", "model.source", "model.path", "model.dtype", "model.mask_feature",
               "output.fps")


def lossy(mode) -> bool:
    """Whether `compile.mode` gives outputs that differ from eager ones (the compiler decides)."""
    import compiler
    return not compiler.parse_options(str(mode)).lossless


def int8_attention(mode, preset: str) -> bool:
    """Whether compile flag `int8-attention` is on and changes this model's outputs."""
    import compiler
    from ..families import PRESETS
    return compiler.parse_options(str(mode)).has("int8_attention") and PRESETS[preset].long_attention


def _output_settings(cfg: DictConfig) -> dict:
    out = {k: OmegaConf.select(cfg, k) for k in OUTPUT_KEYS}
    out["lossy"] = lossy(cfg.compile.mode)
    # LoRA adapters fused into the weights: each one's file and scale; absent when none, so
    # directories made before adapters existed keep their settings id
    adapters = OmegaConf.select(cfg, "model.adapters")
    if adapters:
        from ..config import parse_adapters
        from ..families import PRESETS
        out["adapters"] = [a.settings() for a in parse_adapters(
            OmegaConf.to_container(adapters, resolve=True), PRESETS[cfg.model.preset].experts)]
    # `lossy` alone would give int8-attention by itself (eager-exact Linears; on a model it does
    # not apply to, eager-exact outputs) the id of modes with FP8 Linears (`low-precision`, O3):
    # a rerun would skip outputs made without them. Said only where it is off in a lossy mode, so
    # every other mode keeps its id.
    import compiler
    if out["lossy"] and not compiler.parse_options(str(cfg.compile.mode)).has("low_precision"):
        out["low_precision"] = False
    # INT8/FP8 attention changes a Wan video; absent where it does not apply, so directories made
    # before the flag existed (or of other families) keep their settings id
    if int8_attention(cfg.compile.mode, cfg.model.preset):
        out["int8_attention"] = True
    # Step reuse changes every output; absent when off, so directories made before it existed
    # (whose config.yaml has no step_cache) keep their settings id.
    # The unconditional-branch reuse (`cfg_reuse`) likewise: its keys join when it is on.
    sc = OmegaConf.select(cfg, "step_cache")
    if sc is not None:
        from ..config import StepCacheSection
        sc = StepCacheSection(**OmegaConf.to_container(sc, resolve=True))
        if sc.on:
            out["step_cache"] = sc.settings()
    return out


def fingerprint(cfg: DictConfig) -> dict:
    """What a rerun into the same directory must keep: the output settings, and the `generation`
    defaults (changing one would silently regenerate the whole job; per-row changes in the prompt
    files are regenerated row by row instead)."""
    return {**_output_settings(cfg),
            "generation": OmegaConf.to_container(cfg.generation, resolve=True)}


def settings_id(cfg: DictConfig) -> str:
    """Short hash of the output settings, stamped on every journal line."""
    return _hash(_output_settings(cfg))


def fallback_settings_id(cfg: DictConfig) -> str | None:
    """The settings id of the outputs a worker makes where flag `int8-attention` cannot run: the
    job's output settings less `int8_attention`, `lossy` kept. That is the id of the same job
    asked without the flag only where another lossy flag stays in its mode (O3's
    `low-precision`); with `compile.mode=int8-attention` alone, that job is lossless and its id
    differs, and so does the fallback's from any mode with FP8 Linears (`low_precision: False`
    stays in it: `_output_settings`). None where the flag is off or does not apply."""
    out = _output_settings(cfg)
    return _hash(out) if out.pop("int8_attention", False) else None


def _hash(settings: dict) -> str:
    blob = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def config_changes(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def changed_row(item, old: dict, removed: list[str]) -> dict:
    """The record of an item whose inputs changed and whose old output was removed (`retire`):
    status `changed` until its regeneration writes its own row."""
    what = [k for k in PARAMS if old.get(k) != getattr(item, k)]
    why = ", ".join(what) if what else "the output settings"
    return {**failed_row(item, f"its inputs changed ({why}) since {', '.join(removed)} was made: "
                               f"removed before regenerating"), "status": "changed"}


# Characters of an error's first line that name its cause: the longest cause the runner words
# itself ("killed its worker 2 times (...): the worker process ended without an error of its own:
# killed (SIGKILL; ...) or crashed (...)", 206) whole; a longer one is cut at a word, and says so.
CAUSE_LEN = 240
_TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{8}-")          # storage/outputs temp names: random part
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")          # "object at 0x7f...": differs per call
# Where a message names a file, which differs per row (`_mask_paths`). A name ends before a
# quote, bracket, comma, semicolon or space; a ":" or "." that ends it is the sentence's.
_NAME = r"[^\s'\"<>()\[\],;]"
_URI = re.compile(rf"(?<![\w.+-])([A-Za-z][A-Za-z0-9+.-]*)://([^/\s'\"<>()\[\],;]*)(/{_NAME}*)")
_ABS_PATH = re.compile(rf"(?<![\w.~/:<-])/[\w.~+@%=-]{_NAME}*")
# a relative path: one "/" at least and an extension ("photos/IMG_0001.jpg"), not "and/or", "B/s"
_REL_PATH = re.compile(r"(?<![\w.~/:<-])(?:[\w.~-]+/)+[\w.~-]*\.[A-Za-z][A-Za-z0-9]{0,7}(?![\w/])")
# a row of a prompts file, as messages name it ("prompts.parquet:12", `prompts.Item.source`)
_SOURCE = re.compile(r"(?<![\w.~/:<-])(?:<path>|[\w.~-]+\.[A-Za-z][A-Za-z0-9]{0,7}):\d+\b")


def _masked(what: str):
    """A `re.sub` replacement: the match as `what`, its trailing ":" or "." kept."""
    def sub(m: re.Match) -> str:
        text = m.group(0)
        tail = len(text) - len(text.rstrip(":."))
        return what.format(*m.groups()) + (text[-tail:] if tail else "")
    return sub


def _mask_paths(text: str) -> str:
    """Paths and URIs in `text` as `<path>`: an object URI keeps its store (`s3://bucket/<path>`),
    a local path becomes `<path>`, a prompts file's row (`file:row`) `<path>:<row>`."""
    text = _URI.sub(_masked("{0}://{1}/<path>"), text)
    text = _REL_PATH.sub(_masked("<path>"), _ABS_PATH.sub(_masked("<path>"), text))
    return _SOURCE.sub("<path>:<row>", text)


def error_cause(row: dict) -> str:
    """A failed row's error as a cause that rows share: its first line, with what differs per
    row masked: the files it names (`_mask_paths`: 38 missing images are one cause, not 38), the
    row's own id, replaced by `<id>` (a message may name it, as records of older runs do:
    "non-finite values in the output of 'm0000'"), and what differs per call (temp file names,
    object addresses). Ids of digits only are left alone: numbers in messages (errno, sizes)
    would be mistaken for them; ids of letters only are masked where quoted: a row "loop" must
    not turn "a symlink loop" into "a symlink <id>"."""
    text = next((line.strip() for line in (row.get("error") or "").splitlines() if line.strip()), "?")
    text = _mask_paths(_ADDRESS.sub("0x...", _TMP_NAME.sub(".tmp-*-", text)))
    rid = str(row.get("id") or "")
    if rid.isalpha():
        text = re.sub(rf"(?<=['\"`]){re.escape(rid)}(?=['\"`])", "<id>", text)
    elif rid and not rid.isdigit():
        # the id as a whole name, not inside a longer one (a "." after it starts an extension;
        # a temp file's name is ".tmp-*-<id>.ext"), nor a URI's scheme (an id "s3")
        text = re.sub(rf"(?:(?<=\.tmp-\*-)|(?<![A-Za-z0-9._-])){re.escape(rid)}(?![A-Za-z0-9_-]|:/)",
                      "<id>", text)
    return _cut(text, CAUSE_LEN)


def _cut(text: str, n: int) -> str:
    """`text` within `n` characters, cut at a word with "..." (never mid-word: issue 60's summary
    line for a memory kill ended "(SIGSEGV, a CU")."""
    if len(text) <= n:
        return text
    head = text[:n - 4]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + " ..."


def group_errors(rows) -> list[tuple[str, list[str]]]:
    """The failed rows (status not ok) grouped by `error_cause`: [(cause, [ids])], the largest
    group first (ties: the cause seen first), ids in row order."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.get("status") != "ok":
            groups.setdefault(error_cause(r), []).append(str(r.get("id")))
    first = {cause: k for k, cause in enumerate(groups)}
    return sorted(groups.items(), key=lambda g: (-len(g[1]), first[g[0]]))


def format_errors(groups: list[tuple[str, list[str]]], max_ids: int = 10) -> list[str]:
    """One line per cause: `N x cause: id, id, ... (K more)` (summary.txt's failure list)."""
    lines = []
    for cause, ids in groups:
        more = f", ... ({len(ids) - max_ids} more)" if len(ids) > max_ids else ""
        lines.append(f"{len(ids)} x {cause}: {', '.join(ids[:max_ids])}{more}")
    return lines


@dataclass
class Plan:
    """The current items against the journal."""
    done: set = field(default_factory=set)        # ids made from exactly these parameters
    changed: list = field(default_factory=list)   # items whose recorded parameters differ
    gone: list = field(default_factory=list)      # ids with an ok output, no longer in the input
    stale: dict = field(default_factory=dict)     # changed id -> its media files made from old inputs
    suspect: list = field(default_factory=list)   # ids whose output a failed canary put in doubt
    fallback: list = field(default_factory=list)  # done items made without int8-attention's kernel

    def changed_by_file(self) -> str:
        counts: dict[str, int] = {}
        for it in self.changed:
            counts[it.file] = counts.get(it.file, 0) + 1
        return ", ".join(f"{n} in {f}" for f, n in counts.items())


class Results:
    def __init__(self, job_dir: "str | Store", settings: str | None = None,
                 fallback: str | None = None):
        self.store = job_dir if isinstance(job_dir, Store) else resolve(job_dir)
        # `fallback` (`fallback_settings_id`): the settings of a row whose worker could not run
        # int8-attention's kernel (the row says `int8_attention: false`)
        self.settings, self.fallback = settings, fallback
        self.rows: dict[str, dict] = {}
        self.run = f"{time.time_ns():020d}-{uuid.uuid4().hex[:6]}"   # this run's record names
        self._seq = 0
        self._loaded: list[str] = []          # record names read by load(): compact() replaces them

    def load(self) -> "Results":
        if self.store.exists(JOURNAL):
            self._read_lines(self.store.read_bytes(JOURNAL))
        self._loaded = sorted(self.store.list(RECORDS))
        for name in self._loaded:
            data = self.store.read_bytes(f"{RECORDS}/{name}")
            try:       # a record is whole (written atomically): parse it in one call, ~25 % faster
                rows = json.loads(b"[" + b",".join(data.splitlines()) + b"]")
            except json.JSONDecodeError:
                self._read_lines(data)
                continue
            self.rows.update((r["id"], r) for r in rows)
        return self

    def _read_lines(self, data: bytes) -> None:
        for line in data.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue              # torn line of an old journal.jsonl (crash mid-append)
            self.rows[row["id"]] = row

    def plan(self, items: list) -> Plan:
        plan = Plan()
        media = self.store.list("media") if self.rows else {}    # one listing, not a stat per row
        rows, settings = self.rows, (self.settings, self.fallback or self.settings)
        for it in items:
            r = rows.get(it.id)
            if r is None:
                continue
            # made from this item: the same settings and parameters (its file/row may move); made
            # without int8-attention's kernel where it could not run is done too (`fallback`)
            if r.get("settings") not in settings or tuple(map(r.get, PARAMS)) != it.made_from():
                plan.changed.append(it)
            elif r["status"] == "ok" and media.get(_media_name(r["output"]), 0) > 0:
                plan.done.add(it.id)
                if r["settings"] != self.settings:
                    plan.fallback.append(it)
            elif r["status"] == "suspect":
                plan.suspect.append(it.id)
        if plan.changed:         # their files under their names: made from the old inputs
            by_id: dict[str, list[str]] = {}
            for name in media:
                if "/" not in name:
                    by_id.setdefault(name.rsplit(".", 1)[0], []).append(f"media/{name}")
            plan.stale = {it.id: by_id[it.id] for it in plan.changed if it.id in by_id}
        ids = {it.id for it in items}
        plan.gone = sorted(i for i, r in self.rows.items() if i not in ids and r["status"] == "ok")
        return plan

    def retire(self, plan: Plan) -> list[str]:
        """Before the changed rows run (holding the job's lock): each one's media file made from
        its old inputs is deleted, then one record says so: a row of status `changed` with the
        new parameters and no output. No file made from old inputs stays under a row's name,
        whether its regeneration succeeds, fails or never runs (interrupted); the record is
        written after the deletions, so a crash in between leaves the old rows, which still
        differ from the inputs and are retired again. Returns the ids retired."""
        stale = [(it, plan.stale[it.id]) for it in plan.changed if it.id in plan.stale]
        if not stale:
            return []
        names = [n for _, ns in stale for n in ns]
        if self.store.local:
            for n in names:
                self.store.delete(n)
        else:                    # a request each: in parallel (pyarrow releases the GIL)
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(self.store.delete, names))
        self.add([changed_row(it, self.rows.get(it.id) or {}, ns) for it, ns in stale])
        return [it.id for it, _ in stale]

    def add(self, rows: list[dict]) -> None:
        """Records one shard's rows: one new object, written atomically."""
        if not rows:
            return
        for r in rows:
            without = r.get("int8_attention") is False and self.fallback
            r.setdefault("settings", self.fallback if without else self.settings)
            self.rows[r["id"]] = r
        self.store.write_bytes_atomic(f"{RECORDS}/{self.run}-{self._seq:06d}.jsonl", _jsonl(rows))
        self._seq += 1

    def compact(self) -> None:
        """Every row as one record, then the records it replaces deleted (see the docstring)."""
        mine = [f"{self.run}-{k:06d}.jsonl" for k in range(self._seq)]
        if not self.rows or len(self._loaded) + len(mine) <= 1 and not self.store.exists(JOURNAL):
            return
        name = f"{self.run}-compact.jsonl"
        # written in chunks to a local temporary file (then renamed, or uploaded whole): never
        # the whole record in memory as one string (~0.5 KB per row, twice: text and bytes)
        with self.store.atomic_local(f"{RECORDS}/{name}") as tmp, open(tmp, "wb") as f:
            rows = iter(self.rows.values())
            while chunk := list(itertools.islice(rows, 10_000)):
                f.write(_jsonl(chunk))
        for n in self._loaded + mine:
            if n != name:
                self.store.delete(f"{RECORDS}/{n}")
        self.store.delete(JOURNAL)
        self._loaded, self._seq = [name], 0
        self.run = f"{time.time_ns():020d}-{uuid.uuid4().hex[:6]}"

    def write_table(self, ids: list[str]) -> list[dict]:
        """results.parquet: one row per id of the current prompt set that has a result. Returns
        those rows (the record's own dicts: read, never change them)."""
        table = [self.rows[i] for i in ids if i in self.rows]
        write_parquet(self.store, "results.parquet", table)
        return table


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r, default=str) + "\n" for r in rows).encode()


def _media_name(output: str | None) -> str:
    """A row's `output` ("media/<id>.<ext>") as a name in the listing of `media/`."""
    return (output or "").replace(os.sep, "/").removeprefix("media/")


def write_parquet(store: Store, rel: str, rows: list[dict]) -> None:
    """`rows` as one Parquet object; a column per key of any row (null where a row lacks it),
    built column by column: a list of references per column, not a dict per row (a million rows
    cost ~1 GiB more the other way)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.BytesIO()
    pq.write_table(pa.table({c: [r.get(c) for r in rows] for c in columns}), buf)
    store.write_bytes_atomic(rel, buf.getbuffer())


def start_fresh(store: Store) -> None:
    """output.overwrite=true: forget previous results and media of this job."""
    for name in (JOURNAL, "results.parquet", "summary.json", "summary.txt"):
        store.delete(name)
    for sub in (RECORDS, "media", "metrics"):
        store.delete_prefix(sub)


def remove_temp_files(store: "str | Store") -> int:
    """Half-written files a crash left behind (atomic writes never rename them into place). Only
    local directories have them: on an object store a partial upload never appears."""
    store = store if isinstance(store, Store) else resolve(store)
    if not store.local:
        return 0
    job_dir, n = store.base, 0
    for root, _, files in os.walk(job_dir):
        for f in files:
            if f.startswith(".tmp-"):
                os.remove(os.path.join(root, f))
                n += 1
    return n
