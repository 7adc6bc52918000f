"""`open_chain(url, netuid=...)`: one entry point for every chain backend.

- `local:///abs/path/chain.db` (or `local://relative/path.db`): the embedded SQLite chain. The file
  and the subnet must exist (`tessera chain create`).
- `ws://host:port` / `wss://host:port`: a subtensor node (finney, testnet, a localnet).
- a network name, as Bittensor's tools spell it (`NETWORKS`): `finney`, `test`, `archive`,
  `local` (a localnet on this machine).

A subtensor chain needs the run's subnet (`netuid`); the embedded chain's default subnet is 1.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from protocol.chain.base import Chain
from protocol.chain.errors import ChainError

LOCAL_SCHEME = "local"
SUBTENSOR_SCHEMES = ("ws", "wss")
NETWORKS = {
    "finney": "wss://entrypoint-finney.opentensor.ai:443",
    "test": "wss://test.finney.opentensor.ai:443",
    "archive": "wss://archive.chain.opentensor.ai:443",
    "local": "ws://127.0.0.1:9944",
}
"""Bittensor's network names and their public endpoints."""
LOCAL_NETUID = 1


def chain_url(network_or_url: str) -> str:
    """The endpoint of a network name (`NETWORKS`), or the URL itself."""
    return NETWORKS.get(network_or_url.lower(), network_or_url)


def local_path(url: str) -> Path:
    """The file path of a `local://` URL."""
    parts = urlsplit(url)
    if parts.scheme != LOCAL_SCHEME:
        raise ChainError(f"not a local chain URL: {url!r}")
    if parts.query or parts.fragment:
        raise ChainError("local chain URLs take no query or fragment")
    raw = unquote(parts.netloc + parts.path)
    if not raw:
        raise ChainError("local chain URL has no path; use local:///path/to/chain.db")
    return Path(raw)


def open_chain(url: str, *, netuid: int | None, wait_for_finalization: bool = False) -> Chain:
    """Open subnet `netuid` of the chain at `url` (see the module docstring for the forms); a
    subtensor chain needs `netuid`, the embedded chain defaults to subnet `LOCAL_NETUID`."""
    url = chain_url(url)
    scheme = urlsplit(url).scheme.lower()
    if scheme == LOCAL_SCHEME:
        from protocol.chain.local import LocalChain

        return LocalChain(local_path(url), LOCAL_NETUID if netuid is None else netuid)
    if scheme in SUBTENSOR_SCHEMES:
        from protocol.chain.subtensor import SubtensorChain

        if netuid is None:
            raise ChainError(f"pass --netuid N: the subnet this run trains on, on {url}")
        return SubtensorChain(url, netuid, wait_for_finalization=wait_for_finalization)
    raise ChainError(
        f"unsupported chain {url!r}: use {', '.join(NETWORKS)}, ws(s)://host:port, or "
        "local:///path/chain.db"
    )
