"""Several threads on one store with a real disk tier: storing, looking up, loading,
prefetching and releasing, while the tiers overflow (gpu 6, host 8, disk 24 blocks) and blocks
demote to disk. Whatever any thread loads is bit-exact, `check()` holds throughout and at the
end, every lease is released or expires, and no thread hangs (every join is bounded).

Today the store serialises calls with one lock and demotes inline; the async mover (issue 4)
will run this same test with background demotion.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from conftest import DISK_BLOCK_BYTES, disk_config, kv_for, same

from kvtier.errors import CapacityError, LeaseError
from kvtier.store import KVStore

SECONDS = 4.0
SEQS = 12  # 3 blocks each, sharing a first block in threes


def tokens_of(seq: int) -> list[int]:
    return [900 + seq // 3] * 4 + [seq * 100 + j for j in range(8)]


def test_threads_store_lookup_prefetch_and_release_with_demotion_to_disk(tmp_path: Path) -> None:
    config = disk_config(
        tmp_path / "disk", capacity=24 * (DISK_BLOCK_BYTES + 4096), gpu_blocks=6, host_blocks=8
    )
    store = KVStore(config)
    reference = {seq: kv_for(store, 12, seed=seq) for seq in range(SEQS)}
    for seq in range(SEQS):  # shared first blocks must carry the same KV in every sequence
        reference[seq][:, :, :4] = reference[seq - seq % 3][:, :, :4]
    stop = time.monotonic() + SECONDS
    errors: list[BaseException] = []
    counts = {"stores": 0, "loads": 0, "leases": 0, "refused": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                seq = rng.randrange(SEQS)
                tokens, kv = tokens_of(seq), reference[seq]
                action = rng.random()
                if action < 0.35:
                    store.store(tokens, kv)
                    key = "stores"
                elif action < 0.7:
                    loaded = store.load(tokens)
                    n = loaded.num_tokens
                    assert store.lookup(tokens).num_tokens >= 0
                    assert same(loaded.kv, kv[:, :, :n]), f"sequence {seq}: wrong bytes served"
                    key = "loads"
                else:
                    try:
                        lease = store.prefetch(tokens, ttl_s=5.0)
                    except CapacityError:
                        key = "refused"
                    else:
                        table = store.gpu_pool.buffer[list(lease.block_table)]
                        n = lease.num_tokens
                        want = (
                            kv[:, :, :n].reshape(2, 2, n // 4, 4, 2, 64).permute(2, 0, 1, 3, 4, 5)
                        )
                        assert same(table, want), f"sequence {seq}: a leased page is wrong"
                        try:
                            store.release(lease)
                        except LeaseError:  # it can only have expired, and ttl is 5 s
                            raise AssertionError("a live lease vanished") from None
                        key = "leases"
                with lock:
                    counts[key] += 1
        except BaseException as exc:
            errors.append(exc)

    def checker() -> None:
        try:
            while time.monotonic() < stop:
                store.check()
                time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=checker))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SECONDS + 30)
        assert not thread.is_alive(), "a thread is stuck"
    assert not errors, errors[0]
    store.check()
    assert store.leases() == []
    status = store.status()
    assert status["tiers"]["disk"]["bytes_in"] > 0, "nothing reached disk: the test lost its point"
    assert counts["stores"] > 20 and counts["loads"] > 20 and counts["leases"] > 5, counts
    store.close()
