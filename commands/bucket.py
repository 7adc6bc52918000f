"""`tessera bucket create --store s3://…`: create our bucket with the write key (idempotent)."""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from protocol.stores import StoreError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bucket_command", metavar="ACTION", required=True)
    create = sub.add_parser("create", help="create the bucket unless it exists (idempotent)")
    create.add_argument(
        "--store",
        default=os.environ.get("TESSERA_STORE"),
        help="s3://BUCKET?endpoint=… (write key from TESSERA_S3_ACCESS_KEY_ID / _SECRET_…)",
    )


def run(args: argparse.Namespace) -> int:
    from commands.provision import ProvisionError, ensure_s3_bucket

    console = Console(highlight=False, soft_wrap=True)
    if not args.store:
        raise SystemExit("pass --store or set TESSERA_STORE")
    if args.store.startswith("file:"):
        console.print("file:// buckets need no creation: the directory appears on first write")
        return 0
    try:
        created = ensure_s3_bucket(args.store)
    except (ProvisionError, StoreError) as exc:  # one line, `tessera bucket: …` (commands.cli)
        raise SystemExit(str(exc)) from None
    console.print(f"bucket {'created' if created else 'already exists'}: {args.store}")
    return 0
