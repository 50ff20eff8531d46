"""Preflight: the checks that can refuse a config, made from the config alone, before any tier
is made (nothing created on disk, no slab cut, nothing allocated or bound).

`preflight(config, free)` plans each tier's room (`shares.TierRoom`: its slots and slot bytes,
as the pools and the disk tier will make them: `capacity // block bytes`, a quantized host
tier's payload bytes, a disk slot's header and payload) and checks:
- every tier codec against the layout (`tier_codec`: `tiers.<name>.codec_group`);
- a disk capacity that holds a slot (`tiers.disk.capacity`);
- memory tiers given in bytes within the memory free (`_check_fits`): host within what a gpu
  tier in host memory (no CUDA) leaves, and that gpu tier within host memory;
- the tenants' shares (`shares.check_shares`: floors that fit each tier, no quota of 0 blocks);
- the events' topic: the default's `model.name` without '@' (unless `events.topic` is set),
  and the topic, a tenant's suffix included, within a router's bound (`_check_topic`).
`Parts` runs it first, with the memory free on this machine, so that a refused config never
opens the disk tier (a lower `tiers.disk.capacity` cuts the slabs when the tier opens);
`kvtier validate` runs it with `free` None: a capacity that is a fraction of free memory is
known only at start, and shares on that tier are not checked then.

What can still refuse a start once the disk tier is being opened: a capacity its filesystem
has no room for (refused after its directory and lock file are made, before any slab is cut
or made: the filesystem is not looked at here), and after it has opened (and cut): room that
goes while the slabs are allocated (fewer disk slots than planned, so floors that no longer
fit), a damaged directory found by recovery, and an `events` address that cannot be bound.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.shares import TierRoom, check_shares
from kvtier.sizes import Capacity, format_size
from kvtier.tiers.disk.codec import tier_codec
from kvtier.tiers.disk.tier import disk_slot_bytes


@dataclass(frozen=True)
class Free:
    """The memory free on this machine when the store is built: what a capacity that is a
    fraction resolves against (`Capacity.resolve`), and what a capacity in bytes must fit
    (`host`: what a gpu tier in host memory leaves)."""

    gpu: int
    host: int
    gpu_in_host: int = 0  # the gpu tier's bytes where it lives in host memory (no CUDA)


@dataclass(frozen=True)
class Plan:
    """What `preflight` found: each tier's capacity in bytes and room (None: not known without
    the machine), fastest first as `config.tier_names`."""

    capacities: tuple[int | None, ...]
    rooms: tuple[TierRoom | None, ...]


def _bytes(capacity: Capacity, free: int | None) -> int | None:
    if capacity.nbytes is not None:
        return capacity.nbytes
    return None if free is None else capacity.resolve(free)


def preflight(config: KVTierConfig, free: Free | None) -> Plan:
    """Check `config` (module doc) with the memory `free` here (None: fractions are not known);
    the planned `Plan`, or the first `ConfigError`. Creates, opens and binds nothing."""
    layout = config.layout
    tiers = config.tiers
    capacities: list[int | None] = []
    rooms: list[TierRoom | None] = []
    gpu = _bytes(tiers.gpu.capacity, None if free is None else free.gpu)
    if free is not None and free.gpu_in_host:  # (on CUDA, its allocation says)
        _check_fits("tiers.gpu.capacity", gpu, free.gpu, 0)
    capacities.append(gpu)
    rooms.append(None if gpu is None else TierRoom(gpu // layout.block_bytes, layout.block_bytes))
    if tiers.host is None:  # a host tier of no slots
        capacities.append(0)
        rooms.append(TierRoom(0, layout.block_bytes))
    else:
        host = tiers.host
        codec = tier_codec(host.codec, layout, host.codec_group, host.codec_keys, "tiers.host")
        slot = codec.payload_bound(layout.block_bytes)
        nbytes = _bytes(host.capacity, None if free is None else free.host)
        if free is not None:
            _check_fits("tiers.host.capacity", nbytes, free.host, free.gpu_in_host)
        capacities.append(nbytes)
        rooms.append(None if nbytes is None else TierRoom(nbytes // slot, slot))
    if tiers.disk is not None:
        disk = tiers.disk
        codec = tier_codec(disk.codec, layout, disk.codec_group, disk.codec_keys, "tiers.disk")
        slot = disk_slot_bytes(layout, codec)
        nbytes = disk.capacity.resolve(0)
        if nbytes < slot:
            raise ConfigError("tiers.disk.capacity", nbytes, f"at least one slot of {slot} bytes")
        capacities.append(nbytes)
        rooms.append(TierRoom(nbytes // slot, slot))
    remote = tiers.remote
    if remote is not None:
        tier_codec(remote.codec, layout, remote.codec_group, remote.codec_keys, "tiers.remote")
    check_shares(config, rooms)
    _check_topic(config)
    return Plan(tuple(capacities), tuple(rooms))


def _check_fits(field: str, nbytes: int | None, free: int, beside: int) -> None:
    """A memory tier of `nbytes` within the `free` bytes of its memory (`beside`: a gpu tier's
    bytes in host memory, taken first). A mapping's pages are committed as blocks are written,
    so a tier past it (a gpu tier in host memory and a host tier that each fit, not together)
    was accepted, then filled until the kernel killed a process (audit AY)."""
    if nbytes is None or nbytes <= free:
        return
    there = (
        f" beside the gpu tier's {format_size(beside)} (in host memory: no CUDA)" if beside else ""
    )
    expected = f"at most the {format_size(free)} of memory available{there} ({free} bytes)"
    raise ConfigError(field, format_size(nbytes), expected)


def events_topic(config: KVTierConfig) -> str:
    """The topic the store's events go out on: `events.topic`, else `kv@<host name>@<model
    name>` (a router reads the pod from the second field)."""
    assert config.events is not None
    return config.events.topic or f"kv@{socket.gethostname()}@{config.model.name}"


def _check_topic(config: KVTierConfig) -> None:
    """The events topic (`events_topic`), with `@<tenant>` under `per_tenant_topic`: the
    default's model name without '@', and the longest topic within `MAX_TOPIC_CHARS`, past
    which a router's subscriber (`routing/allowance.py`) ignores every event on it."""
    from kvtier.routing.allowance import MAX_TOPIC_CHARS

    events = config.events
    if events is None:
        return
    if events.topic is None and "@" in config.model.name:
        expected = "no '@' (the default events topic: kv@<host name>@<model name>), or events.topic"
        raise ConfigError("model.name", config.model.name, expected)
    topic = events_topic(config)
    tenant = max(len(name) for name in config.tenants) + 1 if events.per_tenant_topic else 0
    if len(topic) + tenant > MAX_TOPIC_CHARS:
        field, value = ("events.topic", events.topic) if events.topic else ("model.name", None)
        expected = (
            f"an events topic of at most {MAX_TOPIC_CHARS} characters, a tenant's '@<tenant>' "
            f"included (routers ignore longer ones): this one has {len(topic) + tenant}"
        )
        if value is None:  # the default topic: the model name, bounded in the message
            value = f"a name of {len(config.model.name)} characters"
            expected += "; shorten model.name or set events.topic"
        raise ConfigError(field, value, expected)
