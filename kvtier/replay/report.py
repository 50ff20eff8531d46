"""What a replay measured, and how it is shown: a text report, a sweep table, JSON, a plot.

Hit rates are shares of the tokens the trace sends (every hash id a 512-token block); the
ceiling is the infinite-cache prefix hit rate of the same requests (`trace.ceiling`), so
`ratio = hit_rate / ceiling_rate` is the share of what any cache could serve. The yardsticks
(`Yardsticks`, `simulate.py`) are exact simulations of one cache of the run's capacity in
blocks: LRU of leaves (`ratio_to_lru` = the store's hits over its hits, None when it hit
nothing) and the offline furthest-next-use leaf (a planner's headroom over LRU). They compare
like with like only when the store dropped nothing: a store drops all the new blocks of a
request that no tier can take at once (`writes.py`), where a simulation caches the leading ones
that fit, evicting for them; the text report says so, and the store may then serve less than
LRU, or more than either. A paced run (`--speed`) says whether it kept the trace's clock
(`Pacing`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.blocks import KVLayout
from kvtier.errors import InvalidArgumentError, shown
from kvtier.replay.figures import save_figure
from kvtier.replay.simulate import SimResult
from kvtier.sizes import format_size
from kvtier.text import printable

TIERS = ("gpu", "host", "disk")
MOST = 100
"""The largest tier a replay takes, in times the trace's unique blocks."""


@dataclass(frozen=True)
class Sizing:
    """Tier sizes as fractions of the trace's unique blocks; host 0 is no host tier, disk 0 no
    disk tier (a disk tier needs a host tier: host 0 with disk > 0 is refused)."""

    label: str
    gpu: float
    host: float
    disk: float

    def __post_init__(self) -> None:
        for name in TIERS:
            value = getattr(self, name)
            if not 0 <= value <= MOST or (name == "gpu" and value == 0):
                lowest = "> 0" if name == "gpu" else ">= 0 (0: no such tier)"
                expected = f"{lowest} and at most {MOST}"
                raise InvalidArgumentError(
                    f"--{name}: got {shown(value)}, expected a fraction {expected}"
                )
        if self.host == 0 and self.disk > 0:
            raise InvalidArgumentError(
                f"--host: got 0 (no host tier) with --disk {self.disk!r}, expected a fraction "
                "> 0: a disk tier is reached through host (or --disk 0 for a gpu-only store)"
            )

    @property
    def total(self) -> float:
        return self.gpu + self.host + self.disk


@dataclass(frozen=True)
class Latency:
    """Percentiles of a list of durations, in seconds (0.0 for an empty list)."""

    count: int
    p50: float
    p99: float

    @staticmethod
    def of(samples: Sequence[float]) -> Latency:
        if not samples:
            return Latency(0, 0.0, 0.0)
        ordered = sorted(samples)
        return Latency(
            len(ordered),
            ordered[len(ordered) // 2],
            ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        )


@dataclass(frozen=True)
class Pacing:
    """How a paced replay kept the trace's clock: the last of `requests` was due `schedule_s`
    after the first and they took `ran_s`; `late` of them started more than `late_s` after
    they were due, the latest by `max_lag_s`."""

    speed: float
    requests: int
    schedule_s: float
    ran_s: float
    max_lag_s: float
    late: int
    late_s: float

    @property
    def fell_behind(self) -> bool:
        return self.late > 0


@dataclass(frozen=True)
class Yardsticks:
    """One cache of the run's `capacity` blocks, simulated exactly on the same requests: LRU
    of leaves and the offline furthest-next-use leaf."""

    lru: SimResult
    furthest: SimResult


@dataclass(frozen=True)
class ReplayResult:
    """The figures of one replay. Token counts; `served` splits every token sent into the tier
    the lookup found it in (the tiers the store has: no `host` without a host tier), or
    `recomputed`. Of the recomputed, `recomputed_after_drop` were blocks whose latest store had
    been dropped (`dropped_tokens`, never cached since); the rest, `missed_tokens`, were never
    stored before or were evicted."""

    sizing: Sizing
    mover: str
    write: str
    block_tokens: int
    capacity_bytes: dict[str, int]  # of the scaled blocks the replay stores
    capacity_blocks: dict[str, int]  # store blocks of `block_tokens`
    requests: int
    tokens: int
    served: dict[str, int]
    ceiling_tokens: int
    dropped_tokens: int
    recomputed_after_drop: int
    prefetches: int
    prefetch_refused: int
    backpressure_drops: int
    lookup: Latency
    prefetch: Latency
    path_bytes: dict[str, int]
    evictions: dict[str, int]
    demotions: dict[str, int]
    wall_s: float
    pacing: Pacing | None = None
    yardsticks: Yardsticks | None = None

    @property
    def hit_tokens(self) -> int:
        return self.tokens - self.served["recomputed"]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.tokens

    @property
    def missed_tokens(self) -> int:
        """Recomputed tokens not stored before, or evicted: not for a dropped store."""
        return self.served["recomputed"] - self.recomputed_after_drop

    @property
    def ceiling_rate(self) -> float:
        return self.ceiling_tokens / self.tokens

    @property
    def ratio(self) -> float:
        """The share of the infinite-cache ceiling this replay served (1.0 for a trace with
        nothing to hit)."""
        return self.hit_tokens / self.ceiling_tokens if self.ceiling_tokens else 1.0

    @property
    def ratio_to_lru(self) -> float | None:
        """The store's hits over the LRU-of-leaves simulation's; None without yardsticks, and
        None (undefined, shown "n/a") when the simulation hit nothing."""
        if self.yardsticks is None:
            return None
        lru_tokens = self.yardsticks.lru.hits * self.block_tokens
        return self.hit_tokens / lru_tokens if lru_tokens else None

    def rate(self, tier: str) -> float:
        return self.served.get(tier, 0) / self.tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "hit_tokens": self.hit_tokens,
            "missed_tokens": self.missed_tokens,
            "hit_rate": self.hit_rate,
            "ceiling_rate": self.ceiling_rate,
            "ratio_to_ceiling": self.ratio,
            "ratio_to_lru": self.ratio_to_lru,
            "simulated_hit_rates": (
                {name: sim.hit_rate for name, sim in vars(self.yardsticks).items()}
                if self.yardsticks is not None
                else None
            ),
        }

    @staticmethod
    def from_dict(document: dict[str, Any]) -> ReplayResult:
        """The result `document` (a `to_dict`) describes: `from_dict(r.to_dict()) == r`. The
        derived figures in it (hit rate, ratios, ...) are recomputed, not read."""
        fields = {f.name: document[f.name] for f in dataclasses.fields(ReplayResult)}
        pacing, yardsticks = fields["pacing"], fields["yardsticks"]
        fields.update(
            sizing=Sizing(**fields["sizing"]),
            lookup=Latency(**fields["lookup"]),
            prefetch=Latency(**fields["prefetch"]),
            pacing=Pacing(**pacing) if pacing is not None else None,
            yardsticks=(
                Yardsticks(SimResult(**yardsticks["lru"]), SimResult(**yardsticks["furthest"]))
                if yardsticks is not None
                else None
            ),
        )
        return ReplayResult(**fields)


def share(fraction: float) -> str:
    """A fraction as a percentage with two significant digits at least, so that a small tier
    never reads "0%": 0.5 -> "50%", 0.05 -> "5.0%", 0.001 -> "0.10%", 0 -> "0%"."""
    if fraction == 0:
        return "0%"
    digits = max(0, 1 - math.floor(math.log10(fraction * 100)))
    return f"{fraction * 100:.{digits}f}%"


def _tier(fraction: float) -> str:
    """A host or disk tier's size: "none" for 0, which `--host 0`/`--disk 0` means."""
    return share(fraction) if fraction else "none"


def _sizes(sizing: Sizing) -> str:
    return f"gpu {share(sizing.gpu)}, host {_tier(sizing.host)}, disk {_tier(sizing.disk)}"


def model_sizes(
    result: ReplayResult, layout: KVLayout, shrink: dict[str, float] | None = None
) -> str:
    """What each tier of `result` holds, in blocks and bytes of the model of `layout` (the same
    tokens in its blocks; its name escaped, `printable`): what a planner buys. `shrink`: per
    tier, how many times smaller a block is there (a quantized tier's codec)."""
    parts = []
    for tier, blocks in result.capacity_blocks.items():
        model_blocks = blocks * result.block_tokens // layout.block_tokens
        nbytes = round(model_blocks * layout.block_bytes / (shrink or {}).get(tier, 1.0))
        parts.append(f"{tier} {model_blocks:,} blocks ({format_size(nbytes)})")
    name = printable(layout.model_name)
    return (
        f"  as {name} ({layout.dtype_name}, {layout.block_tokens}-token blocks of "
        f"{format_size(layout.block_bytes)}): " + ", ".join(parts)
    )


def format_result(result: ReplayResult) -> str:
    """A multi-line report of one replay."""
    r = result
    capacities = ", ".join(f"{t} {format_size(n)}" for t, n in r.capacity_bytes.items())
    served = ", ".join(
        f"{t} {r.served[t]:,} ({r.rate(t):.1%})" for t in (*TIERS, "recomputed") if t in r.served
    )
    paths = ", ".join(f"{p} {format_size(n)}" for p, n in r.path_bytes.items()) or "none"
    evictions = ", ".join(f"{t} {n:,}" for t, n in r.evictions.items())
    demotions = ", ".join(f"{t} {n:,}" for t, n in r.demotions.items())
    return "\n".join(
        [
            f"== {r.sizing.label}: {_sizes(r.sizing)} of the unique blocks ({capacities}); "
            f"mover {r.mover}, {r.write}, {r.block_tokens}-token store blocks",
            f"  {r.requests:,} requests, {r.tokens:,} tokens in {r.wall_s:.1f} s",
            f"  served (tokens): {served}",
            f"  hit rate {r.hit_rate:.1%} vs ceiling {r.ceiling_rate:.1%} "
            f"(ratio {r.ratio:.3f}); dropped on store {r.dropped_tokens:,} tokens, "
            f"backpressure drops {r.backpressure_drops:,} blocks",
            f"  recomputed (tokens): {r.missed_tokens:,} missed (never stored, or evicted), "
            f"{r.recomputed_after_drop:,} after their store was dropped",
            f"  bytes moved: {paths}",
            f"  evictions (blocks): {evictions}; demotions: {demotions}",
            f"  lookup p50 {r.lookup.p50 * 1e3:.3f} ms, p99 {r.lookup.p99 * 1e3:.3f} ms; "
            f"{r.prefetches:,} prefetches to ready p50 {r.prefetch.p50 * 1e3:.3f} ms, "
            f"p99 {r.prefetch.p99 * 1e3:.3f} ms ({r.prefetch_refused} refused: gpu too small)",
            *_yardsticks(r),
            *_pacing(r.pacing),
        ]
    )


def _yardsticks(r: ReplayResult) -> list[str]:
    if r.yardsticks is None:
        return []
    lru, furthest = r.yardsticks.lru, r.yardsticks.furthest
    lines = [
        f"  one cache of the same {lru.capacity:,} blocks, simulated: LRU of leaves "
        f"{lru.hit_rate:.1%} (store/LRU {_lru_ratio(r)}), furthest next use "
        f"(offline) {furthest.hit_rate:.1%}"
    ]
    if r.dropped_tokens:
        lines.append(
            "  not like for like: the store dropped blocks that the simulations cache (the new "
            "blocks of a request that no tier could take at once are dropped whole)"
        )
    return lines


def _lru_ratio(r: ReplayResult) -> str:
    """`ratio_to_lru` to 3 decimals, "n/a" when undefined (the simulation hit nothing)."""
    ratio = r.ratio_to_lru
    return "n/a" if ratio is None else f"{ratio:.3f}"


def _pacing(p: Pacing | None) -> list[str]:
    if p is None:
        return []
    verdict = (
        f"FELL BEHIND its clock: {p.late:,} of {p.requests:,} requests started over "
        f"{p.late_s * 1e3:.0f} ms late"
        if p.fell_behind
        else "kept its clock"
    )
    return [
        f"  paced x{p.speed:g}: {verdict}; the requests took {p.ran_s:.1f} s for a "
        f"{p.schedule_s:.1f} s schedule, the latest started {p.max_lag_s * 1e3:,.0f} ms late"
    ]


def format_table(results: Sequence[ReplayResult]) -> str:
    """One line per replay: sizes, hit rate by tier, the ratio to the ceiling, and (with
    yardsticks) the LRU-of-leaves and furthest-leaf simulations and store/LRU."""
    header = (
        f"{'run':<10}{'gpu':>7}{'host':>7}{'disk':>7}{'gpu hit':>9}{'host hit':>9}"
        f"{'disk hit':>9}{'total':>8}{'ceiling':>9}{'ratio':>7}{'LRU sim':>9}"
        f"{'furthest':>9}{'st/LRU':>8}{'wall s':>8}"
    )
    lines = [header]
    for r in results:
        s, y = r.sizing, r.yardsticks
        sims = (
            f"{y.lru.hit_rate:>9.1%}{y.furthest.hit_rate:>9.1%}{_lru_ratio(r):>8}"
            if y is not None
            else f"{'-':>9}{'-':>9}{'-':>8}"
        )
        hits = "".join(f"{r.rate(t):>9.1%}" if t in r.served else f"{'-':>9}" for t in TIERS)
        lines.append(
            f"{s.label:<10}{share(s.gpu):>7}{_tier(s.host):>7}{_tier(s.disk):>7}{hits}"
            f"{r.hit_rate:>8.1%}{r.ceiling_rate:>9.1%}{r.ratio:>7.3f}{sims}{r.wall_s:>8.1f}"
        )
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files, no display); `InvalidArgumentError` if
    matplotlib is not installed (the optional extra `plot`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError(
            "--plot: matplotlib is not installed; pip install 'kvtier[plot]'"
        ) from None
    return plt


def plot(results: Sequence[ReplayResult], path: str) -> None:
    """Hit rate by tier (stacked), with the ceiling, against each tier's size: one panel per
    tier that the runs size (gpu, host, disk), so a planner reads the size of each tier to buy
    off its own axis. An image at `path`; `InvalidArgumentError` without matplotlib."""
    plt = pyplot()
    axes_of = [t for t in TIERS if any(getattr(r.sizing, t) for r in results)]
    figure, panels = plt.subplots(
        1, len(axes_of), figsize=(4.2 * len(axes_of), 4.5), sharey=True, squeeze=False
    )
    for axes, tier in zip(panels[0], axes_of, strict=True):
        ordered = sorted(results, key=lambda r: getattr(r.sizing, tier))
        x = [100 * getattr(r.sizing, tier) for r in ordered]
        axes.stackplot(
            x,
            *([100 * r.rate(t) for r in ordered] for t in TIERS),
            labels=[f"served from {t}" for t in TIERS],
            alpha=0.8,
        )
        ceiling = [100 * r.ceiling_rate for r in ordered]
        axes.plot(x, ceiling, "k--", label="infinite-cache ceiling")
        if min(x) > 0:
            axes.set_xscale("log")
        axes.set_xlabel(f"{tier} size, % of the trace's unique blocks")
        axes.grid(True, which="both", alpha=0.3)
    panels[0][0].set_ylabel("hit rate, % of tokens")
    panels[0][0].legend(loc="upper left")
    figure.suptitle("kvtier replay: hit rate by tier, against each tier's size")
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
