"""Where a test run's wall time went, from RUNNER_TEST_TIMELINE's lines (tests/conftest.py):

    RUNNER_TEST_TIMELINE=/tmp/t.jsonl python -m pytest -q -n 4 --dist worksteal
    python tests/timeline.py /tmp/t.jsonl [N]

Prints each worker's busy seconds and when it ran out of tests, how many workers were busy over
the run (the idle tail: the minutes one or two long tests run alone), and the N longest tests
with their start and end (seconds from the first start); with CPU=FILE (tests/cpu_sampler.py's
output of the same run), the N costliest tests in CPU-seconds too: the test process's own, plus
its CLI runs' and their Ray workers' (the processes that carry its RUNNER_TEST_ID), or the
children it waited for where those are more (an in-process compile's C++ builds)."""
import json
import os
import sys


def main(path: str, n: int = 25) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if any(r["worker"] != "main" for r in rows):   # under xdist the main process logs them too
        rows = [r for r in rows if r["worker"] != "main"]
    t0 = min(r["start"] for r in rows)
    end = max(r["end"] for r in rows)
    print(f"{len(rows)} tests, {end - t0:.0f} s from the first start to the last end")
    for w in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == w]
        busy = sum(r["end"] - r["start"] for r in mine)
        print(f"  {w}: {len(mine)} tests, busy {busy:.0f} s, last end at {max(r['end'] for r in mine) - t0:.0f} s")
    step = max((end - t0) / 20, 1)
    print("busy workers over time (each mark: a twentieth of the run):")
    for k in range(20):
        a, b = t0 + k * step, t0 + (k + 1) * step
        busy = sum(max(0.0, min(b, r["end"]) - max(a, r["start"])) for r in rows) / step
        print(f"  {a - t0:6.0f}-{b - t0:6.0f} s  {busy:4.1f}  {'#' * round(busy * 10)}")
    print(f"the {n} longest:")
    for r in sorted(rows, key=lambda r: r["start"] - r["end"])[:n]:
        print(f"  {r['end'] - r['start']:6.1f} s  {r['start'] - t0:6.0f}-{r['end'] - t0:6.0f}  {r['worker']}  {r['id']}")
    if os.environ.get("CPU") and "cpu" in rows[0]:
        sampled = json.load(open(os.environ["CPU"]))
        tagged = sampled["by_test"]
        cost = {r["id"]: r["cpu"] + max(r["children_cpu"], tagged.get(r["id"], 0.0)) for r in rows}
        total = sum(sampled["by_program"].values())
        print(f"CPU-seconds: {total:.0f} sampled in all, {sum(cost.values()):.0f} of them the tests' "
              f"(the rest: Ray's daemons, the test processes' imports and collection, services)")
        for name, s in sorted(sampled["by_program"].items(), key=lambda x: -x[1])[:10]:
            print(f"  {s:6.1f}  {name}")
        print(f"the {n} costliest tests:")
        for i, s in sorted(cost.items(), key=lambda x: -x[1])[:n]:
            print(f"  {s:6.1f} CPU-s  {i}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
