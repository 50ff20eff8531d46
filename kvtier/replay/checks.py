"""The checks `kvtier replay` makes of its arguments before it reads the trace: options that
ask for several sets of runs where one is made (`check_modes`), and where `--plot` writes
(`check_plot`). Each raises `InvalidArgumentError` naming the option and what was expected;
nothing has run then.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from kvtier.errors import InvalidArgumentError

PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""`--plot`: the image formats it writes, by the file's suffix."""


def check_modes(args: argparse.Namespace) -> None:
    """`InvalidArgumentError` naming both options when `args` ask for two sets of runs where
    one is made: `--sweep` with `--codec` (each replaces the tiered sizes), or either of them
    with `--replicas N` / `--remote` / `--route` (a fleet runs the sizes as typed only);
    `--speed` with any of those (not paced), `--plot` with a fleet not `--route`d (not drawn)."""
    asked = (("--sweep", args.sweep), ("--codec", args.codec is not None))
    many = [name for name, on in asked if on]
    fleet = [
        name
        for name, on in (
            ("--route", args.route is not None),
            ("--replicas", args.replicas > 1),
            ("--remote", args.remote),
        )
        if on
    ]
    if len(many) == 2:
        raise InvalidArgumentError(
            "--sweep with --codec: got both, expected one of them (a sweep scales the sizes as "
            "typed; --codec runs them once per codec)"
        )
    if many and fleet:
        raise InvalidArgumentError(
            f"{many[0]} with {fleet[0]}: got both, expected one of them ({fleet[0]} runs the "
            "sizes as typed, once)"
        )
    # the fleet and routed runs keep no clock, and a fleet of round robin draws nothing: the
    # option was ignored (a run of 2**62 ms at --speed 1 ended at once, not paced, unsaid)
    if args.speed is not None and fleet:
        raise InvalidArgumentError(
            f"--speed with {fleet[0]}: got both, expected one of them ({fleet[0]} runs are not "
            "paced)"
        )
    if args.plot is not None and fleet and args.route is None:
        raise InvalidArgumentError(
            f"--plot with {fleet[0]}: got both, expected --route too (only routed runs are drawn)"
        )


def check_plot(path: str, inputs: list[str | None]) -> None:
    """`InvalidArgumentError` unless `--plot` names a new or existing image file, by its
    suffix, in an existing directory, and none of the command's `inputs`: checked before the
    replay, not found out when it is drawn."""
    target = Path(path)
    problem = None
    if target.suffix.lower() not in PLOT_SUFFIXES:
        problem = f"a file ending in {', '.join(PLOT_SUFFIXES)}"
    elif not target.parent.is_dir():
        problem = f"a file in an existing directory ({str(target.parent)!r} is not one)"
    elif target.is_dir():
        problem = "a file, not a directory"
    elif not os.access(target.parent, os.W_OK):  # written beside it, then renamed over it
        problem = "a file kvtier may write (its directory is read-only to it)"
    elif _sticky_foreign(target):  # the rename over it would be refused at the end
        problem = "a file kvtier may replace (another user's, in a sticky directory)"
    elif target.exists() and any(p and Path(p).exists() and target.samefile(p) for p in inputs):
        problem = "a file other than the command's trace and config"
    if problem is not None:
        raise InvalidArgumentError(f"--plot: got {path!r}, expected {problem}")


def _sticky_foreign(target: Path) -> bool:
    """Whether `target` exists, belongs to another user, in a sticky directory (`/tmp`)."""
    try:
        found, parent = target.lstat(), target.parent.stat()
    except OSError:
        return False
    return bool(parent.st_mode & stat.S_ISVTX) and found.st_uid != os.geteuid()
