"""The `tessera` command run in this process, as a test would type it."""

from __future__ import annotations

from commands.cli import main


def run_cli(argv: list[str]) -> int:
    """`main`'s exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
