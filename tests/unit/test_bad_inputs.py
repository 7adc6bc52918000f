"""Every command meets bad operator input the same way: a non-zero exit (2 for usage, 1 for the
rest), no traceback, one line that says what is wrong, and nothing written to a bucket or the
chain. The list covers each command and each kind of mistake: names
and files that do not exist, values out of range, a chain or bucket that cannot be used, a hotkey
that is not registered or holds no permit, a busy port, a device this machine does not have."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from commands.cli import main
from protocol.chain.local import LocalChain
from protocol.keys import create_hotkey


@dataclass(frozen=True)
class World:
    root: Path
    chain: str
    miner: list[str]  # arguments that start a registered miner (a file bucket, the local chain)
    hotkeys: dict[str, str]  # wallet hotkey name -> SS58 address
    bucket: Path
    busy_port: int


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("bad-inputs")
    wallets = root / "wallets"
    hotkeys = {name: create_hotkey("w", name, wallets).ss58_address for name in ("h", "stranger")}
    db = root / "chain.db"
    assert main(["chain", "create", "--db", str(db), "--netuid", "1"]) == 0
    assert (
        main(["chain", "register", "--db", str(db), "--netuid", "1", "--hotkey", hotkeys["h"]]) == 0
    )
    (root / "bad.json").write_text("{not json")
    (root / "field.json").write_text(json.dumps({"name": "x", "inner_steps": -3}))
    (root / "notdata").mkdir()
    (root / "unknown.toml").write_text('run = "tiny"\ncolour = "blue"\n')
    (root / "broken.toml").write_text("run = \n")
    (root / "nested.toml").write_text("[store]\nurl = 'x'\n")
    (root / "zero.toml").write_text("windows = 0\n")
    bucket = root / "buckets" / "mine"
    chain = f"local://{db}"
    miner = [
        "--run", "tiny", "--chain", chain, "--netuid", "1", "--wallet", "w", "--hotkey", "h",
        "--wallet-path", str(wallets), "--store", f"file://{bucket}",
        "--local-root", str(root / "buckets"), "--state-dir", str(root / "state"),
    ]  # fmt: skip
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield World(root, chain, miner, hotkeys, bucket, busy.getsockname()[1])


def _with(w: World, **values: str) -> list[str]:
    """The registered miner's arguments with some replaced (or added)."""
    out = list(w.miner)
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


CASES: dict[str, tuple[str, ...]] = {
    # id: (command line with {placeholders}, what the line must say)
    "miner: unknown preset": ("miner {m} --run nope", "unknown preset 'nope'"),
    "miner: run file not JSON": ("miner {m} --run {root}/bad.json", "not valid JSON"),
    "miner: run file invalid": ("miner {m} --run {root}/field.json", "invalid run config"),
    "miner: run file missing": ("miner {m} --run {root}/none.json", "no such run config file"),
    "miner: no local chain": ("miner {m} --chain local:///nowhere/c.db", "no local chain at"),
    "miner: chain refused": ("miner {m} --chain ws://127.0.0.1:1", "cannot reach"),
    "miner: chain scheme": ("miner {m} --chain bogus://x", "unsupported chain 'bogus://x'"),
    "miner: no such subnet": ("miner {m} --netuid 7", "subnet 7 does not exist"),
    "miner: no hotkey file": ("miner {m} --hotkey missing", "cannot read key file"),
    "miner: no wallets": ("miner {m} --wallet-path /nowhere/wallets", "cannot read key file"),
    "miner: not registered": ("miner {m} --hotkey stranger", "is not registered on subnet 1"),
    "miner: not registered, commit": (
        "miner {m} --hotkey stranger --commit",
        "is not registered on subnet 1",
    ),
    "miner: store scheme": ("miner {m} --store ftp://x", "unsupported store URL scheme 'ftp'"),
    "miner: s3 no bucket": ("miner {m} --store s3://", "bucket name '' is not valid"),
    "miner: s3 bad bucket": ("miner {m} --store s3://b?endpoint=http://h", "'b' is not valid"),
    "miner: relative file store": ("miner {m} --store file://mine", "file:///absolute/path"),
    "miner: no chain or store": ("miner --run tiny", "--chain and --store are required"),
    "miner: zero windows": ("miner {m} --windows 0", "argument --windows: '0': give 1 or more"),
    "miner: windows word": ("miner {m} --windows many", "'many' is not a whole number"),
    "miner: unknown device": ("miner {m} --device tpu", "'tpu': use cpu, cuda or cuda:N"),
    "miner: cpu index": ("miner {m} --device cpu:1", "'cpu:1': use cpu, cuda or cuda:N"),
    "miner: workers below 0": ("miner {m} --exchange-workers -1", "number of processes"),
    "miner: workers word": ("miner {m} --exchange-workers lots", "number of processes"),
    "miner: port range": ("miner {m} --metrics-port 70000", "port from 1 to 65535"),
    "miner: port busy, commit": ("miner {m} --metrics-port {port} --commit", "is in use"),
    "miner: metrics host": ("miner {m} --metrics-host localhost", "is not an IP address"),
    "validator: metrics host": ("validator {m} --metrics-host 1.2.3", "is not an IP address"),
    "validator: port busy": ("validator {m} --metrics-port {port}", "is in use"),
    "miner: config unknown key": ("miner {m} --config {root}/unknown.toml", "no setting 'colour'"),
    "miner: config not toml": ("miner {m} --config {root}/broken.toml", "is not valid TOML"),
    "miner: config missing": ("miner {m} --config {root}/none.toml", "No such file"),
    "miner: config nested": ("miner {m} --config {root}/nested.toml", "must be one value"),
    "validator: config value": ("validator {m} --config {root}/zero.toml", "'0': give 1 or more"),
    "miner: loss chunks": ("miner {m} --loss-chunk-tokens -5", "'-5': give 0 or more"),
    "miner: log level": ("miner {m} --log-level loud", "invalid choice: 'LOUD'"),
    "validator: no permit": ("validator {m} --commit", "has no validator permit"),
    "validator: unknown preset": ("validator {m} --run nope", "unknown preset 'nope'"),
    "validator: zero samples": ("validator {m} --samples 0", "'0': give 1 or more"),
    "validator: interval word": ("validator {m} --weights-every x", "'x' is not a whole number"),
    "validator: unknown device": ("validator {m} --device tpu", "use cpu, cuda or cuda:N"),
    "validator: probe state": ("validator {m} --probe-state gpu", "use auto, device or host"),
    "sim: no peers": ("sim --peers 0 --out {root}/s", "'0': give 1 or more"),
    "sim: no windows": ("sim --windows 0 --out {root}/s", "'0': give 1 or more"),
    "sim: unknown adversary": ("sim --adversaries dragon --out {root}/s", "unknown adversaries"),
    "sim: unknown fault": ("sim --faults fire --out {root}/s", "unknown faults: fire"),
    "sim: negative block time": ("sim --block-time -1 --out {root}/s", "give a number above 0"),
    "sim: block time too long": ("sim --block-time 5000 --out {root}/s", "at most 3600"),
    "sim: block time word": ("sim --block-time soon --out {root}/s", "'soon' is not a number"),
    "sim: unknown strategy": ("sim --strategy nope --out {root}/s", "invalid choice: 'nope'"),
    "sim: storage scheme": ("sim --storage ftp://x --out {root}/s", "use file, or s3://"),
    "bench: unknown bench": ("bench nonsense", "invalid choice: 'nonsense'"),
    "bench: unknown strategy": ("bench train --quick --strategies nope", "unknown strategy"),
    "bench: zero windows": ("bench train --quick --windows 0", "'0': give 1 or more"),
    "bench: unknown preset": ("bench exchange --preset nope", "--preset nope: unknown"),
    "bench: bad workers": ("bench exchange --workers 0,x", "give positive worker counts"),
    "bench: negative numel": ("bench codec --numel -1", "'-1': give 1 or more"),
    "bench: probe preset": ("bench probe --preset nope", "--preset nope: unknown"),
    "bench: tune with a bad method": ("bench train --tune --strategies nope", "unknown strategy"),
    "bench: step rows": ("bench step --rows 0", "'0': give 1 or more"),
    "bench: step preset": ("bench step --preset nope", "--preset nope: unknown"),
    "plan: unknown preset": ("plan --preset huge", "unknown preset 'huge'"),
    "plan: no gpus": ("plan --gpus 0", "'0': give 1 or more"),
    "plan: mfu above one": ("plan --mfu 2", "at most 1"),
    "plan: unknown gpu": ("plan --gpu tpu", "invalid choice: 'tpu'"),
    "plan: negative link": ("plan --link-gbps -1", "must be > 0"),
    "data: not a dataset": ("data info {root}/notdata", "no index.json"),
    "data: bad upload bucket": ("data upload {root}/notdata s3://x/y", "'x' is not valid"),
    "data: prep without tokenizer": ("data prep --input {root}/none --out {root}/d", "--tokenizer"),
    "chain: bad address": (
        "chain register --db {root}/chain.db --netuid 1 --hotkey nope",
        "not an SS58 address",
    ),
    "chain: no database": ("chain show --db {root}/none.db", "no local chain at"),
    "bucket: store scheme": ("bucket create --store ftp://x", "unsupported store URL scheme"),
    "commit: not registered": ("commit {m} --hotkey stranger", "is not registered on subnet 1"),
    "why: uid word": ("why --chain {chain} --netuid 1 --uid abc", "'abc' is not a whole number"),
    "why: negative uid": ("why --chain {chain} --netuid 1 --uid -1", "'-1': give 0 or more"),
    "sim-adversary: unknown kind": ("sim-adversary --kind dragon", "invalid choice: 'dragon'"),
}


def _argv(w: World, line: str) -> list[str]:
    words = line.format(root=w.root, chain=w.chain, port=w.busy_port, m="{m}").split()
    if "{m}" not in words:
        return words
    at = words.index("{m}")
    rest = words[at + 1 :]
    values = dict(zip(rest[0::2], rest[1::2], strict=False))
    flags = [x for x in rest if x.startswith("--") and x not in values]  # bare flags (--commit)
    return [*words[:at], *_with(w, **{k[2:]: v for k, v in values.items()}), *flags]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_input_ends_in_one_line_and_writes_nothing(
    case: str,
    world: World,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    line, says = CASES[case]
    if "cuda" in line and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    monkeypatch.setenv("HOME", str(world.root / "home"))
    monkeypatch.chdir(world.root)
    argv = _argv(world, line)
    code: int | str | None
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert code in (1, 2), (code, err)
    assert "Traceback" not in err and says in err, err
    assert len(err.splitlines()) == 1 and err.startswith(f"tessera {argv[0]}"), err
    assert not world.bucket.exists() or not any(world.bucket.rglob("*")), "wrote to the bucket"
    chain = LocalChain(world.chain.removeprefix("local://"), 1)
    try:
        posted = [chain.read_commitment(address) for address in world.hotkeys.values()]
    finally:
        chain.close()
    assert posted == [None, None], "posted a commitment"


def test_the_list_is_long_enough_and_covers_every_command() -> None:
    from commands.cli import COMMANDS

    assert len(CASES) >= 40
    covered = {line.split()[0] for line, _ in CASES.values()}
    assert covered >= set(COMMANDS) - {"doctor", "entrypoint"}  # their own report formats


def test_a_bad_boolean_in_the_environment_ends_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_ACTIVATION_CHECKPOINTING", "yes")
    with pytest.raises(SystemExit) as stop:
        main(["miner", "--help"])
    assert (
        stop.value.code
        == "tessera miner: TESSERA_ACTIVATION_CHECKPOINTING='yes': set it to 1 or 0, or unset it"
    )


def test_a_bad_probe_state_in_the_environment_ends_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_PROBE_STATE", "gpu")
    with pytest.raises(SystemExit) as stop:
        main(["validator", "--run", "tiny", "--chain", "local:///x.db", "--store", "file:///x"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert "'gpu': use auto, device or host" in err and "Traceback" not in err
