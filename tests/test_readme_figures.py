"""The README's test-suite figures come from records (issue 75: typed figures went stale: 385 s,
"101 tests", pip's 43 s). Each "N passed ... in S s of pytest" is followed by a link to the log
it comes from, under benchmarks/data; the figures must be that log's pytest line."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\((benchmarks/data/[^)]+\.(?:txt|log))\)")
PYTEST = re.compile(r"(\d+) passed((?:, \d+ \w+)*) in ([\d.]+)s")


def pytest_line(path: pathlib.Path) -> tuple[int, dict, float]:
    """The last pytest summary of a log: passed, the other counts by kind, seconds."""
    *_, last = PYTEST.finditer(path.read_text(errors="replace"))
    others = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", last.group(2))}
    return int(last.group(1)), others, float(last.group(3))


def claims(readme: str) -> list[tuple[str, str]]:
    """(text before a data link since the previous one, the linked path), in order."""
    out, start = [], 0
    for m in LINK.finditer(readme):
        out.append((readme[start:m.start()], m.group(1)))
        start = m.end()
    return out


def test_every_suite_figure_in_the_readme_is_its_records():
    readme = (ROOT / "README.md").read_text()
    checked = 0
    for text, path in claims(readme):
        log = ROOT / path
        assert log.is_file(), f"README links {path}, which is not in the tree"
        flat = " ".join(text.replace("*", "").split())
        if " passed" not in flat:
            continue                       # a figure of something else (the install's seconds)
        passed, others, seconds = pytest_line(log)
        assert f"{passed} passed" in flat, (path, passed, flat[-300:])
        assert f"in {round(seconds):,} s of pytest" in flat, (path, seconds, flat[-300:])
        if "skipped" in others:
            assert f"{others['skipped']} skipped" in flat, (path, others, flat[-300:])
        checked += 1
    typed = re.findall(r"\d+ passed", " ".join(readme.replace("*", "").split()))
    assert checked == len(typed) and checked >= 2, ("a suite figure without its record's link",
                                                     typed, checked)


def test_the_readmes_install_seconds_are_the_ci_records():
    """The quick start's install time: the range of `.ci/run`'s "pip install done at N s" over
    the CI records the README links."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    logs = {ROOT / p for p in LINK.findall(readme) if pathlib.Path(p).name.startswith("ci-")}
    done = sorted(int(n) for log in logs
                  for n in re.findall(r"pip install done at (\d+) s", log.read_text()))
    assert done and f"{done[0]}-{done[-1]} s in its records" in readme, done
