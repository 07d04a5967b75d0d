"""CPU seconds of a test run's processes by the test that started them, beside tests/timeline.py:

    python tests/cpu_sampler.py /tmp/cpu.json &     # polls /proc twice a second until killed
    RUNNER_TEST_TIMELINE=/tmp/t.jsonl python -m pytest -q -n 4 --dist worksteal; kill %1

A CLI run's processes and its Ray workers carry RUNNER_TEST_ID (tests/conftest.py `cli_env`, under
RUNNER_TEST_TIMELINE); the rest (Ray's daemons, the test processes themselves, whose own CPU the
timeline's lines hold) are grouped by process name. A process's last sample counts: one that lives
under half a second is missed. Writes {"by_test": {test id or "untagged": CPU-s},
"by_program": {"tagged|untagged: name": CPU-s}, "processes": {same keys: how many}}."""
import json
import os
import re
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def label(cmd: str, stat: str) -> str:
    """A short name for a process: its program and what it runs."""
    words = cmd.split()
    if not words:
        return stat[stat.index("(") + 1:stat.rindex(")")]
    if words[0].startswith("ray::"):
        return words[0]
    for w in words[1:4]:
        if w.endswith(".py") or w in ("-m", "-c"):
            i = words.index(w)
            return " ".join(os.path.basename(x) for x in words[i:i + 2])[:60]
    return re.sub(r"\d+", "N", os.path.basename(words[0]))[:40]


def sample(seen: dict) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            key = f"{pid}:{fields[19]}"          # pid and start time: pids are reused
            if key not in seen or seen[key][0] == "untagged":   # an exec may bring the tag
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                tag = env.get(b"RUNNER_TEST_ID")
                seen[key] = [tag.decode() if tag else "untagged", 0.0, ""]
            # the command line as last seen (Ray's workers retitle themselves once started)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                seen[key][2] = label(f.read().replace(b"\0", b" ").decode(errors="replace"), stat)
        except (OSError, ValueError):
            continue
        seen[key][1] = (int(fields[11]) + int(fields[12])) / TICK    # utime + stime


def main(path: str) -> None:
    seen: dict = {}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        sample(seen)
        time.sleep(0.5)
    by_test: dict = {}
    by_program: dict = {}
    processes: dict = {}       # how many processes of each name
    for tag, cpu, name in seen.values():
        by_test[tag] = by_test.get(tag, 0.0) + cpu
        key = f"{'untagged' if tag == 'untagged' else 'tagged'}: {name}"
        by_program[key] = by_program.get(key, 0.0) + cpu
        processes[key] = processes.get(key, 0) + 1
    json.dump({"by_test": by_test, "by_program": by_program, "processes": processes},
              open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
