"""The `kvtier` command line.

    kvtier info [--config FILE] [--json]   build the store from a config and print its status
    kvtier validate FILE...                check config files; print each one's tier sizes
    kvtier check PATH [--fix]              check a disk tier directory offline (exit 1: problems)

A bad config stops the command with the message of its `ConfigError` (field, bad value, what
was expected) and exit status 2; nothing is started. `kvtier serve` (the sidecar) comes with
issue 6.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.config import KVTierConfig, format_size, load_config
from kvtier.errors import KVTierError
from kvtier.store import KVStore
from kvtier.tiers.disk.check import PROBLEMS, check_directory


def _config(path: str | None) -> KVTierConfig:
    return load_config(path) if path else KVTierConfig()


def cmd_info(args: argparse.Namespace) -> int:
    with KVStore(_config(args.config)) as store:
        status = store.status()
        store.check()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    layout = status["layout"]
    print(
        f"model {layout['model']}: {layout['dtype']}, {layout['block_tokens']} tokens "
        f"= {format_size(layout['block_bytes'])} per block; write policy "
        f"{status['policy']['write']}"
    )
    width = max(10, *(len(t["location"]) + 2 for t in status["tiers"].values()))
    print(f"{'tier':<6}{'location':<{width}}{'capacity':>12}{'slots':>10}{'used':>12}{'blocks':>9}")
    for name, tier in status["tiers"].items():
        print(
            f"{name:<6}{tier['location']:<{width}}{format_size(tier['capacity_bytes']):>12}"
            f"{tier['slots']:>10}{format_size(tier['used_bytes']):>12}{tier['blocks']:>9}"
        )
    print(f"tenants: {status['index']['tenants']}; check passed")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    for path in args.files:
        config = load_config(path)
        layout = config.layout
        sizes = ", ".join(
            f"{name} {getattr(config.tiers, name).capacity}" for name in config.tier_names
        )
        print(
            f"{path}: ok ({layout.model_name}, {format_size(layout.block_bytes)} per block; "
            f"{sizes})"
        )
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    report = check_directory(Path(args.path), fix=args.fix)
    print(f"{args.path}: {report.slots} slots: {report.valid} valid, {report.empty} empty")
    for name in PROBLEMS:
        print(f"  {name.replace('_', ' '):<18}{getattr(report, name):>8}")
    if args.fix:
        print(f"  retired            {report.retired:>8}")
    if report.problems and not args.fix:
        print("problems found: run with --fix (with the store stopped) to retire those slots")
        return 1
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "info": ("build the store from a config and print its status", cmd_info),
    "validate": ("check config files", cmd_validate),
    "check": ("check a disk tier directory offline (store stopped)", cmd_check),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="tiered KV-cache store")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text)
        if name == "info":
            cmd.add_argument("--config", help="YAML config (default: the embedded default)")
            cmd.add_argument("--json", action="store_true", help="print the status as JSON")
        elif name == "check":
            cmd.add_argument("path", help="the disk tier's directory (tiers.disk.path)")
            cmd.add_argument("--fix", action="store_true", help="retire bad slots")
        else:
            cmd.add_argument("files", nargs="+", help="YAML config files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
