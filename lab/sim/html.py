"""`report.html`: the simulation's plots and per-window verdicts in one self-contained page."""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Callable
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import to_hex
from matplotlib.ticker import MaxNLocator

from lab.sim.collect import SimReport

Plot = Callable[[plt.Axes, SimReport], None]


def palette(r: SimReport) -> dict[str, str]:
    """One colour per member, the same in every plot and in the verdict table."""
    names = [p.name for p in r.windows[0].peers] if r.windows else []
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: to_hex(cmap(i % cmap.N)) for i, name in enumerate(names)}


def _series(r: SimReport, field: str) -> dict[str, tuple[str, list[int], list[float]]]:
    """Per member: its kind and the (window, value) points of `field`."""
    out: dict[str, tuple[str, list[int], list[float]]] = {}
    for row in r.windows:
        for p in row.peers:
            value = getattr(p, field)
            if value is not None:
                _, xs, ys = out.setdefault(p.name, (p.kind, [], []))
                xs.append(row.window)
                ys.append(float(value))
    return out


def _lines(ax: plt.Axes, r: SimReport, field: str) -> None:
    colours = palette(r)
    for name, (kind, xs, ys) in sorted(_series(r, field).items()):
        style = "-" if kind == "honest" else "--"
        ax.plot(xs, ys, marker="o", ms=3, label=f"{name} ({kind})", ls=style, color=colours[name])


def loss_plot(ax: plt.Axes, r: SimReport) -> None:
    """The synchronised model's held-out loss beside DDP's; the peers' inner losses faintly."""
    colours = palette(r)
    for name, (kind, xs, ys) in sorted(_series(r, "loss").items()):
        if kind == "honest":
            ax.plot(
                xs, ys, lw=0.8, alpha=0.5, ls=":", color=colours[name], label=f"{name}: inner loss"
            )
    lines: tuple[tuple[str, dict[str, Any], str], ...] = (
        ("synced_loss", {"color": "black", "lw": 2.5}, "validator's model (held-out)"),
        ("ddp_loss", {"color": "dimgray", "lw": 2, "ls": "--"}, "DDP, same tokens (held-out)"),
    )
    for field, style, label in lines:
        pts = [(row.window, getattr(row, field)) for row in r.windows]
        pts = [(w, v) for w, v in pts if v is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=label, **style)
    ax.set(title="Held-out loss of the synchronised model", xlabel="window", ylabel="loss")


def bytes_plot(ax: plt.Axes, r: SimReport) -> None:
    _lines(ax, r, "upload_bytes")
    ax.axhline(
        r.dense_bytes, color="black", lw=2, label=f"dense fp32 ({r.dense_bytes / 2**20:.1f} MiB)"
    )
    ax.set_yscale("log")
    ax.set(title="Bytes per update", xlabel="window", ylabel="bytes")


def score_plot(ax: plt.Axes, r: SimReport) -> None:
    _lines(ax, r, "score")
    ax.set(title="Validator loss score (relative improvement)", xlabel="window", ylabel="score")


def weight_plot(ax: plt.Axes, r: SimReport) -> None:
    _lines(ax, r, "weight")
    ax.set(title="Weights", xlabel="window", ylabel="weight")


def _png(plot: Plot, r: SimReport) -> str:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    plot(ax, r)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=9, loc="best")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _named(text: str, names: dict[int, str]) -> str:
    """`text` with every ``uid N`` of a member followed by its name."""
    return re.sub(
        r"\buid (\d+)\b",
        lambda m: (
            f"{m.group(0)} ({names[int(m.group(1))]})" if int(m.group(1)) in names else m.group(0)
        ),
        text,
    )


def _verdict_rows(r: SimReport) -> str:
    colours = palette(r)
    names = {p.uid: p.name for p in (r.windows[0].peers if r.windows else [])}
    out = []
    for row in r.windows:
        for i, p in enumerate(row.peers):
            window = f"<td rowspan='{len(row.peers)}'>{row.window}</td>" if i == 0 else ""
            swatch = f"<span class='sw' style='background:{colours[p.name]}'></span>"
            why = _named(p.detail or "", names)
            out.append(
                f"<tr>{window}<td>{swatch}{html.escape(p.name)} <small>({html.escape(p.kind)})</small>"
                f"</td><td>{html.escape(p.verdict or '–')}</td><td>{html.escape(p.rule or '–')}</td>"
                f"<td class='num'>{p.weight:.1%}</td><td class='why'>{html.escape(why)}</td></tr>"
            )
    return "".join(out)


def render(r: SimReport, summary: list[tuple[str, str]]) -> str:
    plots = "".join(
        f'<img alt="{p.__name__}" src="data:image/png;base64,{_png(p, r)}">'
        for p in (loss_plot, bytes_plot, score_plot, weight_plot)
    )
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
        for k, v in [*r.parameters.items(), *summary]
    )
    return f"""<!doctype html><html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>Tessera simulation</title>
<style>body{{font-family:sans-serif;margin:1em auto;max-width:1200px;padding:0 1em}}
img{{width:100%;max-width:100%;margin:0.5em 0}}
@media (min-width:1000px){{img{{width:49%}}}}
.scroll{{overflow-x:auto}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:14px;text-align:left;vertical-align:top}}
td.num{{text-align:right}}td.why{{font-size:13px;color:#333;max-width:28em}}
.sw{{display:inline-block;width:0.8em;height:0.8em;margin-right:0.4em;border-radius:2px}}</style>
</head><body><h1>Tessera simulation</h1>
<h2>Run and results</h2><div class="scroll"><table id="summary">{rows}</table></div>
<h2>Plots</h2>{plots}
<h2>Validator verdicts</h2><p>Each member's verdict, the rule that set its weight
(<code>validator/reports.py</code>), its weight and the validator's reason.</p>
<div class="scroll"><table id="verdicts"><tr><th>window</th><th>member</th><th>verdict</th>
<th>rule</th><th>weight</th><th>why</th></tr>{_verdict_rows(r)}</table></div></body></html>"""
