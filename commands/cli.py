"""The `tessera` console command.

Each subcommand lives in its own module and registers itself through `COMMANDS`; the modules are
imported lazily so that `tessera --help` stays fast and a missing optional piece only breaks the
subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from codec.errors import TesseraError

# subcommand name -> (module path, help). Each module exposes `add_arguments(parser)` and
# `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("lab.bench.cli", "run a benchmark (codec, ...) and print a table or --json"),
    "miner": ("commands.miner", "run a peer: train, compress, publish, gather, aggregate"),
    "validator": (
        "commands.validator",
        "run a validator: check, score, rate, set weights, publish",
    ),
    "sim": ("lab.sim.cli", "simulate a run on this machine: peers, adversaries, validator"),
    "sim-adversary": ("lab.sim.adversary", "a misbehaving peer, for simulations only"),
    "chain": (
        "commands.chain",
        "manage the embedded local chain (create a subnet, register hotkeys, stake)",
    ),
    "data": ("commands.data", "prepare pre-tokenized training shards"),
    "doctor": (
        "commands.doctor.cli",
        "preflight checks before joining a run, with a fix for each failure",
    ),
    "plan": (
        "commands.plan",
        "throughput and memory model: compute and communication per window, GPU memory",
    ),
    "why": (
        "commands.why",
        "what the validators said about a peer in the last windows, and how to fix a weight of 0",
    ),
    "bucket": ("commands.bucket", "create our bucket with the write key (idempotent)"),
    "commit": ("commands.commit", "post our bucket commitment (read key) on chain"),
    "entrypoint": (
        "commands.entrypoint",
        "what the Docker image runs: container checks, doctor, then exec the node",
    ),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``tessera``. Only the module of the subcommand named in ``argv`` is imported
    (every module when ``argv`` is None): ``tessera --help`` and ``tessera plan`` do not pay for
    the imports of a validator."""
    chosen = _chosen(argv)
    parser = _Parser(
        prog="tessera",
        description="Tessera: permissionless internet-scale LLM pre-training with SparseLoCo.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--debug",
        action="store_true",
        default=bool(os.environ.get("TESSERA_DEBUG")),
        help="show the traceback of an error instead of its one line (env TESSERA_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_path, help_text) in COMMANDS.items():
        sp = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=_HelpFormatter,
        )
        if chosen in (None, name):
            module = importlib.import_module(module_path)
            module.add_arguments(sp)
            if argv is not None and any(a.dest == "config" for a in sp._actions):
                from commands.config_file import apply_config_file

                apply_config_file(sp, argv)
            runner: Callable[[argparse.Namespace], int] = module.run
            sp.set_defaults(_run=runner)
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help already says what it is or there
    is none to show (``None``: the option is off or taken from elsewhere, as its help says)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text or "%(default)" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, ``tessera <command>: <what is wrong> (see …
    --help)``, exit code 2; subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _chosen(argv: Sequence[str] | None) -> str | None:
    """The subcommand ``argv`` names (its first word that is one), "" when it names none, None
    for every subcommand (no ``argv``)."""
    if argv is None:
        return None
    return next((word for word in argv if word in COMMANDS), "")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. An error the project raises on purpose (`TesseraError`) or the system
    reports (`OSError`) ends in one line, ``tessera <command>: <what is wrong>``, and exit code 1;
    Ctrl-C in ``tessera <command>: interrupted`` and 130. ``--debug`` shows tracebacks instead."""
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(words)
    except TesseraError as exc:  # a config file that cannot be used: before anything runs
        print(f"tessera {_chosen(words)}: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    args = parser.parse_args(words)
    where = f"tessera {args.command}"
    try:
        return int(args._run(args) or 0)
    except SystemExit as stop:  # a command's own one-line refusal: prefixed like the rest
        if not isinstance(stop.code, str):
            raise
        print(f"{where}: {_one_line(stop.code)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except (TesseraError, OSError) as exc:
        if args.debug:
            raise
        print(f"{where}: {_one_line(str(exc) or type(exc).__name__)}", file=sys.stderr)
        return 1


def _one_line(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= 400 else text[:397] + "..."


def _version() -> str:
    try:
        return importlib.metadata.version("tessera-train")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
