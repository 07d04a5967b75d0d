"""The code's layout rules, read from the source itself (ast, no imports): the library never imports
the application, no module imports another's private names, no import cycle between modules, and
no model family's name outside its family module."""

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
    """(imported module, imported names) for every import in `tree`, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = name if is_pkg else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            mod = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            yield mod, tuple(a.name for a in node.names)


def graph():
    mods = modules()
    pkgs = {n for n in mods if (ROOT / n.replace(".", "/") / "__init__.py").exists()}
    return mods, {n: list(imports(n, t, n in pkgs)) for n, t in mods.items()}


def test_the_compiler_never_imports_the_runner():
    _, edges = graph()
    bad = [(n, m) for n, imps in edges.items() if n.startswith("compiler")
           for m, _ in imps if m.split(".")[0] == "runner"]
    assert bad == []


def test_no_module_imports_another_modules_private_names():
    mods, edges = graph()
    bad = [(n, m, x) for n, imps in edges.items() for m, names in imps
           if m in mods and m != n for x in names
           if x.startswith("_") and not x.startswith("__") and f"{m}.{x}" not in mods]
    assert bad == [], "private names imported across modules: " + repr(bad)


def test_no_import_cycle_between_modules():
    """Module-level imports only (a function-level import runs after both modules loaded)."""
    mods, _ = graph()
    pkgs = {n for n in mods if (ROOT / n.replace(".", "/") / "__init__.py").exists()}
    top = {}
    for n, tree in mods.items():
        body = ast.Module(body=[s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))],
                          type_ignores=[])
        deps = set()
        for m, names in imports(n, body, n in pkgs):
            for target in [f"{m}.{x}" for x in names if f"{m}.{x}" in mods] or [m]:
                if target in mods and target != n and not n.startswith(target + "."):
                    deps.add(target)
        top[n] = deps

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for d in top[node]:
                if d == start:
                    return path + [d]
                if d not in seen:
                    seen.add(d)
                    stack.append((d, path + [d]))
        return None

    cycles = [c for n in top if (c := cycle_from(n))]
    assert cycles == [], "import cycles: " + repr(cycles[:3])


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
