"""Buckets for a simulation on an S3-compatible server (MinIO, or moto in tests).

Buckets are created with `deploy.provision.ensure_s3_bucket`; this module picks the read key.
"""

from __future__ import annotations

import os


def read_key_env() -> dict[str, str]:
    """The read key peers commit on chain: TESSERA_S3_READ_* if set, else (local sim) the write key."""
    env = os.environ
    return {
        "TESSERA_S3_READ_ACCESS_KEY_ID": env.get("TESSERA_S3_READ_ACCESS_KEY_ID")
        or env.get("TESSERA_S3_ACCESS_KEY_ID", env.get("AWS_ACCESS_KEY_ID", "")),
        "TESSERA_S3_READ_SECRET_ACCESS_KEY": env.get("TESSERA_S3_READ_SECRET_ACCESS_KEY")
        or env.get("TESSERA_S3_SECRET_ACCESS_KEY", env.get("AWS_SECRET_ACCESS_KEY", "")),
    }
