"""Settings from a TOML file for the commands that take a node's options (`--config FILE`, or
`TESSERA_CONFIG`): each key is an option's long name without its dashes (``exchange-workers`` or
``exchange_workers``), each value a string, number or boolean::

    run = "1B"
    chain = "finney"
    netuid = 3
    wallet = "miner"
    hotkey = "default"
    store = "s3://my-bucket?endpoint=https://ACCOUNT_ID.r2.cloudflarestorage.com"
    metrics-port = 9100

Precedence: the command line, then the file, then the ``TESSERA_*`` variables, then the built-in
defaults. The file is read before the arguments are parsed, so a value it gives is checked as the
same option on the command line would be; a key that names no option, a nested value or a file
that is not TOML ends the command in one line before it does anything.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Sequence
from pathlib import Path

from codec.errors import TesseraError

__all__ = ["ConfigFileError", "add_config_argument", "apply_config_file"]


class ConfigFileError(TesseraError, ValueError):
    """The config file cannot be read or names a setting that does not exist."""


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=os.environ.get("TESSERA_CONFIG"),
        help='a TOML file of settings, keyed by option name (run = "1B", metrics-port = 9100); '
        "the command line overrides it, it overrides TESSERA_* variables [env TESSERA_CONFIG]",
    )


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Make the settings of the config file that `argv` (or `TESSERA_CONFIG`) names the defaults
    of `parser`; nothing when it names none."""
    path = _config_path(argv)
    if not path:
        return
    try:
        settings = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigFileError(
            f"config file {path}: {exc.strerror or exc}: check --config"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"config file {path} is not valid TOML: {exc}") from None
    options = {
        flag[2:].replace("_", "-"): action
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and action.dest not in ("help", "config")
    }
    defaults: dict[str, object] = {}
    for key, value in settings.items():
        action = options.get(key.replace("_", "-"))
        if action is None:
            raise ConfigFileError(
                f"config file {path}: no setting {key!r}; the settings are the options of "
                "--help, without their dashes"
            )
        if isinstance(value, dict | list):
            raise ConfigFileError(
                f"config file {path}: {key} must be one value, not a table or list"
            )
        defaults[action.dest] = value if isinstance(value, bool) else str(value)
    parser.set_defaults(**defaults)


def _config_path(argv: Sequence[str]) -> str | None:
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--config="):
            return word.split("=", 1)[1]
    return os.environ.get("TESSERA_CONFIG")
