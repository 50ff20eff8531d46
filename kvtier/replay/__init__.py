"""`kvtier replay`: request traces (`trace`), replayed against a real store (`runner`), and
what the replay measured (`report`)."""

from kvtier.replay.report import Latency, ReplayResult, Sizing, format_result, format_table
from kvtier.replay.runner import ReplayOptions, replay, replay_config
from kvtier.replay.trace import Ceiling, TraceRequest, ceiling, parse_line, read_trace

__all__ = [
    "Ceiling",
    "Latency",
    "ReplayOptions",
    "ReplayResult",
    "Sizing",
    "TraceRequest",
    "ceiling",
    "format_result",
    "format_table",
    "parse_line",
    "read_trace",
    "replay",
    "replay_config",
]
