"""Assembly: a store's parts, built from its config (the composition root).

`Parts(config, ...)` first runs every check that can refuse the config (`preflight.py`: tenant
shares against the planned tier sizes, codecs, the events topic; the remote tier's keys and TLS
files), so that a refused config creates and cuts nothing on disk; then it binds the KV events'
addresses (one taken refuses the config before a disk tier is opened); then it makes, in
dependency order: the pools (gpu, host[, disk]; in POSIX shared memory for a sidecar; with
`tiers.host: null` a host tier of no slots, `NoHostPool`, and the write policy `without_host`),
the index, the namespaces (tenant <-> seed), the cache's shared state (`transfer/shared.py`),
fair shares, the executors (the inline one for copies made inside a call; a thread or CUDA
executor for the background), the demoter, the disk reader, the recovered index (when there is
a disk tier), the reservation table, the mover, the write path, and the index's observer that
feeds the events. Every part takes the parts it uses, never the store; `KVStore` (`store.py`)
holds the result and calls into it. A failed assembly closes the publisher and the tiers it made
(their shared memory unlinked) before the error propagates.
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Callable

import torch

from kvtier.blocks import BlockHasher, BlockId, KVLayout
from kvtier.config import KVTierConfig
from kvtier.config.fields import resolve_key
from kvtier.config.tiers import (
    DiskTierConfig,
    HostTierConfig,
    RemoteTierConfig,
    RemoteTlsConfig,
)
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.events import EventPublisher, EventSettings, IndexEvents
from kvtier.events.peers import BindError
from kvtier.index import RadixIndex
from kvtier.policy import write_policy
from kvtier.preflight import Free, Plan, events_topic, preflight
from kvtier.recovery import recover
from kvtier.shares import TenantShares, TierRoom
from kvtier.status import TenantCounters
from kvtier.tenancy import Namespaces, ReservationTable
from kvtier.tiers import (
    GpuPool,
    HostPool,
    NoHostPool,
    SlotPool,
    available_host_bytes,
    free_device_bytes,
)
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.codec import Codec, QuantBytes, tier_codec
from kvtier.tiers.gpu import resolve_device
from kvtier.tiers.quantized import QuantPool
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster, TlsSettings
from kvtier.tiers.remote.entry import mac_key_of
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.remote.writer import RemoteWriter
from kvtier.tiers.shm import segment_prefix
from kvtier.transfer import InlineExecutor
from kvtier.transfer.background import BackgroundSettings
from kvtier.transfer.copy import Ledger
from kvtier.transfer.demotion import Demoter
from kvtier.transfer.mover import Mover, MoverSettings
from kvtier.transfer.prefetch import PrefetchSettings
from kvtier.transfer.reads import DiskReader
from kvtier.transfer.remote import RemoteLink
from kvtier.transfer.shared import CacheState, Executor
from kvtier.transfer.threads import ThreadExecutor
from kvtier.writes import Writes


class Parts:
    """Everything a store is made of (module doc). `executor` runs copies made inside a call;
    the mover's executor runs the background ones. Built in dependency order; a construction
    that fails closes the tiers it made."""

    def __init__(
        self,
        config: KVTierConfig | None = None,
        secret: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
        executor: Executor | None = None,
        shared_memory: str | None = None,
    ) -> None:
        config = config if config is not None else KVTierConfig()  # the embedded defaults
        if executor is not None and not config.mover.background:
            raise InvalidArgumentError(
                "executor: given, but mover.background is false (copies run in the caller)"
            )
        # every check that can refuse the config, before a tier is made: a disk tier opened
        # at a lower capacity cuts its slabs (`preflight.py`)
        device = resolve_device(config.tiers.gpu.device)
        free = Free(free_device_bytes(device), available_host_bytes())
        if device.type == "cpu":  # a gpu tier in host memory: host's fraction is of the rest
            gpu = config.tiers.gpu.capacity.resolve(free.gpu)
            free = Free(free.gpu, max(0, free.host - gpu), gpu)
        plan = preflight(config, free)
        remote = config.tiers.remote
        if remote is not None:
            if remote.secret is not None:  # nodes that share it share salts
                secret = resolve_key(remote.secret, "tiers.remote.secret").encode()
            if remote.password is not None:
                resolve_key(remote.password, "tiers.remote.password")
            _tls_settings(remote.tls)  # its files loaded now, again when the cluster is made
        made: list[Tier] = []
        publisher = None
        try:  # the events' addresses bound first: one taken refuses before a disk is cut
            publisher = self.events = _publisher(config)
            pools = _pools(config, plan, shared_memory, made)
            self._build(config, secret, clock, executor, (plan, pools))
        except BaseException:
            if publisher is not None:
                publisher.close()
            for tier in made:
                tier.close()
            raise

    def _build(
        self,
        config: KVTierConfig,
        secret: bytes,
        clock: Callable[[], float],
        executor: Executor | None,
        planned: tuple[Plan, list[Tier]],
    ) -> None:
        self.config = config
        plan, pools = planned
        hasher = BlockHasher(config.hashing.algorithm)
        index = RadixIndex(config.tier_names, config.layout.block_tokens, hasher)
        self.namespaces = Namespaces(config.tenants, hasher, config.layout.fingerprint, secret)
        self.state = state = CacheState(index, pools, self.namespaces)
        # fair shares (shares.py): floors steer eviction, quotas bound what a tenant holds; the
        # rooms `preflight` checked (all known here), with the slots made: a disk tier short of
        # room has fewer than planned
        rooms = []
        for pool, room in zip(pools, plan.rooms, strict=True):
            assert room is not None  # planned with the memory free here: every room known
            rooms.append(TierRoom(pool.num_slots, room.slot_bytes))
        self.shares = TenantShares(config, rooms)
        index.set_floors(self.shares.floors(self.namespaces.seeds))
        policy = write_policy(config.policy.write, config.policy.selective_hits)
        self.policy = policy = policy if config.tiers.host is not None else policy.without_host()
        ledger = Ledger() if executor is None else executor.ledger  # one count of every copy
        self.executor = inline = InlineExecutor(ledger)  # copies made inside a call
        background = executor or _background_executor(config, state, inline)
        admission = [0, policy.min_hits_to_keep, config.policy.disk_admission_hits]
        holds: list[Callable[[int], int]] = []  # flights' and reservations' slots, set below
        self.demoter = Demoter(
            state,
            # room made inside a call: on CUDA through the copy streams (the engine's marks)
            background.in_call_runner(inline),
            admission,
            reserved=lambda tier: sum(held(tier) for held in holds),
            sync_disk=not config.mover.background,
        )
        self.reader = DiskReader(index, pools, inline, state.ops)
        self.recovery = (
            recover(state.disk, index, self.namespaces) if state.disk is not None else {}
        )
        quarantine_s = config.policy.reservation_quarantine_s  # reserved slots off the floors:
        self.reservations = ReservationTable(  # no tenant pins a tier (`residency.py`)
            [state.gpu, state.host], index.leases, clock, quarantine_s, index.residency
        )
        tiers = [t for t in (config.tiers.gpu, config.tiers.host) if t is not None]
        settings = MoverSettings(
            background=config.mover.background,
            prefetch=PrefetchSettings(
                config.mover.layer_groups, policy.copy_on_store, config.mover.lift_on_lookup
            ),
            work=BackgroundSettings(
                [(t.high_watermark, t.low_watermark) for t in tiers],
                admission,
                background=config.mover.background,
            ),
            store_wait_s=config.mover.store_wait_s,
        )
        self.mover = Mover(self.demoter, background, clock, settings)
        holds.extend((self.mover.reserved, self.reservations.held))
        self.writes = Writes(
            state, self.demoter, self.mover, self.shares, self.reservations, policy, inline
        )
        self.remote = _remote_link(config, state, self.writes)
        self.writes.remote = self.remote
        if self.events is not None:  # after recovery: no replayed past
            _observe(self.events, state, self.namespaces)
        self.tenant_counters = {
            tenant: TenantCounters(len(pools)) for tenant in self.namespaces.seeds
        }

    @property
    def pools(self) -> list[Tier]:
        return list(self.state.pools)

    @property
    def memory(self) -> list[SlotPool]:
        """The memory tiers present: gpu, and host unless the store has none."""
        return [pool for pool in (self.state.gpu, self.state.host) if pool.num_slots]


def _pools(
    config: KVTierConfig, plan: Plan, shared_memory: str | None, made: list[Tier]
) -> list[Tier]:
    """The tiers of `plan`'s capacities (gpu, host[, disk]), each appended to `made` as it is
    made."""
    layout = config.layout
    gpu_cfg, host_cfg = config.tiers.gpu, config.tiers.host
    prefix = None if shared_memory is None else segment_prefix(shared_memory)
    gpu_bytes, host_bytes = plan.capacities[0], plan.capacities[1]
    assert gpu_bytes is not None and host_bytes is not None  # planned with the memory free
    gpu = GpuPool.create(
        layout,
        gpu_bytes,
        gpu_cfg.device,
        None if prefix is None else f"{prefix}-gpu",
    )
    made.append(gpu)
    made.append(_host_pool(host_cfg, layout, host_bytes, prefix))
    disk_cfg = config.tiers.disk
    if disk_cfg is not None:
        disk = DiskTier(
            layout,
            disk_cfg.path,
            disk_cfg.capacity.resolve(0),
            codec=_codec(disk_cfg, layout, "tiers.disk"),
            fsync=disk_cfg.fsync,
            hashing=config.hashing.algorithm,
        )
        made.append(disk)
    return list(made)


def _host_pool(
    host_cfg: HostTierConfig | None, layout: KVLayout, host_bytes: int, prefix: str | None
) -> SlotPool:
    if host_cfg is None:  # no host tier: one of no slots keeps its place
        return NoHostPool.absent(layout)
    host_codec = _codec(host_cfg, layout, "tiers.host")  # none or quantized (the schema's)
    if isinstance(host_codec, QuantBytes):  # payloads, never in a shared segment
        return QuantPool.create_quantized(host_codec.quant, host_bytes, host_cfg.pinned)
    shared = None if prefix is None else f"{prefix}-host"
    return HostPool.create(layout, host_bytes, host_cfg.pinned, shared)


def _publisher(config: KVTierConfig) -> EventPublisher | None:
    """`events`: a publisher (fed by the index's observer, `_observe`); a `ConfigError` naming
    the address when it cannot be bound (`model.name` with an '@' is refused by `preflight`)."""
    events = config.events
    if events is None:
        return None
    settings = EventSettings(
        events_topic(config),
        events.per_tenant_topic,
        events.buffer,
        buffer_bytes=events.buffer_bytes,
        max_message_bytes=events.max_message_bytes,
    )
    try:
        publisher = EventPublisher(
            events.endpoint,
            events.replay_endpoint,
            settings,
            connect=events.connect,
            first_seq=time.time_ns() // 1000,  # a restart's numbers pass its past life's
        )
    except BindError as e:
        verb = "connect to" if e.name == "connect" else "bind"
        raise ConfigError(
            f"events.{e.name}", e.address, f"an address to {verb} ({e.reason})"
        ) from None
    return publisher


def _observe(publisher: EventPublisher, state: CacheState, namespaces: Namespaces) -> None:
    """Feed `publisher` from the index: a peer that joined before is told once this is set."""
    index = state.index
    observer = IndexEvents(publisher, index, namespaces.tenant_of, state.lock, namespaces.seeds)
    index.observer = observer
    observer.announce()  # what recovery brought back: a restarted store's first words


def _codec(
    tier: HostTierConfig | DiskTierConfig | RemoteTierConfig, layout: KVLayout, field: str
) -> Codec:
    """The codec a tier's `codec`, `codec_group` and `codec_keys` name, for `layout`; a
    `ConfigError` naming the field when the group does not fit the layout."""
    return tier_codec(tier.codec, layout, tier.codec_group, tier.codec_keys, field)


def _tls_settings(tls: RemoteTlsConfig | None) -> TlsSettings | None:
    """`tiers.remote.tls` with its files checked: each a readable regular file, the key one
    no other user can read or write, loaded as a connection loads it (`_load_tls`)."""
    if tls is None:
        return None
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(tls, name)
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError(f"tiers.remote.tls.{name}", path, "a readable file")
    _load_tls(tls)
    if tls.key_file is not None and os.stat(tls.key_file).st_mode & 0o006:  # as ssh's keys
        expected = "a key others cannot read (chmod o-rw; a Kubernetes Secret: defaultMode 0440)"
        raise ConfigError("tiers.remote.tls.key_file", tls.key_file, expected)
    return TlsSettings(tls.ca_file, tls.cert_file, tls.key_file, tls.check_hostname)


class _Passphrase(Exception):
    """The key file asked for a passphrase (`_load_tls`)."""


def _no_passphrase() -> bytes:
    raise _Passphrase


def _load_tls(tls: RemoteTlsConfig) -> None:
    """Load the TLS files as every connection will, now: `ca_file` and `cert_file` PEM
    certificates, `key_file` an unencrypted PEM key of `cert_file`'s certificate; a
    `ConfigError` naming the field otherwise. An encrypted key is not supported: OpenSSL would
    ask for its passphrase on the terminal, in the connect thread, at every connect."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for name in ("ca_file", "cert_file"):
        path = getattr(tls, name)
        try:
            if path is not None:
                context.load_verify_locations(cafile=path)
        except ssl.SSLError as e:
            raise ConfigError(
                f"tiers.remote.tls.{name}", path, f"PEM certificates (OpenSSL: {e.reason or e})"
            ) from None
    if tls.cert_file is None or tls.key_file is None:
        return
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_passphrase)
    except _Passphrase:
        raise ConfigError(
            "tiers.remote.tls.key_file",
            tls.key_file,
            "an unencrypted PEM private key (one with a passphrase is not supported; "
            "`openssl pkey -in KEY -out PLAIN` writes it unencrypted)",
        ) from None
    except ssl.SSLError as e:
        raise ConfigError(
            "tiers.remote.tls.key_file",
            tls.key_file,
            f"the PEM private key of cert_file's certificate (OpenSSL: {e.reason or e})",
        ) from None


def _remote_link(config: KVTierConfig, state: CacheState, writes: Writes) -> RemoteLink | None:
    remote = config.tiers.remote
    if remote is None:
        return None
    cluster = RemoteCluster(
        ClusterSettings(
            remote.nodes,
            timeout_s=remote.timeout_s,
            max_value_bytes=remote.max_value_bytes.resolve(0),
            username=remote.username,
            password=(
                resolve_key(remote.password, "tiers.remote.password") if remote.password else None
            ),
            tls=_tls_settings(remote.tls),
            allowed=remote.allowed_nodes,
        )
    )
    codec = _codec(remote, config.layout, "tiers.remote")
    mac_key = None
    if remote.authenticate:  # the config refuses it without a secret
        assert remote.secret is not None
        mac_key = mac_key_of(resolve_key(remote.secret, "tiers.remote.secret").encode())
    tier = RemoteTier(
        cluster, config.layout, remote.key_prefix, remote.group_blocks, codec, mac_key
    )
    writer = RemoteWriter(tier, remote.max_pending_bytes.resolve(0))

    def store_blocks(
        namespace: BlockId, tenant: str, key: bytes, blocks: torch.Tensor, first: int
    ) -> int:
        stored = writes.store_new(namespace, tenant, key, blocks, first, share=False)
        taken = stored.stored_tokens + stored.pending_tokens  # pending: landing on disk
        return taken // config.layout.block_tokens

    return RemoteLink(state.index, tier, writer, state.lock, store_blocks)


def _background_executor(
    config: KVTierConfig, state: CacheState, inline: InlineExecutor
) -> Executor:
    if not config.mover.background:
        return inline
    if state.gpu.device.type == "cuda":
        from kvtier.transfer.cuda import CudaExecutor

        return CudaExecutor(state.gpu.device, ledger=inline.ledger)
    return ThreadExecutor(config.mover.workers_per_path, ledger=inline.ledger)
