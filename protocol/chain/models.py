"""What a chain backend returns: commitments, neurons, the metagraph and one block's snapshot.

Everything here is built from chain state, which is hostile input: the models validate types and
bounds, and hotkeys are canonicalised to the Bittensor SS58 format (42) so that the same account
always compares equal whichever backend or encoding it came from.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from scalecodec.utils.ss58 import ss58_decode, ss58_encode

SS58_FORMAT = 42
"""Substrate's generic prefix, which Bittensor uses for every account."""

MAX_COMMITMENT_BYTES = 128
"""One `Raw<N>` field of the Commitments pallet holds at most 128 bytes."""

MAX_UID = 65_535
"""Uids are u16 on chain."""

MAX_BLOCK = 2**32 - 1
"""Block numbers are u32 on subtensor; the local chain keeps to the same range."""

MAX_STAKE_TAO = 1e12
"""Far above the 21M supply: anything larger is a decoding error or a lie."""


def canonical_hotkey(address: str) -> str:
    """The SS58 (format 42) form of an account address; `ValueError` if it is not one."""
    if not isinstance(address, str) or not 40 <= len(address) <= 60:
        raise ValueError(f"not an SS58 address: {address!r:.80}")
    try:
        public_key = ss58_decode(address)
    except Exception as exc:  # the decoder raises several types on garbage
        raise ValueError(f"not an SS58 address: {address!r:.80}") from exc
    if len(public_key) != 64:  # hex of a 32-byte public key
        raise ValueError(f"not a 32-byte account address: {address!r:.80}")
    return str(ss58_encode(public_key, SS58_FORMAT))


def hotkey_from_public_key(public_key: bytes) -> str:
    """The SS58 (format 42) address of a 32-byte public key."""
    if not isinstance(public_key, bytes | bytearray) or len(public_key) != 32:
        raise ValueError("an account id is exactly 32 bytes")
    return str(ss58_encode(bytes(public_key), SS58_FORMAT))


Hotkey = Annotated[str, AfterValidator(canonical_hotkey)]


class Commitment(BaseModel):
    """The opaque bytes a hotkey committed on a subnet, and the block they were committed at.

    Models here are strict (no str -> bytes or float -> int coercion): chain data either has the
    right type or is rejected.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    hotkey: Hotkey
    data: bytes = Field(max_length=MAX_COMMITMENT_BYTES)
    block: int = Field(ge=0, le=MAX_BLOCK)


class Neuron(BaseModel):
    """One uid of a subnet."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    uid: int = Field(ge=0, le=MAX_UID)
    hotkey: Hotkey
    stake: float = Field(ge=0.0, le=MAX_STAKE_TAO, description="stake in TAO (alpha on dTAO)")
    validator_permit: bool
    registered_block: int = Field(
        0, ge=0, le=MAX_BLOCK, description="block the uid was (re)registered at by this hotkey"
    )
    last_update: int = Field(
        0,
        ge=0,
        le=MAX_BLOCK,
        description="block of the neuron's last set_weights; 0 if never on the local chain "
        "(subtensor's LastUpdate starts at the registration block instead)",
    )

    @field_validator("stake")
    @classmethod
    def _finite(cls, stake: float) -> float:
        if not math.isfinite(stake):
            raise ValueError("stake must be finite")
        return stake


class Metagraph(BaseModel):
    """The neurons of one subnet as of one block."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    netuid: int = Field(ge=0, le=MAX_UID)
    block: int = Field(ge=0, le=MAX_BLOCK)
    neurons: tuple[Neuron, ...] = Field(default=(), strict=False)

    @field_validator("neurons")
    @classmethod
    def _unique(cls, neurons: tuple[Neuron, ...]) -> tuple[Neuron, ...]:
        uids = [n.uid for n in neurons]
        hotkeys = [n.hotkey for n in neurons]
        if len(set(uids)) != len(uids):
            raise ValueError("duplicate uid in metagraph")
        if len(set(hotkeys)) != len(hotkeys):
            raise ValueError("duplicate hotkey in metagraph")
        return tuple(sorted(neurons, key=lambda n: n.uid))

    @property
    def n(self) -> int:
        return len(self.neurons)

    @property
    def hotkeys(self) -> list[str]:
        return [n.hotkey for n in self.neurons]

    def uid_of(self, hotkey: str) -> int | None:
        """The uid of `hotkey` in this snapshot, or None."""
        try:
            key = canonical_hotkey(hotkey)
        except ValueError:
            return None
        return next((n.uid for n in self.neurons if n.hotkey == key), None)

    def neuron(self, uid: int) -> Neuron | None:
        return next((n for n in self.neurons if n.uid == uid), None)

    @property
    def validators(self) -> list[Neuron]:
        """Neurons holding a validator permit."""
        return [n for n in self.neurons if n.validator_permit]


class ChainSnapshot(BaseModel):
    """One subnet exactly as it was after every write of blocks <= `block` (see `Chain.snapshot`).

    Everything here was read at that one block, so two callers asking for the same block get
    equal snapshots, whenever and wherever they ask.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    block: int = Field(ge=0, le=MAX_BLOCK)
    block_hash: str | None = Field(
        default=None,
        pattern=r"^0x[0-9a-fA-F]{64}$",
        description="the block's hash on subtensor; a deterministic stand-in on the local chain",
    )
    metagraph: Metagraph
    commitments: dict[Hotkey, Commitment] = Field(
        default_factory=dict, description="well-formed commitments by hotkey (registered or not)"
    )
    weights: dict[int, dict[int, float]] = Field(
        default_factory=dict, description="normalised weights by validator uid (no empty rows)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> ChainSnapshot:
        if self.metagraph.block != self.block:
            raise ValueError("the metagraph was read at another block")
        if any(key != c.hotkey for key, c in self.commitments.items()):
            raise ValueError("a commitment is filed under another hotkey")
        for validator, row in self.weights.items():
            if not 0 <= validator <= MAX_UID or not row:
                raise ValueError(f"bad weights row for validator {validator}")
            if any(not 0 <= u <= MAX_UID or not 0.0 <= w <= 1.0 for u, w in row.items()):
                raise ValueError(f"weights of validator {validator} are not normalised")
        return self

    @property
    def netuid(self) -> int:
        return self.metagraph.netuid
