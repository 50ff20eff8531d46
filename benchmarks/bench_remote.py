"""The remote tier's put and get against raw pipelined SET/GET of the same bytes (issue 14).

A Redis Cluster of 3 primaries (Debian's `redis-server`, started here on loopback ports by
`tests/redis_cluster.py`, or the one named by `--nodes`). For 2 MiB blocks (Llama-3.1-8B
geometry: 32 layers, 8 KV heads, head_dim 128, bf16, 16 tokens) and 64 KiB blocks, each round
moves `--mib` MiB both ways, twice:

- raw: redis-py's `RedisCluster`, one pipeline of `SET` per group of `--group` blocks (keys of
  one hash tag, as the tier's), then one pipeline of `GET` per group; the values are the bare
  payloads;
- tier: `RemoteCluster.put` of the same groups, each value encoded in the timed loop
  (`entry.encode_value_into`: header, xxh3-128 of the payload, the payload copied once into a
  staging buffer reused per round trip, as a writer keeps them), then `RemoteCluster.get`, each
  value verified (`decode_value`: both checksums, the expected ids) in the timed loop.

Every block has a payload of its own (as pool slots do): one shared buffer would stay in the
CPU's cache and flatter whichever side copies least.

Both use one client with the same timeouts; every round uses fresh keys and deletes them after,
so `SET NX` never skips. Raw and tier alternate, one of each per round; figures are medians of
`--repeat` rounds, GB/s of payload bytes (1e9). The last lines give tier / raw for put and get
(issue 14's target: 0.8 or more).
Run: `python benchmarks/bench_remote.py [--quick] [--mib N] [--repeat N] [--nodes h:p,...]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from redis.cluster import ClusterNode, RedisCluster

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster, parse_node
from kvtier.tiers.remote.entry import ValueMeta, encode_value_into, header_nbytes, path_keys
from kvtier.tiers.remote.local import LocalCluster, have_redis

BIG = KVLayout("Llama-3.1-8B", 32, 8, 128, "bfloat16", 16)  # 2 MiB blocks
SMALL = KVLayout("Llama-3.1-8B-1L", 1, 8, 128, "bfloat16", 16)  # 64 KiB blocks
HASHER = BlockHasher()


@contextmanager
def cluster_nodes(nodes: str | None) -> Iterator[list[str]]:
    if nodes:
        yield nodes.split(",")
        return
    if not have_redis():
        sys.exit("redis-server is not installed (Debian: apt-get install redis-server)")
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-remote-") as tmp,
        LocalCluster(Path(tmp), primaries=3) as cluster,
    ):
        yield cluster.nodes


def workload(
    layout: KVLayout, count: int, group: int, round_: int
) -> tuple[list[list[bytes]], list[list[ValueMeta]], list[list[bytes]]]:
    """`count` blocks of one path, fresh for `round_`, cut in groups: keys, metas, payloads."""
    seed = HASHER.seed(layout.fingerprint, tenant_salt(f"bench-{round_}"))
    tokens = encode_tokens(list(range(count * layout.block_tokens)))
    ids = [bytes(i) for i in HASHER.split(HASHER.chain(seed, tokens, layout.block_tokens * 4))]
    keys = path_keys("kvtier-bench", ids, 0, count, group)
    parents = [seed, *ids[:-1]]
    metas = [
        ValueMeta(i, p, layout.fingerprint, layout.block_bytes)
        for i, p in zip(ids, parents, strict=True)
    ]
    # a payload of its own per block, as pool slots are: one shared buffer would stay in the
    # CPU's cache and flatter whichever side copies least
    payloads = [os.urandom(layout.block_bytes) for _ in range(count)]
    cut = range(0, count, group)
    return (
        [keys[g : g + group] for g in cut],
        [metas[g : g + group] for g in cut],
        [payloads[g : g + group] for g in cut],
    )


def raw_round(
    client: RedisCluster, keys: list[list[bytes]], payloads: list[list[bytes]]
) -> tuple[float, float]:
    start = time.perf_counter()
    for group_keys, group_values in zip(keys, payloads, strict=True):
        pipe = client.pipeline()
        for key, value in zip(group_keys, group_values, strict=True):
            pipe.set(key, value)
        pipe.execute()
    put = time.perf_counter() - start
    start = time.perf_counter()
    for group_keys in keys:
        pipe = client.pipeline()
        for key in group_keys:
            pipe.get(key)
        got = pipe.execute()
        assert all(value is not None for value in got)
    get = time.perf_counter() - start
    return put, get


def tier_round(
    remote: RemoteCluster,
    keys: list[list[bytes]],
    metas: list[list[ValueMeta]],
    payloads: list[list[bytes]],
    buffers: list[bytearray],
) -> tuple[float, float]:
    """Put then get through the tier; values are encoded into `buffers`, reused per round trip
    as a writer's staging buffers would be."""
    start = time.perf_counter()
    for group_keys, group_metas, group_payloads in zip(keys, metas, payloads, strict=True):
        values = [
            encode_value_into(m, "none", p, out)
            for m, p, out in zip(group_metas, group_payloads, buffers, strict=False)
        ]
        assert all(remote.put(list(zip(group_keys, values, strict=True))))
    put = time.perf_counter() - start
    start = time.perf_counter()
    for group_keys, group_metas in zip(keys, metas, strict=True):
        assert all(got is not None for got in remote.get(group_keys, group_metas))
    get = time.perf_counter() - start
    return put, get


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="64 MiB per round, 3 rounds")
    parser.add_argument("--mib", type=int, default=256, help="MiB moved each way per round")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--group", type=int, default=16, help="blocks per pipelined round trip")
    parser.add_argument("--nodes", help="an existing cluster: host:port,... (else one is started)")
    args = parser.parse_args()
    mib, repeat = (64, 3) if args.quick else (args.mib, args.repeat)
    with cluster_nodes(args.nodes) as nodes:
        settings = ClusterSettings(tuple(nodes), timeout_s=5.0)
        remote = RemoteCluster(settings)
        raw = RedisCluster(
            startup_nodes=[ClusterNode(*parse_node(n)) for n in nodes],
            socket_connect_timeout=5.0,
            socket_timeout=5.0,
        )
        print(
            f"cluster: {len(nodes)} primaries {','.join(nodes)}; {mib} MiB each way per round, "
            f"{args.group} blocks per round trip, medians of {repeat} rounds (GB/s of payload)"
        )
        ratios = {}
        for layout, label in ((BIG, "2 MiB"), (SMALL, "64 KiB")):
            count = max(args.group, mib * 2**20 // layout.block_bytes)
            nbytes = count * layout.block_bytes
            figures: dict[str, list[float]] = {
                "raw put": [],
                "raw get": [],
                "tier put": [],
                "tier get": [],
            }
            value_bytes = header_nbytes(32, "none") + layout.block_bytes
            buffers = [bytearray(value_bytes) for _ in range(args.group)]
            for round_ in range(repeat):
                keys, metas, payloads = workload(layout, count, args.group, round_)
                put, get = raw_round(raw, keys, payloads)
                figures["raw put"].append(nbytes / put / 1e9)
                figures["raw get"].append(nbytes / get / 1e9)
                for group_keys in keys:  # one slot per group: one DEL each
                    raw.delete(*group_keys)
                put, get = tier_round(remote, keys, metas, payloads, buffers)
                figures["tier put"].append(nbytes / put / 1e9)
                figures["tier get"].append(nbytes / get / 1e9)
                for group_keys in keys:
                    remote.delete(group_keys)
            medians = {name: statistics.median(values) for name, values in figures.items()}
            print(
                f"{label:>7} blocks ({count} per round): raw put {medians['raw put']:6.2f} get "
                f"{medians['raw get']:6.2f}; tier put {medians['tier put']:6.2f} get "
                f"{medians['tier get']:6.2f}"
            )
            ratios[label] = (
                medians["tier put"] / medians["raw put"],
                medians["tier get"] / medians["raw get"],
            )
        stats = remote.stats()
        assert stats["errors"] == 0 and stats["verify_failures"] == 0, stats
        for label, (put_ratio, get_ratio) in ratios.items():
            print(
                f"tier / raw, {label:>6}: put {put_ratio:.2f}, get {get_ratio:.2f} (target >= 0.8)"
            )
        remote.close()
        raw.close()


if __name__ == "__main__":
    main()
