"""`kvtier serve`: the sidecar process.

Start-up: the config is validated (before anything starts), every `env:` key and secret is read
(the tenants' and admin keys by `Auth`, the remote tier's secret and password here: an unset or
short one is a `ConfigError` naming its field, never its value, before the port is bound or the
store built), a non-loopback address without auth is refused, the server secret is read or
created, the shared-memory segments that killed servers left in /dev/shm are removed
(`tiers/shm.py`), the port is bound (one in use: a `ConfigError` naming it, before any store is
built), and the store is built on a thread (disk recovery included) while /healthz already
answers; /readyz turns 200 when it is done, and a store that fails to start turns /healthz 503
too (`app.py`), for a liveness probe to restart it.
SIGTERM or SIGINT: uvicorn stops accepting connections and finishes the requests in progress
(the local lane its calls: `lane.py`), then the store closes: pending leases end, flights in
flight are waited for (at most 30 s) and published, the disk tier is left consistent (every
copy in the index is durable), and the process exits 0. The next start recovers everything
durable. A second SIGINT while that waits forces the exit: the store is not closed, and the
process says so and exits 1.

Garbage collection: once the app is built (every module imported: torch, the web stack), its
objects are frozen out of the cyclic collector (`gc.freeze`). They live as long as the process,
and every full collection walked them all, under whatever lock the allocation that set it off
held (the store's, often): 221,000 objects, a full pass of 124 ms with nothing cached, 0.0 ms
frozen; with a 380,000-block index beside a bare `KVStore`, 150-165 ms, and 31-46 ms with the
start-up frozen (`gc.collect()` timed in-process). The store is built after the freeze, so
the index's nodes stay collectable (a cleared subtree is a cycle of parents and children).
`/metrics` has the collector's counts (`python_gc_*`) and `kvtier_gc_frozen_objects`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from kvtier.config import KVTierConfig
from kvtier.config.fields import resolve_key
from kvtier.errors import ConfigError
from kvtier.service.admission import Service
from kvtier.service.app import create_app
from kvtier.service.auth import Auth, require_loopback, server_secret
from kvtier.service.protocol import protocol_class
from kvtier.store import KVStore
from kvtier.tiers.shm import SERVE_BASE, sweep_stale

log = logging.getLogger("kvtier.serve")

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes of request line and headers a request may carry (431 past it)."""


def build_app(config: KVTierConfig, host: str) -> FastAPI:
    """The app for `config` served on `host`; `ConfigError` before anything starts."""
    require_loopback(host, Auth(config))
    _check_remote_secrets(config)
    secret = server_secret(config.service.state_dir)
    swept = sweep_stale()
    if swept:
        names = " ".join(swept)
        log.warning(
            "kvtier: swept %d shared-memory segments of dead servers: %s", len(swept), names
        )
    shared = SERVE_BASE if config.service.shared_memory else None

    def factory() -> KVStore:
        return KVStore(config, secret=secret, shared_memory=shared)

    return create_app(config, factory, host)


def _check_remote_secrets(config: KVTierConfig) -> None:
    """Read the remote tier's `env:` secret and password now (`resolve_key`): the store reads
    them when it is built, on a thread, where an unset one would only turn /healthz 503."""
    remote = config.tiers.remote
    if remote is None:
        return
    for name, ref in (("secret", remote.secret), ("password", remote.password)):
        if ref is not None:
            resolve_key(ref, f"tiers.remote.{name}")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (listening starts in uvicorn), as uvicorn binds
    one; a port that cannot be bound (in use, not allowed) is a `ConfigError`, and so is a host
    that names no address here (`[::1]`, bracketed, was blamed on the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if isinstance(exc, socket.gaierror):
            expected = f"an address of this machine, a name or an IP ({exc.strerror or exc})"
            raise ConfigError("service.host", host, expected) from None
        raise ConfigError(
            "service.port", port, f"a port free to bind on {host} ({exc.strerror or exc})"
        ) from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn re-raises the signal that stopped it once it has shut down, so that the process
    dies of it (status 143 for SIGTERM); here SIGTERM is the ordinary way to stop, and a clean
    shutdown exits 0. It serves on the socket `bind` made, and logs where, as uvicorn does on
    one it binds itself."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn says where it listens only on a socket of its own
            host, port = sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", shown, port
            )

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # handled: the graceful shutdown is done


class _ForcedExitQuiet(logging.Filter):
    """A second signal cancels the app's lifespan task, and uvicorn logs the CancelledError's
    traceback (Starlette's `lifespan.shutdown.failed` message is the formatted traceback); the
    forced exit is said in one line instead (`_forced_open`)."""

    def __init__(self, server: uvicorn.Server) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        cancelled = isinstance(error, asyncio.CancelledError) or "CancelledError" in str(record.msg)
        return not (self.server.force_exit and cancelled)


def serve(config: KVTierConfig, host: str | None = None, port: int | None = None) -> int:
    host = config.service.host if host is None else host
    port = config.service.port if port is None else port
    app = build_app(config, host)
    listener = bind(host, port)  # before the store is built: a port in use ends it here
    gc.freeze()  # the start-up's objects leave every later full collection (module doc)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            access_log=False,  # headers (keys) never reach a log; /metrics has the traffic
            # nothing here reads the peer's address or scheme, so no X-Forwarded-* header from
            # a local process may rewrite them, and every request skips that middleware (4 %
            # of the event loop's samples in request handling, py-spy, 16 MiB commits)
            proxy_headers=False,
            timeout_graceful_shutdown=30,
            # a request's head: at most MAX_HEAD_BYTES, complete within body_timeout_s
            http=protocol_class(MAX_HEAD_BYTES, config.service.body_timeout_s),
            # no route is a WebSocket: an `Upgrade: websocket` request is an HTTP one, through
            # the edge's checks and answered as any (a WebSocket scope passed them, then 403
            # with no body)
            ws="none",
        )
    )
    quiet, errors = _ForcedExitQuiet(server), logging.getLogger("uvicorn.error")
    errors.addFilter(quiet)
    try:
        server.run(sockets=[listener])
    finally:
        errors.removeFilter(quiet)
    return 1 if _forced_open(server, app.state.service) else 0


def _forced_open(server: uvicorn.Server, service: Service) -> bool:
    """Whether a second signal forced the exit past the store's close (uvicorn skips the
    app's shutdown then): logged in one line, and the exit status is 1, not 0."""
    if not server.force_exit or (service.store is None and service.ready.is_set()):
        return False
    log.error(
        "kvtier: forced to exit by a second signal: the store was not closed (copies in flight "
        "dropped); the next start recovers what was durable"
    )
    return True
