"""Copies counted per tier, in all and per namespace, and the fair-share floors they are held to.

`Residency` is the index's tally of where blocks live, kept incrementally, O(1) per change:
every edit of the index that sets or clears a slot field calls `add(namespace, tier, ±n)`, so

    resident(t)           == number of set `slots[t]` fields in the whole index
    resident_in(ns, t)    == the same, counted below the root of namespace `ns` only

    only_in(t)            == number of blocks whose slowest copy is in `t`

(`check.py` recounts them). `only_in(t)` of a memory tier is its dirty data: the copies that
must be written down before their slots can be freed without losing the block (a block whose
slowest copy is in `t` has no copy below it). Every edit that adds or removes a block's slowest
copy moves it with `slowest_moved(old, new)` (-1: no copy). A namespace appears in the
per-namespace table from its first copy until the index removes its last node (`forget`), when
every count must be back at zero.

Floors are the fair shares of DESIGN invariant 9 (`RadixIndex.set_floors`): a namespace holding
no more than its floor in a tier is protected there. `eviction.victims` ranks candidates by
them; `evictable_share` bounds, with the same rule, what one call may take. `add` keeps, per
tier, the copies above their namespace's floor summed (`above`: `evictable_share` in O(1)) and
the namespaces over their floor (`over`: a pass starts from them and the owner, not from every
namespace). Before, each make-room summed over every tenant and each pass ranked every one:
with 2,000 tenants, tiny KV and evictions on each call, `store()` p50 1.23 ms, now 0.28
(100 tenants: 0.243 -> 0.188; one: 0.09 either way).

A floor counts what a namespace holds in the tier outside the index too: the slots its
reservations hold (live, and in quarantine: `hold`, which the reservation table calls) come off
the floor its cached copies get (`floors` is the floor left, never below 0; `set_floors` the
configured one). Before, a floor protected cached copies only while a quota bounded reserved
slots only, so with the default split (floor = quota = slots / n) a tenant held its floor's
worth of cached copies and its quota's worth of reservations: with two tenants, the whole tier,
and the other's prefetches and stores found no room (DESIGN invariant 9: no tenant pins a tier).
"""

from __future__ import annotations

from collections.abc import Sequence


class Residency:
    def __init__(self, num_tiers: int) -> None:
        self._num_tiers = num_tiers
        self._resident = [0] * num_tiers
        self._ns_resident: dict[bytes, list[int]] = {}  # namespace -> copies per tier
        self._only = [0] * num_tiers  # blocks by the tier of their slowest copy
        self.floors: dict[bytes, tuple[int, ...]] = {}  # namespace -> floor left per tier
        self._configured: dict[bytes, tuple[int, ...]] = {}  # (`set_floors`)
        self._held: dict[bytes, list[int]] = {}  # namespace -> reserved slots per tier (`hold`)
        self._above = [0] * num_tiers  # with floors: copies above them, summed (`above`)
        self._over: list[set[bytes]] = [set() for _ in range(num_tiers)]  # (`over`)

    def add(self, namespace: bytes, tier: int, delta: int) -> None:
        """`delta` copies in `tier` of blocks of `namespace` (negative: copies gone)."""
        self._resident[tier] += delta
        counts = self._ns_resident.get(namespace)
        if counts is None:
            counts = self._ns_resident[namespace] = [0] * self._num_tiers
        before = counts[tier]
        counts[tier] = now = before + delta
        if self.floors:  # the namespace's copies above its floor, as `above` and `over` say
            floor = self.floors.get(namespace)
            level = floor[tier] if floor is not None else 0
            self._moved(namespace, tier, before - level, now - level)

    def slowest_moved(self, old: int, new: int, count: int = 1) -> None:
        """`count` blocks' slowest copy went from tier `old` to `new` (-1: no copy)."""
        if old >= 0:
            self._only[old] -= count
        if new >= 0:
            self._only[new] += count

    def slowest_counted(self, counts: Sequence[int], sign: int) -> None:
        """Blocks counted by the tier of their slowest copy (`slowest_counts`) gained (sign
        +1) or lost (-1) that copy as their slowest."""
        only = self._only
        for tier, count in enumerate(counts):
            only[tier] += sign * count

    def only_in(self, tier: int) -> int:
        """Blocks whose slowest copy is in `tier`: its copies with nothing below them."""
        return self._only[tier]

    def forget(self, namespace: bytes) -> None:
        """`namespace` holds no block any more: drop its (zero) counts."""
        counts = self._ns_resident.pop(namespace, None)
        assert counts is None or not any(counts), f"an empty namespace holds {counts}"

    def resident(self, tier: int) -> int:
        """Number of blocks with a copy in `tier`."""
        return self._resident[tier]

    def resident_in(self, namespace: bytes, tier: int) -> int:
        """Number of blocks of `namespace` with a copy in `tier`."""
        counts = self._ns_resident.get(namespace)
        return counts[tier] if counts is not None else 0

    def namespaces_resident(self) -> dict[bytes, tuple[int, ...]]:
        """Copies per tier of every namespace that holds blocks."""
        return {namespace: tuple(counts) for namespace, counts in self._ns_resident.items()}

    def locked_share(self, tier: int, owner: bytes | None, locked: dict[bytes, int]) -> int:
        """How many of `evictable_share(tier, owner)`'s copies are locked (`locked`: locked
        copies per namespace, `helpers.locked_by_namespace`), so that no pass can offer them:
        all of `owner`'s locked ones, and of another namespace those its unlocked copies above
        its floor fall short by. Without it, `can_make_room` counted the owner's leased blocks
        as room and a call demoted other tenants' blocks before it found it could not fit.
        O(namespaces holding locks)."""
        cut = 0
        for namespace, count in locked.items():
            if namespace == owner:
                cut += count
                continue
            floor = self.floors.get(namespace)
            resident = self.resident_in(namespace, tier)
            give = max(0, resident - (floor[tier] if floor is not None else 0))
            cut += give - min(give, resident - count)
        return cut

    def set_floors(self, floors: dict[bytes, tuple[int, ...]]) -> None:
        """Each namespace's floor per tier, in blocks (absent: 0). Empty: plain LRU. What its
        reservations hold comes off it (`hold`)."""
        self._configured = dict(floors)
        self.floors = {namespace: self._floor_left(namespace) for namespace in floors}
        self._above = [self.above(tier, recount=True) for tier in range(self._num_tiers)]
        self._over = [self.over(tier, recount=True) for tier in range(self._num_tiers)]

    def hold(self, namespace: bytes, tier: int, delta: int) -> None:
        """`delta` slots of `tier` held for `namespace` outside the index (a reservation's,
        live or quarantined; negative: freed or published): its floor there moves the other
        way (module doc). O(1)."""
        held = self._held.get(namespace)
        if held is None:
            held = self._held[namespace] = [0] * self._num_tiers
        held[tier] += delta
        assert held[tier] >= 0, f"namespace {namespace.hex()}: {held[tier]} held in tier {tier}"
        if not any(held):
            del self._held[namespace]
        if namespace not in self._configured:
            return
        before = self.floors[namespace][tier]
        self.floors[namespace] = floor = self._floor_left(namespace)
        resident = self.resident_in(namespace, tier)
        self._moved(namespace, tier, resident - before, resident - floor[tier])

    def _moved(self, namespace: bytes, tier: int, before: int, now: int) -> None:
        """`namespace`'s copies in `tier` less its floor went from `before` to `now`: `above`
        and `over` follow."""
        self._above[tier] += max(0, now) - max(0, before)
        if (now > 0) != (before > 0):
            if now > 0:
                self._over[tier].add(namespace)
            else:
                self._over[tier].discard(namespace)

    def held(self) -> dict[bytes, tuple[int, ...]]:
        """The slots per tier each namespace's reservations hold (`hold`), as told."""
        return {namespace: tuple(held) for namespace, held in self._held.items()}

    def _floor_left(self, namespace: bytes) -> tuple[int, ...]:
        configured, held = self._configured[namespace], self._held.get(namespace)
        if held is None:
            return configured
        return tuple(max(0, floor - h) for floor, h in zip(configured, held, strict=True))

    def over(self, tier: int, recount: bool = False) -> set[bytes]:
        """With floors: the namespaces holding more copies in `tier` than their floor (absent:
        0), the ones whose candidates rank first (`eviction.py`); kept by `add`, `recount`
        finds them again, O(namespaces). The caller does not change the set."""
        if not recount:
            return self._over[tier]
        over = set()
        for namespace, counts in self._ns_resident.items():
            floor = self.floors.get(namespace)
            if counts[tier] > (floor[tier] if floor is not None else 0):
                over.add(namespace)
        return over

    def above(self, tier: int, recount: bool = False) -> int:
        """Copies in `tier` above their namespace's floor, summed over namespaces (kept by
        `add`; `recount` sums them again, O(namespaces), as `check` does)."""
        if not recount:
            return self._above[tier]
        total = 0
        for namespace, counts in self._ns_resident.items():
            floor = self.floors.get(namespace)
            total += max(0, counts[tier] - (floor[tier] if floor is not None else 0))
        return total

    def evictable_share(
        self, tier: int, owner: bytes | None, locked: dict[bytes, int] | None = None
    ) -> int | None:
        """With floors set: the most copies of `tier` that `victims(tier, owner)` may offer
        (every namespace's copies above its floor, and all of `owner`'s); None without floors.
        O(1): the sum above floors is kept (`above`). With `locked` (`locked_share`), the locked
        copies no pass offers are left out too (O(namespaces holding locks)); without it the
        caller bounds by the locks itself, as a total (which does not say whose they are)."""
        if not self.floors:
            return None
        cut = self.locked_share(tier, owner, locked) if locked else 0
        counts = self._ns_resident.get(owner) if owner is not None else None
        if counts is None:
            return self._above[tier] - cut
        floor = self.floors.get(owner)  # type: ignore[arg-type]
        level = floor[tier] if floor is not None else 0
        return self._above[tier] - max(0, counts[tier] - level) + counts[tier] - cut
