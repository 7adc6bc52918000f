"""JSON log lines parse and carry the fields log shippers need."""

from __future__ import annotations

import json
import logging

import pytest

from node.runtime.logs import setup_logging


def test_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("INFO", "json")
    try:
        logging.getLogger("tessera.test").info("window %d done", 7)
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("tessera.test").exception("failed")
    finally:
        setup_logging("WARNING", "text")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert lines[0]["msg"] == "window 7 done" and lines[0]["level"] == "INFO"
    assert lines[0]["logger"] == "tessera.test" and lines[0]["ts"].endswith("+00:00")
    assert "ValueError: boom" in lines[1]["exc"]
