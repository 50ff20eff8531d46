"""`Namespaces`: each tenant's namespace seed, and what a disk copy records about a block.

A tenant's blocks hang from its own root in the index, keyed by a seed derived from the model's
fingerprint and the tenant's salt (`hashing.tenant_salt`, keyed by the server secret): the same
tokens give other block ids in another namespace (DESIGN invariant 6). The seeds are fixed when
the store is built; nothing here changes afterwards.

`describe(index, ref)` is the metadata a disk copy of block `ref` carries (`BlockMeta`): its id,
its parent's id, its namespace seed, its tenant's identifier (never a secret) and its tokens.
The demoter, the mover and `persist` take this object rather than a callback into the store, so
calls run down the floors (STYLE 14).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvtier.errors import UnknownTenantError
from kvtier.hashing import BlockHasher, BlockId, tenant_salt
from kvtier.index import BlockRef, RadixIndex
from kvtier.tiers.disk import BlockMeta


class Namespaces:
    def __init__(
        self, tenants: Iterable[str], hasher: BlockHasher, fingerprint: bytes, secret: bytes
    ) -> None:
        """The seed of each of `tenants`, from the model's `fingerprint` and the server
        `secret` that keys the tenant salts."""
        self._seeds: dict[str, BlockId] = {
            tenant: hasher.seed(fingerprint, tenant_salt(tenant, secret)) for tenant in tenants
        }
        self._tenants: dict[bytes, str] = {seed: tenant for tenant, seed in self._seeds.items()}

    @property
    def seeds(self) -> Mapping[str, BlockId]:
        """Tenant -> namespace seed, for every configured tenant."""
        return self._seeds

    def seed(self, tenant: str) -> BlockId:
        """The namespace of `tenant`; `UnknownTenantError` naming the tenants there are."""
        seed = self._seeds.get(tenant)
        if seed is None:
            raise UnknownTenantError(
                f"tenant {tenant!r}: unknown, expected one of {sorted(self._seeds)}"
            )
        return seed

    def tenant_of(self, namespace: bytes) -> str | None:
        """The tenant whose namespace `namespace` is, or None (another server secret's, or a
        tenant no longer configured)."""
        return self._tenants.get(namespace)

    def describe(self, index: RadixIndex, ref: BlockRef) -> BlockMeta:
        """What a disk copy of block `ref` of `index` records about it."""
        kb = index.key_nbytes
        namespace = index.namespace_of(ref.node)
        return BlockMeta(
            block_id=index.block_id(ref),
            parent_id=index.parent_id(ref),
            namespace=namespace,
            tenant=self._tenants.get(namespace, ""),
            tokens=ref.node.key[ref.i * kb : (ref.i + 1) * kb],
        )
