"""Pay relative to an honest peer's for one training split over three hotkeys and for training
on reversed tokens, with pay scaled by the own-data effect and on significance alone: the
figures of docs/incentives.md, section 5 (the updates and probes of
`tests/unit/test_pay_for_work.py`).

    python scripts/experiments/pay_for_work.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]

import test_pay_for_work as work  # noqa: E402


def main() -> None:
    scores = work.scores.__wrapped__()  # type: ignore[attr-defined]
    rules = {
        "own-data effect (effect_full 0.8)": work.CFG,
        "significance alone": work.CFG.model_copy(update={"effect_full": 1e-9}),
    }
    print("rule | honest (each) | split, 3 hotkeys (sum) | reversed tokens")
    for name, cfg in rules.items():
        pay = work._pay(scores, cfg)
        honest = ", ".join(f"{pay[u]:.2f}" for u in work.HONEST)
        split = sum(pay[u] for u in work.SPLIT)
        print(f"{name} | {honest} | {split:.2f} | {pay[work.REVERSED]:.2f}")


if __name__ == "__main__":
    main()
