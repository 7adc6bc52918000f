"""Types for command-line values: each refuses a bad value with what to give instead, so that
argparse answers with one line before anything runs."""

from __future__ import annotations

import argparse

__all__ = ["device", "fraction", "non_negative_int", "port", "positive_float", "positive_int"]


def positive_int(text: str) -> int:
    """A whole number of 1 or more (windows, intervals, samples)."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 or more")
    return value


def non_negative_int(text: str) -> int:
    """A whole number of 0 or more."""
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0 or more")
    return value


def port(text: str) -> int:
    """A TCP port, or 0 for off."""
    value = _whole(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: give a port from 1 to 65535, or 0 for off")
    return value


def listen_address(text: str) -> str:
    """An IP address to listen on (127.0.0.1, 0.0.0.0, ::1, ...)."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an IP address: use 127.0.0.1 (this machine only) or 0.0.0.0 (every "
            "interface)"
        ) from None


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, refused when this machine has no such device."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu, cuda or cuda:N")
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here; use --device cpu")
        if index and int(index) >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA devices")
    return text


def positive_float(text: str) -> float:
    """A number above 0."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number above 0")
    return value


def fraction(text: str) -> float:
    """A share in (0, 1]."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a share above 0 and at most 1, e.g. 0.4")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value
