"""The simulation's `report.html` read in a real browser (headless Chromium, `tests.support.browser`)
at 800 px: the page does not scroll sideways, every plot loads and fits, the run's parameters are
on it, and the verdict table shows each member by name with its verdict, rule, weight and the
validator's reason as text, uids turned into names."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.sim.collect import PeerWindow, SimReport, WindowRow
from lab.sim.html import palette, render
from tests.support.browser import CHROMIUM, evaluate

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium on the PATH: apt-get install chromium (scripts/test.sh does)",
)


def _report() -> SimReport:
    def peers(w: int) -> list[PeerWindow]:
        return [
            PeerWindow(name="peer0", kind="honest", uid=0, loss=6.0 - w / 10, upload_bytes=70_000,
                       verdict="ok", rule="ok", score=0.01, weight=0.5),
            PeerWindow(name="peer1", kind="honest", uid=1, loss=6.1 - w / 10, upload_bytes=71_000,
                       verdict="ok", rule="ok", score=0.011, weight=0.5),
            PeerWindow(name="copier", kind="copier", uid=2, loss=None, upload_bytes=70_500,
                       verdict="copy", rule="copy", detail="explained by uid 1's update (R² 0.99)",
                       weight=0.0),
        ]  # fmt: skip

    windows = [WindowRow(window=w, synced_loss=7.0 - w / 5, peers=peers(w)) for w in range(4)]
    return SimReport(
        run_id="0123abcd", dense_bytes=5_000_000, kept_entries=80_000, windows=windows,
        exit_codes={"peer0": 0}, diverged=[], non_finite=[], final_weights={"peer0": 0.5},
        parameters={"run id": "0123abcd", "inner steps (H)": "10", "adversaries": "copier ×1"},
    )  # fmt: skip


def test_the_report_reads_at_800_pixels_in_a_browser(tmp_path: Path) -> None:
    report = _report()
    page = tmp_path / "report.html"
    page.write_text(render(report, [("honest weight share", "100.0%")]))
    sideways, images, widest, summary, verdicts, colours = evaluate(
        page.as_uri(),
        [
            "document.documentElement.scrollWidth <= window.innerWidth",
            "[...document.images].map(i => i.complete && i.naturalWidth > 0)",
            "Math.max(...[...document.images].map(i => i.getBoundingClientRect().right))",
            "document.querySelector('#summary').innerText",
            "document.querySelector('#verdicts').innerText",
            "[...document.querySelectorAll('#verdicts .sw')].map(s => s.style.background)",
        ],
        width=800,
    )
    assert sideways, "the page scrolls sideways at 800 px"
    assert images == [True] * 4
    assert widest <= 800
    assert "inner steps (H)" in summary and "copier ×1" in summary and "100.0%" in summary
    assert "copier (copier)" in verdicts and "copy" in verdicts and "0.0%" in verdicts
    assert "explained by uid 1 (peer1)'s update" in verdicts  # the reason, with names
    assert len(colours) == 3 * 4 and len(set(colours)) == 3  # one colour per member
    assert len(set(palette(report).values())) == 3
