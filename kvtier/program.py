"""The `kvtier` program (`[project.scripts]`): the command line's modules imported only where a
stop during their import is answered as `cli.main` answers one.

Importing `kvtier.cli` takes seconds (torch, through the config's layouts; FastAPI for
`serve` after), and before this module a signal in them met Python's defaults: Ctrl-C printed a
KeyboardInterrupt's traceback of some 20 lines, a SIGTERM to a starting `kvtier serve` killed
it with status 143 (systemd's `Restart=on-failure` restarts that), unlike the same stop a moment
later (`cli.py`'s module doc). Here, with no module of kvtier's loaded but the package's
lazy `__init__`:

- `kvtier serve`: SIGTERM or SIGINT while the command line's modules load ends it with one
  line, `kvtier: SIGTERM while starting: stopped before serving anything`, and status 0, and
  the handler stays for `cli.cmd_serve`, which keeps it until its server takes the signals
  over (a signal ignored, as under `nohup`, stays ignored); SIGHUP is logged and ignored
  (`hangup`) from here on, not only once the command runs.
- Any other command: Ctrl-C while they load prints `kvtier: interrupted` and the program dies
  of SIGINT, as Ctrl-C later in the command does (`run`).

Contract: nothing here imports torch or any module of kvtier's but `kvtier.cli`, inside `run`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

INTERRUPTED = 130
"""`cli.main`'s status for Ctrl-C, as a shell reports a command that SIGINT ended (128 + 2)."""
STOPS = (signal.SIGTERM, signal.SIGINT)


class StoppedAtStart(BaseException):
    """SIGTERM or SIGINT to `kvtier serve` before its server took them over: a BaseException,
    as KeyboardInterrupt is, so that no `except Exception` on the way up holds the stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stop_at_start(signum: int, frame: object) -> None:
    """SIGTERM or SIGINT while `kvtier serve` starts (its imports, the config, the secret, the
    port): nothing is served yet, so the start ends there, one line and exit 0 (`cli.main`), as
    a stop of a running sidecar does; SIGINT's default was a KeyboardInterrupt's traceback,
    SIGTERM's a death by the signal (status 143). The server installs its own handlers (a clean
    stop of the store) once it runs, and puts these back after."""
    raise StoppedAtStart(signum)


def hangup(signum: int, frame: object) -> None:
    """SIGHUP to `kvtier serve`: logged and ignored. Its default action killed the process
    with no clean stop (copies in flight dropped, the pools left in /dev/shm until the next
    start), and systemd's `Restart=on-failure` takes a death by SIGHUP for a clean exit, so it
    stayed down. The config is read only at start: a change needs a restart."""
    logging.getLogger("kvtier.serve").warning(
        "kvtier: SIGHUP ignored: the config is read only at start (restart to apply a change; "
        "SIGTERM stops cleanly)"
    )


def stopped_line(stop: StoppedAtStart) -> str:
    name = signal.Signals(stop.signum).name
    return f"kvtier: {name} while starting: stopped before serving anything"


def die_interrupted() -> None:
    """End the program by SIGINT itself, as Python ends on an unhandled Ctrl-C: a shell
    script's loop stops on a command that SIGINT ended (an exit status of 130 lets it go on)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # (None: stdout closed)
        sys.stdout.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def run() -> None:
    """The program: `cli.main`'s status, or, interrupted, death by SIGINT (module doc)."""
    before = {stop: signal.getsignal(stop) for stop in STOPS}
    if sys.argv[1:2] == ["serve"]:
        signal.signal(signal.SIGHUP, hangup)
        for stop in STOPS:
            if before[stop] is not signal.SIG_IGN:  # `nohup`: left ignored
                signal.signal(stop, stop_at_start)
    try:
        from kvtier.cli import main
    except StoppedAtStart as stop:
        _say(stopped_line(stop))
        sys.exit(0)
    except KeyboardInterrupt:
        _say("kvtier: interrupted")
        die_interrupted()
        sys.exit(INTERRUPTED)  # SIGINT blocked by the caller: its status, as a shell says it
    try:
        code = main()
    except StoppedAtStart as stop:  # between the imports and `cmd_serve`'s own handlers
        _say(stopped_line(stop))
        code = 0
    finally:  # what the program started with (`cmd_serve` keeps `stop_at_start` while it starts)
        for sig in STOPS:
            if before[sig] is not None:  # None: a handler not set from Python (kept)
                signal.signal(sig, before[sig])
    if code == INTERRUPTED:
        die_interrupted()
    sys.exit(code)


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr closed (`2>&-`)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
