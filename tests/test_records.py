"""benchmarks/ holds records (issue 76): dated reports, their data and a few entry points. A record's
commands are rerun as written, so every script a doc names (`benchmarks/NAME.sh|.py|.cuh`, or the
bare name of one that was ever under benchmarks/) exists at HEAD, or the doc names a commit to
check out for it (`git checkout SHA`), at which it exists. The scaffolding and the experiments that
left the tree in issue 76 are named so by the records that ran them. Read from the files and git
(`git cat-file`; without a git checkout, as a GPU machine's copy, the commits are not verified)."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPT = r"[A-Za-z0-9_]+\.(?:sh|py|cuh)"
PATH = re.compile(rf"(?<![\w/.-])benchmarks/({SCRIPT})\b")
BARE = re.compile(rf"(?<![\w/.-])({SCRIPT})\b")
CHECKOUT = re.compile(r"git checkout ([0-9a-f]{7,40})\b")
MAX_SCRIPTS = 3          # shell scripts under benchmarks/ (the entry points a record runs)


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted(BENCH.glob("*.md"))]


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def history_names() -> set[str] | None:
    """The script names ever under benchmarks/ (top level) in git's history; None without git."""
    done = _git("log", "--all", "--format=", "--name-only", "--", "benchmarks/")
    if done is None or done.returncode != 0:
        return None
    return {p.split("/", 1)[1] for p in done.stdout.split()
            if p.count("/") == 1 and re.fullmatch(SCRIPT, p.split("/", 1)[1])}


def exists_at(commit: str, name: str) -> bool | None:
    """benchmarks/NAME at `commit` (None: no git to ask)."""
    done = _git("cat-file", "-e", f"{commit}:benchmarks/{name}")
    return None if done is None else done.returncode == 0


def stale(docs: list[Path], head: set[str], known: set[str] | None) -> list[str]:
    """`doc: name` for each script a doc names that is not at HEAD (`head`: the names there) and
    that no commit the doc checks out has. `known`: names ever under benchmarks/, whose bare
    mentions count too (None: only `benchmarks/NAME` paths count)."""
    bad = []
    for doc in docs:
        text = doc.read_text()
        names = set(PATH.findall(text))
        if known is not None:
            names |= {n for n in BARE.findall(text) if n in known}
        commits = CHECKOUT.findall(text)
        where = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name
        for name in sorted(names - head):
            if not commits:
                bad.append(f"{where}: {name} (not at HEAD, and no `git checkout SHA` for it)")
                continue
            found = [exists_at(c, name) for c in commits]
            if None not in found and not any(found):
                bad.append(f"{where}: {name} (at none of {', '.join(commits)})")
    return bad


def at_head() -> set[str]:
    return {p.name for p in BENCH.iterdir() if p.is_file() and re.fullmatch(SCRIPT, p.name)}


def test_benchmarks_holds_records_their_data_and_a_few_entry_points():
    cuh = sorted(str(p.relative_to(ROOT)) for p in BENCH.rglob("*.cuh"))
    shell = sorted(p.name for p in BENCH.glob("*.sh"))
    assert cuh == [], f"kernel experiments are not records: {cuh}"
    assert len(shell) <= MAX_SCRIPTS, f"at most {MAX_SCRIPTS} shell scripts under benchmarks/: {shell}"
    assert sorted(p.name for p in BENCH.glob("*.py")) == [], "a tool belongs in runner/bench or compiler/bench"


def test_every_script_a_record_names_exists_or_the_record_names_its_commit():
    bad = stale(documents(), at_head(), history_names())
    assert not bad, ("a doc names a script that is not in the tree: name the last commit that had "
                     "it (`git log -1 --format=%h -- benchmarks/NAME` before removing it) as "
                     "`git checkout SHA`:\n" + "\n".join(bad))


def test_the_check_sees_a_removed_script_and_a_wrong_commit(tmp_path):
    if history_names() is None:
        pytest.skip("not a git checkout")
    head_commit = _git("rev-parse", "--short", "HEAD").stdout.strip()
    doc = tmp_path / "r.md"
    doc.write_text("`bash benchmarks/gone.sh pair` and `gpu_suite.sh`\n")
    assert stale([doc], {"gpu_suite.sh"}, {"gone.sh", "gpu_suite.sh"}) == [
        "r.md: gone.sh (not at HEAD, and no `git checkout SHA` for it)"]
    doc.write_text(f"reproduce: `git checkout {head_commit} && bash benchmarks/gone.sh`\n")
    assert stale([doc], set(), None) == [f"r.md: gone.sh (at none of {head_commit})"]
    doc.write_text(f"reproduce: `git checkout {head_commit} && bash benchmarks/gpu_suite.sh DIR 1`\n")
    assert stale([doc], set(), None) == []        # it exists at that commit


RECORD = re.compile(r"(?<![\w/.-])benchmarks/(20\d\d-\d\d-\d\d-[\w.-]+?\.md)\b")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def missing_records(files: list[Path]) -> list[str]:
    """`file: target` for each dated record a file names (`benchmarks/DATE-NAME.md`, in a doc, a
    script's header or a code comment) and each relative link of a Markdown file whose target is
    not in the tree (mlperf_wan22.sh's header named a record under a name it never had)."""
    bad = []
    for f in files:
        text = f.read_text(errors="replace")
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name
        bad += [f"{where}: benchmarks/{n}" for n in sorted(set(RECORD.findall(text)))
                if not (BENCH / n).is_file()]
        if f.suffix == ".md":
            bad += [f"{where}: {t}" for t in sorted(set(LINK.findall(text)))
                    if not re.match(r"[a-z]+:", t) and not (f.parent / t).exists()]
    return bad


def tracked_text_files() -> list[Path]:
    """The docs, benchmarks/' scripts and the project's Python sources (no git needed)."""
    code = [p for d in ("runner", "compiler", "tests", "conf", "jobs") for p in (ROOT / d).rglob("*")
            if p.suffix in (".py", ".yaml", ".sh") and p.is_file()]
    return documents() + sorted(BENCH.glob("*.sh")) + sorted(code)


def test_every_record_and_link_a_file_names_is_in_the_tree():
    bad = missing_records(tracked_text_files())
    assert not bad, "names or links a record or file that is not in the tree:\n" + "\n".join(bad)


def test_the_record_check_sees_a_wrong_record_name_and_a_broken_link(tmp_path):
    gone = "benchmarks/" + "2026-12-02-mlperf-wan22-o3-cold.md"     # split: this file is checked too
    doc = tmp_path / "r.md"
    doc.write_text(f"see {gone} and [data](data/gone/)\n"
                   "and [here](https://example.com) and benchmarks/2026-12-06-gpu-suite-two-calls-h100.md\n")
    assert missing_records([doc]) == [f"r.md: {gone}", "r.md: data/gone/"]
