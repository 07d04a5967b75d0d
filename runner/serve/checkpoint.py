"""A pretrained checkpoint checked from its files on the driver, before any worker loads it: JSON
and safetensors headers only (no torch; milliseconds for a 64 GiB checkpoint).

Contract: `problem(index, preset, where, folder)` is None, or one line naming the value and the
fix (`runner.serve.models.check_pretrained` raises it as a `ModelLoadError`) when
- `index` (the checkpoint's model_index.json, parsed) is not of `preset`'s family: another
  pipeline class (`_class_name`), or the same class with the entries of another family
  (`Family.checkpoint`: a Wan 2.2 A14B directory given to a Wan 2.1 preset);
- `folder` (the checkpoint's directory; None: a hub id the hub client will download) lacks a
  component its index lists (no `vae/`), a model component lacks its config.json or its weights
  file (a shard of a sharded one included), or a safetensors file is truncated or corrupt
  (its header does not parse, or the file is not the size the header describes).
Without it a worker found these after loading the components before it: minutes of GPU time for
a real checkpoint, four start-ups (one per restart), and errors that did not name the file
("no file named config.json found in directory DIR" for a missing `vae/`; "incomplete metadata,
file not fully covered" for a truncated text encoder; an AttributeError for another family's).
`where` names the checkpoint in messages (`model.path '/models/x'`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..families import PRESETS

# the weights file names diffusers and transformers load without a `variant` (their sharded
# forms list their shards in `<name>.index.json`)
WEIGHTS = ("diffusion_pytorch_model.safetensors", "model.safetensors",
           "diffusion_pytorch_model.bin", "pytorch_model.bin")
# components without weights: their folder holds configs (and a tokenizer's vocabulary)
NO_WEIGHTS = re.compile(r"Scheduler|Tokenizer|Processor|FeatureExtractor")
MAX_HEADER = 100 << 20    # safetensors' own bound on a header (100 MB)


def problem(index: dict, preset: str, where: str, folder: str | None) -> str | None:
    fam = PRESETS[preset]
    why = _not_of_family(index, preset)
    if why:
        fits = [p for p in PRESETS if not _not_of_family(index, p)]
        other = (f"model.preset={' or '.join(fits)} for this checkpoint, or " if fits else "")
        return (
            f"{where} {why}. Fix: {other}a {preset} checkpoint (hf download "
            f"{fam.presets[preset]['hub_id']} --local-dir DIR, then model.path=DIR)")
    if folder is not None:
        problems = [p for name, entry in sorted(index.items())
                    for p in _component_problems(Path(folder), name, entry)]
        if problems:
            return (
                f"{where} is incomplete or damaged: {'; '.join(problems[:5])}"
                f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}. Fix: "
                f"download it again (remove what is damaged, then hf download "
                f"{fam.presets[preset]['hub_id']} --local-dir DIR), or save the pipeline again "
                f"(save_pretrained)")
    return None


def _is_set(value) -> bool:
    return bool(value) and value != [None, None]


def _not_of_family(index: dict, preset: str) -> str | None:
    """Why `index` is not a checkpoint of `preset`'s family, or None."""
    fam = PRESETS[preset]
    cls = index.get("_class_name")
    if cls != fam.pipeline:
        return (f"is a {cls} checkpoint (its model_index.json), not the {fam.pipeline} "
                f"model.preset={preset} loads")
    wrong = [f"{k} {'unset' if want else 'set'}" for k, want in fam.checkpoint.items()
             if _is_set(index.get(k)) != want]
    if wrong:
        return (f"is a {cls} checkpoint of another model than model.preset={preset} (its "
                f"model_index.json has {', '.join(wrong)})")
    return None


def _component_problems(folder: Path, name: str, entry) -> list[str]:
    """What is missing or damaged of component `name` (model_index.json: [library, class])."""
    if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or not entry[1]:
        return []                           # a pipeline setting, or a component left out (null)
    sub = folder / name
    if not sub.is_dir():
        return [f"{name}/ is missing (model_index.json lists {name}: {entry[1]})"]
    if NO_WEIGHTS.search(entry[1]):
        return []
    if not (sub / "config.json").is_file():
        return [f"{name}/config.json is missing"]
    for w in WEIGHTS:
        if (sub / w).is_file():
            return _safetensors_problems(sub / w, f"{name}/{w}")
        shards = sub / f"{w}.index.json"
        if shards.is_file():
            return _shard_problems(shards, name)
    return [f"{name}/ has no weights ({', '.join(WEIGHTS)} or a sharded .index.json)"]


def _shard_problems(index_file: Path, name: str) -> list[str]:
    try:
        files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        return [f"{name}/{index_file.name} is unreadable ({type(e).__name__}: {e})"]
    problems = []
    for f in files:
        p = index_file.parent / f
        if not p.is_file():
            problems.append(f"{name}/{f} is missing (listed in {index_file.name})")
        else:
            problems += _safetensors_problems(p, f"{name}/{f}")
    return problems


def _safetensors_problems(path: Path, shown: str) -> list[str]:
    if path.suffix != ".safetensors":
        return []                       # a pickle (.bin): read only by torch.load, on the worker
    why = safetensors_problem(path, shown)
    return [why] if why else []


def safetensors_problem(path: Path, shown: str) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte
    range, then the data: truncated or corrupt unless the size is what the header describes."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size >= 8 and n <= MAX_HEADER and n > size - 8:
                return f"{shown} is truncated: {size} bytes, its header alone takes {8 + n}"
            if size < 8 or n > MAX_HEADER:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                  default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"{shown} is not a readable safetensors file ({type(e).__name__}: {e})"[:300]
    if size != 8 + n + end:
        what = "truncated" if size < 8 + n + end else "longer than its header says"
        return f"{shown} is {what}: {size} bytes, its header describes {8 + n + end}"
    return None
