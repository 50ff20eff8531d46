"""The remote tier after auditor N, over a real Redis Cluster (and a fake node for one reply):

- with `authenticate`, a value copied from one key prefix's key to another's (old weights' KV
  under a new prefix) fails its MACs there: a verify failure, deleted (before: the MACs bound
  the block, not the prefix, so the new fleet served the old weights' KV);
- a node that answers a read of one value with a bulk of many MiB is refused once its reply
  passes the bytes asked for, before the bulk is buffered: a counted miss, its connection
  closed (before: the reader buffered the whole bulk, three times over);
- a TLS key with a passphrase, or of another certificate, is a `ConfigError` naming
  `tiers.remote.tls.key_file` at start (before: the store started, and OpenSSL asked for the
  passphrase on the terminal at every connect, or every handshake failed);
- a cluster whose nodes answer with error replies (an ACL's `-NOPERM`) is `connected` (before:
  a call whose every reply was an error counted as one that reached no node);
- blocks over `max_value_bytes` are said so in `last_error` and `writer_last_error`, with their
  sizes (before: the writer showed whatever the cluster said last, unrelated).

Skipped without `redis-server` (or `openssl` for TLS), unless KVTIER_REQUIRE_REDIS=1."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis.cluster import RedisCluster
from test_remote_audit import LAYOUT, FakeNode, meta_of, path

from kvtier import KVStore, parse_config
from kvtier.errors import ConfigError
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import mac_key_of, path_keys
from kvtier.tiers.remote.local import make_certificates
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.remote.writer import RemoteWriter

SECRET = b"cluster-secret-SECRETSECRET42"


def blocks(count: int) -> torch.Tensor:
    return torch.randn(count, *LAYOUT.block_shape).to(LAYOUT.dtype)


# ---- 1. the MACs bind the key prefix ---------------------------------------------------------


def test_a_value_copied_under_another_key_prefix_fails_its_macs_and_is_deleted(
    redis_nodes: list[str],
) -> None:
    key = mac_key_of(SECRET)  # both fleets share the cluster secret
    old = RemoteTier(RemoteCluster(ClusterSettings(tuple(redis_nodes))), LAYOUT, "wv1", 4,
                     mac_key=key)  # fmt: skip
    new = RemoteTier(RemoteCluster(ClusterSettings(tuple(redis_nodes))), LAYOUT, "wv2", 4,
                     mac_key=key)  # fmt: skip
    seed, ids = path("n-prefix", 0, 4)
    assert old.write(seed, ids, 0, list(blocks(4))) == [True] * 4
    host, port = redis_nodes[0].split(":")
    attacker = RedisCluster(host=host, port=int(port))
    copied = path_keys("wv2", ids, 0, 4, 4, keyed=True)  # authenticated values' keys
    for source, target in zip(path_keys("wv1", ids, 0, 4, 4, keyed=True), copied, strict=True):
        value = attacker.get(source)
        assert isinstance(value, bytes)
        attacker.set(target, value)
    # a fleet of the same prefix reads them back; the other prefix's does not
    assert old.read(seed, ids, 0, list(torch.empty(4, *LAYOUT.block_shape).half()))[0]
    served = new.read(seed, ids, 0, list(torch.empty(4, *LAYOUT.block_shape).half()))
    stats = new.stats()
    assert served == [False] * 4 and stats["hits"] == 0 and stats["verify_failures"] == 4
    assert sum(attacker.exists(k) for k in copied) == 0  # deleted, as every failed value
    attacker.close()
    old.cluster.close()
    new.cluster.close()


# ---- 2. a reply is read no further than what was asked for -----------------------------------


def test_a_reply_longer_than_the_range_asked_for_is_refused_before_it_is_buffered() -> None:
    size = 32 * 2**20  # asked for one 128-byte block's value
    chunk = b"x" * 2**20  # made before the measure (it traces the node's thread too)

    def answer(args: list[bytes], conn: socket.socket) -> bytes | None:
        if args[0].upper() != b"GETRANGE":
            return b":1\r\n"
        try:
            conn.sendall(b"$%d\r\n" % size)
            for _ in range(size // 2**20):
                conn.sendall(chunk)
            conn.sendall(b"\r\n")
        except OSError:  # the reader hung up on it
            pass
        return None

    node = FakeNode(answer)
    remote = RemoteCluster(ClusterSettings((f"127.0.0.1:{node.port}",), timeout_s=5.0))
    seed, ids = path("n-huge", 0, 1)
    keys = path_keys("n", ids, 0, 1, 4)
    assert remote.present(keys) == 1  # connected, slot table read: not part of the measure
    tracemalloc.start()
    try:
        got = remote.get(keys, [meta_of(seed, ids, 0)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    stats = remote.stats()
    assert got == [None] and peak < 2**20, peak
    assert (stats["hits"], stats["misses"], stats["errors"]) == (0, 1, 1)
    assert "ReplyTooLong" in stats["last_error"]
    remote.close()


# ---- 3. TLS files are loaded at start ------------------------------------------------------


def tls_config(tls: dict[str, str]) -> dict[str, Any]:
    remote = {"nodes": ["127.0.0.1:1"], "secret": SECRET.decode(), "tls": tls}
    return {
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                  "dtype": "float16"},
        "block_tokens": 4,
        "tiers": {"gpu": {"capacity": 64 * 2048, "device": "cpu"}, "host": None, "disk": None,
                  "remote": remote},
        "tenants": {"default": {}},
        "mover": {"background": False},
    }  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    """Two CAs' certificates, and the first's key encrypted with a passphrase."""
    if shutil.which("openssl") is None:
        pytest.skip(reason="no openssl on PATH: the TLS files are made with it")
    directory = tmp_path_factory.mktemp("tls")
    ours, other = make_certificates(directory / "ours"), make_certificates(directory / "other")
    encrypted = directory / "encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(ours.key_file), "-aes256",
         "-passout", "pass:passphrase-0123", "-out", str(encrypted)],
        check=True, capture_output=True,
    )  # fmt: skip
    return ours, other, encrypted


@pytest.mark.parametrize("case", ["encrypted", "other key", "not a key"])
def test_a_tls_key_that_cannot_serve_the_certificate_is_a_config_error_naming_it(
    certs: tuple[Any, Any, Path], case: str
) -> None:
    ours, other, encrypted = certs
    key = {"encrypted": str(encrypted), "other key": other.key_file, "not a key": ours.ca_file}
    tls = {"ca_file": ours.ca_file, "cert_file": ours.cert_file, "key_file": key[case]}
    with pytest.raises(ConfigError) as caught:
        KVStore(parse_config(tls_config(tls))).close()
    assert caught.value.field == "tiers.remote.tls.key_file"
    expected = "passphrase is not supported" if case == "encrypted" else "key of cert_file"
    assert expected in str(caught.value)


def test_a_tls_key_of_its_certificate_starts(certs: tuple[Any, Any, Path]) -> None:
    ours, _, _ = certs
    tls = {"ca_file": ours.ca_file, "cert_file": ours.cert_file, "key_file": ours.key_file}
    KVStore(parse_config(tls_config(tls))).close()


# ---- 4. an error reply reached a node --------------------------------------------------------


def test_a_cluster_answering_noperm_is_connected_with_the_error_counted(
    redis_nodes: list[str],
) -> None:
    password = "acl-user-pass-0123456789"
    admins: list[Any] = [
        redis.Redis(node.split(":")[0], int(node.split(":")[1])) for node in redis_nodes
    ]
    for admin in admins:  # a user that may touch only other keys than ours
        admin.execute_command("ACL", "SETUSER", "auditn", "on", ">" + password, "~other:*",
                              "+@all")  # fmt: skip
    try:
        remote = RemoteCluster(
            ClusterSettings(tuple(redis_nodes), username="auditn", password=password)
        )
        _, ids = path("n-noperm", 0, 4)
        assert remote.present(path_keys("n", ids, 0, 4, 4)) == 0
        stats = remote.stats()
        assert stats["errors"] >= 1 and "NoPermissionError" in stats["last_error"]
        assert stats["connected"]  # every reply came from a node
        remote.close()
    finally:
        for admin in admins:
            admin.execute_command("ACL", "DELUSER", "auditn")
            admin.close()


# ---- 5. blocks too large to send are said so ---------------------------------------------------


def test_blocks_over_max_value_bytes_are_said_so_not_the_clusters_last_error(
    redis_nodes: list[str],
) -> None:
    remote = RemoteCluster(ClusterSettings(tuple(redis_nodes), max_value_bytes=64))
    tier = RemoteTier(remote, LAYOUT, "n-large", 4)
    seed, ids = path("n-large", 0, 2)
    # an unrelated failure first: a value that is not a block, read back
    remote.put([(path_keys("n-large", ids, 0, 1, 4)[0], b"garbage")])
    assert tier.read(seed, ids, 0, [torch.empty(*LAYOUT.block_shape).half()]) == [False]
    assert remote.stats()["verify_failures"] == 1
    writer = RemoteWriter(tier, 2**20)
    writer.submit(seed, ids, 0, blocks(2))
    assert writer.drain(10)
    stats = remote.stats()
    assert stats["too_large"] == 2 and writer.stats["failed_blocks"] == 2
    said = re.fullmatch(
        r"2 blocks not written: 2 values of (\d+) to \1 bytes not sent: "
        r"over max_value_bytes \(64\)",
        writer.last_error,
    )
    assert said is not None and int(said[1]) > LAYOUT.block_bytes, writer.last_error
    assert "over max_value_bytes (64)" in stats["last_error"]
    writer.close()
    remote.close()
