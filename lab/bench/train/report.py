"""`tessera bench train`'s outputs: ``bench.json``, ``bench.png`` and the comparison table.

``bench.json`` is read by tools; its keys are stable::

    {"results": [{"strategy", "label", "dense", "final_loss", "bytes_per_window", "loss_curve",
                  ...extra keys}], ...extra keys}

* ``dense``: the method sends uncompressed values (``ddp``, ``diloco``);
* ``final_loss``: held-out loss of the synchronised model after the last window;
* ``bytes_per_window``: what one replica sends per window (mean over windows);
* ``loss_curve``: the held-out loss after each window.

Extra: ``final_loss_all_applied`` is the final loss with every window's aggregate applied (with
``outer.delay = 1`` the last one is still held after the last window; otherwise it is
``final_loss``). With several seeds each row is the mean over them (`combine_seeds`):
``final_loss_by_seed``, ``final_loss_spread`` (largest minus smallest), and for each ratio whether
the difference exceeds the larger of the two methods' spreads (``vs_ddp_beyond_spread``,
``vs_best_dense_beyond_spread``; None with one seed).

The held-out set's own noise: ``final_row_losses`` holds the final model's loss on each held-out
sample (with several seeds, each sample's mean over them), ``final_loss_se`` the standard error
of their mean, and ``vs_ddp_se`` / ``vs_best_dense_se`` that of each ratio from the held-out
samples alone: both methods are scored on the same samples, so it is the standard error of the
mean per-sample difference, over the reference's loss (`heldout_se`).

Ratios: each method's final loss over **the best DDP** (the lowest final loss among the DDP
configurations: one, or the learning rates of ``--tune``) and over the **best dense local method**
(the lowest final loss among the dense methods other than DDP, in the same run); bytes over a
dense float32 pseudo-gradient (4 bytes per parameter) and over that best dense method's bytes.
``family`` groups the configurations of one tuned baseline; the summary names each family's best
(``best_of_family``).
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import fmean, stdev
from typing import Any

from lab.bench.train.engine import Curve

TARGET_VS_DENSE = 1.02
TARGET_BYTES_VS_DENSE = 0.03
TARGET_VS_DDP = 1.08
WITHIN_SPREAD = "*: the difference is within the spread between seeds"
HELDOUT_NOTE = (
    "±: a ratio's standard error from the held-out samples alone (both methods scored on the "
    "same samples)"
)


def result_row(c: Curve, tokens_per_window: int) -> dict[str, Any]:
    m = c.method
    n = len(c.loss)
    return {
        "strategy": m.strategy,
        "label": m.label,
        "family": m.family,
        "dense": m.dense,
        "final_loss": c.loss[-1] if c.loss else math.nan,
        "final_loss_all_applied": c.applied_loss
        if c.applied_loss is not None
        else (c.loss[-1] if c.loss else math.nan),
        "bytes_per_window": sum(c.bytes_sent) / n if n else 0.0,
        "loss_curve": list(c.loss),
        "initial_loss": c.initial_loss,
        "tokens_curve": [tokens_per_window * (w + 1) for w in range(n)],
        "bytes_curve": [sum(c.bytes_sent[: w + 1]) for w in range(n)],
        "wall_s": sum(c.wall_s),
        "options": dict(m.options),
        "run_id": m.run.run_id,
        "final_row_losses": list(c.final_rows),
    }


def combine_seeds(by_seed: list[list[dict[str, Any]]], seeds: list[int]) -> list[dict[str, Any]]:
    """One row per method from its row of each seed (`result_row`, methods in the same order):
    the means over the seeds of its losses, curves and bytes, every seed's final loss and their
    spread; wall time summed."""
    combined = []
    for rows in zip(*by_seed, strict=True):
        if len({r["label"] for r in rows}) != 1:
            raise ValueError("every seed must train the same methods in the same order")
        finals = [r["final_loss"] for r in rows]

        def mean(key: str, rows: tuple[dict[str, Any], ...] = rows) -> float:
            return fmean(r[key] for r in rows)

        def curve(key: str, rows: tuple[dict[str, Any], ...] = rows) -> list[float]:
            return [fmean(points) for points in zip(*(r[key] for r in rows), strict=True)]

        combined.append(
            {
                **rows[0],
                "final_loss": mean("final_loss"),
                "final_loss_all_applied": mean("final_loss_all_applied"),
                "bytes_per_window": mean("bytes_per_window"),
                "initial_loss": mean("initial_loss"),
                "loss_curve": curve("loss_curve"),
                "bytes_curve": curve("bytes_curve"),
                "wall_s": sum(r["wall_s"] for r in rows),
                "run_id": [r["run_id"] for r in rows],
                "seeds": list(seeds),
                "final_loss_by_seed": finals,
                "final_loss_spread": max(finals) - min(finals),
                "final_row_losses": curve("final_row_losses"),
            }
        )
    return combined


def heldout_se(rows: list[float], reference: list[float] | None = None) -> float | None:
    """The standard error of the mean of `rows` (per-sample losses), or, given the `reference`
    method's losses on the same samples, of the mean per-sample difference; None without two
    samples to tell it from."""
    diffs = rows if reference is None else [a - b for a, b in zip(rows, reference, strict=True)]
    if len(diffs) < 2:
        return None
    return stdev(diffs) / math.sqrt(len(diffs))


def _ratio_se(r: dict[str, Any], reference: dict[str, Any] | None) -> float | None:
    """The held-out samples' standard error of ``r``'s loss over `reference`'s."""
    if reference is None:
        return None
    rows, ref = r.get("final_row_losses", []), reference.get("final_row_losses", [])
    if len(rows) != len(ref):  # a row without its samples' losses (one from an older bench)
        return None
    se = heldout_se(rows, ref)
    return None if se is None else se / reference["final_loss"]


def _beyond_spread(a: dict[str, Any], b: dict[str, Any] | None) -> bool | None:
    """Whether two methods' mean final losses differ by more than the larger of their spreads
    (None with one seed, or without the other method)."""
    if b is None or len(a.get("seeds", [])) < 2:
        return None
    spread = max(a["final_loss_spread"], b["final_loss_spread"])
    return abs(a["final_loss"] - b["final_loss"]) > spread


def summarise(rows: list[dict[str, Any]], dense_fp32_bytes: int) -> dict[str, Any]:
    """Per-method ratios (added to each row) and the targets' checks."""
    ddps = [r for r in rows if r["strategy"] == "ddp"]
    ddp = min(ddps, key=lambda r: r["final_loss"]) if ddps else None
    local_dense = [r for r in rows if r["dense"] and r["strategy"] != "ddp"]
    best = min(local_dense, key=lambda r: r["final_loss"]) if local_dense else None
    families: dict[str, dict[str, Any]] = {}
    for r in rows:
        known = families.get(r["family"])
        if known is None or r["final_loss"] < known["final_loss"]:
            families[r["family"]] = r
    sizes = {f: sum(r["family"] == f for r in rows) for f in families}
    for r in rows:
        r["best_in_family"] = sizes[r["family"]] > 1 and families[r["family"]] is r
    for r in rows:
        r["vs_ddp"] = r["final_loss"] / ddp["final_loss"] if ddp else None
        r["vs_best_dense"] = r["final_loss"] / best["final_loss"] if best else None
        r["vs_ddp_beyond_spread"] = _beyond_spread(r, ddp)
        r["vs_best_dense_beyond_spread"] = _beyond_spread(r, best)
        r["final_loss_se"] = heldout_se(r.get("final_row_losses", []))
        r["vs_ddp_se"] = _ratio_se(r, ddp)
        r["vs_best_dense_se"] = _ratio_se(r, best)
        r["bytes_vs_fp32"] = r["bytes_per_window"] / dense_fp32_bytes
        r["bytes_vs_best_dense"] = (
            r["bytes_per_window"] / best["bytes_per_window"] if best else None
        )
    checks = {}
    for r in rows:
        if r["strategy"] != "sparseloco":
            continue
        if best is not None:
            checks[f"{r['label']}: loss <= {TARGET_VS_DENSE}x best dense"] = (
                r["vs_best_dense"] <= TARGET_VS_DENSE
            )
            checks[f"{r['label']}: bytes <= {TARGET_BYTES_VS_DENSE:.0%} of best dense"] = (
                r["bytes_vs_best_dense"] <= TARGET_BYTES_VS_DENSE
            )
        if ddp is not None:
            checks[f"{r['label']}: loss <= {TARGET_VS_DDP}x DDP"] = r["vs_ddp"] <= TARGET_VS_DDP
    return {
        "dense_fp32_bytes": dense_fp32_bytes,
        "best_dense": best["label"] if best else None,
        "best_ddp": ddp["label"] if ddp else None,
        "best_of_family": {f: r["label"] for f, r in families.items()},
        "checks": checks,
    }


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The table's rows as text (shared by the terminal table and the markdown file)."""

    def ratio(
        x: float | None, fmt: str = "{:.3f}", beyond: bool | None = None, se: float | None = None
    ) -> str:
        if x is None:
            return "–"
        noise = f" ±{se:.3f}" if se else ""  # the reference's own row has none
        return fmt.format(x) + noise + ("*" if beyond is False else "")

    def spread(r: dict[str, Any]) -> str:
        return f"{r['final_loss_spread']:.4f}" if len(r.get("seeds", [])) > 1 else "–"

    return [
        [
            r["label"] + (" (best)" if r.get("best_in_family") else ""),
            f"{r['final_loss']:.4f}",
            spread(r),
            ratio(r["vs_ddp"], beyond=r.get("vs_ddp_beyond_spread"), se=r.get("vs_ddp_se")),
            ratio(
                r["vs_best_dense"],
                beyond=r.get("vs_best_dense_beyond_spread"),
                se=r.get("vs_best_dense_se"),
            ),
            f"{r['bytes_per_window']:,.0f}",
            ratio(r["bytes_vs_fp32"], "{:.2%}"),
            ratio(r["bytes_vs_best_dense"], "{:.2%}"),
            f"{r['wall_s']:.0f}",
        ]
        for r in rows
    ]


COLUMNS = [
    "method",
    "final held-out loss",
    "seed spread",
    "× best DDP",
    "× best dense",
    "bytes/window/replica",
    "of dense fp32",
    "of best dense",
    "wall s",
]


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    lines.append("")
    lines.append(f"best DDP: {summary['best_ddp'] or '–'}")
    lines.append(f"best dense local method: {summary['best_dense'] or '–'}")
    lines.append(WITHIN_SPREAD)
    lines.append(HELDOUT_NOTE)
    for name, ok in summary["checks"].items():
        lines.append(f"- {name}: {'met' if ok else 'MISSED'}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Two panels: held-out loss against tokens, and against cumulative bytes per replica."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        style = {"ls": "-" if not r["dense"] else "--", "marker": "o", "ms": 2}
        if r["strategy"] == "ddp":
            style.update(color="black", lw=2, ls="-")
        tokens = [0, *r["tokens_curve"]]
        loss = [r["initial_loss"], *r["loss_curve"]]
        a.plot(tokens, loss, label=r["label"], **style)
        b.plot(r["bytes_curve"], r["loss_curve"], label=r["label"], **style)
    a.set(xlabel="tokens (all replicas)", ylabel="held-out loss", title="Loss against tokens")
    b.set(xlabel="bytes sent by one replica (cumulative)", ylabel="held-out loss")
    b.set(title="Loss against bytes", xscale="log")
    low = min((min(r["loss_curve"]) for r in rows if r["loss_curve"]), default=0)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=low - 0.1, top=low + 2.5)
    a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
