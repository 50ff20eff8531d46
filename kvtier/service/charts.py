"""SVG line charts for the status page: drawn here as text, no library and no script.

    line_chart(title, series, fmt, y_max=None) -> str
        series: name -> [(seconds, value or None)], oldest first; None is a gap. The seconds
        are on a clock that only goes forward (the history's monotonic `t`): a wall clock's
        jump would draw the points out of order and mislabel the axis
        fmt: how an axis value reads (a percentage, bytes per second)

Contract: the SVG is self-contained, styled by classes only (`series-<i>` in the order given,
colours in page.css; no style attributes, which the page's Content-Security-Policy forbids);
every name is escaped. The x axis spans the samples shown and is labelled by how long ago its
left end was; the y axis runs from 0 to `y_max` (default: the largest value, at least 1). A
series' points are `data-points` on its group, so a test can see the chart grow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from html import escape

Point = tuple[float, float | None]

WIDTH, HEIGHT = 480, 150
LEFT, RIGHT, TOP, BOTTOM = 64, 8, 8, 20


def line_chart(
    title: str,
    series: Mapping[str, Sequence[Point]],
    fmt: Callable[[float], str],
    y_max: float | None = None,
) -> str:
    """A chart of `series` (module doc), with its legend."""
    times = [at for points in series.values() for at, _ in points]
    values = [v for points in series.values() for _, v in points if v is not None]
    top = y_max if y_max is not None else max([1.0, *values])
    if not times:
        return f'<figure class="chart"><figcaption>{escape(title)}</figcaption>' + (
            '<p class="empty">no samples yet</p></figure>'
        )
    first, last = min(times), max(times)
    span = max(last - first, 1e-9)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(at: float) -> float:
        return LEFT + (at - first) / span * plot_w

    def y(value: float) -> float:
        return TOP + plot_h - min(value, top) / top * plot_h

    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<line class="axis" x1="{LEFT}" y1="{TOP + plot_h}" x2="{WIDTH - RIGHT}" '
        f'y2="{TOP + plot_h}"/>',
        f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}"/>',
        f'<line class="grid" x1="{LEFT}" y1="{TOP + plot_h / 2}" x2="{WIDTH - RIGHT}" '
        f'y2="{TOP + plot_h / 2}"/>',
        _text(LEFT - 4, TOP + 10, fmt(top), "end"),
        _text(LEFT - 4, TOP + plot_h / 2 + 4, fmt(top / 2), "end"),
        _text(LEFT - 4, TOP + plot_h, fmt(0.0), "end"),
        _text(LEFT, HEIGHT - 4, f"-{_ago(span)}", "start"),
        _text(WIDTH - RIGHT, HEIGHT - 4, "now", "end"),
    ]
    legend = []
    for i, (name, points) in enumerate(series.items()):
        drawn = sum(v is not None for _, v in points)
        parts.append(f'<g class="series-{i}" data-series="{escape(name)}" data-points="{drawn}">')
        for run in _runs(points):
            if len(run) == 1:
                at, value = run[0]
                parts.append(f'<circle cx="{x(at):.1f}" cy="{y(value):.1f}" r="2"/>')
            else:
                coords = " ".join(f"{x(w):.1f},{y(v):.1f}" for w, v in run)
                parts.append(f'<polyline points="{coords}"/>')
        parts.append("</g>")
        legend.append(f'<li class="series-{i}">{escape(name)}</li>')
    parts.append("</svg>")
    return (
        f'<figure class="chart"><figcaption>{escape(title)}</figcaption>{"".join(parts)}'
        f'<ul class="legend">{"".join(legend)}</ul></figure>'
    )


def _runs(points: Sequence[Point]) -> list[list[tuple[float, float]]]:
    """The points split at gaps (None), each run of values to draw as one line."""
    runs: list[list[tuple[float, float]]] = [[]]
    for at, value in points:
        if value is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((at, value))
    return [run for run in runs if run]


def _text(x: float, y: float, label: str, anchor: str) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{escape(label)}</text>'


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
