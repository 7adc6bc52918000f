"""Every `tessera` subcommand prints its help and exits 0 (argparse formats each help string only
when asked, so a bad one stays hidden until an operator types --help)."""

from __future__ import annotations

import pytest

from commands.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    assert f"usage: tessera {command}" in capsys.readouterr().out
