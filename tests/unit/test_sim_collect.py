"""The simulation's report (`lab.sim.collect`) read from real run folders and report logs."""

from __future__ import annotations

import json
from pathlib import Path

from lab.sim.collect import PeerWindow, SimReport, WindowRow, collect
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


def _report_with(peers: list[PeerWindow]) -> SimReport:
    rows = [WindowRow(window=w, peers=peers) for w in range(3)]
    return SimReport(
        run_id="r", dense_bytes=1, kept_entries=1, windows=rows, exit_codes={},
        diverged=[], non_finite=[], final_weights={},
    )  # fmt: skip


def test_a_run_whose_validator_scored_nobody_says_how_to_give_it_time() -> None:
    unscored = [PeerWindow(name=f"peer{i}", kind="honest", uid=i, rule="unscored") for i in (0, 1)]
    hint = _report_with(unscored).unscored_hint(20)
    assert hint is not None and "6 of 6 peer-windows unscored" in hint
    assert "--blocks-per-window 40" in hint
    paid = [unscored[0], PeerWindow(name="peer1", kind="honest", uid=1, weight=0.5)]
    assert _report_with(paid).unscored_hint(20) is None  # someone was paid: the run scored
    gated = [PeerWindow(name=f"peer{i}", kind="honest", uid=i, rule="gain gate") for i in (0, 1)]
    assert _report_with(gated).unscored_hint(20) is None  # scored and judged: not a time problem


def test_a_run_whose_honest_pay_spread_is_too_wide_says_so() -> None:
    """Honest weights 0.1 and 0.3 deviate ±50 % from their mean: above the ±20 % a run with
    faults is to keep; 0.45 and 0.55 (±10 %) is within it, and so is a run that paid nobody."""

    def paid(a: float, b: float) -> SimReport:
        return _report_with(
            [
                PeerWindow(name="peer0", kind="honest", uid=0, weight=a),
                PeerWindow(name="peer1", kind="honest", uid=1, weight=b),
            ]
        )

    wide = paid(0.1, 0.3)
    wide.windows.append(WindowRow(window=3, peers=wide.windows[0].peers))
    hint = wide.spread_hint(30)
    assert hint is not None and "±50.0%" in hint
    assert "--blocks-per-window 60" in hint
    narrow = paid(0.45, 0.55)
    narrow.windows.append(WindowRow(window=3, peers=narrow.windows[0].peers))
    assert narrow.spread_hint(30) is None
    nobody = paid(0.0, 0.0)
    nobody.windows.append(WindowRow(window=3, peers=nobody.windows[0].peers))
    assert nobody.spread_hint(30) is None
