"""`kvtier replay`: request traces (`trace`), replayed against a real store (`runner`), exact
one-cache simulations to compare with (`simulate`, `policies`), and what the replay measured
(`report`)."""

from kvtier.replay.report import (
    Latency,
    Pacing,
    ReplayResult,
    Sizing,
    Yardsticks,
    format_result,
    format_table,
)
from kvtier.replay.runner import ReplayOptions, capacity_blocks, replay, replay_config
from kvtier.replay.simulate import LRU, Furthest, LeafCache, SimResult, chains, simulate
from kvtier.replay.trace import Ceiling, TraceRequest, ceiling, parse_line, read_trace

__all__ = [
    "LRU",
    "Ceiling",
    "Furthest",
    "Latency",
    "LeafCache",
    "Pacing",
    "ReplayOptions",
    "ReplayResult",
    "SimResult",
    "Sizing",
    "TraceRequest",
    "Yardsticks",
    "capacity_blocks",
    "ceiling",
    "chains",
    "format_result",
    "format_table",
    "parse_line",
    "read_trace",
    "replay",
    "replay_config",
    "simulate",
]
