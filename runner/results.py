"""The job's record of finished items, durable across driver crashes, and resume.

Contract:
- `journal.jsonl` in the job directory is append-only: one JSON line per finished item (ok or
  failed), written and fsynced as each shard's rows arrive, so a SIGKILLed driver loses nothing it
  was told. A torn last line (killed mid-append) is ignored on reading.
- `results.parquet` is derived from the journal: one row per prompt of the current prompt set (the
  latest line of an id wins), rewritten atomically.
- Every line records what its output was made from: the row's parameters (`ROW_KEYS`) and
  `settings`, a short hash of the job settings that shape every output (`settings_id`).
- An item is done only when its latest line says ok, its media file exists, and it was made from
  exactly the current row's parameters and settings (`Results.plan`); a rerun generates the rest:
  new rows, rows whose parameters changed, failed rows. Ids of the journal that are no longer in
  the input keep their outputs and lines and are reported, never dropped silently.
- `fingerprint()` is the job-level part that must not change between runs into one directory
  (model, dtype, fps, lossy compilation, step reuse, `generation.*` defaults): a change is refused unless
  `output.overwrite=true`, which starts the directory afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from .outputs import write_parquet

JOURNAL = "journal.jsonl"
# Job settings that decide what every output looks like; anything else (workers, batch size,
# lossless compile modes) may change between a run and its resume.
OUTPUT_KEYS = ("model.preset", "model.source", "model.path", "model.dtype", "model.mask_feature",
               "output.fps")
# A row's own parameters (its `file`/`row` may move between runs without changing the output).
ROW_KEYS = ("prompt", "negative_prompt", "seed", "height", "width", "num_frames",
            "num_inference_steps", "guidance_scale")


def lossy(mode) -> bool:
    """Whether `compile.mode` gives outputs that differ from eager ones (the compiler decides)."""
    import compiler
    return not compiler.parse_options(str(mode)).lossless


def _output_settings(cfg: DictConfig) -> dict:
    out = {k: OmegaConf.select(cfg, k) for k in OUTPUT_KEYS}
    out["lossy"] = lossy(cfg.compile.mode)
    # Step reuse changes every output; absent when off, so directories made before it existed
    # (whose config.yaml has no step_cache) keep their settings id.
    sc = OmegaConf.select(cfg, "step_cache")
    if sc is not None and sc.method != "none":
        out["step_cache"] = OmegaConf.to_container(sc, resolve=True)
    return out


def fingerprint(cfg: DictConfig) -> dict:
    """What a rerun into the same directory must keep: the output settings, and the `generation`
    defaults (changing one would silently regenerate the whole job; per-row changes in the prompt
    files are regenerated row by row instead)."""
    return {**_output_settings(cfg),
            "generation": OmegaConf.to_container(cfg.generation, resolve=True)}


def settings_id(cfg: DictConfig) -> str:
    """Short hash of the output settings, stamped on every journal line."""
    blob = json.dumps(_output_settings(cfg), sort_keys=True, default=str)
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


def failed_row(item, error: str, worker: int | None = None) -> dict:
    """The result row of an item that produced no output (same columns as a worker's ok rows)."""
    return {**item.params(), "status": "failed", "error": error[:2000], "output": None,
            "worker": worker, "batch_size": 1 if worker is not None else None, "e2e_s": None,
            "denoise_it_s": None}


@dataclass
class Plan:
    """The current items against the journal."""
    done: set = field(default_factory=set)        # ids made from exactly these parameters
    changed: list = field(default_factory=list)   # items whose recorded parameters differ
    gone: list = field(default_factory=list)      # ids with an ok output, no longer in the input

    def changed_by_file(self) -> str:
        counts: dict[str, int] = {}
        for it in self.changed:
            counts[it.file] = counts.get(it.file, 0) + 1
        return ", ".join(f"{n} in {f}" for f, n in counts.items())


class Results:
    def __init__(self, job_dir: str, settings: str | None = None):
        self.job_dir = job_dir
        self.settings = settings
        self.path = os.path.join(job_dir, JOURNAL)
        self.rows: dict[str, dict] = {}
        self._file = None

    def load(self) -> "Results":
        if os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue              # torn line from a crash mid-append
                    self.rows[row["id"]] = row
        return self

    def made_from(self, row: dict, item) -> bool:
        """`row` (a journal line) was made from `item`'s parameters and this job's settings."""
        return row.get("settings") == self.settings and all(
            row.get(k) == getattr(item, k) for k in ROW_KEYS)

    def plan(self, items: list) -> Plan:
        plan = Plan()
        for it in items:
            r = self.rows.get(it.id)
            if r is None:
                continue
            if not self.made_from(r, it):
                plan.changed.append(it)
            elif r["status"] == "ok" and os.path.isfile(os.path.join(self.job_dir, r["output"])):
                plan.done.add(it.id)
        ids = {it.id for it in items}
        plan.gone = sorted(i for i, r in self.rows.items() if i not in ids and r["status"] == "ok")
        return plan

    def add(self, rows: list[dict]) -> None:
        if self._file is None:
            self._file = open(self.path, "a")
        for r in rows:
            r.setdefault("settings", self.settings)
            self.rows[r["id"]] = r
            self._file.write(json.dumps(r, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def write_table(self, ids: list[str]) -> list[dict]:
        """results.parquet: one row per id of the current prompt set that has a result."""
        table = [self.rows[i] for i in ids if i in self.rows]
        columns = list(dict.fromkeys(k for r in table for k in r))
        table = [{c: r.get(c) for c in columns} for r in table]
        write_parquet(os.path.join(self.job_dir, "results.parquet"), table)
        return table

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def start_fresh(job_dir: str) -> None:
    """output.overwrite=true: forget previous results and media of this job."""
    for name in (JOURNAL, "results.parquet", "summary.json", "summary.txt"):
        p = os.path.join(job_dir, name)
        if os.path.exists(p):
            os.remove(p)
    for sub in ("media", "metrics"):
        shutil.rmtree(os.path.join(job_dir, sub), ignore_errors=True)


def remove_temp_files(job_dir: str) -> int:
    """Half-written files a crash left behind (atomic writes never rename them into place)."""
    n = 0
    for root, _, files in os.walk(job_dir):
        for f in files:
            if f.startswith(".tmp-"):
                os.remove(os.path.join(root, f))
                n += 1
    return n
