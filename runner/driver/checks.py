"""The job's pre-flight checks: everything that can be wrong with its input, checked before any
worker starts or any model is built (`check_job`, which `job.run` calls first). Each failure is a
`JobError`, `ConfigError` or `PromptError` naming the key or file and the fix: exit 2 (`job.main`).

- the model: its pretrained checkpoint's files and its adapters against its denoiser
  (`constraints`, through `models.check_pretrained` and `adapters.check`), which give the
  limits every row is checked against (`prompts.Constraints`); the workers' warm-up call within
  the model's steps (`check_warmup`);
- the prompts: every file and row (`prompts.check_prompts`), step reuse against the model and
  every row's steps (`step_cache`);
- the job directory (`output.dir`): it can be created and written, a local one holds no file
  where the job keeps a directory, and ids that differ only in case do not share a media file
  on a case-insensitive filesystem (`check_case_collisions`);
- the results an earlier run left there: made with a compatible config (`check_same_config`,
  called holding the job's lock and by a dry run).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass

import pyarrow.fs as pafs
from omegaconf import OmegaConf

from ..serve import step_cache
from ..config import ConfigError
from .ending import first_line
from ..io.outputs import plural
from ..io.prompts import MAX_LISTED, Constraints, Item, case_collisions, check_prompts
from .results import JOURNAL, RECORDS, config_changes, fingerprint
from ..io.storage import Store, case_insensitive, resolve

log = logging.getLogger("runner")


class JobError(RuntimeError):
    """The job cannot run as given (exit 2): raised by the checks, and by `job` where the job
    directory refuses what the run must write before any worker starts."""


@dataclass(frozen=True)
class Checked:
    """The job's input, checked against the model."""
    limits: Constraints
    files: list[str]
    items: list[Item]
    skipped: int                  # rows with an empty prompt left out (prompts.on_empty=skip)


def check_job(job: dict) -> tuple[Checked, Store]:
    """The model, the prompts and the job directory (`job`: the typed config), all checked before
    any worker or model; the job directory as one Store for the whole run."""
    checked = check_input(job)
    store = resolve(job["output"].job_dir)
    check_output_dir(store, create=not job["run"].dry_run)
    check_case_collisions(checked.items, store)
    return checked, store


def check_input(job: dict) -> Checked:
    """The model and the prompts: the model's limits, step reuse, the warm-up call, every row."""
    limits = constraints(job["model"])
    step_cache.prepare(job)                      # step reuse: offered for this model? step graph off
    check_warmup(job, limits)
    p = job["prompts"]
    files, raw_rows, items = check_prompts(p.paths, job["generation"], limits, p.on_empty, p.strict,
                                           p.max_image_bytes)
    step_cache.check_steps(job["step_cache"], items)   # compute_steps within every row's steps
    skipped = sum(raw_rows.values()) - len(items)      # empty prompts, prompts.on_empty=skip
    if skipped:
        log.warning("%s with an empty prompt skipped (prompts.on_empty=skip)", plural(skipped, "row"))
    return Checked(limits, files, items, skipped)


def constraints(model) -> Constraints:
    """The limits every row is checked against, from the model: its checkpoint and adapters
    checked first (a JobError naming the file and the fix)."""
    from ..serve import adapters
    from ..serve.models import ModelLoadError, check_pretrained, video_length
    try:
        check_pretrained(model)
        hashes = adapters.check(model)   # each adapter's file and keys against its denoiser
    except (ModelLoadError, adapters.AdapterError) as e:
        raise JobError(str(e)) from e
    fam = model.family
    info = model.info     # a distilled preset's sampler may bound the steps itself (FastWan: 3)
    return Constraints(size_factor=info["size_factor"], video_length=video_length(model),
                       frame_step=fam.frame_step, min_steps=info.get("min_steps", fam.min_steps),
                       max_steps=info.get("max_steps", fam.max_steps), image=fam.image,
                       published=published_setting(model.preset, fam.kind == "video"),
                       adapters=tuple(a.name for a in model.adapters if a.per_row),
                       adapter_hashes=tuple(adapters.row_hashes(model.adapters, hashes).items()),
                       distilled=distilled_setting(model.preset, info))


def distilled_setting(preset: str, info: dict) -> tuple[str, int, float] | None:
    """A distilled preset's (name, published steps, guidance) from conf/models/<preset>.yaml:
    those with a few-step sampler of their own or a step range (`distilled` in the preset)."""
    from ..config import CONF_DIR
    if "sampler" not in info and not info.get("distilled"):
        return None
    gen = OmegaConf.load(CONF_DIR / "models" / f"{preset}.yaml").get("generation") or {}
    return preset, int(gen.num_inference_steps), float(gen.guidance_scale)


def published_setting(preset: str, video: bool) -> tuple[int, int, int | None] | None:
    """The preset's published (height, width, frames) from conf/models/<preset>.yaml: what the
    model was made for, and so the measure of a row's work (`Constraints.work_error`)."""
    from ..config import CONF_DIR
    gen = OmegaConf.load(CONF_DIR / "models" / f"{preset}.yaml").get("generation") or {}
    if "height" not in gen or "width" not in gen:
        return None
    return int(gen.height), int(gen.width), int(gen.num_frames) if video and "num_frames" in gen else None


def check_warmup(job: dict, limits: Constraints) -> None:
    """The workers' warm-up call (`Worker._warmup_call`: `run.warmup_steps`, at least the model's
    minimum, lengthened by step reuse to reach a reused step) within the steps the model runs:
    past them it would fail after every worker loaded and compiled the model."""
    run = job["run"]
    if not run.warmup_steps or limits.max_steps is None:
        return
    steps = step_cache.warmup_steps(job["step_cache"], max(run.warmup_steps, limits.min_steps))
    if steps > limits.max_steps:
        raise ConfigError(f"run.warmup_steps={run.warmup_steps}: the warm-up call would run {steps} "
                          f"steps, more than this model runs (at most {limits.max_steps}: "
                          f"docs/models.md, \"Step limits\"); set run.warmup_steps <= "
                          f"{limits.max_steps}")


def check_output_dir(store: Store, create: bool = True) -> None:
    """The job directory can be created and written (created if `create`; else its nearest
    existing parent is probed, so a dry run writes nothing that stays). On an object store: a
    probe object is written and deleted (a dry run only lists)."""
    if store.local:
        _check_local_dir(store.base, create)
    else:
        _check_store_dir(store, create)


def _check_store_dir(store: Store, create: bool) -> None:
    try:
        if create:
            probe = f".probe-{os.getpid()}-{time.time_ns()}"
            store.write_text(probe, "")
            store.delete(probe)
        else:   # read only: the bucket must exist (listing a missing one says nothing)
            bucket = store.base.split("/", 1)[0]
            if store.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                raise OSError(f"the bucket {bucket!r} does not exist")
            store.list(RECORDS)
    except (OSError, ValueError) as e:
        raise JobError(f"output.dir: cannot write {store.uri()!r} ({e}); check the bucket and the "
                       f"credentials in the environment (docs/cloud.md)") from e


def _check_local_dir(job_dir: str, create: bool) -> None:
    _check_job_subdirs(job_dir)
    p = job_dir
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise JobError(f"output.dir: {p!r} exists and is a file; set output.dir to a directory "
                       f"(or remove the file)")
    try:
        if create:
            os.makedirs(job_dir, exist_ok=True)
            p = job_dir
        with tempfile.NamedTemporaryFile(dir=p, prefix=".tmp-probe-"):
            pass
    except OSError as e:
        raise JobError(f"output.dir: cannot create or write {job_dir!r} ({e.strerror or e}); set "
                       f"output.dir to a writable directory") from e


JOB_SUBDIRS = ("media", "records", "metrics", "report")    # what a job keeps in its directory


def _check_job_subdirs(job_dir: str) -> None:
    """A file (or a dangling link) where the job keeps a directory: exit 2 naming it, before any
    worker. It passed the checks, then stopped the job with exit 3 after Ray started, with no
    summary or report written (issue 60)."""
    for name in JOB_SUBDIRS:
        path = os.path.join(job_dir, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise JobError(f"output.dir: {path!r} is a file, where the job keeps its {name}/ "
                           f"directory; move or remove it, or use another job.name")


def check_case_collisions(items: list[Item], store: Store) -> None:
    """Ids that differ only in case ("Fox", "fox") name one media file where output.dir folds
    case (macOS's default, FAT/exFAT, SMB): one output would silently replace the other while
    both rows report ok. An error there, before any model; elsewhere (a case-sensitive directory,
    an object store) both are fine. The directory is probed only when such ids exist: media/, or
    its nearest existing parent (a dry run creates nothing)."""
    pairs = case_collisions(items)
    if not pairs:
        return
    if not store.local:
        return
    probed = os.path.join(store.base, "media")
    while not os.path.isdir(probed):
        probed = os.path.dirname(probed)
    try:
        if not case_insensitive(probed):
            return
    except OSError as e:
        raise JobError(f"output.dir: cannot probe {probed!r} for case-insensitive names "
                       f"({e.strerror or e}); set output.dir to a writable directory") from e
    listed = "\n  ".join(f"{a.id!r} ({a.source}) and {b.id!r} ({b.source})"
                         for a, b in pairs[:MAX_LISTED])
    shown = "" if len(pairs) <= MAX_LISTED else f", the first {MAX_LISTED} below"
    raise JobError(f"output.dir: {store.base!r} is on a case-insensitive filesystem, where prompt "
                   f"ids that differ only in case name one media file: one output would replace "
                   f"the other ({len(pairs)} such ids{shown}). Rename one id of each pair, or set "
                   f"output.dir to a case-sensitive directory or an object store (s3://, gs://):"
                   f"\n  {listed}")


def check_same_config(cfg, out, store: Store) -> None:
    """The job directory's config.yaml (`store`'s) against `cfg`: an error naming what changed
    where the outputs recorded there were made otherwise (`out.job_dir` as the user gave it)."""
    try:
        old_cfg = store.read_text("config.yaml")
    except OSError as e:       # local: a directory in its place, no access; a store's: its own
        if not store.local:
            raise
        raise _damaged_config(store, e) from e
    if old_cfg is not None and (store.exists(JOURNAL) or store.list(RECORDS)):
        try:
            old = OmegaConf.create(old_cfg)
            old_fingerprint = fingerprint(old)
        except Exception as e:    # not YAML, not a mapping, keys missing: yaml's, omegaconf's errors
            raise _damaged_config(store, e) from e
        changes = _named_changes(config_changes(old_fingerprint, fingerprint(cfg)), old, cfg)
        if changes:
            raise JobError(f"{out.job_dir} holds results of a different config ({'; '.join(changes)}); "
                           f"set output.overwrite=true to regenerate everything, or choose another "
                           f"job.name or output.dir")


def _named_changes(changes: list[str], old, cfg) -> list[str]:
    """The fingerprint holds whether the mode is lossy; the user changed the mode: name it."""
    mode = f"compile.mode: {OmegaConf.select(old, 'compile.mode')!r} -> {cfg.compile.mode!r}"
    named = {"lossy: False -> True": f"{mode} (lossless -> lossy)",
             "lossy: True -> False": f"{mode} (lossy -> lossless)",
             "low_precision: False -> None": f"{mode} (FP8 Linears on)",
             "low_precision: None -> False": f"{mode} (FP8 Linears off)"}
    return [named.get(c, c) for c in changes]


def _damaged_config(store: Store, e: BaseException) -> JobError:
    """The config.yaml of an earlier run that cannot be read as one (empty or zero-filled after a
    power loss: its write is not synced; edited by hand): the error names it and the ways on. Its
    removal is safe: each recorded row still carries the settings and parameters its output was
    made from, and a rerun regenerates the rows made otherwise (`Results.plan`)."""
    return JobError(f"{store.uri('config.yaml')} is damaged or unreadable ({first_line(e)}): it "
                    f"is the config the outputs recorded there were made with. Restore it, or "
                    f"remove it to resume (each output is still checked against what it was made "
                    f"from; those made otherwise are regenerated), or set output.overwrite=true "
                    f"to regenerate everything")

