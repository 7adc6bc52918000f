"""`open_chain(url, netuid=...)`: one entry point for every chain backend.

- `local:///abs/path/chain.db` (or `local://relative/path.db`): the embedded SQLite chain. The file
  and the subnet must exist (`tessera chain create`).
- `ws://host:port` / `wss://host:port`: a subtensor node (finney, testnet, a localnet).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from protocol.chain.base import Chain
from protocol.chain.errors import ChainError

LOCAL_SCHEME = "local"
SUBTENSOR_SCHEMES = ("ws", "wss")


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


def open_chain(url: str, *, netuid: int, wait_for_finalization: bool = False) -> Chain:
    """Open subnet `netuid` of the chain at `url` (see the module docstring for the forms)."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == LOCAL_SCHEME:
        from protocol.chain.local import LocalChain

        return LocalChain(local_path(url), netuid)
    if scheme in SUBTENSOR_SCHEMES:
        from protocol.chain.subtensor import SubtensorChain

        return SubtensorChain(url, netuid, wait_for_finalization=wait_for_finalization)
    raise ChainError(
        f"unsupported chain URL scheme {scheme!r}: use local:///path/chain.db or ws(s)://host:port"
    )
