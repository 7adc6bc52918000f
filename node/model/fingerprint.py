"""A small parameter fingerprint, so peers and validators can check they hold the same model.

The fingerprint hashes every parameter's exact float32 bytes (BLAKE2b-128) in name order, so two
models have the same fingerprint only if they are bit-identical. For models above
`FULL_HASH_LIMIT` elements it hashes a fixed, evenly strided sample of each tensor plus the
tensor's float64 sum instead, which catches any divergence that matters at a fraction of the cost.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

FULL_HASH_LIMIT = 200_000_000
SAMPLE_STRIDE = 4099  # prime, so the sample does not align with tile or row boundaries


def fingerprint(model: torch.nn.Module) -> str:
    params = sorted(model.state_dict().items())
    return fingerprint_tensors(params, sum(p.numel() for _, p in params))


def fingerprint_tensors(params: Iterable[tuple[str, torch.Tensor]], total: int) -> str:
    """The fingerprint of a model's ``(name, tensor)`` pairs in name order, `total` elements in
    all; one tensor at a time, so a sharded model can gather them as they are hashed."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in params:
        flat = p.detach().reshape(-1).to(torch.float32)
        h.update(name.encode())
        if total <= FULL_HASH_LIMIT:
            h.update(flat.cpu().numpy().tobytes())
        else:
            h.update(flat[::SAMPLE_STRIDE].cpu().numpy().tobytes())
            h.update(repr(float(flat.double().sum())).encode())
    return h.hexdigest()
