"""Write policies: when a block gets a copy in the next slower tier (DESIGN "Movement policy").

A table of small strategies, chosen by `policy.write` in the config:

| policy          | copy to host when stored | when hit N times | when demoted              |
|-----------------|--------------------------|------------------|---------------------------|
| `write_through` | yes                      |                  | yes, if no copy below yet |
| `write_back`    | no                       |                  | yes                       |
| `selective`     | no                       | yes (1)          | only if hit N times (2)   |

(1) N = `selective_hits`; the copy is made by the load or prefetch that reaches N.
(2) a colder leaf is dropped instead.

A block that cannot be dropped (it has children still cached) is always copied down.
In a store without a host tier (`tiers.host: null`) there is nothing to copy to: every policy
is then `without_host()` (its name kept), and gpu victims are dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class WritePolicy:
    name: str
    copy_on_store: bool
    min_hits_to_keep: int  # a demoted block with fewer hits is dropped, if it is a leaf
    copy_on_hits: int | None = None  # a gpu block hit this many times gets its host copy

    def without_host(self) -> WritePolicy:
        """This policy in a store without a host tier: no host copy on store or on hits."""
        return dataclasses.replace(self, copy_on_store=False, copy_on_hits=None)


def write_policy(name: str, selective_hits: int) -> WritePolicy:
    """The strategy for a validated `policy.write` value."""
    table = {
        "write_through": WritePolicy("write_through", copy_on_store=True, min_hits_to_keep=0),
        "write_back": WritePolicy("write_back", copy_on_store=False, min_hits_to_keep=0),
        "selective": WritePolicy(
            "selective",
            copy_on_store=False,
            min_hits_to_keep=selective_hits,
            copy_on_hits=selective_hits,
        ),
    }
    return table[name]
