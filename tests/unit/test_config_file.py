"""`--config FILE`: a node's settings from TOML, under the command line and over the `TESSERA_*`
variables, each value checked as the same option on the command line would be."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from commands.cli import build_parser


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


def test_the_file_sets_what_the_command_line_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "miner.toml"
    config.write_text('run = "1B"\nwindows = 7\nmetrics-port = 9200\nexchange_workers = "4"\n')
    monkeypatch.setenv("TESSERA_RUN", "150M")  # the file wins over the environment
    monkeypatch.setenv("TESSERA_NETUID", "5")  # what the file leaves, the environment still sets
    args = _parse("miner", "--config", str(config))
    assert (args.run, args.windows, args.metrics_port, args.exchange_workers) == ("1B", 7, 9200, 4)
    assert args.netuid == 5
    args = _parse("miner", f"--config={config}", "--windows", "3", "--run", "tiny")
    assert (args.run, args.windows) == ("tiny", 3)  # the command line wins
    monkeypatch.setenv("TESSERA_CONFIG", str(config))
    assert _parse("validator").run == "1B"


def test_a_value_from_the_file_is_checked_like_one_typed(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("metrics-port = 70000\n")
    with pytest.raises(SystemExit) as stop:
        _parse("miner", "--config", str(config))
    assert stop.value.code == 2
