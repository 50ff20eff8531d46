"""The `kvtier` command line.

    kvtier serve [--config FILE] [--host H] [--port P]   run the sidecar (service/server.py)
    kvtier status [--url URL] [--key KEY] [--json]       a running sidecar's status, as a table
    kvtier reset [--url URL] [--key KEY]   forget the key's tenant's cached KV (new weights
                                           under the same model.name); exit 1 unless all of it
    kvtier info [--config FILE] [--json]   build the store from a config and print its status
                                           (keyed by serve's secret in service.state_dir, if any)
    kvtier validate FILE...                check config files as serve would (keys, address,
                                           tenant shares), starting nothing; print tier sizes
                                           (every file; exit 2 if any failed)
    kvtier check PATH [--fix]              check a disk tier directory offline (exit 1: problems,
                                           a damaged superblock or slab file among them)
    kvtier replay TRACE [--gpu F --host F --disk F] [--sweep] [--plot PNG] [--json]
                                           replay a Mooncake trace against a real store

A bad config stops the command with the message of its `ConfigError` (field, bad value, what
was expected) and exit status 2; nothing is started. So does a sidecar's status reply that
`kvtier status` cannot print as a table (`status_reply.check_status`: a `ReplyError` naming the
field, before any line of the table). Every line printed goes through `say`:
what came from outside (a server's reply or error, a status field) is shown with its control
characters escaped (`\x1b`), never as a terminal escape or a forged line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvtier.config import KVTierConfig, default_config, format_size, load_config, parse_config
from kvtier.errors import KVTierError
from kvtier.status_reply import check_status
from kvtier.store import KVStore
from kvtier.text import printable
from kvtier.tiers.disk.check import PROBLEMS, check_directory
from kvtier.tiers.disk.codec import tier_codec
from kvtier.tiers.disk.slabs import DamagedDiskError
from kvtier.tiers.disk.tier import disk_slot_bytes


def say(text: str, file: TextIO | None = None) -> None:
    """Print `text` as one line (to `file`, else stdout) with its control characters escaped
    (`text.printable`): every line the CLI prints goes through here, so nothing a server, a
    cluster node or a file said reaches the terminal as an escape sequence or a line of its
    own."""
    print(printable(text), file=file)


def say_json(data: Any) -> None:
    """`data` as indented JSON, each line through `say` (`json.dumps` escapes every control
    character in a string, so the lines are as JSON wrote them)."""
    for line in json.dumps(data, indent=2).splitlines():
        say(line)


def _config(path: str | None) -> KVTierConfig:
    """The config `--config` names, or the embedded default when the flag is not given. An
    empty `--config ""` (`--config "$CONFIG"` with the variable unset) is a path that names no
    file, refused as such: it never falls back to the default silently."""
    return default_config() if path is None else load_config(path)


def _hangup(signum: int, frame: object) -> None:
    """SIGHUP to `kvtier serve`: logged and ignored. Its default action killed the process
    with no clean stop (copies in flight dropped, the pools left in /dev/shm until the next
    start), and systemd's `Restart=on-failure` takes a death by SIGHUP for a clean exit, so it
    stayed down. The config is read only at start: a change needs a restart."""
    logging.getLogger("kvtier.serve").warning(
        "kvtier: SIGHUP ignored: the config is read only at start (restart to apply a change; "
        "SIGTERM stops cleanly)"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from kvtier.service.server import serve

    signal.signal(signal.SIGHUP, _hangup)  # before the config is read (not before the imports)
    config = _config(args.config)
    given = {"host": args.host, "port": args.port}
    if any(value is not None for value in given.values()):  # checked as service.host/port are
        data = config.to_dict()
        data["service"].update({k: v for k, v in given.items() if v is not None})
        config = parse_config(data, "--host/--port")
    return serve(config)


def cmd_reset(args: argparse.Namespace) -> int:
    """`POST /v1/reset` as the key's tenant (`integrations/resets.py`: asked again while leases
    hold blocks); exit 1, saying why, unless the sidecar holds none of the tenant's KV after."""
    from kvtier.client import Client
    from kvtier.integrations.resets import reset_tenants

    with Client(args.url, api_key=args.key, shared_memory=False) as client:
        why = reset_tenants([client])
    if why is not None:
        say(f"kvtier reset: {why}", file=sys.stderr)
        return 1
    say("reset: the tenant's cached KV is forgotten")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from kvtier.client import Client

    with Client(args.url, api_key=args.key, shared_memory=False) as client:
        reply = client.status()
    if args.json:
        say_json(reply)
        return 0
    status = check_status(reply)  # a field missing or mistyped: `ReplyError`, exit 2
    if "tenant" in status:  # a tenant key's: that tenant's own figures
        _print_tenant_status(status)
        return 0
    _print_status(status)
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
        say(
            f"requests in flight: {format_size(held['held_bytes'])} of "
            f"{format_size(held['limit_bytes'])} held, {held['waits']} waited for room, "
            f"{held['busy']} refused busy"
        )
    if "remote" in status:
        say(_remote_line(status["remote"]))
    if "events" in status:
        say(_events_line(status["events"]))
    return 0


def _print_tenant_status(status: dict[str, Any]) -> None:
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


def _events_line(events: dict[str, Any]) -> str:
    unsynced = events["unsynced_topics"]
    state = f"{unsynced} TOPICS NOT TOLD AGAIN YET; " if unsynced else ""
    return (
        f"events: {state}{events['events']} sent in {events['messages']} messages on "
        f"{events['topic']}, {events['dropped_events']} dropped (full queue), "
        f"{events['resyncs']} resyncs, {events['retells']} retells (peers joined), "
        f"{events['queued']} queued"
    )


def _remote_line(remote: dict[str, Any]) -> str:
    state = "connected" if remote["connected"] else f"NOT CONNECTED ({remote['last_error']})"
    return (
        f"remote: {state}; {remote['hits']} hits, {remote['misses']} misses, "
        f"{remote['verify_failures']} failed verification, {remote['errors']} errors; "
        f"{remote['filled_blocks']} blocks filled in; writer {remote['writer_written_blocks']} "
        f"written, {remote['writer_dropped_blocks']} dropped, "
        f"{format_size(remote['writer_pending_bytes'])} pending"
    )


def cmd_info(args: argparse.Namespace) -> int:
    config = _config(args.config)
    with KVStore(config, secret=_server_secret(config)) as store:
        status = store.status()
        store.check()
    if args.json:
        say_json(status)
        return 0
    _print_status(status)
    say(f"tenants: {status['index']['tenants']}; check passed")
    return 0


def _server_secret(config: KVTierConfig) -> bytes:
    """The server secret in `service.state_dir` that `serve` keys tenant salts with (its disk
    copies are found under them), read as the server reads it; b"" when there is none yet.
    Read only: `info` never creates the directory or the secret."""
    from kvtier.service.auth import read_secret

    path = Path(config.service.state_dir) / "secret"
    return read_secret(path) if os.path.lexists(path) else b""


def _print_status(status: dict[str, Any]) -> None:
    layout = status["layout"]
    say(
        f"model {layout['model']}: {layout['dtype']}, {layout['block_tokens']} tokens "
        f"= {format_size(layout['block_bytes'])} per block; write policy "
        f"{status['policy']['write']}"
    )
    width = max(10, *(len(t["location"]) + 2 for t in status["tiers"].values()))
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


def cmd_validate(args: argparse.Namespace) -> int:
    """Each file as `serve` reads it: the config, its keys (none in two places, each a key a
    request can present; an `env:` key whose variable is unset here is taken as given) and
    its address (`require_loopback`), and the checks a store makes before it makes a tier
    (`preflight`: tenant floors and quotas against the tier sizes, codecs; a capacity that is a
    fraction of free memory is known only at start). Nothing is written, nothing started.
    Every file is checked and its result printed (an error on stderr); 2 if any failed."""
    from kvtier.preflight import preflight
    from kvtier.service.auth import Auth, require_loopback

    failed = 0
    for path in args.files:
        try:
            config = load_config(path)
            require_loopback(config.service.host, Auth(config, unset_ok=True))
            preflight(config, None)
            sizes = ", ".join(
                f"{name} {getattr(config.tiers, name).capacity}{_codec_note(config, name)}"
                if getattr(config.tiers, name) is not None
                else f"{name} none"
                for name in config.tier_names
            )
        except KVTierError as exc:
            say(f"kvtier: {path}: {exc}", file=sys.stderr)
            failed += 1
            continue
        layout = config.layout
        say(
            f"{path}: ok ({layout.model_name}, {format_size(layout.block_bytes)} per block; "
            f"{sizes})"
        )
    return 2 if failed else 0


def _codec_note(config: KVTierConfig, tier: str) -> str:
    """` in <codec id>, <ratio>x the blocks` for a tier that quantizes (the blocks its capacity
    holds against codec none: slots of the payload on host, of a header and the aligned
    payload on disk, `disk_slot_bytes`), ` (lz4)` for one that compresses, checked against
    the layout as at start (`tier_codec`); else nothing."""
    section = getattr(config.tiers, tier)
    name = getattr(section, "codec", "none")
    if name == "none":
        return ""
    layout = config.layout
    codec = tier_codec(name, layout, section.codec_group, section.codec_keys, f"tiers.{tier}")
    if not codec.lossy:
        return f" ({name})"
    if tier == "disk":  # a disk slot is a header region plus the payload, aligned
        plain = tier_codec("none", layout, section.codec_group, section.codec_keys, "tiers.disk")
        ratio = disk_slot_bytes(layout, plain) / disk_slot_bytes(layout, codec)
    else:  # a host slot is the payload
        ratio = layout.block_bytes / codec.payload_bound(layout.block_bytes)
    return f" in {codec.name}, {ratio:.2f}x the blocks"


def cmd_replay(args: argparse.Namespace) -> int:
    from kvtier.replay.cli import run_replay

    return run_replay(args)


def cmd_check(args: argparse.Namespace) -> int:
    try:
        report = check_directory(Path(args.path), fix=args.fix)
    except DamagedDiskError as exc:  # a problem found, like a corrupt slot: status 1
        say(f"{args.path}: damaged: {exc}")
        return 1
    say(f"{args.path}: {report.slots} slots: {report.valid} valid, {report.empty} empty")
    for name in PROBLEMS:
        say(f"  {name.replace('_', ' '):<18}{getattr(report, name):>8}")
    if args.fix:
        say(f"  retired            {report.retired:>8}")
    if report.left:  # to retire; or a retire failed, or a slot could not be read: still there
        say(f"problems found: {report.left} slots " + (FAILED_FIX if args.fix else TO_FIX))
        return 1
    return 0


TO_FIX, FAILED_FIX = "to retire: run with --fix (with the store stopped)", "not retired"
COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "serve": ("run the sidecar: REST status API, metrics, engine data plane", cmd_serve),
    "status": ("print a running sidecar's status", cmd_status),
    "reset": ("forget the key's tenant's cached KV (its model's weights changed)", cmd_reset),
    "info": ("build the store from a config and print its status", cmd_info),
    "validate": ("check config files", cmd_validate),
    "check": ("check a disk tier directory offline (store stopped)", cmd_check),
    "replay": ("replay a request trace (Mooncake format) against a real store", cmd_replay),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="tiered KV-cache store")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text)
        if name == "serve":
            cmd.add_argument("--config", help="YAML config (default: the embedded default)")
            cmd.add_argument("--host", help="bind address (default: service.host)")
            cmd.add_argument("--port", type=int, help="port (default: service.port)")
        elif name in ("status", "reset"):
            cmd.add_argument("--url", default="http://127.0.0.1:8750", help="the sidecar")
            cmd.add_argument("--key", help="API key (default: $KVTIER_API_KEY)")
            if name == "status":
                cmd.add_argument("--json", action="store_true", help="print the status as JSON")
        elif name == "info":
            cmd.add_argument("--config", help="YAML config (default: the embedded default)")
            cmd.add_argument("--json", action="store_true", help="print the status as JSON")
        elif name == "replay":
            from kvtier.replay.cli import add_arguments

            add_arguments(cmd)
        elif name == "check":
            cmd.add_argument("path", help="the disk tier's directory (tiers.disk.path)")
            cmd.add_argument("--fix", action="store_true", help="retire bad slots")
        else:
            cmd.add_argument("files", nargs="+", help="YAML config files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = COMMANDS[args.command][1](args)
        if sys.stdout is not None:  # None: started with stdout closed (`>&-`)
            sys.stdout.flush()  # a reader gone shows here, not at the exit's flush (buffered)
        return code
    except KVTierError as exc:
        say(f"kvtier: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvtier status | head -1`: the reader has what it wanted
        _quiet_stdout()
        return 141  # as a shell reports a command that SIGPIPE ended (128 + 13)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the exit's last flush then raises (and prints) nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
