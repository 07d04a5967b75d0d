"""What a new user sees (issue 17): `--help`, start-up phases and progress lines, a no-op rerun,
a quiet embedded Ray, the summary's legend; and the two structural rules behind them: one config
schema, and `compiler` independent of `runner`."""
import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_compiler_never_imports_runner():
    """`compiler` is a library; `runner` is its application (the benchmark lives in runner/bench.py)."""
    bad = []
    for path in sorted((ROOT / "compiler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "runner"]
    assert bad == []
