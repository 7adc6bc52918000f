"""A pytest plugin: the CPU time of every test, its own process's and its children's.

Each test's user + system time (`resource.getrusage`, the test process and the children it
waited for) and wall time go to ``$CPU_PER_TEST_OUT/<pid>.jsonl`` (default
``/tmp/cpu-per-test``), one line per test; ``--summary`` prints the heaviest files and tests.

    PYTHONPATH=scripts/experiments OMP_NUM_THREADS=1 python -m pytest -p cpu_per_test \\
        -n 2 -m "not slow" tests/unit tests/e2e
    python scripts/experiments/cpu_per_test.py --summary
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

OUT = Path(os.environ.get("CPU_PER_TEST_OUT", "/tmp/cpu-per-test"))


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own, kids, began = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.time()
    yield
    row = {
        "id": item.nodeid,
        "own": _cpu(resource.RUSAGE_SELF) - own,
        "kids": _cpu(resource.RUSAGE_CHILDREN) - kids,
        "wall": time.time() - began,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    with (OUT / f"{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def summary(top: int) -> None:
    rows = [json.loads(line) for p in sorted(OUT.glob("*.jsonl")) for line in p.open()]
    by_file: collections.Counter[str] = collections.Counter()
    for r in rows:
        by_file[r["id"].split("::")[0]] += r["own"] + r["kids"]
    print(f"{len(rows)} tests, {sum(by_file.values()):.0f} CPU-s")
    for name, cpu in by_file.most_common(top):
        print(f"{cpu:8.1f}  {name}")
    for r in sorted(rows, key=lambda r: -(r["own"] + r["kids"]))[:top]:
        print(f"{r['own'] + r['kids']:8.1f}  {r['wall']:7.1f} s wall  {r['id']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summary", action="store_true", help="print the heaviest files, tests")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    if args.summary:
        summary(args.top)
