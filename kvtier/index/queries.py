"""`RadixIndex`'s eviction queries (floors, victims, candidates), a part of its own: the
index's fair shares and recency queues (`eviction.py`, `node.Residency`) read through it."""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.index.eviction import CandidateSets, victim_runs, victims
from kvtier.index.node import BlockRef, Node, VictimRun
from kvtier.index.residency import Residency


class EvictionQueries:
    """Mixed into `RadixIndex`, whose candidate sets and residency these read."""

    _candidates: CandidateSets
    residency: Residency

    @property
    def floors(self) -> dict[bytes, tuple[int, ...]]:
        """Each namespace's floor per tier (`set_floors`)."""
        return self.residency.floors

    def set_floors(self, floors: dict[bytes, tuple[int, ...]]) -> None:
        """Fair shares: each namespace's floor per tier, in blocks (absent: 0). Empty: plain
        LRU, as with a single tenant. A namespace holding no more than its floor in a tier is
        protected there (see `eviction.victims`)."""
        self.residency.set_floors(floors)

    def victims(self, tier: int, owner: bytes | None = None) -> Iterator[BlockRef]:
        """Least-recently-used leaves of `tier`, never locked; with floors set, first those of
        namespaces above their floor, then `owner`'s own (see `eviction.victims`)."""
        return victims(self._candidates, self.residency, tier, owner)

    def victim_runs(self, tier: int, owner: bytes | None = None) -> Iterator[VictimRun]:
        """The victims of `victims(tier, owner)`, in the same order, as runs of blocks of one
        node; after a run the caller frees a suffix of it (`eviction.victim_runs`)."""
        return victim_runs(self._candidates, self.residency, tier, owner)

    def candidates(self, tier: int) -> dict[Node, int]:
        """The nodes offering a `tier` victim, with their entry stamps; the live set."""
        return self._candidates.of(tier)

    def unqueued(self, tier: int) -> int:
        """Candidates of `tier` missing from its recency queue (none, when consistent)."""
        return self._candidates.queue(tier).unqueued()
