"""The job's record of finished items, durable across driver crashes, and resume.

Contract:
- `journal.jsonl` in the job directory is append-only: one JSON line per finished item (ok or
  failed), written and fsynced as each shard's rows arrive, so a SIGKILLed driver loses nothing it
  was told. A torn last line (killed mid-append) is ignored on reading.
- `results.parquet` is derived from the journal: one row per prompt of the current prompt set (the
  latest line of an id wins), rewritten atomically.
- An item is done when its latest line says ok and its media file exists; a rerun generates only
  the rest. `fingerprint()` is what must not change between runs into one directory (model, sizes,
  steps, ...): a change is refused unless `output.overwrite=true`, which starts the directory afresh.
"""

from __future__ import annotations

import json
import os
import shutil

from omegaconf import DictConfig, OmegaConf

from .outputs import write_parquet

JOURNAL = "journal.jsonl"
# Config that decides what an output looks like; anything else (workers, batch size, compile mode
# other than low precision) may change between a run and its resume.
FINGERPRINT_KEYS = ("model.preset", "model.source", "model.path", "model.dtype", "model.mask_feature",
                    "generation", "output.fps")


def fingerprint(cfg: DictConfig) -> dict:
    out = {}
    for k in FINGERPRINT_KEYS:
        v = OmegaConf.select(cfg, k)
        out[k] = OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v
    out["low_precision"] = "low-precision" in str(cfg.compile.mode) or str(cfg.compile.mode) == "O3"
    return out


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


class Results:
    def __init__(self, job_dir: str):
        self.job_dir = job_dir
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

    def done_ids(self) -> set[str]:
        return {i for i, r in self.rows.items()
                if r["status"] == "ok" and os.path.isfile(os.path.join(self.job_dir, r["output"]))}

    def add(self, rows: list[dict]) -> None:
        if self._file is None:
            self._file = open(self.path, "a")
        for r in rows:
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
