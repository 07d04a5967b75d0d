"""Shared fixtures. GPU tests (`@pytest.mark.gpu`) are skipped, with the reason shown, without CUDA."""
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # tests never touch the network
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def write_prompts(tmp_path):
    """write_prompts({"prompt": [...], ...}, name="p.parquet") -> path of a Parquet file."""
    def write(columns: dict, name: str = "prompts.parquet"):
        path = tmp_path / name
        pq.write_table(pa.table(columns), path)
        return str(path)
    return write
