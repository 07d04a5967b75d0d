"""The code's layout rules, read from the source itself (ast, no imports): the library never imports
the application, no module imports another's private names, no import cycle between modules (at any
level: module, class or function), and no model family's name outside its family module. And every
name the tests take from the packages exists (that one imports the modules it checks)."""

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runner", "compiler")


def modules() -> dict[str, ast.Module]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return out


def imports(name: str, tree: ast.Module, is_pkg: bool):
    """(imported module, imported names) for every import in `tree`, at any level (module, class,
    function), relative ones resolved; not those under `if TYPE_CHECKING:`, which never run."""
    skip = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and _type_checking(b.test)
            for stmt in b.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = name if is_pkg else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            mod = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            yield mod, tuple(a.name for a in node.names)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph():
    mods = modules()
    pkgs = {n for n in mods if (ROOT / n.replace(".", "/") / "__init__.py").exists()}
    return mods, {n: list(imports(n, t, n in pkgs)) for n, t in mods.items()}


def test_the_compiler_never_imports_the_runner():
    _, edges = graph()
    bad = [(n, m) for n, imps in edges.items() if n.startswith("compiler")
           for m, _ in imps if m.split(".")[0] == "runner"]
    assert bad == []


# runner/ by role (issue 76): driver/ is the job's driver process; serve/ the worker side (Ray
# actors), io/ inputs, outputs and storage, families/ the model families, all of which the
# workers import, as they do the package itself and runner.config (the config and its types).
WORKER_SIDE = ("runner", "runner.config", "runner.serve", "runner.io", "runner.families")


def worker_side(name: str) -> bool:
    return name in WORKER_SIDE or name.startswith(tuple(f"{p}." for p in WORKER_SIDE[2:]))


def driver_imports(edges) -> list[tuple[str, str]]:
    """(module, what it imports) for each import of runner.driver by a worker-side module, at any
    level (a function's own imports too)."""
    return [(n, m if m != "runner" else "runner.driver") for n, imps in edges.items()
            if worker_side(n) for m, names in imps
            if m == "runner.driver" or m.startswith("runner.driver.")
            or (m == "runner" and "driver" in names)]


def test_the_worker_side_never_imports_the_driver():
    """No module of runner/serve/, runner/io/ or runner/families/ (nor runner.config or the
    package) imports runner/driver/, at any level: a worker never loads the driver's code, and
    what both sides need lives on the worker's side (`outputs.failed_row`, once
    `results.failed_row`, the worker's one driver import). The driver imports them freely."""
    _, edges = graph()
    assert driver_imports(edges) == []
    mutated = {"runner.serve.worker": [("runner.driver.results", ("failed_row",))],
               "runner.io.images": [("runner", ("driver",))],
               "runner.families.wan": [("runner.driver", ("job",))],
               "runner.config": [("runner.driver.checks", ("JobError",))],
               "runner.driver.job": [("runner.serve.worker", ("Worker",))],
               "runner.bench.canary": [("runner.driver.job", ())],
               "runner.iox": [("runner.driver.job", ())]}
    assert driver_imports(mutated) == [
        ("runner.serve.worker", "runner.driver.results"), ("runner.io.images", "runner.driver"),
        ("runner.families.wan", "runner.driver"), ("runner.config", "runner.driver.checks")]


def test_the_library_never_imports_its_probes():
    """`compiler.bench` holds measurement tools (`python -m compiler.bench.<probe>`): no module
    outside it imports them, so they stay out of the library's import path."""
    _, edges = graph()
    bad = [(n, m) for n, imps in edges.items() if not n.startswith("compiler.bench")
           for m, names in imps
           if m.startswith("compiler.bench") or (m == "compiler" and "bench" in names)]
    assert bad == []


def benchmark_imports(edges) -> list[tuple[str, str]]:
    """(module, what it imports) for each import of `benchmarks` (the records' folder) by a module
    of the packages, at any level."""
    return [(n, m) for n, imps in edges.items() for m, names in imps
            if m.split(".")[0] == "benchmarks"]


def test_nothing_under_benchmarks_is_imported_by_the_packages():
    """benchmarks/ holds records and their entry points (issue 76): runner/ and compiler/ never
    import from it (their tools are `runner.bench` and `compiler.bench`), so a record's folder can
    be pruned without touching what runs."""
    _, edges = graph()
    assert benchmark_imports(edges) == []
    mutated = {"runner.x": [("benchmarks.qk_ab", ("main",))], "compiler.y": [("benchmarks", ())]}
    assert benchmark_imports(mutated) == [("runner.x", "benchmarks.qk_ab"), ("compiler.y", "benchmarks")]


def test_no_module_imports_another_modules_private_names():
    mods, edges = graph()
    bad = [(n, m, x) for n, imps in edges.items() for m, names in imps
           if m in mods and m != n for x in names
           if x.startswith("_") and not x.startswith("__") and f"{m}.{x}" not in mods]
    assert bad == [], "private names imported across modules: " + repr(bad)


def module_graph(mods: dict[str, ast.Module], pkgs: set[str]) -> dict[str, set[str]]:
    """module -> the modules of `mods` it imports, at any level (a function-level import is still
    a dependency: it runs whenever that function does)."""
    deps = {}
    for n, tree in mods.items():
        deps[n] = set()
        for m, names in imports(n, tree, n in pkgs):
            for target in [f"{m}.{x}" for x in names if f"{m}.{x}" in mods] or [m]:
                if target in mods and target != n and not n.startswith(target + "."):
                    deps[n].add(target)
    return deps


def cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for d in deps.get(node, ()):
                if d == start:
                    return path + [d]
                if d not in seen:
                    seen.add(d)
                    stack.append((d, path + [d]))
        return None
    return [c for n in deps if (c := cycle_from(n))]


def test_no_import_cycle_between_modules():
    """Imports at any level count (runner.serve.actor imported runner.serve.worker inside a method, and
    runner.serve.worker imported runner.serve.actor at the top: a cycle the module-level view missed)."""
    mods = modules()
    pkgs = {n for n in mods if (ROOT / n.replace(".", "/") / "__init__.py").exists()}
    found = cycles(module_graph(mods, pkgs))
    assert found == [], "import cycles: " + repr(found[:3])


def test_the_cycle_check_sees_function_level_and_ignores_type_checking_imports():
    def deps(a_src, b_src):
        return module_graph({"pkg.a": ast.parse(a_src), "pkg.b": ast.parse(b_src)}, set())
    inner = "def f():\n    from . import b\n"
    assert cycles(deps(inner, "from .a import x\n"))                          # found at any level
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import Y\n"
    assert not cycles(deps(guarded, "from .a import x\n"))                   # never runs


def family_words() -> set[str]:
    from runner.families import FAMILIES, PRESETS
    return {w.lower() for f in FAMILIES.values() for w in (f.name, f.pipeline)} | set(PRESETS) | {
        n[:-3] for n in os.listdir(ROOT / "runner" / "families") if n.endswith(".py")} - {
        "__init__", "record", "parts"}


def test_no_family_name_outside_the_family_modules():
    """Adding a family is one module under runner/families (+ presets, a job): no code elsewhere
    in runner/ or compiler/ names a family, a preset or a family's pipeline class (an identifier, or a string
    that is one: what a branch on the family would compare with). Docs and help text may."""
    words = family_words()
    assert {"latte", "pixart_alpha_1024", "wan21_t2v_1_3b", "lattepipeline"} <= words
    named = re.compile(r"(?<![a-z])(" + "|".join(sorted(map(re.escape, words), key=len,
                                                         reverse=True)) + r")(?![a-z])")
    bad = []
    for path in sorted([*(ROOT / "runner").rglob("*.py"), *(ROOT / "compiler").rglob("*.py")]):
        if path.parent.name == "families":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                text = node.id
            elif isinstance(node, ast.Attribute):
                text = node.attr
            elif isinstance(node, ast.alias):
                text = node.name
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value if node.value.lower() in words else ""
            else:
                continue
            if named.search(text.lower()):
                bad.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {text}")
    assert bad == [], "\n".join(bad)


DRIVER = ("job", "checks", "dispatch", "progress", "summary", "raypool")


def test_the_driver_keeps_its_state_in_objects_and_the_job_reads_as_a_short_recipe():
    """No `nonlocal` in the driver's modules (a run's state is `JobRun`'s, its callbacks its
    methods), and the locked part of the job, its recipe, fits on one screen (<= 50 lines)."""
    for name in DRIVER:
        tree = ast.parse((ROOT / "runner" / "driver" / f"{name}.py").read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Nonlocal)], name
    tree = ast.parse((ROOT / "runner" / "driver" / "job.py").read_text())
    (recipe,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_run_locked"]
    assert recipe.end_lineno - recipe.lineno + 1 <= 50


def test_every_module_is_in_the_readme_code_map():
    """The README's one-line-per-file map names every module of the two packages."""
    import glob
    readme = open(os.path.join(ROOT, "README.md")).read()
    files = [os.path.relpath(f, ROOT) for pkg in ("runner", "compiler")
             for f in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True)]
    lines = readme.splitlines()

    def named(f):   # its path, or its name on a row of its directory's files (`dir/a.py`, `b.py`)
        d, name = os.path.split(f)
        return f"`{f}`" in readme or any(f"`{d}/" in line and f"`{name}`" in line for line in lines)
    missing = [f for f in files if not f.endswith("__init__.py") and not named(f)]
    assert not missing, f"add to the README's code map: {missing}"


def test_every_name_the_tests_take_from_the_packages_exists():
    """Each `from runner... / compiler... import X` in a test file, at any level (a function's own
    imports too), names something that exists, and so does each attribute read off a package
    module a test imported (`compiler.compile_pipe`, `step_cache.apply`). A gpu test never runs
    on CPU, so a name moved away from under it was seen only on a GPU machine (issue 48: the
    A14B test imported `WorkerConfig` from `runner.serve.actor`). Imports the modules named."""
    import importlib
    import types
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = lambda node: f"{path.name}:{node.lineno}"
        modules = {}                                   # name bound in the file -> package module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                    node.module or "").split(".")[0] in PACKAGES:
                mod = importlib.import_module(node.module)
                for a in node.names:
                    try:
                        v = getattr(mod, a.name) if hasattr(mod, a.name) else \
                            importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        bad.append(f"{where(node)}: from {node.module} import {a.name}")
                        continue
                    if isinstance(v, types.ModuleType):
                        modules[a.asname or a.name] = v
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in PACKAGES:
                        importlib.import_module(a.name)
                        modules[a.asname or a.name.split(".")[0]] = importlib.import_module(
                            a.name if a.asname else a.name.split(".")[0])
        rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.value.id not in rebound):
                continue
            mod = modules[node.value.id]
            if not hasattr(mod, node.attr):
                try:
                    importlib.import_module(f"{mod.__name__}.{node.attr}")
                except ImportError:
                    bad.append(f"{where(node)}: {node.value.id}.{node.attr} ({mod.__name__})")
    assert bad == [], "\n".join(bad)
