"""What the docs name exists: every `python -m X` command, `compiler/...py` or `runner/...py` path
and `` `compiler.x.y` `` / `` `runner.x.y` `` name in README.md, docs/*.md, BENCHMARKS.md and
benchmarks/*.md (dated records too: their commands are rerun as written). The compiler package's
move into subpackages (issue 61) left records naming `python -m compiler.attn_probe` and
`compiler/video_vae.py`. Read from the files and the source tree (ast), nothing imported: the
project's modules by their files, others by `importlib.util.find_spec` of their top package. A
dated record keeps the names of its time where runner's flat modules moved into runner/driver/,
runner/serve/ and runner/io/ (issue 76; benchmarks/README.md says so): `runner.job` there is
read as `runner.driver.job`, and a name of that layout still has to exist under it."""
import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compiler", "runner")
COMMAND = re.compile(r"python3? -m ([A-Za-z_][\w.]*)(<?)")        # `<`: a placeholder, `<probe>`
PATH = re.compile(r"(?<![\w/.-])((?:compiler|runner)/[\w/.-]*\.py)\b")
DOTTED = re.compile(r"`((?:compiler|runner)(?:\.[A-Za-z_]\w*)+)")
LAYERS = ("driver", "serve", "io")     # issue 76: runner's flat modules moved into these


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "benchmarks").glob("*.md"))]


def runnable(module: str) -> bool:
    """`python -m module` finds something to run: a project module by its file (a package by its
    `__main__.py`), another by its top package being installed (not imported)."""
    top = module.split(".")[0]
    if top not in PACKAGES:
        return importlib.util.find_spec(top) is not None
    path = ROOT / module.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def top_names(path: Path) -> set[str]:
    """Names a module defines at its top: functions, classes, assignments, imports, and the strings
    of a top-level tuple or list (`__all__`, names served lazily by `__getattr__`)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if isinstance(node.value, (ast.Tuple, ast.List)):
                names |= {e.value for e in node.value.elts
                          if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return names


def resolves(dotted: str) -> bool:
    """`compiler.video.video_vae.chunk_for`: the longest run of packages and a module under the
    project's tree, then (if anything is left) a name that module defines at its top."""
    parts = dotted.split(".")
    path, i = ROOT / parts[0], 1
    while i < len(parts) and (path / parts[i]).is_dir():
        path, i = path / parts[i], i + 1
    if i < len(parts) and (path / f"{parts[i]}.py").is_file():
        module, i = path / f"{parts[i]}.py", i + 1
    else:
        module = path / "__init__.py"
    return module.is_file() and (i == len(parts) or parts[i] in top_names(module))


def of_its_time(name: str, sep: str) -> list[str]:
    """`name` (`runner.job.main`, or `runner/job.py` with `sep` "/") and what it is now if it
    names a module of runner's flat layout, moved into one of `LAYERS` (`runner.driver.job.main`)."""
    top, _, rest = name.partition(sep)
    return [name] + [sep.join((top, layer, rest)) for layer in LAYERS
                     if top == "runner" and rest and rest.split(sep)[0] not in LAYERS]


def dated(doc: Path) -> bool:
    """A record: benchmarks/<date>-<what>.md, written once, in the names of its day."""
    return doc.parent.name == "benchmarks" and doc.name[:1].isdigit()


def stale(docs: list[Path]) -> list[str]:
    """What `docs` name that does not exist, one line each: `doc: what`."""
    bad = []
    for doc in docs:
        text, name = doc.read_text(), doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name
        then = of_its_time if dated(doc) else (lambda n, sep: [n])
        bad += [f"{name}: python -m {m}" for m, placeholder in COMMAND.findall(text)
                if not placeholder and not any(map(runnable, then(m.rstrip("."), ".")))]
        bad += [f"{name}: {p}" for p in sorted(set(PATH.findall(text)))
                if not any((ROOT / q).is_file() for q in then(p, "/"))]
        bad += [f"{name}: {d}" for d in sorted(set(DOTTED.findall(text)))
                if not any(map(resolves, then(d, ".")))]
    return bad


def test_every_command_path_and_module_the_docs_name_exists():
    bad = stale(documents())
    assert not bad, "the docs name what does not exist (moved? give its path of today):\n" + \
        "\n".join(bad)


def test_the_check_sees_a_moved_module_a_moved_file_and_a_name_gone(tmp_path):
    """The forms the move left behind, each caught; their paths of today, a placeholder and
    another package's module pass."""
    doc = tmp_path / "old.md"
    doc.write_text("```\npython -m compiler.attn_probe out=x.json\npython -m compiler.bench.attn_probe\n"
                   "python -m runner.bench.<tool>\npython3 -m pytest -m gpu\n```\n"
                   "`compiler/video_vae.py` and `compiler/video/video_vae.py`; "
                   "`compiler.video_vae.chunk_for`, `compiler.video.video_vae.chunk_for`, "
                   "`compiler.video.video_vae.no_such_name`, `compiler.compile_pipe`.\n")
    found = [b.split(": ", 1)[1] for b in stale([doc])]
    assert found == ["python -m compiler.attn_probe", "compiler/video_vae.py",
                     "compiler.video.video_vae.no_such_name", "compiler.video_vae.chunk_for"]


def test_a_dated_record_keeps_runners_flat_names_and_the_docs_do_not(tmp_path):
    """Issue 76 moved runner's modules into runner/driver/, serve/ and io/: a record written
    before names them as they were, and is read through the move (a name gone under it is still
    caught); the README and docs/ name today's paths."""
    text = ("`python -m runner.warm job=x`, `runner/job.py`, `runner.job.main`, "
            "`runner.job.no_such_name`, `runner.bench.scale`\n")
    record, doc = tmp_path / "benchmarks" / "2026-11-25-x.md", tmp_path / "docs" / "x.md"
    for f in (record, doc):
        f.parent.mkdir()
        f.write_text(text)
    assert [b.split(": ", 1)[1] for b in stale([record])] == ["runner.job.no_such_name"]
    assert [b.split(": ", 1)[1] for b in stale([doc])] == [
        "python -m runner.warm", "runner/job.py", "runner.job.main", "runner.job.no_such_name"]
