"""The `kvtier` command line.

    kvtier serve [--config FILE] [--host H] [--port P]   run the sidecar (service/server.py)
    kvtier status [--url URL] [--key KEY] [--json] [--timeout S]   a sidecar's status, a table
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
was expected) and exit status 2; nothing is started (`serve` runs `validate`'s checks,
`preflight`, before its state directory or its port). So does a sidecar's status reply that
`kvtier status` cannot print as a table (`status_reply.check_status`: a `ReplyError` naming the
field, before any line of the table). Every line printed goes through `say` (`cli_status.py`,
with what `status` and `info` print): what came from outside (a server's reply or error, a
status field) is shown with its control characters escaped (`\x1b`), never as a terminal
escape or a forged line. SIGTERM or SIGINT while `serve` starts, before its server takes them
over, ends it with one line and status 0 (`program.stop_at_start`); Ctrl-C in another command
with one line, then (the program, `program.run`) by SIGINT itself, as Python ends: a shell
script's loop stops on it only when its command died of SIGINT (an exit status of 130 let it go
on); never a traceback. The same holds while this module's imports load (`program.py`, the
installed `kvtier`'s entry; `python -m kvtier.cli` runs it too, once its own imports are done).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.cli_status import cmd_status, print_status, say, say_json
from kvtier.config import KVTierConfig, default_config, format_size, load_config, parse_config
from kvtier.errors import ConfigError, KVTierError
from kvtier.program import (
    INTERRUPTED,
    StoppedAtStart,
    hangup,
    stop_at_start,
    stopped_line,
)
from kvtier.store import KVStore
from kvtier.tiers.disk.check import PROBLEMS, check_directory
from kvtier.tiers.disk.codec import tier_codec
from kvtier.tiers.disk.slabs import DamagedDiskError
from kvtier.tiers.disk.tier import disk_slot_bytes


def _config(path: str | None) -> KVTierConfig:
    """The config `--config` names, or the embedded default when the flag is not given. An
    empty `--config ""` (`--config "$CONFIG"` with the variable unset) is a path that names no
    file, refused as such: it never falls back to the default silently."""
    return default_config() if path is None else load_config(path)


def cmd_serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGHUP, hangup)  # before the config (`program.run`: the imports)
    before = {stop: signal.getsignal(stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    for stop, handler in before.items():
        if handler is not signal.SIG_IGN:  # ignored (`nohup`, `&` in a script): left so
            signal.signal(stop, stop_at_start)
    try:
        from kvtier.preflight import preflight
        from kvtier.service.server import serve  # FastAPI, uvicorn: a second or two

        config = _config(args.config)
        given = {"host": args.host, "port": args.port}
        if any(value is not None for value in given.values()):  # checked as service.host/port
            data = config.to_dict()
            data["service"].update({k: v for k, v in given.items() if v is not None})
            config = parse_config(data, "--host/--port")
        # what `validate` refuses (floors that do not fit, a codec group, the events topic)
        # stops here, exit 2: found only by the store, once serving, it left the process up
        # answering 503 for ever (a liveness probe's restart loop; systemd saw it running)
        preflight(config, None)
        return serve(config)
    finally:  # served and stopped (or refused): a stop now is no stop "while starting"
        for stop, handler in before.items():  # (`program.run`'s own: the default, then)
            signal.signal(stop, signal.SIG_DFL if handler is stop_at_start else handler)


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


def cmd_info(args: argparse.Namespace) -> int:
    config = _config(args.config)
    with KVStore(config, secret=_server_secret(config)) as store:
        status = store.status()
        store.check()
    if args.json:
        say_json(status)
        return 0
    print_status(status)
    say(f"tenants: {status['index']['tenants']}; check passed")
    return 0


def _server_secret(config: KVTierConfig) -> bytes:
    """The server secret in `service.state_dir` that `serve` keys tenant salts with (its disk
    copies are found under them), read as the server reads it; b"" when there is none yet.
    Read only: `info` never creates the directory or the secret."""
    from kvtier.service.auth import read_secret

    path = Path(config.service.state_dir) / "secret"
    return read_secret(path) if os.path.lexists(path) else b""


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
    if not args.path:  # `kvtier check "$DISK" --fix` with DISK unset: not the working directory
        raise ConfigError("PATH", args.path, "a disk tier directory (an empty path names none)")
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
                cmd.add_argument("--timeout", type=float, default=10.0,
                                 help="seconds for the whole reply (default: 10)")  # fmt: skip
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
    except StoppedAtStart as stop:
        say(stopped_line(stop), file=sys.stderr)
        return 0
    except KeyboardInterrupt:  # Ctrl-C in a command other than `serve`: one line, no traceback
        say("kvtier: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # `kvtier status | head -1`: the reader has what it wanted
        _quiet_stdout()
        return 141  # as a shell reports a command that SIGPIPE ended (128 + 13)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the exit's last flush then raises (and prints) nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":  # `python -m kvtier.cli`: the installed program's entry
    from kvtier.program import run

    run()
