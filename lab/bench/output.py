"""A bench's result printed the way it was asked for: JSON (``--json``) or its tables."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table


def emit(result: dict[str, Any], as_json: bool, tables: Callable[[dict[str, Any]], None]) -> int:
    """Print ``result`` as indented JSON or through ``tables``; the command's exit status (0)."""
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        tables(result)
    return 0


def targets_table(console: Console, checks: dict[str, bool]) -> None:
    """The bench's targets, each met or not."""
    t = Table(title="Targets")
    t.add_column("check")
    t.add_column("met")
    for name, ok in checks.items():
        t.add_row(name, "[green]yes[/]" if ok else "[red]no[/]")
    console.print(t)
