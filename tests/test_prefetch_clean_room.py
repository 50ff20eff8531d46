"""A prefetch never waits, so under write_through it made the host staging room for the disk
blocks it brings up (their kept host copies) by dropping host blocks not yet written to disk,
with the disk idle (audit AX: 2 of 8). Where host has no room freeable without such a drop, a
CPU gpu pool now reads the disk blocks straight in and keeps no host copy, as write_back does
(a CUDA pool must stage: there the drop stays, documented)."""

from __future__ import annotations

from pathlib import Path

from test_mover_audit_AX import assert_whole, disk_only_prefix, open_store


def test_a_prefetch_under_write_through_drops_no_unwritten_host_block(tmp_path: Path) -> None:
    with open_store(tmp_path, "write_through", gpu=8, host=8) as store:
        p, others = disk_only_prefix(store, evict_others=False)
        status = store.status()["tiers"]["host"]
        assert status["free_slots"] == 0 and status["dirty_blocks"] > 0
        hit = store.lookup(p)
        assert (hit.num_tokens, hit.disk_tokens) == (2 * 4, 2 * 4)

        lease = store.prefetch(p)
        lease.wait(10)
        assert lease.num_tokens == len(p)
        store.release(lease)
        assert store.drain(10)
        store.check()
        assert store.status()["mover"]["backpressure_drops"] == 0  # was 2
        for tokens in (p, *others):
            assert_whole(store, tokens)
        store.check()
