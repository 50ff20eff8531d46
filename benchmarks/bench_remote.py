"""The remote tier's put and get against raw pipelined SET/GET of the same bytes (issue 14).

A Redis Cluster of 3 primaries (Debian's `redis-server`, started here on loopback ports by
`tests/redis_cluster.py`, or the one named by `--nodes`). For 2 MiB blocks (Llama-3.1-8B
geometry: 32 layers, 8 KV heads, head_dim 128, bf16, 16 tokens) and 64 KiB blocks, each round
moves `--mib` MiB both ways, twice:

- raw: redis-py's `RedisCluster`, one pipeline of `SET` per group of `--group` blocks (keys of
  one hash tag, as the tier's), then one pipeline of `GET` per group; the values are the bare
  payloads;
- tier: `RemoteCluster.put` of the same groups, each value encoded in the timed loop as the
  tier's writer encodes it (`entry.encode_value_parts`: header, xxh3-128 of the payload; the
  payload is sent from where it lies, after the header, not copied), then `RemoteCluster.get`,
  each value verified (`decode_value`: both checksums, the expected ids) in the timed loop.

Every block has a payload of its own (as pool slots do): one shared buffer would stay in the
CPU's cache and flatter whichever side copies least.

Both use one client with the same timeouts; every round uses fresh keys (each side its own) and
deletes them after, so `SET NX` never skips. Raw and tier alternate group by group, each going
first on every other group: the two clients share 2 cores with the cluster, and a side that ran
its whole round first measured 10-30% slower, whichever side it was. Figures are medians of
`--repeat` rounds, GB/s of payload bytes (1e9). The last lines give tier / raw for put and get
(issue 14's target: 0.8 or more). `--authenticate`: the tier's values carry MACs (HMAC-SHA256
of the header and the payload, `tiers.remote.authenticate`) instead of xxh3 checksums.
Run: `python benchmarks/bench_remote.py [--quick] [--mib N] [--repeat N] [--nodes h:p,...]
[--authenticate]`.
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
from kvtier.tiers.remote.entry import ValueMeta, encode_value_parts, mac_key_of, path_keys
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
    layout: KVLayout, count: int, group: int, round_: int, mac_key: bytes | None = None
) -> tuple[list[list[bytes]], list[list[ValueMeta]], list[list[bytes]]]:
    """`count` blocks of one path, fresh for `round_`, cut in groups: keys, metas, payloads."""
    seed = HASHER.seed(layout.fingerprint, tenant_salt(f"bench-{round_}"))
    tokens = encode_tokens(list(range(count * layout.block_tokens)))
    ids = [bytes(i) for i in HASHER.split(HASHER.chain(seed, tokens, layout.block_tokens * 4))]
    keys = path_keys("kvtier-bench", ids, 0, count, group)
    parents = [seed, *ids[:-1]]
    metas = [
        ValueMeta(i, p, layout.fingerprint, layout.block_bytes, mac_key)
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


class Raw:
    """One group at a time through redis-py's pipelines, the values bare payloads."""

    def __init__(self, client: RedisCluster, layout: KVLayout, count: int, group: int, seed: int):
        self.client = client
        self.keys, _, self.payloads = workload(layout, count, group, seed)

    def put(self, g: int) -> None:
        pipe = self.client.pipeline()
        for key, value in zip(self.keys[g], self.payloads[g], strict=True):
            pipe.set(key, value)
        pipe.execute()

    def get(self, g: int) -> None:
        pipe = self.client.pipeline()
        for key in self.keys[g]:
            pipe.get(key)
        assert all(value is not None for value in pipe.execute())


class Tier:
    """One group at a time through `RemoteCluster`, each value encoded as the tier's writer
    does (`encode_value_parts`) and verified when read."""

    def __init__(
        self,
        remote: RemoteCluster,
        layout: KVLayout,
        count: int,
        group: int,
        seed: int,
        mac_key: bytes | None,
    ):
        self.remote = remote
        self.keys, self.metas, self.payloads = workload(layout, count, group, seed, mac_key)

    def put(self, g: int) -> None:
        values = [
            encode_value_parts(m, "none", p)
            for m, p in zip(self.metas[g], self.payloads[g], strict=True)
        ]
        assert all(self.remote.put(list(zip(self.keys[g], values, strict=True))))

    def get(self, g: int) -> None:
        got = self.remote.get(self.keys[g], self.metas[g])
        assert all(value is not None for value in got)


def interleaved(raw: Raw, tier: Tier, op: str) -> tuple[float, float]:
    """Seconds `raw` and `tier` spend on `op` ("put" or "get") of every group, the two sides
    alternating group by group, each first on every other group."""
    spent = {"raw": 0.0, "tier": 0.0}
    sides = {"raw": raw, "tier": tier}
    for g in range(len(raw.keys)):
        for side in ("raw", "tier") if g % 2 == 0 else ("tier", "raw"):
            call = getattr(sides[side], op)
            start = time.perf_counter()
            call(g)
            spent[side] += time.perf_counter() - start
    return spent["raw"], spent["tier"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="64 MiB per round, 3 rounds")
    parser.add_argument("--mib", type=int, default=256, help="MiB moved each way per round")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--group", type=int, default=16, help="blocks per pipelined round trip")
    parser.add_argument("--nodes", help="an existing cluster: host:port,... (else one is started)")
    parser.add_argument("--authenticate", action="store_true", help="MACs, not checksums")
    args = parser.parse_args()
    mib, repeat = (64, 3) if args.quick else (args.mib, args.repeat)
    mac_key = mac_key_of(b"bench-remote-cluster-secret") if args.authenticate else None
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
            f"; the tier's values {'with MACs' if mac_key else 'with xxh3 checksums'}"
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
            for round_ in range(repeat):
                raw_side = Raw(raw, layout, count, args.group, 2 * round_)
                tier_side = Tier(remote, layout, count, args.group, 2 * round_ + 1, mac_key)
                for op in ("put", "get"):
                    raw_s, tier_s = interleaved(raw_side, tier_side, op)
                    figures[f"raw {op}"].append(nbytes / raw_s / 1e9)
                    figures[f"tier {op}"].append(nbytes / tier_s / 1e9)
                for group_keys in raw_side.keys + tier_side.keys:  # a group is one slot
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
