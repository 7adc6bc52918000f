"""Mutation check of the subtensor backend: every pallet, storage item, call and call-parameter
name it sends must be caught by the offline chain tests (docs/chains.md).

For each quoted occurrence of such a name in `protocol/chain/subtensor.py` and
`protocol/chain/subtensor_state.py`, a scratch copy of the repository gets that one occurrence
changed (``"Uids"`` -> ``"UidsX"``) and runs the metadata, call and snapshot tests against it.
It prints each occurrence as caught or not. Occurrences that are only labels of error messages
(``what="SubnetworkN"``, ``read(..., "Uids")``) reach no chain and are expected to survive.

    python scripts/audit/chain_name_mutations.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMES = (
    "Timestamp", "Now", "SubtensorModule", "Uids", "CommitRevealWeightsEnabled", "Commitments",
    "set_commitment", "CommitmentOf", "set_weights", "Weights", "NetworksAdded", "SubnetworkN",
    "ValidatorPermit", "LastUpdate", "TotalHotkeyAlpha", "Keys", "BlockAtRegistration", "netuid",
    "dests", "weights", "version_key", "info", "fields",
)  # fmt: skip
FILES = ("protocol/chain/subtensor.py", "protocol/chain/subtensor_state.py")
TESTS = (
    "tests/unit/test_chain_metadata.py",
    "tests/unit/test_chain_subtensor_calls.py",
    "tests/unit/test_chain_subtensor_snapshot.py",
)


def occurrences(source: str) -> list[tuple[int, int, str]]:
    """(offset, line, name) of every quoted name outside comments and docstring bullets."""
    lines = source.splitlines()
    out = []
    for name in NAMES:
        for m in re.finditer(f'"{re.escape(name)}"', source):
            line = source.count("\n", 0, m.start()) + 1
            if not lines[line - 1].strip().startswith(("#", "-", "`")):
                out.append((m.start(), line, name))
    return sorted(out)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "repo"
        shutil.copytree(ROOT, scratch, ignore=shutil.ignore_patterns(".venv", ".git", "runs"))
        env = dict(os.environ, PYTHONPATH=str(scratch))
        survived = []
        for rel in FILES:
            path = scratch / rel
            source = path.read_text()
            for offset, line, name in occurrences(source):
                end = offset + len(name) + 2
                path.write_text(f'{source[:offset]}"{name}X"{source[end:]}')
                run = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                    cwd=scratch, env=env, capture_output=True, text=True,
                )  # fmt: skip
                path.write_text(source)
                caught = run.returncode != 0
                print(f"{rel}:{line} {name}: {'caught' if caught else 'survived'}", flush=True)
                if not caught:
                    survived.append(f"{rel}:{line} {name}")
        print(f"{len(survived)} survived: {survived}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
