"""`report.html`: the simulation's plots and per-window verdicts in one self-contained page."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from lab.sim.collect import SimReport

Plot = Callable[[plt.Axes, SimReport], None]


def _series(r: SimReport, field: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in r.windows:
        for p in row.peers:
            value = getattr(p, field)
            if value is not None:
                xs, ys = out.setdefault(f"{p.name} ({p.kind})", ([], []))
                xs.append(row.window)
                ys.append(float(value))
    return out


def _lines(ax: plt.Axes, series: dict[str, tuple[list[int], list[float]]]) -> None:
    for label, (xs, ys) in sorted(series.items()):
        ax.plot(xs, ys, marker="o", ms=3, label=label, ls="-" if "honest" in label else "--")


def loss_plot(ax: plt.Axes, r: SimReport) -> None:
    """The synchronised model's held-out loss beside DDP's; the peers' inner losses faintly."""
    for label, (xs, ys) in sorted(_series(r, "loss").items()):
        if "honest" in label:
            ax.plot(xs, ys, lw=0.8, alpha=0.35, ls=":", label=f"{label}: inner loss")
    for field, style, label in (
        ("synced_loss", {"color": "tab:blue", "lw": 2.5}, "validator's model (held-out)"),
        ("ddp_loss", {"color": "black", "lw": 2}, "DDP, same tokens (held-out)"),
    ):
        pts = [(row.window, getattr(row, field)) for row in r.windows]
        pts = [(w, v) for w, v in pts if v is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=label, **style)
    ax.set(title="Held-out loss of the synchronised model", xlabel="window", ylabel="loss")


def bytes_plot(ax: plt.Axes, r: SimReport) -> None:
    _lines(ax, _series(r, "upload_bytes"))
    ax.axhline(
        r.dense_bytes, color="black", lw=2, label=f"dense fp32 ({r.dense_bytes / 2**20:.1f} MiB)"
    )
    ax.set_yscale("log")
    ax.set(title="Bytes per update", xlabel="window", ylabel="bytes")


def score_plot(ax: plt.Axes, r: SimReport) -> None:
    _lines(ax, _series(r, "score"))
    ax.set(title="Validator loss score (relative improvement)", xlabel="window", ylabel="score")


def weight_plot(ax: plt.Axes, r: SimReport) -> None:
    _lines(ax, _series(r, "weight"))
    ax.set(title="Weights", xlabel="window", ylabel="weight")


def _png(plot: Plot, r: SimReport) -> str:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    plot(ax, r)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def render(r: SimReport, summary: list[tuple[str, str]]) -> str:
    plots = "".join(
        f'<img alt="{p.__name__}" src="data:image/png;base64,{_png(p, r)}">'
        for p in (loss_plot, bytes_plot, score_plot, weight_plot)
    )
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in summary
    )
    verdicts = "".join(
        f"<tr><td>{row.window}</td>"
        + "".join(
            f"<td title='{html.escape(p.detail or '')}'>{html.escape(p.verdict or '–')}</td>"
            for p in row.peers
        )
        + "</tr>"
        for row in r.windows
    )
    header = "".join(
        f"<th>{html.escape(p.name)}</th>" for p in (r.windows[0].peers if r.windows else [])
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Tessera simulation</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}img{{max-width:48%;margin:1%}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}</style>
</head><body><h1>Tessera simulation</h1><p>run {html.escape(r.run_id)}</p>
<table>{rows}</table>{plots}<h2>Validator verdicts</h2>
<table><tr><th>window</th>{header}</tr>{verdicts}</table></body></html>"""
