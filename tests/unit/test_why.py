"""`tessera why` reads what the validators published about a peer (`validator.published`): a
validator's report is another node's bytes, so a missing, oversized or malformed one is a row
that says so, never an error; a hotkey that is not registered is one line. (What it prints for
real reports: tests/e2e/test_sim.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from substrateinterface import Keypair

from commands.cli import main
from node.runtime.commit import commitment_for
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.commitment import render_commitment
from protocol.keys import create_hotkey
from protocol.naming import scores_key
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from validator.published import MAX_REPORT_BYTES, peer_verdicts

RUN = RunConfig.preset("tiny", name="why", timing={"block_time_s": 0.1, "blocks_per_window": 10})
KEYS = [Keypair.create_from_uri(f"//why{i}") for i in range(3)]  # 0, 1: validators; 2: a peer


@pytest.fixture
def world(tmp_path: Path) -> LocalChain:
    # genesis 10 s ago: ten windows of the run have passed
    create_local_chain(tmp_path / "chain.db", 1, block_time=0.1, clock=lambda: time.time() - 10)
    admin = LocalChainDB(tmp_path / "chain.db")
    for i, key in enumerate(KEYS):
        admin.register(1, key.ss58_address, validator=i < 2, stake=100.0 - i if i < 2 else 0.0)
    chain = LocalChain(tmp_path / "chain.db", 1)
    for i, key in enumerate(KEYS):
        chain.commit(key, render_commitment(commitment_for(f"file://{tmp_path}?bucket=bucket{i}")))
    return chain


def test_missing_oversized_and_malformed_reports_are_rows(
    tmp_path: Path, world: LocalChain
) -> None:
    open_store(f"file://{tmp_path}?bucket=bucket0").put(
        scores_key(RUN.run_id, 0, 0, KEYS[0].ss58_address), b'{"run_id": "not json'
    )
    big = open_store(f"file://{tmp_path}?bucket=bucket1")
    big.put(scores_key(RUN.run_id, 0, 1, KEYS[1].ss58_address), b" " * (MAX_REPORT_BYTES + 1))
    rows = peer_verdicts(world, RUN, 2, [0, 1], local_root=tmp_path)
    said = {(r.window, r.validator_uid): r.problem for r in rows}
    assert said[(0, 0)].startswith("malformed") and said[(0, 1)].startswith("unreadable")
    assert said[(1, 0)] == said[(1, 1)] == "no report"
    assert all(r.line is None for r in rows)


def test_the_command_prints_a_row_per_window_and_validator(
    tmp_path: Path, world: LocalChain, capsys: pytest.CaptureFixture[str]
) -> None:
    run = RUN.dump(tmp_path / "run.json")
    argv = ["why", "--run", str(run), "--chain", f"local://{tmp_path / 'chain.db'}", "--netuid",
            "1", "--local-root", str(tmp_path), "--uid", "2", "--windows", "3", "--json"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 * 2 and all(r["detail"] == "no report" for r in rows)
    assert main(argv[:-1]) == 0  # the table
    table = capsys.readouterr().out
    assert "what the validators said about uid 2" in table and table.count("no report") == 6


def test_a_hotkey_that_is_not_registered_is_one_line(
    tmp_path: Path, world: LocalChain, capsys: pytest.CaptureFixture[str]
) -> None:
    create_hotkey("w", "stranger", root=tmp_path / "wallets")
    argv = ["why", "--chain", f"local://{tmp_path / 'chain.db'}", "--netuid", "1", "--wallet",
            "w", "--hotkey", "stranger", "--wallet-path", str(tmp_path / "wallets")]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera why: hotkey ") and "not registered" in err
    assert len(err.splitlines()) == 1
