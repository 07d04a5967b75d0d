"""Load, merge and check a job's config; split it into the narrow typed pieces the rest uses.

One config tree (`conf/defaults.yaml` lists every key). Merge order, later wins:

    conf/defaults.yaml  <  conf/models/<model.preset>.yaml  <  jobs/<job>.yaml  <  command line

`job=NAME` picks `jobs/NAME.yaml` (or `job=path/to/file.yaml`); every other argument is
`dotted.key=value` (the value may itself contain `=`; it is parsed as YAML, so `steps=20` is an int).
The model preset is read after the job file and the command line are known, so `model.preset=sd21`
on the command line switches presets. Unknown keys and values of the wrong type are `ConfigError`s
that name the key and what is valid. Only `runner.job` sees the whole tree: it hands each part of
the runner one of the frozen dataclasses below, each of which validates itself.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
JOBS_DIR = ROOT / "jobs"
# Subtrees whose keys are free-form (passed through to Inductor / checked by the compiler).
FREE_FORM = {"compile.options"}


class ConfigError(ValueError):
    pass


def available_jobs() -> list[str]:
    return sorted(p.stem for p in JOBS_DIR.glob("*.yaml"))


def available_presets() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "models").glob("*.yaml"))


def _job_path(job: str) -> Path:
    p = Path(job)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"job file {job!r} does not exist")
        return p
    p = JOBS_DIR / f"{job}.yaml"
    if not p.is_file():
        raise ConfigError(f"unknown job {job!r}; valid: {available_jobs()} (or job=path/to/file.yaml)")
    return p


def _load_yaml(path: Path, what: str) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml syntax errors name the line
        raise ConfigError(f"cannot parse {what} {path}: {e}") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{what} {path} must be a mapping of config keys")
    return cfg


def parse_cli(argv: list[str]) -> tuple[str | None, DictConfig]:
    """Split `job=NAME` from the `key=value` overrides."""
    job, dotlist = None, []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not key=value; usage: python -m runner "
                              f"job=NAME [key=value ...] (jobs: {available_jobs()})")
        key, value = arg.split("=", 1)
        if key == "job.name" and not value.strip():
            # not "unset": an empty name would silently fall back to the job file's name
            raise ConfigError("job.name is empty on the command line; give a name "
                              "(job.name=NAME) or leave the argument out to use the job file's name")
        if key == "job":
            job = value
        else:
            dotlist.append(f"{key}={value}")
    try:
        return job, OmegaConf.from_dotlist(dotlist)
    except Exception as e:
        raise ConfigError(f"bad command-line override: {e}") from e


def _check_keys(schema: DictConfig, cfg: DictConfig, source: str, prefix: str = "") -> None:
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in list(schema.keys()):
            valid = [str(k) for k in schema.keys()]
            hint = difflib.get_close_matches(str(key), valid, n=1)
            raise ConfigError(
                f"unknown config key {full!r} in {source}"
                + (f" (did you mean {prefix + hint[0]!r}?)" if hint else "")
                + f"; valid keys{' under ' + repr(prefix[:-1]) if prefix else ''}: {valid}")
        sub, val = schema._get_node(key), cfg._get_node(key)
        if full in FREE_FORM:
            continue
        if isinstance(sub, DictConfig):
            if not isinstance(val, DictConfig):
                raise ConfigError(f"{full!r} in {source} must be a mapping with keys {list(sub.keys())}")
            _check_keys(sub, val, source, full + ".")


def _check_types(schema: DictConfig, cfg: DictConfig, prefix: str = "") -> None:
    """Leaves whose default is a bool/int/float/str must keep that type (null defaults take any)."""
    for key in schema.keys():
        full = f"{prefix}{key}"
        node = schema._get_node(key)
        if isinstance(node, DictConfig):
            if full not in FREE_FORM:
                _check_types(node, cfg._get_node(key), full + ".")
            continue
        want, got = node._value(), cfg._get_node(key)._value()
        if want is None or want == "???" or got == "???":
            continue
        if isinstance(want, bool):
            ok = isinstance(got, bool)
        elif isinstance(want, int):
            ok = isinstance(got, int) and not isinstance(got, bool)
        elif isinstance(want, float):
            ok = isinstance(got, (int, float)) and not isinstance(got, bool)
        else:
            ok = isinstance(got, type(want))
        if not ok:
            raise ConfigError(f"{full}={got!r} has the wrong type: expected {type(want).__name__} "
                              f"(default {want!r})")


def load_config(argv: list[str]) -> DictConfig:
    """The merged, checked config for `python -m runner job=NAME key=value ...`."""
    job, cli = parse_cli(argv)
    if job is None:
        raise ConfigError(f"no job given: python -m runner job=NAME [key=value ...]; "
                          f"jobs: {available_jobs()}")
    job_path = _job_path(job)
    defaults = _load_yaml(CONF_DIR / "defaults.yaml", "defaults")
    job_cfg = _load_yaml(job_path, "job file")
    _check_keys(defaults, job_cfg, f"job file {job_path}")
    _check_keys(defaults, cli, "the command line")

    preset = OmegaConf.select(cli, "model.preset") or OmegaConf.select(job_cfg, "model.preset") \
        or defaults.model.preset
    preset_path = CONF_DIR / "models" / f"{preset}.yaml"
    if not preset_path.is_file():
        raise ConfigError(f"unknown model.preset {preset!r}; valid: {available_presets()}")
    preset_cfg = _load_yaml(preset_path, "model preset")
    _check_keys(defaults, preset_cfg, f"model preset {preset_path}")

    cfg = OmegaConf.merge(defaults, preset_cfg, job_cfg, cli)
    if cfg.job.name is None:
        cfg.job.name = job_path.stem
    _check_types(defaults, cfg)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"required config keys not set: {missing} (set them in the job file or "
                          f"on the command line, e.g. prompts.path=prompts.parquet)")
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:
        raise ConfigError(f"cannot resolve interpolation: {e}") from e
    OmegaConf.set_struct(cfg, True)
    return cfg


# ---------------------------------------------------------------------------------------------
# The narrow pieces. Each validates itself; nothing below runner.job sees the whole tree.

def _choice(name: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {list(valid)}")


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


@dataclass(frozen=True)
class GenerationDefaults:
    """Values for the Parquet columns a prompt file leaves out."""
    seed: int = 0
    height: int = 1024
    width: int = 1024
    num_frames: int = 16
    num_inference_steps: int = 20
    guidance_scale: float = 4.5
    negative_prompt: str = ""

    def __post_init__(self):
        for k in ("height", "width", "num_frames", "num_inference_steps"):
            _positive(f"generation.{k}", getattr(self, k))
        if self.seed < 0:
            raise ConfigError(f"generation.seed={self.seed} must be >= 0")


@dataclass(frozen=True)
class PromptSource:
    paths: tuple[str, ...]
    on_empty: str = "error"

    def __post_init__(self):
        _choice("prompts.on_empty", self.on_empty, ("error", "skip"))
        if not self.paths:
            raise ConfigError("prompts.path is empty: give a .parquet file, a directory or a list")


@dataclass(frozen=True)
class RunOptions:
    batch_size: int = 1
    shard_size: int = 8
    warmup_steps: int = 2
    max_shard_retries: int = 2
    dry_run: bool = False

    def __post_init__(self):
        _positive("run.max_shard_retries", self.max_shard_retries, allow_zero=True)
        _positive("run.batch_size", self.batch_size)
        _positive("run.shard_size", self.shard_size)
        _positive("run.warmup_steps", self.warmup_steps, allow_zero=True)


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None
    num_workers: int | None = None
    cpu_workers: int = 2
    cpus_per_worker: int = 1
    max_worker_restarts: int = 3
    worker_start_timeout_s: float = 900.0

    def __post_init__(self):
        _positive("ray.max_worker_restarts", self.max_worker_restarts, allow_zero=True)
        _positive("ray.worker_start_timeout_s", self.worker_start_timeout_s)
        if self.num_workers is not None:
            _positive("ray.num_workers", self.num_workers)
        _positive("ray.cpu_workers", self.cpu_workers)
        _positive("ray.cpus_per_worker", self.cpus_per_worker)


@dataclass(frozen=True)
class OutputOptions:
    job_dir: str                   # <output.dir>/<job.name>
    fps: int = 8
    results_every_s: float = 30.0

    def __post_init__(self):
        _positive("output.fps", self.fps)
        _positive("output.results_every_s", self.results_every_s, allow_zero=True)


@dataclass(frozen=True)
class CompileConfig:
    """The nexfort-style options dict handed to `compiler.compile_pipe`, plus the cache dir."""
    options: dict = field(default_factory=lambda: {"mode": "none"})
    fuse_qkv: bool = True
    cache_dir: str | None = None

    @property
    def enabled(self) -> bool:
        return self.options.get("mode", "none") != "none"


def _as_paths(value) -> tuple[str, ...]:
    if isinstance(value, (list, tuple, ListConfig)):
        return tuple(str(v) for v in value)
    return (str(value),) if value not in (None, "") else ()


def split(cfg: DictConfig) -> dict:
    """The typed pieces of a merged config (see the dataclasses above)."""
    from .models import ModelSpec  # models imports torch; keep `config` light for the CLI's errors

    def section(name):
        return OmegaConf.to_container(cfg[name], resolve=True)

    m = section("model")
    try:
        model = ModelSpec(preset=m["preset"], source=m["source"], path=m["path"], dtype=m["dtype"],
                          device=m["device"], local_files_only=m["local_files_only"],
                          mask_feature=m["mask_feature"])
    except ValueError as e:
        raise ConfigError(str(e)) from e
    name = str(cfg.job.name)
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"job.name={name!r} must be a plain directory name")
    c = section("compile")
    if c["cache_dir"] and "://" in str(c["cache_dir"]):
        raise ConfigError(f"compile.cache_dir={c['cache_dir']!r}: URIs are not supported yet; use a "
                          f"path every node can reach (a shared filesystem, or an object store "
                          f"mounted with FUSE), or null for <output.dir>/.compile-cache")
    return dict(
        name=name,
        model=model,
        prompts=PromptSource(paths=_as_paths(cfg.prompts.path), on_empty=cfg.prompts.on_empty),
        generation=GenerationDefaults(**section("generation")),
        run=RunOptions(**section("run")),
        ray=RayOptions(**section("ray")),
        output=OutputOptions(job_dir=os.path.join(str(cfg.output.dir), name), fps=cfg.output.fps,
                             results_every_s=cfg.output.results_every_s),
        compile=CompileConfig(
            options={k: v for k, v in c.items() if k != "cache_dir"},  # the rest is compiler options
            fuse_qkv=c["fuse_qkv"],
            cache_dir=os.path.abspath(c["cache_dir"] or os.path.join(str(cfg.output.dir), ".compile-cache"))),
    )
