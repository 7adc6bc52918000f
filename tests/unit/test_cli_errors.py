"""Bad operator input ends in one line, ``tessera <command>: <what is wrong>``, with a non-zero
exit code and no traceback; ``--debug`` shows the traceback instead; ``--version`` answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from commands.cli import main
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["plan", "--preset", "huge"], 1, "unknown preset 'huge'"),
        (["miner", "--run", "runs/missing.toml"], 1, "no such run config file"),
        (["validator", "--run", "/nowhere/run.json"], 1, "no such run config file"),
        (["miner", "--run", "tiny"], 1, "--chain and --store are required"),
        (["miner", "--run", "tiny", "--log-level", "loud"], 2, "invalid choice: 'LOUD'"),
        (["data", "info", "/nonexistent/shards"], 1, "/nonexistent/shards"),
        (["bench", "nonsense"], 2, "invalid choice"),
        (["sim", "--peers", "x"], 2, "'x' is not a whole number"),
        (["sim", "--faults", "fire"], 1, "unknown faults: fire (known: store-errors, lead-restart"),
        (["sim", "--windows", "3", "--faults", "chain-stall"], 1, "needs --windows 6 or more"),
        (["sim", "--start-block", "3"], 1, "--start-block 3: the processes need until block 45"),
    ],
)
def test_bad_input_is_one_line_with_what_is_wrong(
    argv: list[str], code: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(argv) == code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and says in err
    if code == 1:  # ours: one line; argparse's usage errors (2) come with the usage line
        assert len(err.splitlines()) == 1 and err.startswith(f"tessera {argv[0]}: "), err


def test_a_bad_number_in_the_environment_names_the_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TESSERA_NETUID", "one")
    with pytest.raises(SystemExit) as stop:
        main(["miner", "--run", "tiny"])
    assert stop.value.code == 2
    assert "argument --netuid: invalid int value: 'one'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # other commands, and help, are not affected
        main(["plan", "--help"])
    assert stop.value.code == 0


def test_debug_shows_the_traceback() -> None:
    from protocol.runconfig import RunConfigError

    with pytest.raises(RunConfigError, match="unknown preset"):
        main(["--debug", "plan", "--preset", "huge"])


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("tessera ")


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """A real process interrupted while a command waits: no KeyboardInterrupt traceback."""
    script = tmp_path / "waits.py"
    script.write_text(
        "import signal, sys, time\n"
        "from commands import cli\n"
        # a process started in the background inherits SIGINT ignored: take it back, as a
        # terminal's foreground process has it
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "def add_arguments(parser): pass\n"
        "def run(args):\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "    return 0\n"
        "cli.COMMANDS['wait'] = ('waits', 'wait for a minute')\n"
        "sys.exit(cli.main(['wait']))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.decode().strip() == "tessera wait: interrupted"
