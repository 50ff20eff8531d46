"""The status page's HTML, rendered on the server from one `store.status()` and the history.

    document(view) -> str      the whole page: head, the live part, the script that refreshes it
    live(view) -> str          the live part alone (`<main id="live">`), which the script fetches

Contract:
- Every figure of `GET /v1/status` is on the page (but `mover.copy_choices`, names for the
  API, and a null error text), as one element `data-field="<dotted path>"
  data-value="<the status' value>"`, its text the value for people (sizes, percentages): the
  path reads the same field out of `GET /v1/status` (tier and path names hold no dot), so the
  page and the API can be compared exactly. Numbers are shown as the status gives them, never
  recomputed; only the charts are derived (from `history.py`).
- A tenant viewer gets its own status (the tiers' columns differ: held, reserved, quota, floor)
  and no charts or config, which are global; the admin key, or no auth, gets everything.
- Everything that came from outside the code (names, paths, errors, config values) is escaped;
  the page carries no inline script or style (its CSP forbids them), only classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from html import escape
from typing import Any

from kvtier.service.charts import Point, line_chart
from kvtier.service.history import Rates
from kvtier.sizes import format_size

REFRESH_MS = 2000


@dataclass(frozen=True)
class View:
    """What one page shows: `status` None while the store is not ready (`readiness` says why);
    `rates` and `config` None for a tenant viewer."""

    status: dict[str, Any] | None
    readiness: str
    tenant: str | None
    rates: list[Rates] | None
    config: dict[str, Any] | None
    build: dict[str, str]
    as_of: str


def document(view: View) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>kvtier</title>"
        '<link rel="stylesheet" href="/page.css"></head>'
        f'<body data-refresh-ms="{REFRESH_MS}" data-refreshes="0">'
        '<p id="stale" hidden></p>'
        f"{live(view)}"
        '<script src="/page.js" defer></script></body></html>'
    )


def live(view: View) -> str:
    status = view.status
    if view.tenant:
        viewer = _figure("tenant", view.tenant, f"tenant {view.tenant}")
    else:
        viewer = "all tenants"
    head = (
        f"<header><h1>kvtier</h1><p>{_figure('readiness', view.readiness)} · {viewer} · as of "
        f'<time data-field="as_of">{escape(view.as_of)}</time></p></header>'
    )
    if status is None:  # recovering, or failed to start: what it runs on still helps
        return f'<main id="live">{head}{_config(view.config)}{_build(view.build)}</main>'
    sections = [
        head,
        _model(status),
        _tiers(status["tiers"]),
        _hits(status, view.rates),
        _paths(status.get("paths"), view.rates),
        _figures("Mover", "mover", status.get("mover")),
        _figures("Leases", "leases", status.get("leases")),
        _figures("Locks", "", _picked(status, "locked_blocks")),
        _figures("Index", "index", status.get("index")),
        _figures("Operations", "ops", status.get("ops")),
        _health(status["tiers"]),
        _figures("Recovery at start", "recovery", status.get("recovery") or None),
        _figures("Remote tier", "remote", status.get("remote")),
        _figures("KV events", "events", status.get("events")),
        _figures("Requests in flight", "inflight", status.get("inflight")),
        _config(view.config),
        _build(view.build),
    ]
    return f'<main id="live">{"".join(s for s in sections if s)}</main>'


# ---- figures ------------------------------------------------------------------------------------


def _figure(field: str, value: Any, text: str | None = None) -> str:
    """One figure: `data-value` the status' value as JSON writes it (a string as it is)."""
    if text is not None:
        shown = text
    elif isinstance(value, bool):
        shown = "yes" if value else "no"
    elif isinstance(value, int):
        shown = f"{value:,}"
    else:
        shown = str(value)
    exact = value if isinstance(value, str) else json.dumps(value)
    return (
        f'<span class="v" data-field="{escape(field)}" data-value="{escape(exact)}">'
        f"{escape(shown)}</span>"
    )


def _size(field: str, value: int) -> str:
    return _figure(field, value, format_size(value))


def _share(value: float) -> str:
    return f"{value:.1%}"


def _rate(value: float) -> str:
    return format_size(int(value)) + "/s"


def _figures(title: str, prefix: str, figures: Mapping[str, Any] | None) -> str:
    """A section of every scalar of `figures`, and of each nested mapping of numbers under its
    own name (others, such as the mover's copy choices, are for the API); `prefix` "": fields
    at the status' top level."""
    if not figures:
        return ""
    rows = []
    for name, value in figures.items():
        field = f"{prefix}.{name}" if prefix else name
        if isinstance(value, Mapping):
            if all(isinstance(v, (int, float)) for v in value.values()):
                inner = ", ".join(
                    f"{escape(str(k))} {_figure(f'{field}.{k}', v)}" for k, v in value.items()
                )
                rows.append(f"<dt>{escape(name.replace('_', ' '))}</dt><dd>{inner or '–'}</dd>")
        elif value is not None:
            shown = _size(field, value) if name.endswith("_bytes") else _figure(field, value)
            rows.append(f"<dt>{escape(name.replace('_', ' '))}</dt><dd>{shown}</dd>")
    return f"<section><h2>{escape(title)}</h2><dl>{''.join(rows)}</dl></section>"


def _picked(figures: Mapping[str, Any], *names: str) -> dict[str, Any]:
    """The fields `names` that `figures` has (a tenant's status has some a global one lacks)."""
    return {name: figures[name] for name in names if name in figures}


def _model(status: Mapping[str, Any]) -> str:
    layout, policy = status["layout"], status.get("policy")
    write = "" if policy is None else f"; write policy {_figure('policy.write', policy['write'])}"
    return (
        f'<p class="model">model {_figure("layout.model", layout["model"])}, '
        f"{_figure('layout.dtype', layout['dtype'])}, "
        f"{_figure('layout.block_tokens', layout['block_tokens'])} tokens a block of "
        f"{_size('layout.block_bytes', layout['block_bytes'])}{write}; overall hit rate "
        f"{_figure('hit_rate', status['hit_rate'], _share(status['hit_rate']))}</p>"
    )


# ---- tiers --------------------------------------------------------------------------------------

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("location", "location"),
    ("codec", "codec"),
    ("capacity_bytes", "capacity"),
    ("used_bytes", "used"),
    ("slots", "slots"),
    ("free_slots", "free slots"),
    ("blocks", "blocks"),
    ("reserved_slots", "reserved slots"),
    ("leased_blocks", "leased"),
    ("dirty_blocks", "dirty"),
    ("held_blocks", "held"),
    ("reserved_blocks", "reserved"),
    ("quota_blocks", "quota"),
    ("floor_blocks", "floor"),
)
_MOVES: tuple[tuple[str, str], ...] = (
    ("hits", "hits"),
    ("promotions", "promoted in"),
    ("demotions", "demoted out"),
    ("evictions", "evicted"),
    ("cleared", "cleared"),
    ("bytes_in", "bytes in"),
    ("bytes_out", "bytes out"),
)


def _tiers(tiers: Mapping[str, Mapping[str, Any]]) -> str:
    """What each tier holds (with an occupancy bar: used of capacity), then what went in and
    out of it; each table with the columns the tiers' status has."""
    held = _table("Tiers", "tiers", tiers, _COLUMNS, bar=True)
    moved = _table("Tier traffic since start", "traffic", tiers, _MOVES, bar=False)
    return held + moved


def _table(
    title: str,
    kind: str,
    tiers: Mapping[str, Mapping[str, Any]],
    columns: tuple[tuple[str, str], ...],
    bar: bool,
) -> str:
    shown = [(f, label) for f, label in columns if any(f in t for t in tiers.values())]
    if not shown:
        return ""
    head = ("<th>occupancy</th>" if bar else "") + "".join(f"<th>{x}</th>" for _, x in shown)
    rows = []
    for name, figures in tiers.items():
        cells = [f'<th scope="row">{escape(name)}</th>']
        if bar:
            cells.append(f"<td>{_bar(figures)}</td>")
        for field, _ in shown:
            if field not in figures:
                cells.append("<td>–</td>")
                continue
            cells.append(f"<td>{_tier_figure(f'tiers.{name}.{field}', field, figures[field])}</td>")
        rows.append(f'<tr data-tier="{escape(name)}">{"".join(cells)}</tr>')
    return (
        f'<section class="wide"><h2>{title}</h2><table class="{kind}"><thead><tr><th>tier</th>'
        f"{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _tier_figure(path: str, field: str, value: Any) -> str:
    is_size = field.endswith("_bytes") or field.startswith("bytes_")
    return _size(path, value) if is_size else _figure(path, value)


def _health(tiers: Mapping[str, Mapping[str, Any]]) -> str:
    """The rest of a tier's figures (a disk's faults, refused writes, backoff, last write
    error, direct I/O), one section a tier that has any."""
    tabled = {f for f, _ in (*_COLUMNS, *_MOVES)}
    parts = []
    for name, figures in tiers.items():
        rest = {k: v for k, v in figures.items() if k not in tabled}
        if rest:
            parts.append(_figures(f"Health of {name}", f"tiers.{name}", rest))
    return "".join(parts)


def _bar(figures: Mapping[str, Any]) -> str:
    """Used of capacity as an SVG bar (bytes where the status has them, else blocks of slots)."""
    used, whole = figures.get("used_bytes"), figures.get("capacity_bytes")
    if used is None:
        used, whole = figures.get("blocks"), figures.get("slots")
    share = 0.0 if not used or not whole else min(1.0, used / whole)
    return (
        f'<svg class="bar" viewBox="0 0 100 10" aria-label="{share:.0%} used">'
        f'<rect class="whole" width="100" height="10"/>'
        f'<rect class="used" width="{share * 100:.1f}" height="10"/></svg> {share:.0%}'
    )


# ---- charts -------------------------------------------------------------------------------------


def _series(
    rates: list[Rates], pick: Callable[[Rates], Mapping[str, float | None]]
) -> dict[str, list[Point]]:
    series: dict[str, list[Point]] = {}
    for r in rates:
        for name, value in pick(r).items():
            series.setdefault(name, []).append((r.t, value))  # monotonic: no clock jumps
    return series


def _hits(status: Mapping[str, Any], rates: list[Rates] | None) -> str:
    if rates is None:
        return ""
    series = _series(rates, lambda r: r.tier_hit_rate)
    series["all tiers"] = [(r.t, r.hit_rate) for r in rates]
    chart = line_chart("Hit rate by tier (tokens found / asked)", series, _share, 1.0)
    return f"<section><h2>Hit rate</h2>{chart}</section>"


def _paths(paths: Mapping[str, Mapping[str, Any]] | None, rates: list[Rates] | None) -> str:
    if paths is None:
        return ""
    rows = "".join(
        f"<tr><th scope='row'>{escape(path)}</th><td>{_size(f'paths.{path}.bytes', f['bytes'])}"
        f"</td><td>{_figure(f'paths.{path}.recent_bytes_per_s', f['recent_bytes_per_s'], _rate(f['recent_bytes_per_s']))}</td></tr>"  # noqa: E501
        for path, f in paths.items()
    )
    table = (
        "<table><thead><tr><th>path</th><th>moved</th><th>while copying, last minute</th>"
        "</tr></thead>"
        f"<tbody>{rows or '<tr><td colspan=3>nothing moved yet</td></tr>'}</tbody></table>"
    )
    chart = (
        ""
        if rates is None
        else line_chart("Bandwidth by path", _series(rates, lambda r: r.bytes_per_s), _rate)
    )
    return f"<section><h2>Copies between tiers</h2>{chart}{table}</section>"


# ---- config and build ---------------------------------------------------------------------------


def _config(config: Mapping[str, Any] | None) -> str:
    """The effective config's summary (already redacted): model, tiers, policy, mover,
    service, and how many tenants."""
    if config is None:
        return ""
    rows = []
    for section in ("model", "block_tokens", "tiers", "policy", "mover", "service", "events"):
        rows.extend(_flat(section, config.get(section)))
    tenants = config.get("tenants", {})
    keyed = sum(bool(t.get("api_keys")) for t in tenants.values())
    rows.append(f"<dt>tenants</dt><dd>{len(tenants)} ({keyed} with API keys)</dd>")
    # A plain section, not a <details>: the script replaces the live part every 2 s, and a
    # <details> the viewer opened came back closed, so the config could not be read.
    return f"<section><h2>Config</h2><dl class='config'>{''.join(rows)}</dl></section>"


def _flat(name: str, value: Any) -> list[str]:
    if isinstance(value, Mapping):
        return [row for key, inner in value.items() for row in _flat(f"{name}.{key}", inner)]
    if value is None:
        return []
    shown = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return [f"<dt>{escape(name)}</dt><dd>{escape(shown)}</dd>"]


def _build(build: Mapping[str, str]) -> str:
    rows = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in build.items())
    return f"<section><h2>Build</h2><dl>{rows}</dl></section>"
