"""The simulation's report (`lab.sim.collect`) read from real run folders and report logs."""

from __future__ import annotations

import json
from pathlib import Path

from lab.sim.collect import collect
from lab.sim.layout import World, build_world
from node.runtime.report_log import REPORTS


def _log(world: World, name: str, rows: list[dict]) -> None:
    member = next(m for m in world.members if m.name == name)
    member.state_dir.mkdir(parents=True, exist_ok=True)
    path = member.state_dir / REPORTS
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_ends_at_the_runs_last_window(tmp_path: Path) -> None:
    """A peer that skipped a window (a chain outage, a restart) trains one past the run's end,
    where nobody else uploads and the validator pays it nothing: the report's windows and final
    weights are those of the run's own last window."""
    world = build_world(tmp_path, 3, 1.0, 10, 2, [], "file")
    uids = {m.name: m.uid for m in world.members}
    _log(world, "peer0", [{"window": w, "loss": 8.0 - w} for w in (0, 1, 3)])  # skipped 2
    _log(world, "peer1", [{"window": w, "loss": 8.0 - w} for w in (0, 1, 2)])
    paid = {str(uids["peer0"]): 0.4, str(uids["peer1"]): 0.6}
    alone = {str(uids["peer0"]): 0.0, str(uids["peer1"]): 1.0}
    _log(
        world,
        "validator",
        [{"window": w, "peers": [], "weights": alone if w == 3 else paid} for w in range(4)],
    )
    report = collect(world, {}, 1, 1, {})
    assert [row.window for row in report.windows] == [0, 1, 2]
    assert report.final_weights == {"peer0": 0.4, "peer1": 0.6}
