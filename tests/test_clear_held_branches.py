"""A clear or a reset drops every block no lease holds, also beside a held one (audit A): prompts
that share their first block (a system prompt) hang from one node, and a lease on that block
kept the whole subtree below it, every other prompt's blocks included (`reset` answered
`dropped_blocks` 0 and the tenant's pre-reset KV went on being served until the lease ended).
Now a held node stays with the nodes above it and what lies below it that is held, and every
branch off them goes (`index.helpers.unheld_subtrees`)."""

from __future__ import annotations

from pathlib import Path

import torch
from test_restart_audit_q import config  # block 4; gpu 64 KiB, host 256 KiB, disk 1 MiB

from kvtier import KVStore

TENANTS = ("a", "b")
SHARED = list(range(1000, 1004))  # one block of 4 tokens, first in every prompt


def prompt(branch: int, blocks: int = 3) -> list[int]:
    return SHARED + [branch * 100 + i for i in range(4 * (blocks - 1))]


def test_a_reset_drops_the_branches_beside_a_leased_shared_block(tmp_path: Path) -> None:
    with KVStore(config(tmp_path, TENANTS)) as store:
        for tenant in ("a", "b"):
            for branch in (1, 2, 3):
                store.store(prompt(branch), torch.randn(2, 2, 12, 2, 8), tenant=tenant)
        assert store.persist() == 14  # 7 blocks a tenant: the shared one and 3 branches of 2
        store.check()
        lease = store.prefetch(SHARED, tenant="a")  # a request reading the system prompt
        assert lease.num_tokens == 4
        reset = store.reset("a")
        assert (reset["dropped_blocks"], reset["left_blocks"]) == (6, 1), reset  # before: 0, 7
        store.check()
        assert [store.lookup(prompt(b), tenant="a").num_tokens for b in (1, 2, 3)] == [4, 4, 4]
        assert [store.lookup(prompt(b), tenant="b").num_tokens for b in (1, 2, 3)] == [12] * 3
        store.release(lease)
        assert store.reset("a") == {**reset, "dropped_blocks": 1, "left_blocks": 0}
        store.check()
        assert store.lookup(SHARED, tenant="a").num_tokens == 0


def test_a_clear_keeps_a_leased_branch_and_its_path_and_drops_the_rest(tmp_path: Path) -> None:
    with KVStore(config(tmp_path, TENANTS)) as store:
        for branch in (1, 2):
            store.store(prompt(branch), torch.randn(2, 2, 12, 2, 8), tenant="a")
        deeper = prompt(1, 5)  # branch 1 grown by two more blocks
        store.store(deeper, torch.randn(2, 2, 20, 2, 8), tenant="a")
        lease = store.prefetch(prompt(1), tenant="a")  # the shared block and branch 1's two
        assert store.clear("a") == 4  # branch 2's two blocks and the two grown below branch 1
        store.check()
        assert store.lookup(deeper, tenant="a").num_tokens == 12
        assert store.lookup(prompt(2), tenant="a").num_tokens == 4
        store.release(lease)
        assert store.clear() == 3
        store.check()
        assert store.lookup(deeper, tenant="a").num_tokens == 0
