"""KVStore with a real disk tier against the reference model: the rules of
`test_store_stateful.py` plus persist, restart (close and recover from the same directory) and
disk eviction, on gpu 3 / host 4 / disk 12 blocks, so blocks travel through every tier.

What must hold after every step: `check()`; whatever is reported cached loads bit-exact as the
reference says; after a restart, every block that had a disk copy is still cached, and nothing
the memory tiers held alone is.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from conftest import DISK_BLOCK_BYTES, disk_config
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from test_store_stateful import BT, StoreMachine, letters, tails, tokens_of

from kvtier.blocks import encode_tokens
from kvtier.store import KVStore

DISK = 2


class DiskStoreMachine(StoreMachine):
    @initialize(write=st.sampled_from(["write_through", "write_back", "selective"]))
    def build(self, write: str) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="kvtier-stateful-"))
        self.config = disk_config(
            self.directory / "disk",
            capacity=12 * (DISK_BLOCK_BYTES + 4096),
            gpu_blocks=3,
            host_blocks=4,
            write=write,
        )
        self.store = KVStore(self.config, clock=lambda: self.now[0])

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(self.directory, ignore_errors=True)

    @rule()
    def persist(self) -> None:
        written = self.s.persist()
        disk = self.s.status()["tiers"]["disk"]
        assert written >= 0 and disk["blocks"] <= disk["slots"]

    @rule(blocks=letters, tail=tails)
    def restart(self, blocks: list[int], tail: list[int]) -> None:
        tokens = tokens_of(blocks, tail)
        on_disk = self._disk_prefix(tokens)
        self.s.close()
        self.held.clear()  # leases do not survive the process,
        self.released.clear()  # and a new store numbers its leases afresh
        self.store = KVStore(self.config, clock=lambda: self.now[0])
        recovered = self.s.index.num_blocks
        assert recovered == self.s.status()["tiers"]["disk"]["blocks"]
        assert self.s.lookup(tokens).num_tokens >= on_disk
        assert self.verify_cached(tokens) >= on_disk

    @rule(n=st.integers(0, 6))
    def evict_disk(self, n: int) -> None:
        used = self.s.disk.num_used if self.s.disk else 0
        freed = self.s.evict("disk", n)
        assert 0 <= freed <= n and self.s.disk is not None and self.s.disk.num_used == used - freed

    def _disk_prefix(self, tokens: list[int]) -> int:
        """Leading tokens of `tokens` whose blocks all have a disk copy (they survive)."""
        index = self.s.index
        match = index.match(self.s.namespaces.seed("default"), encode_tokens(tokens))
        count = 0
        for ref in index.blocks(match.end):
            if ref.node.slots[DISK][ref.i] is None:
                break
            count += BT
        return count


DiskStoreMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
test_disk_store_against_reference = DiskStoreMachine.TestCase
