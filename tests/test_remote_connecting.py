"""A call made while another thread connects to the cluster waits for that connect instead of
missing (`tiers/remote/cluster.py`): a node just started, whose writer is still connecting
(here slowed by a startup node reached through a proxy that holds each connection 0.6 s before
it forwards it), still finds on its first load what the cluster holds. Before, every call in
that window was a miss at once.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from test_remote_audit3 import config, kv_for, node, twin

HOLD_S = 0.6


@contextmanager
def slow_proxy(target: str) -> Iterator[str]:
    """`host:port` of a proxy to `target` that waits `HOLD_S` before forwarding a connection."""
    host, port = target.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    sockets: list[socket.socket] = [listener]

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def serve() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            time.sleep(HOLD_S)
            upstream = socket.create_connection((host, int(port)))
            sockets.extend((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(src, dst), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for sock in sockets:
            sock.close()


def test_a_load_while_the_writer_connects_waits_for_it(redis_nodes: list[str]) -> None:
    ca = config(redis_nodes, timeout_s=2.0)
    tokens = list(range(3000, 3032))
    kv = kv_for(tokens, seed=4)
    with node(ca) as a, slow_proxy(redis_nodes[0]) as proxy:
        a.store(tokens, kv)
        assert a.drain()
        with node(twin(ca, nodes=[proxy])) as b:
            own = b.store(tokens[:8], kv[:, :, :8])  # its writer connects, in the background
            assert own.stored_tokens == 8
            time.sleep(HOLD_S / 3)  # within that connect
            assert not b.status()["remote"]["connected"]
            got = b.load(tokens)
            assert got.num_tokens == 32 and torch.equal(got.kv, kv)
            assert b.status()["remote"]["fill_misses"] == 0
            b.check()
