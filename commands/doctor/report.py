"""The rows of `tessera doctor`: one `Check` per question, printed as a checklist or as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from protocol.stores.errors import sanitize


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    """Not applicable here, or not checked because a check it depends on failed."""


_MARKS = {
    Status.OK: ("✓", "green"),
    Status.WARN: ("!", "yellow"),
    Status.FAIL: ("✗", "red"),
    Status.SKIP: ("-", "dim"),
}


@dataclass(frozen=True)
class Check:
    """One row: what was checked, what was found and, for failures and warnings, the fix."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status is Status.FAIL and not self.fix:
            raise ValueError(f"check {self.name!r} failed without a fix")
        # details may carry text a remote server chose: keep them printable and bounded
        object.__setattr__(self, "detail", sanitize(self.detail, 600))
        object.__setattr__(self, "fix", sanitize(self.fix, 400))


def ok(name: str, detail: str) -> Check:
    return Check(name, Status.OK, detail)


def warn(name: str, detail: str, fix: str = "") -> Check:
    return Check(name, Status.WARN, detail, fix)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, Status.FAIL, detail, fix)


def skip(name: str, detail: str) -> Check:
    return Check(name, Status.SKIP, detail)


def describe_error(exc: BaseException) -> str:
    """An exception for a row; pydantic errors without the rejected input (it may be a key)."""
    if isinstance(exc, ValidationError):
        return "; ".join(sorted({str(e["msg"]) for e in exc.errors()}))
    return f"{type(exc).__name__}: {exc}"


def passed(checks: Sequence[Check]) -> bool:
    """True when no check failed (warnings and skipped checks allowed)."""
    return all(c.status is not Status.FAIL for c in checks)


def to_json(checks: Sequence[Check], role: str) -> str:
    rows = [{**asdict(c), "status": c.status.value} for c in checks]
    return json.dumps({"ok": passed(checks), "role": role, "checks": rows}, indent=2)


def print_checklist(checks: Sequence[Check], console: Console, role: str) -> None:
    table = Table(title=f"tessera doctor ({role})", show_header=False, box=None, padding=(0, 1))
    table.add_column(width=1)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for c in checks:
        mark, style = _MARKS[c.status]
        body = Text(c.detail)
        if c.fix:
            body.append(f"\nfix: {c.fix}", style=style)
        table.add_row(Text(mark, style=style), c.name, body)
    console.print(table)
    failed = sum(c.status is Status.FAIL for c in checks)
    warned = sum(c.status is Status.WARN for c in checks)
    if failed:
        console.print(f"[red]{failed} check(s) failed[/red], {warned} warning(s)")
    else:
        console.print(f"[green]ready[/green] ({warned} warning(s))")
