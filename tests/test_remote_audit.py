"""The remote tier against a cluster that is broken or hostile: every byte it sends is untrusted.

Two kinds of attacker. A writer on a real Redis Cluster (3 primaries on loopback: the cluster
CI started, KVTIER_REDIS_NODES, or one this module starts) puts values of its own under our
keys. `FakeNode`, a small RESP server that answers as a one-node cluster owning every slot,
is a hostile node: it answers our commands with malformed redirects, impossible lengths, or
a reply dripped a byte at a time. Each is a counted miss, never an exception, a wrong byte, an
allocation the size of what the attacker wrote, or a call held past its timeouts.

Skipped without Debian's `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it); the fake
node's tests need no server."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import BinaryIO

import pytest
import torch
from redis.cluster import RedisCluster

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import ValueMeta, encode_value, mac_key_of, path_keys
from kvtier.tiers.remote.tier import RemoteTier

LAYOUT = KVLayout("tiny", 1, 1, 8, "float16", 4)
HASHER = BlockHasher()
SEED = HASHER.seed(LAYOUT.fingerprint, tenant_salt("alice"))


def path(tenant: str, start: int, count: int) -> tuple[bytes, list[bytes]]:
    seed = HASHER.seed(LAYOUT.fingerprint, tenant_salt(tenant))
    tokens = encode_tokens(list(range(start, start + count * LAYOUT.block_tokens)))
    ids = HASHER.split(HASHER.chain(seed, tokens, LAYOUT.block_tokens * 4))
    return seed, [bytes(i) for i in ids]


def meta_of(seed: bytes, ids: list[bytes], p: int) -> ValueMeta:
    return ValueMeta(ids[p], ids[p - 1] if p else seed, LAYOUT.fingerprint, LAYOUT.block_bytes)


# ---- a real cluster, written to by a hostile writer ------------------------------------------


@pytest.fixture
def attacker(redis_nodes: list[str]) -> Iterator[RedisCluster]:
    """A plain client of the cluster: whoever can write to it."""
    host, port = redis_nodes[0].split(":")
    client = RedisCluster(host=host, port=int(port))
    yield client
    client.close()


def test_a_huge_value_under_our_key_costs_a_reader_no_more_memory_than_a_block(
    redis_nodes: list[str], attacker: RedisCluster
) -> None:
    seed, ids = path("alice", 0, 2)
    keys = path_keys("audit", ids, 0, 2, 4)
    attacker.set(keys[0], os.urandom(2**20) * 16)  # 16 MiB for a 128-byte block
    remote = RemoteCluster(ClusterSettings(tuple(redis_nodes), timeout_s=5.0))
    remote.present(keys)  # connected, slot table read: not part of the measure
    tracemalloc.start()
    try:
        got = remote.get(keys[:1], [meta_of(seed, ids, 0)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [None] and peak < 2**20, peak
    stats = remote.stats()
    assert (stats["verify_failures"], stats["hits"], stats["errors"]) == (1, 0, 0)
    assert stats["bytes_in"] == 0 and attacker.exists(keys[0]) == 0  # deleted
    remote.close()


def test_another_tenants_values_copied_under_our_keys_are_misses_and_leave_ours_unwritten(
    redis_nodes: list[str], attacker: RedisCluster
) -> None:
    """Same tokens, another tenant: the attacker copies alice's values under bob's keys. Bob's
    reader gets none of her bytes; hers still read bit-exact."""
    alice = RemoteTier(RemoteCluster(ClusterSettings(tuple(redis_nodes))), LAYOUT, "audit", 4)
    bob = RemoteTier(RemoteCluster(ClusterSettings(tuple(redis_nodes))), LAYOUT, "audit", 4)
    a_seed, a_ids = path("alice", 1000, 6)
    b_seed, b_ids = path("bob", 1000, 6)
    blocks = [torch.randn(LAYOUT.block_shape).to(LAYOUT.dtype) for _ in range(6)]
    assert alice.write(a_seed, a_ids, 0, blocks) == [True] * 6
    for a_key, b_key in zip(
        path_keys("audit", a_ids, 0, 6, 4), path_keys("audit", b_ids, 0, 6, 4), strict=True
    ):
        value = attacker.get(a_key)
        assert isinstance(value, bytes)
        attacker.set(b_key, value)
    assert bob.probe(b_seed, b_ids, 0) == 6  # present: a probe is only a hint
    out = [torch.full(LAYOUT.block_shape, 7.0, dtype=LAYOUT.dtype) for _ in range(6)]
    assert bob.read(b_seed, b_ids, 0, out) == [False] * 6
    assert all(bool((block == 7.0).all()) for block in out)
    assert bob.stats()["verify_failures"] == 6 and bob.probe(b_seed, b_ids, 0) == 0
    mine = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in range(6)]
    assert alice.read(a_seed, a_ids, 0, mine) == [True] * 6
    assert all(torch.equal(x, y) for x, y in zip(mine, blocks, strict=True))
    alice.cluster.close()
    bob.cluster.close()


def test_a_forged_value_passes_plain_checksums_but_not_a_reader_that_authenticates(
    redis_nodes: list[str], attacker: RedisCluster
) -> None:
    """A writer without the secret replaces a block's payload. The value itself names the ids
    and layout, so the writer rebuilds every plain checksum: a plain reader serves its bytes.
    With MACs keyed by the cluster secret, the same forgery (and one keyed with a guess) is a
    counted miss, the reader's tensor untouched, and honest values still read bit-exact."""
    seed, ids = path("alice", 2000, 2)
    blocks = [torch.randn(LAYOUT.block_shape).to(LAYOUT.dtype) for _ in range(2)]
    evil = torch.full(LAYOUT.block_shape, 66.0, dtype=LAYOUT.dtype)
    forged = encode_value(meta_of(seed, ids, 1), "none", evil.view(torch.uint8).numpy().tobytes())
    key = mac_key_of(b"the cluster secret, 16+ chars")
    guess = encode_value(
        dataclasses.replace(meta_of(seed, ids, 1), mac_key=mac_key_of(b"a guess at it")),
        "none",
        evil.view(torch.uint8).numpy().tobytes(),
    )
    for prefix, mac_key, served in (("plain", None, True), ("macs", key, False)):
        tier = RemoteTier(
            RemoteCluster(ClusterSettings(tuple(redis_nodes))), LAYOUT, prefix, 4, None, mac_key
        )
        assert tier.write(seed, ids, 0, blocks) == [True, True]
        for value in (forged, guess) if mac_key is not None else (forged,):
            attacker.set(path_keys(prefix, ids, 1, 2, 4, mac_key is not None)[0], value)
            out = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in range(2)]
            assert tier.read(seed, ids, 0, out) == [True, served]
            assert torch.equal(out[0], blocks[0])
            assert bool((out[1] == 66.0).all()) is served  # plain: the forgery is served
        if mac_key is not None:
            assert tier.stats()["verify_failures"] == 2
            tier.write(seed, ids, 1, blocks[1:])  # the honest value again
            out = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in range(2)]
            assert tier.read(seed, ids, 0, out) == [True, True]
            assert torch.equal(out[1], blocks[1])
        tier.cluster.close()


def test_the_cluster_client_takes_no_maintenance_notices_from_a_node(
    redis_nodes: list[str],
) -> None:
    """redis-py 8 speaks RESP3 and, by default, lets a node push "maintenance" notices that
    move connections and stretch timeouts on the node's word: off."""
    remote = RemoteCluster(ClusterSettings(tuple(redis_nodes)))
    assert remote.present([b"audit:none"]) == 0  # connected
    client = remote._client
    assert client is not None and client.maint_notifications_config is not None
    assert client.maint_notifications_config.enabled is False
    remote.close()


# ---- a hostile node --------------------------------------------------------------------------

COMMANDS = {b"get": (2, 1), b"getrange": (4, 1), b"set": (-3, 1), b"exists": (-2, 1)}
COMMANDS |= {b"del": (-2, 1)}
Answer = Callable[[list[bytes], socket.socket], bytes | None]


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def array(items: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(items) + b"".join(items)


def read_command(stream: BinaryIO) -> list[bytes] | None:
    line = stream.readline()
    if not line.startswith(b"*"):
        return None
    args = []
    for _ in range(int(line[1:])):
        size = int(stream.readline()[1:])
        args.append(stream.read(size + 2)[:-2])
    return args


def serve_each(server: socket.socket, serve: Callable[[socket.socket], None]) -> None:
    """Accept connections on `server` until it closes, each served by `serve` on a thread."""

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


class FakeNode:
    """A RESP server on a loopback port that says it is a one-node cluster owning every slot
    (HELLO, CLUSTER SLOTS, which names `host` and its own port, COMMAND), and hands every other
    command to `answer`, which returns the reply's bytes or sends them itself (and returns
    None)."""

    def __init__(self, answer: Answer, host: bytes = b"127.0.0.1") -> None:
        self.answer, self.host = answer, host
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        serve_each(self.server, self._serve)

    def _serve(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        with conn, stream:
            try:
                while (args := read_command(stream)) is not None:
                    reply = self._reply(args, conn)
                    if reply is not None:
                        conn.sendall(reply)
            except OSError:  # the client hung up
                return

    def _reply(self, args: list[bytes], conn: socket.socket) -> bytes | None:
        name = args[0].upper()
        if name == b"HELLO":
            return b"%2\r\n+server\r\n+redis\r\n+proto\r\n:3\r\n"
        if name == b"CLUSTER" and args[1].upper() == b"SLOTS":
            me = array([bulk(self.host), b":%d\r\n" % self.port, bulk(b"fake")])
            return array([array([b":0\r\n", b":16383\r\n", me])])
        if name == b"COMMAND":
            return array(
                [
                    array([bulk(n), b":%d\r\n" % a, array([]), *[b":%d\r\n" % k] * 2, b":1\r\n"])
                    for n, (a, k) in COMMANDS.items()
                ]
            )
        if name == b"CLIENT":
            return b"+OK\r\n"
        return self.answer(args, conn)

    def close(self) -> None:
        self.server.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


HOSTILE = {
    "moved-without-a-slot": b"-MOVED nowhere\r\n",
    "ask-without-a-slot": b"-ASK x y\r\n",
    "ask-to-a-node-outside-the-slot-table": b"-ASK 12 127.0.0.1:%d\r\n" % closed_port(),
    "bulk-length-past-2**63": b"$99999999999999999999\r\n",
    "big-number-that-is-not-one": b"(12x\r\n",
}


@pytest.mark.parametrize("reply", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_malformed_reply_is_a_counted_miss_and_the_next_call_is_served(reply: bytes) -> None:
    """GETRANGE, EXISTS and SET get the hostile reply until the node turns honest. redis-py
    raises ValueError, AttributeError or OverflowError on these: none may escape."""
    seed, ids = path("alice", 2000, 1)
    meta = meta_of(seed, ids, 0)
    value = encode_value(meta, "none", os.urandom(LAYOUT.block_bytes))
    truth = {
        b"GET": bulk(value),
        b"GETRANGE": bulk(value),
        b"EXISTS": b":1\r\n",
        b"SET": b"+OK\r\n",
    }
    honest = threading.Event()

    def answer(args: list[bytes], conn: socket.socket) -> bytes:
        name = args[0].upper()
        return truth.get(name, b"+OK\r\n") if honest.is_set() or name not in truth else reply

    node = FakeNode(answer)
    remote = RemoteCluster(ClusterSettings((f"127.0.0.1:{node.port}",), timeout_s=1.0))
    key = path_keys("audit", ids, 0, 1, 4)
    try:
        assert remote.get(key, [meta]) == [None]
        assert remote.present(key) == 0
        assert remote.put([(key[0], value)]) == [False]
        assert remote.stats()["errors"] >= 3 and remote.stats()["hits"] == 0
        honest.set()
        got = remote.get(key, [meta])
        assert got[0] is not None and bytes(got[0][1]) == value[-LAYOUT.block_bytes :]
        assert remote.present(key) == 1 and remote.put([(key[0], value)]) == [True]
    finally:
        remote.close()
        node.close()


def drip(head: bytes, body: bytes, every_s: float) -> Answer:
    """An answer that sends `head`, then `body` a byte at a time, each just inside a timeout."""

    def answer(args: list[bytes], conn: socket.socket) -> bytes | None:
        if args[0].upper() not in (b"GET", b"GETRANGE", b"EXISTS"):
            return b"+OK\r\n"
        conn.sendall(head)
        for byte in body:
            time.sleep(every_s)
            conn.sendall(bytes([byte]))
        return b"\r\n"

    return answer


@pytest.mark.parametrize(
    "head, body",
    [(b"$40\r\n", b"x" * 40), (b":", b"1" * 40)],
    ids=["a-value-dripped", "a-number-that-never-ends"],
)
def test_a_reply_dripped_inside_each_socket_timeout_ends_as_a_counted_miss(
    head: bytes, body: bytes
) -> None:
    """Each byte comes 0.25 s after the last, inside the 0.5 s socket timeout: the reply would
    take 10 s. A read and a probe (what `lookup` runs) end within a few timeouts, as misses."""
    seed, ids = path("alice", 3000, 1)
    node = FakeNode(drip(head, body, 0.25))
    remote = RemoteCluster(ClusterSettings((f"127.0.0.1:{node.port}",), timeout_s=0.5))
    key = path_keys("audit", ids, 0, 1, 4)
    try:
        started = time.monotonic()
        assert remote.get(key, [meta_of(seed, ids, 0)]) == [None]
        assert remote.present(key) == 0
        assert time.monotonic() - started < 6.0
        assert remote.stats()["errors"] >= 2 and "Timeout" in remote.stats()["last_error"]
    finally:
        remote.close()
        node.close()
