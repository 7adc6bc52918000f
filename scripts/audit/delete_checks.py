"""Delete each check of a module in turn and run the tests that should notice.

Every protection needs a test that fails when the protection is deleted. This script deletes
each ``raise`` statement of one module in turn (it becomes ``pass``), runs the given tests, and
prints the checks whose deletion no test noticed. It works on a scratch copy of the repository,
never on this checkout, and is not part of the suite (one pytest run per ``raise``)::

    python scripts/audit/delete_checks.py codec/wire.py tests/unit/test_wire.py tests/unit/test_update_bounds.py
    python scripts/audit/delete_checks.py node/window/manifest.py tests/unit/test_consensus.py -k manifest

Exits 1 if a deletion went unnoticed.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPIED = (
    "codec",
    "protocol",
    "node",
    "miner",
    "validator",
    "commands",
    "lab",
    "tests",
    "pyproject.toml",
)


def raises(source: str) -> list[ast.Raise]:
    """Every ``raise`` statement of `source`, in line order."""
    found = {n.lineno: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Raise)}
    return [found[line] for line in sorted(found)]


def without(source: str, statement: ast.Raise) -> str:
    """`source` with `statement` replaced by ``pass`` (line numbers kept)."""
    lines = source.split("\n")
    first = lines[statement.lineno - 1]
    indent = first[: len(first) - len(first.lstrip())]
    span = (statement.end_lineno or statement.lineno) - statement.lineno
    kept = lines[: statement.lineno - 1] + [indent + "pass"] + [""] * span
    return "\n".join(kept + lines[statement.lineno + span :])


def noticed(scratch: Path, pytest_args: list[str], timeout_s: float) -> bool:
    """Whether the tests fail (or hang) in `scratch`."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow"]
    try:
        done = subprocess.run(
            [*cmd, *pytest_args], cwd=scratch, capture_output=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return True
    return done.returncode != 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", help="the module whose checks are deleted, e.g. codec/wire.py")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="tests (and pytest options)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="delete-checks-") as tmp:
        scratch = Path(tmp)
        for name in COPIED:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, scratch / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, scratch / name)
        target = scratch / args.module
        source = target.read_text()
        if noticed(scratch, [*args.pytest_args, "--co"], args.timeout):
            print("the tests do not collect on the untouched copy", file=sys.stderr)
            return 2
        unnoticed = 0
        for statement in raises(source):
            target.write_text(without(source, statement))
            t0 = time.monotonic()
            ok = noticed(scratch, args.pytest_args, args.timeout)
            target.write_text(source)
            unnoticed += not ok
            line = source.split("\n")[statement.lineno - 1].strip()[:100]
            verdict = "noticed  " if ok else "UNNOTICED"
            print(
                f"{verdict} {args.module}:{statement.lineno} {line} ({time.monotonic() - t0:.0f} s)"
            )
    return 1 if unnoticed else 0


if __name__ == "__main__":
    sys.exit(main())
