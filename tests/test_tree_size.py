"""The tracked tree stays small: a GPU run carries the checkout beside a ~58 MiB bundle of packages
within 64 MiB (issue 61), so the project's own files get at most 6 MiB, and what benchmarks/data
keeps of a run is its figures (tables, logs, metrics, plots), never its media (videos, images,
tensors), which would eat that budget in a few runs."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 6 * 2 ** 20
# What a generation or benchmark run makes that is not a figure: outputs and tensors.
MEDIA = (".mp4", ".webm", ".avi", ".mov", ".mkv", ".gif", ".png", ".jpg", ".jpeg", ".webp",
         ".npy", ".npz", ".pt", ".pth", ".safetensors", ".bin", ".parquet", ".tgz", ".tar", ".gz")


def tracked() -> list[str]:
    """The tracked files (paths from the root); skips the test where there is no git checkout (a
    copy of the tree, as a GPU machine gets: its size was checked here before it was sent)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({type(e).__name__})")
    return [p for p in out.decode().split("\0") if p]


def sizes(paths: list[str]) -> dict[str, int]:
    """Bytes of each file as it is in the working tree (a tracked file deleted there counts 0)."""
    return {p: os.path.getsize(ROOT / p) if (ROOT / p).is_file() else 0 for p in paths}


def largest(by_size: dict[str, int], n: int = 10) -> str:
    top = sorted(by_size.items(), key=lambda kv: -kv[1])[:n]
    return "\n".join(f"  {s / 2 ** 10:8.0f} KiB  {p}" for p, s in top)


def test_the_tracked_tree_fits_beside_the_gpu_bundle():
    by_size = sizes(tracked())
    total = sum(by_size.values())
    assert total <= LIMIT, (f"the tracked tree is {total / 2 ** 20:.2f} MiB, over {LIMIT / 2 ** 20:.0f} MiB "
                            f"(a GPU run carries it beside the package bundle); the largest files:\n"
                            + largest(by_size))


def test_benchmark_data_keeps_figures_not_media():
    media = [p for p in tracked() if p.startswith("benchmarks/data/") and p.lower().endswith(MEDIA)]
    assert media == [], ("benchmarks/data keeps figures (tables, logs, metrics, plots), not a run's "
                         "media (its summary.json, metrics/ and logs, not its media/). Remove: "
                         + ", ".join(media))


def test_the_message_names_the_largest_files_first():
    text = largest({"a.txt": 10, "big.svg": 3 * 2 ** 20, "mid.log": 2 ** 20}, n=2)
    assert text.splitlines() == ["      3072 KiB  big.svg", "      1024 KiB  mid.log"]
