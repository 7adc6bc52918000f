"""JSON log lines parse and carry the fields log shippers need."""

from __future__ import annotations

import json
import logging

import pytest

from node.runtime.logs import fields, setup_logging
from node.runtime.phases import Phases


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


def test_one_project_root_at_the_chosen_level_and_libraries_at_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("debug")  # any case
    try:
        logging.getLogger("tessera.node.window.gather").debug("ours")
        logging.getLogger("botocore.endpoint").debug("a library's chatter")
        logging.getLogger("botocore.endpoint").warning("a library's warning")
    finally:
        setup_logging("WARNING", "text")
    err = capsys.readouterr().err
    assert "ours" in err and "a library's warning" in err
    assert "chatter" not in err
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        setup_logging("loud")


def test_a_records_fields_are_keys_of_its_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    """What a shipper filters or plots (window, phase, seconds, loss) without parsing `msg`; the
    text format keeps just the message."""
    setup_logging("INFO", "json")
    try:
        with Phases(3, logging.getLogger("tessera.test"))("train", "10 inner steps"):
            pass
        logging.getLogger("tessera.test").info(
            "window %d: loss %.2f", 3, 5.25, extra=fields(window=3, loss=5.25, gathered=[0, 2])
        )
    finally:
        setup_logging("WARNING", "text")
    phase, done = (json.loads(x) for x in capsys.readouterr().err.splitlines())
    assert phase["msg"].startswith("window 3: train") and phase["phase"] == "train"
    assert phase["window"] == 3 and phase["seconds"] >= 0
    assert done["msg"] == "window 3: loss 5.25"
    assert (done["window"], done["loss"], done["gathered"]) == (3, 5.25, [0, 2])
    setup_logging("INFO", "text")
    try:
        logging.getLogger("tessera.test").info("plain %d", 1, extra=fields(window=1))
    finally:
        setup_logging("WARNING", "text")
    assert capsys.readouterr().err.strip().endswith("tessera.test: plain 1")
