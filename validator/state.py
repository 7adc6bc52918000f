"""The validator's state, saved atomically after every window and restored on restart.

One file, ``validator.pt`` (the previous one kept as ``validator.prev.pt``): the model at the start
of the next window, its fingerprint and the strategy's outer state (`node.strategy`), the per-peer records (`validator.ratings.PeerRecord`, as
JSON), the copy-detection history and its secret salt, and the key the evaluation secrets are
derived from (`validator.reveal`: a restart must reveal the secrets it committed to). Written to a temporary file, fsynced and
renamed (`node.runtime.atomic_files`), so a crash leaves the old state or the new one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from node.runtime.state import FORMAT, load_rotating, save_rotating
from validator.copies import Sketch
from validator.ratings import PeerRecord

STATE_FILE = "validator.pt"
PREVIOUS_FILE = "validator.prev.pt"
OUTAGES_FILE = "chain_outages.json"
"""When the chain failed our calls (`node.runtime.resilient_chain.Outages`), kept beside the state."""


@dataclass
class ValidatorState:
    run_id: str
    window: int  # the next window to process; the model is at the start of it
    model: dict[str, torch.Tensor]
    fingerprint: str
    salt: int
    records: dict[int, PeerRecord] = field(default_factory=dict)
    sketches: list[Sketch] = field(default_factory=list)
    reveal_key: bytes = b""  # empty in states written before commit-reveal
    outer: dict[str, torch.Tensor] = field(default_factory=dict)  # the strategy's outer state


def _encode(state: ValidatorState) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "run_id": state.run_id,
        "window": state.window,
        "model": state.model,
        "fingerprint": state.fingerprint,
        "salt": str(state.salt),
        "reveal_key": state.reveal_key.hex(),
        "outer": state.outer,
        "records": json.dumps({str(u): r.model_dump() for u, r in state.records.items()}),
        "sketches": [
            {
                "uid": s.uid,
                "window": s.window,
                "digest": s.digest.hex(),
                "positions": torch.from_numpy(s.positions.astype(np.int64)),
                "values": torch.from_numpy(s.values.astype(np.float32)),
            }
            for s in state.sketches
        ],
    }


def _decode(raw: dict) -> ValidatorState:
    return ValidatorState(
        run_id=raw["run_id"],
        window=int(raw["window"]),
        model=raw["model"],
        fingerprint=raw["fingerprint"],
        salt=int(raw["salt"]),
        reveal_key=bytes.fromhex(raw.get("reveal_key", "")),
        outer=raw.get("outer", {}),
        records={int(u): PeerRecord(**r) for u, r in json.loads(raw["records"]).items()},
        sketches=[
            Sketch(
                uid=int(s["uid"]),
                window=int(s["window"]),
                digest=bytes.fromhex(s["digest"]),
                positions=s["positions"].numpy().astype(np.uint64),
                values=s["values"].numpy().astype(np.float32),
            )
            for s in raw["sketches"]
        ],
    )


def save_state(directory: Path, state: ValidatorState) -> Path:
    return save_rotating(directory / STATE_FILE, directory / PREVIOUS_FILE, _encode(state))


def load_state(directory: Path, run_id: str) -> ValidatorState | None:
    """The newest readable state of this run, or None (`StateError` for another run's state)."""
    raw = load_rotating(directory / STATE_FILE, directory / PREVIOUS_FILE, run_id)
    return _decode(raw) if raw is not None else None
