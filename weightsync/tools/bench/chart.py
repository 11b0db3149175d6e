"""The bench's chart (``bench --plot PATH``): GB/s of every case next to its raw limit.

One panel per model size, one horizontal bar per measured case (effective GB/s, the model's
bytes over the median sync), the raw-limit rows (one copy of one buffer; one gloo
broadcast of one buffer) drawn in their own colour, and on every other bar a tick at the
GB/s of the limit that case is measured against, with the fraction reached. Each panel has
its own linear axis: the sizes differ by orders of magnitude.

``.svg`` is written here, with nothing beyond the standard library, so the README's set-up
covers it; any other suffix (``.png``) goes through matplotlib, which the ``plot`` extra
installs. :func:`check_plot_path` refuses a path that cannot be written before a run starts,
so a long run is not lost to it at the end. Call order::

    check_plot_path(path)         # before measuring
    plot(cases, path)             # after the last case
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from xml.sax.saxutils import escape

from weightsync.core.wire.errors import SettingsError
from weightsync.tools.bench.report import Case

#: Rows whose GB/s means nothing (a no-op call divides the model's bytes by Ray's floor).
SKIPPED_PREFIXES = ("ray floor",)

WIDTH = 900
LABEL_W = 330
RIGHT_W = 150
BAR_H = 16
GAP = 6
PANEL_HEAD = 34
AXIS_H = 26
LIMIT_COLOUR = "#4d4d4d"
CASE_COLOUR = "#3b7dd8"
TICK_COLOUR = "#d62728"


@dataclass(frozen=True)
class Bar:
    """One case as drawn: its label, GB/s, the GB/s of its limit (None: none) and whether
    it is itself a raw-limit row."""

    label: str
    gbps: float
    limit_gbps: float | None
    is_limit: bool

    @property
    def note(self) -> str:
        if self.is_limit or self.limit_gbps is None:
            return f"{self.gbps:.3g} GB/s"
        return f"{self.gbps:.3g} GB/s, {self.gbps / self.limit_gbps:.0%} of limit"


def panels(cases: list[Case]) -> list[tuple[str, list[Bar]]]:
    """Per size, in the order run: the bars of its cases, in the order measured."""
    out: list[tuple[str, list[Bar]]] = []
    for size in dict.fromkeys(c.size for c in cases):
        bars = []
        for c in cases:
            if c.size != size or not c.times or c.name.startswith(SKIPPED_PREFIXES):
                continue
            label = c.name + (f" ({c.buffer_mib:.3g} MiB x {c.num_buffers})" if c.name.endswith("(knobs)") else "")
            limit = c.model_bytes / c.limit_s / 1e9 if c.limit_s else None
            bars.append(Bar(label, c.gbps, limit, c.name.startswith("raw limit")))
        if bars:
            model_gb = next(c.model_bytes for c in cases if c.size == size) / 1e9
            out.append((f"{size} ({model_gb:.3g} GB)", bars))
    return out


def check_plot_path(path: str) -> None:
    """Refuse, before anything is measured, a chart that could not be written at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SettingsError(f"--plot {path}: folder {folder} does not exist; create it or pick another path")
    if not path.endswith(".svg") and importlib.util.find_spec("matplotlib") is None:
        raise SettingsError(
            f"--plot {path}: only .svg is written without matplotlib, which is not installed; "
            "name a .svg file, or install the plot extra (.venv/bin/python -m pip install -e '.[plot]')"
        )


def plot(cases: list[Case], path: str, title: str = "weightsync bench: GB/s against the raw limit") -> None:
    """Write the chart of ``cases`` to ``path`` (SVG by suffix, else PNG through matplotlib)."""
    drawn = panels(cases)
    if path.endswith(".svg"):
        with open(path, "w") as fh:
            fh.write(svg(drawn, title))
    else:
        _matplotlib(drawn, path, title)
    print(f"wrote {path}")


def _ticks(top: float) -> list[float]:
    """About five round tick values from 0 to at least ``top``."""
    raw = top / 5 if top > 0 else 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(top / step) + 2)]


def svg(drawn: list[tuple[str, list[Bar]]], title: str) -> str:
    """The chart as an SVG document."""
    plot_w = WIDTH - LABEL_W - RIGHT_W
    parts: list[str] = []
    y = 40
    for heading, bars in drawn:
        top = max(max(b.gbps, b.limit_gbps or 0) for b in bars)
        ticks = _ticks(top)
        scale = plot_w / ticks[-1]
        parts.append(f'<text x="10" y="{y + 16}" font-size="14" font-weight="bold">{escape(heading)}</text>')
        y += PANEL_HEAD
        body_h = len(bars) * (BAR_H + GAP)
        for t in ticks:
            x = LABEL_W + t * scale
            parts.append(f'<line x1="{x:.1f}" y1="{y - 4}" x2="{x:.1f}" y2="{y + body_h}" stroke="#e0e0e0"/>')
            parts.append(f'<text x="{x:.1f}" y="{y + body_h + 14}" font-size="10" text-anchor="middle">{t:g}</text>')
        for bar in bars:
            colour = LIMIT_COLOUR if bar.is_limit else CASE_COLOUR
            parts.append(
                f'<text x="{LABEL_W - 6}" y="{y + BAR_H - 4}" font-size="11" text-anchor="end">{escape(bar.label)}</text>'
            )
            parts.append(
                f'<rect x="{LABEL_W}" y="{y}" width="{max(bar.gbps * scale, 1):.1f}" height="{BAR_H}" fill="{colour}"/>'
            )
            if bar.limit_gbps is not None and not bar.is_limit:
                x = LABEL_W + bar.limit_gbps * scale
                parts.append(
                    f'<line x1="{x:.1f}" y1="{y - 2}" x2="{x:.1f}" y2="{y + BAR_H + 2}" '
                    f'stroke="{TICK_COLOUR}" stroke-width="2"/>'
                )
            parts.append(
                f'<text x="{LABEL_W + plot_w + 6}" y="{y + BAR_H - 4}" font-size="10">{escape(bar.note)}</text>'
            )
            y += BAR_H + GAP
        parts.append(
            f'<text x="{LABEL_W + plot_w / 2:.0f}" y="{y + AXIS_H}" font-size="10" text-anchor="middle">'
            "effective GB/s (model bytes / median sync)</text>"
        )
        y += AXIS_H + 16
    legend = (
        f'<rect x="{LABEL_W}" y="{y}" width="12" height="10" fill="{LIMIT_COLOUR}"/>'
        f'<text x="{LABEL_W + 16}" y="{y + 9}" font-size="10">raw limit row</text>'
        f'<rect x="{LABEL_W + 110}" y="{y}" width="12" height="10" fill="{CASE_COLOUR}"/>'
        f'<text x="{LABEL_W + 126}" y="{y + 9}" font-size="10">case</text>'
        f'<line x1="{LABEL_W + 180}" y1="{y - 1}" x2="{LABEL_W + 180}" y2="{y + 11}" stroke="{TICK_COLOUR}" '
        f'stroke-width="2"/><text x="{LABEL_W + 186}" y="{y + 9}" font-size="10">the raw limit it is measured '
        "against</text>"
    )
    height = y + 30
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">\n'
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>\n'
        f'<text x="10" y="22" font-size="16" font-weight="bold">{escape(title)}</text>\n'
        + "\n".join(parts)
        + "\n"
        + legend
        + "\n</svg>\n"
    )


def _matplotlib(drawn: list[tuple[str, list[Bar]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(drawn), 1, figsize=(10, 1 + 0.3 * sum(len(b) + 3 for _, b in drawn)), squeeze=False)
    for ax, (heading, bars) in zip(axes[:, 0], drawn):
        rows = range(len(bars))[::-1]
        ax.barh(rows, [b.gbps for b in bars], color=[LIMIT_COLOUR if b.is_limit else CASE_COLOUR for b in bars])
        for row, bar in zip(rows, bars):
            if bar.limit_gbps is not None and not bar.is_limit:
                ax.plot([bar.limit_gbps] * 2, [row - 0.4, row + 0.4], color=TICK_COLOUR, linewidth=2)
            ax.text(bar.gbps, row, " " + bar.note, va="center", fontsize=7)
        ax.set_yticks(list(rows), [b.label for b in bars], fontsize=7)
        ax.set_title(heading, fontsize=9, loc="left")
        ax.set_xlabel("effective GB/s (model bytes / median sync)", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
