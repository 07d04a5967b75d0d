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


# ---------------------------------------------------------------------------------------------
# One source of truth for config (runner/config.py's dataclasses).

def test_schema_is_the_only_place_defaults_live():
    from dataclasses import fields

    from runner.config import ModelSection, defaults, schema
    from runner.models import ModelSpec
    assert not (ROOT / "conf" / "defaults.yaml").exists()
    keys = schema()
    assert all(k.doc for k in keys.values()), "every key has a one-line doc"
    d = defaults()
    assert {f"{s}.{k}" for s in d for k in d[s]} == set(keys)
    # ModelSpec's defaults are the schema's (they used to disagree: tiny vs pretrained)
    for f in fields(ModelSection):
        assert getattr(ModelSpec("sd21"), f.name) == getattr(ModelSection(), f.name) or f.name == "preset"
    assert ModelSpec("sd21").source == "pretrained" == d.model.source


def test_compile_section_defaults_match_the_compiler():
    from compiler.options import parse_options
    from runner.config import CompileConfig
    assert parse_options({"mode": "none"}).to_dict() == CompileConfig().options


def test_readme_key_table_is_generated_from_the_schema():
    from runner.config import markdown_table
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- config-table")
    body = readme[readme.index("\n", start) + 1:readme.index("<!-- /config-table -->")].strip()
    assert body == markdown_table(), "README table is stale: paste `python -m runner.config --markdown`"


@pytest.mark.parametrize("arg,needle", [
    ("ray.num_workers=two", "ray.num_workers='two' has the wrong type: expected int or null"),
    ("compile.compile_vae=sometimes", "expected bool or null"),
    ("prompts.path=3.5", None),                      # numbers are accepted where strings are
    ("job.name=2024", None),
])
def test_types_come_from_the_annotations(arg, needle):
    from runner.config import ConfigError, load_config
    if needle is None:
        cfg = load_config(["job=demo_image", arg])
        k, v = arg.split("=")
        assert cfg[k.split(".")[0]][k.split(".")[1]] == v
        return
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(["job=demo_image", arg])


def test_unknown_section_suggests_and_lists_valid_sections():
    from runner.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"did you mean 'generation'\?.*valid keys: \[.*'compile'"):
        load_config(["job=demo_image", "generaton.seed=1"])


# ---------------------------------------------------------------------------------------------
# --help

def test_help_lists_jobs_examples_and_where_keys_are_documented(capsys):
    from runner.config import COMMON_KEYS, available_jobs
    from runner.job import main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m runner job=NAME")
    for job in available_jobs():
        assert f"  {job}  " in out
    examples = out.split("examples:")[1].split("\n\n")[0]
    assert examples.count("python -m runner job=") == 3
    for k in COMMON_KEYS:
        assert k in out
    assert "python -m runner.config" in out and "README.md" in out
    assert "main(argv)" not in out and "results.py" not in out      # no developer docstring


def test_no_arguments_prints_help_and_exits_2(capsys):
    from runner.job import main
    assert main([]) == 2
    assert "examples:" in capsys.readouterr().err
