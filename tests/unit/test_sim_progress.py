"""The simulation's line per finished window (`lab.sim.progress`), read from the validator's
report file as it grows: names not uids, pay in percent, the rule behind each zero, the time left."""

from __future__ import annotations

import json
from pathlib import Path

from lab.sim.layout import Member, World
from lab.sim.progress import WindowLines, window_line
from node.runtime.report_log import REPORTS
from protocol.runconfig import RunConfig

NAMES = {0: "peer0", 1: "peer1", 2: "noise", 3: "copier"}


def _report(window: int) -> dict:
    return {
        "window": window,
        "selected": [0, 1, 2, 3],
        "aggregated": [0, 1, 2],
        "weights": {"0": 0.55, "1": 0.45, "2": 0.0, "3": 0.0},
        "peers": [
            {"uid": 0, "verdict": "ok", "rule": ""},
            {"uid": 1, "verdict": "ok", "rule": ""},
            {"uid": 2, "verdict": "ok", "rule": "gain"},
            {"uid": 3, "verdict": "copy", "rule": ""},
        ],
    }


def test_a_window_line_names_the_pay_and_every_zero_with_its_rule() -> None:
    line = window_line(_report(4), NAMES)
    assert line == (
        "window 4: applied 3 of 4 selected; paid peer0 55%, peer1 45%; "
        "paid nothing: noise (gain), copier (copy)"
    )


def test_each_finished_window_is_printed_once_as_the_file_grows(tmp_path: Path) -> None:
    members = [
        Member(
            name,
            "validator" if name == "validator" else "honest",
            uid,
            "5x",
            "file://",
            tmp_path / name,
        )
        for uid, name in [*NAMES.items(), (9, "validator")]
    ]
    world = World(
        tmp_path, tmp_path / "run.json", RunConfig.preset("tiny"), "local://", None, members
    )
    (tmp_path / "validator").mkdir()
    printed: list[str] = []
    lines = WindowLines(world, 4, printed.append)
    lines.tick()
    assert printed == []
    path = tmp_path / "validator" / REPORTS
    path.write_text(json.dumps(_report(0)) + "\n" + json.dumps(_report(1)) + "\n")
    lines.tick()
    lines.tick()
    assert [p.split(";")[0] for p in printed] == [
        "window 0: applied 3 of 4 selected",
        "window 1: applied 3 of 4 selected",
    ]
    assert all("s so far, about" in p and p.endswith("s left") for p in printed)
