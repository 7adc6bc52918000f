"""Bucket credentials. Read keys are public by design (they go on chain); write keys never leave the node.

`WriteCredentials` is deliberately not a pydantic model: it cannot be dumped, pickled, JSON-encoded
or printed with its secret, so a write key cannot slip into a commitment, a report or a log line.
"""

from __future__ import annotations

from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict, Field


class ReadCredentials(BaseModel):
    """Read-only S3 credentials that a peer publishes in its on-chain commitment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    access_key_id: str = Field(min_length=1, max_length=128)
    secret_access_key: str = Field(min_length=1, max_length=128)


class SecretLeakError(TypeError):
    """Raised when code tries to serialize a write credential."""


class WriteCredentials:
    """Read-write S3 credentials. Only the node that owns the bucket ever holds these."""

    __slots__ = ("_access_key_id", "_secret_access_key")
    _access_key_id: str
    _secret_access_key: str

    def __init__(self, access_key_id: str, secret_access_key: str) -> None:
        if not access_key_id or not secret_access_key:
            raise ValueError("write credentials need both an access key id and a secret")
        object.__setattr__(self, "_access_key_id", access_key_id)
        object.__setattr__(self, "_secret_access_key", secret_access_key)

    @property
    def access_key_id(self) -> str:
        return self._access_key_id

    def reveal_secret(self) -> str:
        """The secret, for handing to the S3 client only. Never log or store the result."""
        return self._secret_access_key

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError("WriteCredentials is immutable")

    def __repr__(self) -> str:
        return f"WriteCredentials(access_key_id={self._access_key_id!r}, secret_access_key='***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, WriteCredentials)
            and other._access_key_id == self._access_key_id
            and other._secret_access_key == self._secret_access_key
        )

    def __hash__(self) -> int:
        return hash(self._access_key_id)

    def __reduce__(self) -> NoReturn:
        raise SecretLeakError("write credentials cannot be pickled")

    def __getstate__(self) -> NoReturn:
        raise SecretLeakError("write credentials cannot be serialized")

    def __format__(self, spec: str) -> str:
        return repr(self)
