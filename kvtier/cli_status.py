"""What `kvtier status` and `kvtier info` print, and how the command line prints a line.

Every line printed goes through `say`: what came from outside (a server's reply or error, a
status field) is shown with its control characters escaped (`\\x1b`), never as a terminal
escape or a forged line. `kvtier status` checks a reply before it prints any line of its table
(`status_reply.check_status`: a `ReplyError` naming the field)."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from kvtier.errors import ReplyError
from kvtier.sizes import format_size
from kvtier.status_reply import check_status
from kvtier.text import printable

LOCATION_COLUMN = 48
"""The widest the tier table's location column gets (a device or a directory; longer ones
overflow their row)."""


def say(text: str, file: TextIO | None = None) -> None:
    """Print `text` as one line (to `file`, else stdout) with its control characters escaped
    (`text.printable`): every line the CLI prints goes through here, so nothing a server, a
    cluster node or a file said reaches the terminal as an escape sequence or a line of its
    own."""
    print(printable(text), file=file)


def say_json(data: Any) -> None:
    """`data` as indented JSON, each line through `say` (`json.dumps` escapes every control
    character in a string, so the lines are as JSON wrote them). A number that is NaN or
    Infinity (a server's reply: Python's parser takes them) is a `ReplyError` before any line:
    JSON has none, and `kvtier status --json | jq` would fail on the `NaN` printed before."""
    try:
        text = json.dumps(data, indent=2, allow_nan=False)
    except ValueError:
        raise ReplyError("status: a number is NaN or Infinity; expected finite numbers") from None
    for line in text.splitlines():
        say(line)


def cmd_status(args: argparse.Namespace) -> int:
    from kvtier.client import Client

    # a server that trickles its reply holds the command `--timeout` (10 s), not the client's 120
    with Client(args.url, api_key=args.key, shared_memory=False, timeout_s=args.timeout) as client:
        reply = client.status()
    if args.json:
        say_json(reply)
        return 0
    status = check_status(reply)  # a field missing or mistyped: `ReplyError`, exit 2
    if "tenant" in status:  # a tenant key's: that tenant's own figures
        print_tenant_status(status)
        return 0
    print_status(status)
    mover = status["mover"]
    ready = mover["prefetch_to_ready_s"]
    say(
        f"ops: {status['ops']['lookups']} lookups (hit rate {status['hit_rate']:.1%}), "
        f"{status['ops']['stores']} stores, {status['ops']['prefetches']} prefetches, "
        f"{status['index']['leases']} leases live, "
        f"{status['index'].get('reservations', 0)} reservations live"
    )
    say(
        f"mover: {mover['in_flight']} flights in flight, {mover['queued_transfers']} copies "
        f"queued, {mover['failed_flights']} failed, {mover['backpressure_drops']} dropped "
        f"(backpressure); prefetch to ready p50 {ready['p50'] * 1e3:.2f} ms, "
        f"p99 {ready['p99'] * 1e3:.2f} ms"
    )
    for path, moved in status["paths"].items():
        say(
            f"  {path:<12}{format_size(moved['bytes']):>12} moved, "
            f"{moved['recent_bytes_per_s'] / 1e9:6.2f} GB/s recently"
        )
    if "busy" in status.get("inflight", {}):  # a server that has the budget, global figures
        held = status["inflight"]
        share = held.get("share_bytes")  # a tenant's most (a server before the field: none)
        most = "" if share is None else f" (a tenant's most {format_size(share)})"
        say(
            f"requests in flight: {format_size(held['held_bytes'])} of "
            f"{format_size(held['limit_bytes'])} held{most}, {held['waits']} waited for room, "
            f"{held['busy']} refused busy"
        )
    if "remote" in status:
        say(remote_line(status["remote"]))
    if "events" in status:
        say(events_line(status["events"]))
    return 0


def print_tenant_status(status: dict[str, Any]) -> None:
    """A tenant's status (`KVStore.status(tenant=...)`, what a tenant key is shown): its
    blocks, quotas and floors per tier, its leases and its calls."""
    layout = status["layout"]
    say(
        f"tenant {status['tenant']}: model {layout['model']}, {layout['dtype']}, "
        f"{layout['block_tokens']} tokens = {format_size(layout['block_bytes'])} per block"
    )
    say(f"{'tier':<6}{'capacity':>12}{'blocks':>9}{'reserved':>10}{'held':>9}{'quota':>9}"
          f"{'floor':>9}{'hits':>10}")  # fmt: skip
    for name, tier in status["tiers"].items():
        cells = [tier.get(k) for k in ("blocks", "reserved_blocks", "held_blocks")]
        cells += [tier.get(k) for k in ("quota_blocks", "floor_blocks", "hits")]
        shown = ["-" if cell is None else str(cell) for cell in cells]  # None: no quota, floor
        widths = (9, 10, 9, 9, 9, 10)
        say(
            f"{name:<6}{format_size(tier['capacity_bytes']):>12}"
            + "".join(f"{cell:>{width}}" for cell, width in zip(shown, widths, strict=True))
        )
    ops, leases = status["ops"], status["leases"]
    say(
        f"ops: {ops['lookups']} lookups (hit rate {status['hit_rate']:.1%}), {ops['stores']} "
        f"stores, {ops['loads']} loads, {ops['prefetches']} prefetches; {leases['live']} of "
        f"{leases['quota']} leases live, {status['locked_blocks']} blocks locked"
    )
    if "inflight" in status:  # the sidecar's: the tenant's share of the request budget
        held = status["inflight"]
        say(
            f"requests in flight: {format_size(held['held_bytes'])} of "
            f"{format_size(held['limit_bytes'])} (the tenant's share) held"
        )


def events_line(events: dict[str, Any]) -> str:
    unsynced = events["unsynced_topics"]
    state = f"{unsynced} TOPICS NOT TOLD AGAIN YET; " if unsynced else ""
    return (
        f"events: {state}{events['events']} sent in {events['messages']} messages on "
        f"{events['topic']}, {events['dropped_events']} dropped (full queue), "
        f"{events['resyncs']} resyncs, {events['retells']} retells (peers joined), "
        f"{events['queued']} queued"
    )


def remote_line(remote: dict[str, Any]) -> str:
    state = "connected" if remote["connected"] else f"NOT CONNECTED ({remote['last_error']})"
    return (
        f"remote: {state}; {remote['hits']} hits, {remote['misses']} misses, "
        f"{remote['verify_failures']} failed verification, {remote['errors']} errors; "
        f"{remote['filled_blocks']} blocks filled in; writer {remote['writer_written_blocks']} "
        f"written, {remote['writer_dropped_blocks']} dropped, "
        f"{format_size(remote['writer_pending_bytes'])} pending"
    )


def print_status(status: dict[str, Any]) -> None:
    layout = status["layout"]
    say(
        f"model {layout['model']}: {layout['dtype']}, {layout['block_tokens']} tokens "
        f"= {format_size(layout['block_bytes'])} per block; write policy "
        f"{status['policy']['write']}"
    )
    # the column fits the longest location up to LOCATION_COLUMN: a longer one overflows its
    # own row only (before, a server's 4 MiB location padded every tier's row to it: 277 KB
    # of reply printed 200 MB), and a reply with no tiers prints the header alone (before,
    # `max(10, *())` raised a TypeError, a traceback)
    width = min(
        LOCATION_COLUMN, max([10, *(len(t["location"]) + 2 for t in status["tiers"].values())])
    )
    say(
        f"{'tier':<6}{'location':<{width}}{'capacity':>12}{'slots':>10}{'used':>12}{'blocks':>9}"
        f"{'reserved':>10}"
    )
    for name, tier in status["tiers"].items():
        say(  # reserved: slots of reservations (a server before the field: 0)
            f"{name:<6}{tier['location']:<{width}}{format_size(tier['capacity_bytes']):>12}"
            f"{tier['slots']:>10}{format_size(tier['used_bytes']):>12}{tier['blocks']:>9}"
            f"{tier.get('reserved_slots', 0):>10}"
        )
