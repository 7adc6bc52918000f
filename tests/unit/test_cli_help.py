"""Every `tessera` subcommand prints its help and exits 0 (argparse formats each help string only
when asked, so a bad one stays hidden until an operator types --help); the roles' help shows
defaults and variables; Bittensor's spellings of the wallet and network options work."""

from __future__ import annotations

import pytest

from commands.cli import COMMANDS, build_parser, main
from protocol.chain.errors import ChainError
from protocol.chain.url import NETWORKS, chain_url, open_chain


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: tessera {command}" in out
    # each option's default is said once, and never as "None" (an option that is off, or one
    # whose help says where its value comes from)
    flat = " ".join(out.split())
    assert "(default: None)" not in flat
    for option in flat.split(" --")[1:]:
        assert option.count("(default:") <= 1, option


def test_a_roles_help_shows_defaults_and_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["miner", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[env TESSERA_RUN] (default: tiny)" in out
    assert "[env TESSERA_NETUID]" in out and "[env TESSERA_CHAIN]" in out


def test_the_bittensor_spellings_are_accepted() -> None:
    args = build_parser().parse_args(
        ["miner", "--wallet.name", "w", "--wallet.hotkey", "h", "--wallet.path", "/wallets",
         "--subtensor.network", "finney", "--netuid", "3"]
    )  # fmt: skip
    assert (args.wallet, args.hotkey, args.wallet_path) == ("w", "h", "/wallets")
    assert (args.chain, args.netuid) == ("finney", 3)
    endpoint = build_parser().parse_args(["validator", "--subtensor.chain_endpoint", "ws://h:9944"])
    assert endpoint.chain == "ws://h:9944" and endpoint.netuid is None


def test_a_network_name_is_its_endpoint_and_a_subtensor_chain_needs_a_netuid() -> None:
    assert chain_url("finney") == NETWORKS["finney"] and chain_url("FINNEY").startswith("wss://")
    assert chain_url("ws://h:9944") == "ws://h:9944"
    with pytest.raises(ChainError, match="pass --netuid N"):
        open_chain("finney", netuid=None)
    with pytest.raises(ChainError, match="unsupported chain 'mainnet'"):
        open_chain("mainnet", netuid=1)
