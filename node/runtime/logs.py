"""Logging for long-running roles: readable lines by default, JSON lines with `--log-format json`.

JSON records carry `ts`, `level`, `logger` and `msg` (plus `exc` for exceptions), one object per
line, ready for log shippers, and the record's own fields (``log.info(..., extra=fields(window=3,
loss=5.2))``) as keys of their own, so a shipper filters on ``window`` or plots ``loss`` without
parsing the message. Nothing here ever formats credentials: write keys cannot be
serialised (`protocol.credentials`) and read keys are public by design.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


FIELDS = "tessera_fields"
"""The attribute of a log record that carries its structured fields (`fields`)."""


def fields(**values: object) -> dict[str, dict[str, object]]:
    """``extra=`` for a log call whose values the JSON lines carry as keys of their own."""
    return {FIELDS: values}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, FIELDS, None)
        if isinstance(extra, dict):
            out |= {k: v for k, v in extra.items() if k not in out}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


ROOT = "tessera"
"""Every logger of the project is under this one (``tessera.<module>``): one name to configure."""


def setup_logging(level: str, fmt: str = "text") -> None:
    """One handler on the root logger; the project's loggers (`ROOT`) at `level`, everything
    else (boto, urllib3, asyncio, ...) at WARNING or above, whatever `level` says."""
    number = logging.getLevelNamesMapping().get(level.upper())
    if number is None:
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(logging.WARNING, number))
    logging.getLogger(ROOT).setLevel(number)
