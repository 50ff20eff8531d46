"""A hostile node's slot table (CLUSTER SLOTS), which every kvtier node of a fleet reads when
it connects and again after each failed round trip (`tiers/remote/slots.py`,
`tiers/remote/connection.py`); and the memory a writer's backlog holds beside its blocks
(`tiers/remote/writer.py`, last test).

redis-py builds its slot map from the table as sent: before, a 60-byte table naming slots 0 to
10**8 took a node's connect 3 GB in 15 s (10**12: the process killed for memory), a host name
of 400 MiB took 1.2 GB (the reply buffered whole: only a round trip's replies were bounded), and
a table naming 16,384 nodes 170 MB and 8.6 s of CPU. Now each is refused before a slot map is
built: the connect is a counted failure whose `last_error` says why, the node is not
connected, and a table of an honest size is still taken.

`FakeNode` (`test_remote_audit.py`) is a RESP server that answers as a one-node cluster; it
needs no redis-server."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Callable

import torch
from conftest import wait_until
from test_remote_audit import FakeNode, array, bulk

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.remote.writer import RemoteWriter

HASHER = BlockHasher()

Table = Callable[[int], bytes]  # the fake node's port -> its CLUSTER SLOTS reply


def node_entry(port: int, host: bytes = b"127.0.0.1", name: bytes = b"fake") -> bytes:
    return array([bulk(host), b":%d\r\n" % port, bulk(name)])


def slot_range(start: int, end: int, *nodes: bytes) -> bytes:
    return array([b":%d\r\n" % start, b":%d\r\n" % end, *nodes])


class TableNode(FakeNode):
    """A fake node whose CLUSTER SLOTS reply is `table(port)`, sent in pieces of 1 MiB; `sent`
    is set once all of it went out (a reader that stops reading leaves it clear)."""

    def __init__(self, table: Table) -> None:
        self.table, self.sent = table, threading.Event()
        super().__init__(lambda args, conn: b":1\r\n")

    def _reply(self, args: list[bytes], conn: socket.socket) -> bytes | None:
        if args[0].upper() == b"CLUSTER" and args[1].upper() == b"SLOTS":
            reply = self.table(self.port)
            for at in range(0, len(reply), 2**20):
                conn.sendall(reply[at : at + 2**20])
            self.sent.set()
            return None
        return super()._reply(args, conn)


def connect(table: Table) -> tuple[RemoteCluster, TableNode]:
    """A cluster client of a fake node with `table`, once its connect ended."""
    node = TableNode(table)
    # 3 s: a fake node in this process sends 64 MiB under the GIL; 1 s timed out on a busy box
    remote = RemoteCluster(ClusterSettings((f"127.0.0.1:{node.port}",), timeout_s=3.0))
    assert wait_until(lambda: remote.connected or remote.stats()["errors"] > 0, timeout=20.0)
    return remote, node


def refused(table: Table, why: str) -> TableNode:
    """Connecting to a fake node with `table` fails, counted, `last_error` saying `why`."""
    started = time.monotonic()
    remote, node = connect(table)
    try:
        stats = remote.stats()
        assert not stats["connected"] and stats["errors"] == 1
        assert why in stats["last_error"], stats["last_error"]
        assert remote.present([b"k"]) == 0  # a miss, not an exception
        assert time.monotonic() - started < 10.0
    finally:
        remote.close()
        node.close()
    return node


def test_a_slot_range_past_the_cluster_s_slots_is_refused_not_expanded() -> None:
    """Before: redis-py set each slot of 0..10**6 in its map (a million entries; 10**12 would
    take the process down), then connected."""
    refused(lambda port: array([slot_range(0, 10**6, node_entry(port))]), "to 1000000")
    # a range turned round, a negative slot, slots summing past 16384 (each in range alone)
    refused(lambda port: array([slot_range(9, 3, node_entry(port))]), "slots 9 to 3")
    refused(lambda port: array([slot_range(-1, 3, node_entry(port))]), "slots -1 to 3")
    twice = [slot_range(0, 16383, node_entry(port)) for port in (1, 1)]
    refused(lambda port: array(twice), "more than the 16384 slots")


def test_a_slot_table_bigger_than_a_reply_may_be_is_not_read_whole() -> None:
    """A host name of 64 MiB: before, buffered whole (and a slot map built naming it); now the
    reply stops being read at 16 MiB, so the node cannot even send all of it."""
    host = b"a" * 64 * 2**20
    node = refused(
        lambda port: array([slot_range(0, 16383, node_entry(port, host))]), "16777216 bytes"
    )
    assert not node.sent.is_set()


def test_a_slot_table_naming_thousands_of_nodes_or_odd_ones_is_refused() -> None:
    """5,000 nodes (before: a client and a pool made for each, 2.5 s of a connect); a port
    out of range; a host longer than a DNS name."""

    def many(port: int) -> bytes:
        ranges = [slot_range(i * 3, i * 3 + 2, node_entry(10000 + i)) for i in range(5000)]
        return array([*ranges, slot_range(15000, 16383, node_entry(port))])

    refused(many, "more than 4096 nodes")
    refused(lambda port: array([slot_range(0, 16383, node_entry(70000))]), "port 70000")
    long_host = node_entry(1, b"h" * 300)
    refused(lambda port: array([slot_range(0, 16383, long_host)]), "at most 255")


def test_an_honest_slot_table_is_still_taken() -> None:
    """Three ranges, a replica each, Redis 7's metadata after the id: connected, served."""

    def honest(port: int) -> bytes:
        me = array([bulk(b"127.0.0.1"), b":%d\r\n" % port, bulk(b"a" * 40), array([])])
        return array([slot_range(a, b, me, me) for a, b in ((0, 5460), (5461, 10922),
                                                           (10923, 16383))])  # fmt: skip

    remote, node = connect(honest)
    try:
        assert remote.connected
        assert remote.present([b"k1", b"k2"]) == 2
        assert remote.stats()["errors"] == 0
    finally:
        remote.close()
        node.close()


# ---- the writer's backlog holds what `pending_bytes` says --------------------------------------


def test_a_backlog_of_one_block_stores_holds_no_whole_group_of_ids_each() -> None:
    """group_blocks 4096 and a sequence extended one block at a time (a decode loop's stores):
    before, each job kept the ids of its group up to its block (up to 4,096 of them, 57 bytes
    each) beside a block of 128 bytes, so a backlog of 40 such jobs (5 KiB of `pending_bytes`)
    held 9 MiB. Now a job keeps the ids its write reads: its block's, its parent's, its group's
    first. The writer is held on its first write by a node that answers it late."""
    layout = KVLayout("tiny", 1, 1, 8, "float16", 4)  # 128-byte blocks
    seed = HASHER.seed(layout.fingerprint, tenant_salt("alice"))
    tokens = encode_tokens(list(range(4100 * layout.block_tokens)))
    ids = [bytes(i) for i in HASHER.split(HASHER.chain(seed, tokens, layout.block_tokens * 4))]
    answered = threading.Event()

    def answer(args: list[bytes], conn: socket.socket) -> bytes:
        if args[0].upper() == b"SET":
            answered.wait(5.0)  # the first write waits here, the writer with it
        return b"+OK\r\n"

    node = FakeNode(answer)
    cluster = RemoteCluster(ClusterSettings((f"127.0.0.1:{node.port}",), timeout_s=4.0))
    writer = RemoteWriter(RemoteTier(cluster, layout, "au", group_blocks=4096), 2**20)
    block = torch.zeros((1, *layout.block_shape), dtype=layout.dtype)
    try:
        assert wait_until(lambda: cluster.connected)
        writer.submit(seed, ids, 0, block)  # the writer takes it and waits for the node
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for position in range(4000, 4040):
                path = [bytes(bytearray(i)) for i in ids[: position + 1]]  # a store's own
                assert writer.submit(seed, path, position, block)
                del path  # what the job keeps of it stays
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert writer.pending_bytes == 41 * layout.block_bytes
        assert held < 200 * 2**10, held  # 40 blocks and their few ids; before: 9 MiB
        answered.set()
        assert writer.drain(5.0)
        assert writer.stats["written_blocks"] == 41 and writer.stats["failed_blocks"] == 0
    finally:
        answered.set()
        writer.close()
        cluster.close()
        node.close()
