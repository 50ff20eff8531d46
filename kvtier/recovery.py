"""Rebuilding the index from the disk tier when a store starts (DESIGN invariants 2 and 7).

    scan every slot's header  ->  keep valid copies of this layout  ->  newest copy per block id
      ->  group by namespace (tenants this store knows)  ->  `restore_namespace` (ids re-hashed)
      ->  claim the restored slots; every other slot is free

What is not restored is counted, never served: torn or damaged headers (`corrupt`), another
layout's copies (`foreign`), copies a capacity lowered since the last start cut away with its
slots, by slot position whatever they held (`cut`, logged once at start), namespaces of
tenants this store does not know or of another server secret (`unknown_namespace`), older
copies of a block id (`duplicates`), copies whose parent is missing (`orphans`), and copies
whose id is not the hash of their parent id and tokens (`bad_ids`). Payloads are verified
when read (a recovered copy that fails its checksum then is dropped and counted), so recovery
reads only the header regions: seconds for 100k blocks.

Duplicates, orphans and bad ids are retired at once, durably (`DiskTier.free_durably`; a
refusal is counted in the tier's faults): no later start may bring them back. Left on disk as
free slots, they did: a duplicate outlived a durable `clear` of its block (the clear retires
the copy the index holds) and came back at the next start, and an orphan came back as soon as
its parent was stored again. Copies of unknown namespaces are left as they are (a tenant taken
out of the config and put back finds them), as are corrupt and foreign slots (nothing can
bring those back); all of them are free slots, overwritten as the tier needs room. The tier
notes the unknown namespaces' copies by the tenant id in their headers (`DiskTier.keep`): a
clear or reset of that tenant (of every tenant, for a clear of all) retires them durably
(`operations.py`), else a config rolled back (hash algorithm, secret) would serve KV from
before the reset.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from kvtier.blocks import BlockId
from kvtier.index import RadixIndex
from kvtier.index.restore import RestoreEntry, restore_namespace
from kvtier.tenancy import Namespaces
from kvtier.tiers.base import DISK
from kvtier.tiers.disk import DiskTier, ScannedCopy

log = logging.getLogger("kvtier.disk")


def recover(disk: DiskTier, index: RadixIndex, namespaces: Namespaces) -> dict[str, float]:
    """Restore the empty `index` from `disk`, keeping the namespaces of known tenants only;
    return what was found, by kind."""
    assert index.num_blocks == 0
    start = time.perf_counter()
    if disk.cut_copies:
        log.warning(
            "disk tier %s: the capacity lowered to %d slots cut %d copies past them",
            disk.location,
            disk.num_slots,
            disk.cut_copies,
        )
    report = disk.scan()
    newest: dict[bytes, ScannedCopy] = {}
    for copy in report.copies:
        held = newest.get(copy.header.block_id)
        if held is None or copy.header.seq > held.header.seq:
            newest[copy.header.block_id] = copy
    counts: dict[str, float] = {
        "slots_scanned": disk.num_slots,
        "recovered": 0,
        "empty": report.empty,
        "corrupt": report.corrupt,
        "foreign": report.foreign,
        "cut": disk.cut_copies,
        "duplicates": len(report.copies) - len(newest),
        "unknown_namespace": 0,
        "orphans": 0,
        "bad_ids": 0,
    }
    by_namespace: dict[bytes, list[RestoreEntry]] = defaultdict(list)
    kept: dict[int, str] = {}
    for copy in newest.values():
        header = copy.header
        if namespaces.tenant_of(header.namespace) is None:
            counts["unknown_namespace"] += 1
            kept[copy.slot] = header.tenant
            continue
        by_namespace[header.namespace].append(
            RestoreEntry(header.block_id, header.parent_id, header.tokens, {DISK: copy.slot})
        )
    claimed: list[int] = []
    stale = [copy.slot for copy in report.copies if newest[copy.header.block_id] is not copy]
    for namespace, entries in by_namespace.items():
        restored = restore_namespace(index, BlockId(namespace), entries)
        claimed.extend(entry.slots[DISK] for entry in restored.restored)
        stale.extend(entry.slots[DISK] for entry in restored.orphans + restored.bad_ids)
        counts["orphans"] += len(restored.orphans)
        counts["bad_ids"] += len(restored.bad_ids)
    disk.claim(claimed + stale)
    if stale:
        disk.free_durably(stale)
    disk.keep(kept)
    counts["recovered"] = len(claimed)
    counts["seconds"] = round(time.perf_counter() - start, 3)
    return counts
