"""The `tiers` section: where blocks live, fastest first (DESIGN.md, "Configuration").

Contract:
- gpu always exists; host exists unless `host: null` (a store without one: gpu victims are
  dropped, nothing is ever copied to host, and status leaves the tier out); both have
  defaults. disk exists only when configured, and then its `capacity` is required; it needs a
  host tier (its writes and reads are staged through host memory), so `host: null` with a disk
  tier is refused naming `tiers.host`.
- A memory tier's capacity is a size or a fraction of free memory, resolved by the tier that
  owns it (`Capacity.resolve`), never here; the disk tier's is a size.
- `0 < low_watermark <= high_watermark <= 1` on gpu and host: demotion starts above the high
  one and stops at the low one.
- That a capacity in bytes holds at least one block depends on the model, so the root
  (`root.py`) checks it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Literal, get_args

from pydantic import BeforeValidator, model_validator

from kvtier.config.fields import (
    DiskCapacity,
    FilePath,
    Fraction01,
    InvalidValue,
    MemoryCapacity,
    SecretRef,
    Section,
    int_in,
    matching,
    number_in,
    one_of,
    rule,
)
from kvtier.config.network import EXPECTED, NodeFilter, parse_entry
from kvtier.errors import InvalidArgumentError
from kvtier.quant import MAX_GROUP
from kvtier.sizes import Capacity

CodecName = Literal["none", "lz4", "fp8", "int8", "int4"]  # `tiers/disk/codec.py`, `quant.py`
KeyGroups = Literal["token", "channel"]
FsyncMode = Literal["batch", "none"]
Pinned = Literal["auto", True, False]

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _group(value: object) -> bool:
    return value is None or (type(value) is int and 1 <= value <= MAX_GROUP)


class _CodecFields(Section):
    """How a lower tier keeps its copies: `codec` none or lz4 (lossless), fp8, int8 or int4
    (quantized: `kvtier.quant`); `codec_group` (values a group, int8/int4, at most 255; default
    128 for int8, 32 for K and 64 for V for int4, or the largest divisor of a token's row below
    that) and `codec_keys` (K's groups per token, or per channel as KIVI). That the group
    divides the layout's rows is checked when the tier is built."""

    codec: Annotated[CodecName, one_of(get_args(CodecName))] = "none"
    codec_group: Annotated[int | None, rule(_group, f"null or an integer in [1, {MAX_GROUP}]")] = (
        None
    )
    codec_keys: Annotated[KeyGroups, one_of(get_args(KeyGroups))] = "token"


class _MemoryTierConfig(Section):
    """A tier in memory: demotion starts above `high_watermark` and stops at `low_watermark`."""

    capacity: MemoryCapacity
    high_watermark: Fraction01
    low_watermark: Fraction01

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> _MemoryTierConfig:
        if self.low_watermark > self.high_watermark:
            expected = f"at most high_watermark ({self.high_watermark}): 0 < low <= high <= 1"
            raise InvalidValue(self.low_watermark, expected, key="low_watermark")
        return self


class GpuTierConfig(_MemoryTierConfig):
    """The fastest tier. A fraction capacity is of the device's free memory."""

    capacity: MemoryCapacity = Capacity(nbytes=256 * 2**20)
    high_watermark: Fraction01 = 0.95
    low_watermark: Fraction01 = 0.85
    device: Annotated[str, matching(_DEVICE, "one of auto, cpu, cuda, cuda:N")] = "auto"


class HostTierConfig(_MemoryTierConfig, _CodecFields):
    """Host RAM. A fraction capacity is of MemAvailable; `pinned: auto` pins when CUDA is up.
    `codec` fp8, int8 or int4 keeps its blocks quantized (`tiers/quantized.py`; not lz4: a
    host slot is one size)."""

    capacity: MemoryCapacity = Capacity(nbytes=2**30)
    high_watermark: Fraction01 = 0.95  # with a disk tier: write LRU leaves down above this
    low_watermark: Fraction01 = 0.85
    pinned: Annotated[Pinned, one_of(get_args(Pinned))] = "auto"

    @model_validator(mode="after")
    def _fixed_size(self) -> HostTierConfig:
        if self.codec == "lz4":
            expected = "none, fp8, int8 or int4 (a host slot is one size)"
            raise InvalidValue(self.codec, expected, "codec")
        return self


class DiskTierConfig(_CodecFields):
    """Files under `path`; validated here, built by the disk tier. `compression`, the older
    name of `codec`, is still read."""

    capacity: DiskCapacity
    path: FilePath = "./kvtier-data"
    fsync: Annotated[FsyncMode, one_of(get_args(FsyncMode))] = "batch"

    @model_validator(mode="before")
    @classmethod
    def _older_name(cls, data: object) -> object:
        if isinstance(data, Mapping) and "compression" in data:
            if "codec" in data:
                expected = "codec or compression, not both"
                raise InvalidValue(data["compression"], expected, "compression")
            data = {("codec" if k == "compression" else k): v for k, v in data.items()}
        return data


_NODE = re.compile(r"[A-Za-z0-9_.\-]{1,253}:(\d{1,5})")
_PREFIX = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _nodes(value: object) -> object:
    nodes = tuple(value) if isinstance(value, list) else value
    expected = "a list of 1 to 64 startup nodes as host:port"
    if not isinstance(nodes, tuple) or not 1 <= len(nodes) <= 64:
        raise InvalidValue(value, expected)
    for node in nodes:
        match = _NODE.fullmatch(node) if isinstance(node, str) else None
        if match is None or not 0 < int(match.group(1)) < 65536:
            raise InvalidValue(node, "host:port, the port in 1..65535")
    return nodes


def _allowed(value: object) -> object:
    if value is None:
        return None
    entries = tuple(value) if isinstance(value, list) else value
    if not isinstance(entries, tuple) or not 1 <= len(entries) <= 256:
        raise InvalidValue(
            value, f"null (any node), or a list of 1 to 256 entries, each {EXPECTED}"
        )
    for entry in entries:
        try:
            parse_entry(entry)
        except InvalidArgumentError:
            raise InvalidValue(entry, EXPECTED) from None
    return entries


class RemoteTlsConfig(Section):
    """TLS to the cluster (Redis `tls-port`, `tls-cluster yes`): the nodes' certificates are
    verified against `ca_file`; `cert_file` + `key_file` are this node's client certificate,
    for a cluster that asks for one (`tls-auth-clients yes`). Files are checked when the store
    starts, loaded as a connection loads them: a missing or unreadable one, one that is not a
    PEM certificate, a key that does not match `cert_file` or is encrypted (not supported: its
    passphrase would be asked for on the terminal) is a `ConfigError` naming the field."""

    ca_file: FilePath
    cert_file: FilePath | None = None
    key_file: FilePath | None = None
    check_hostname: Annotated[bool, one_of((True, False))] = True

    @model_validator(mode="after")
    def _pair(self) -> RemoteTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.cert_file is not None else "cert_file"
            raise InvalidValue(None, "cert_file and key_file together, or neither", missing)
        return self


class RemoteTierConfig(_CodecFields):
    """A Redis / Valkey Cluster that kvtier nodes share (`tiers/remote/`); off unless set.

    `secret` ('env:NAME' or a literal of 16+ characters) keys the tenant salts instead of the
    node's own server secret, so that every node sharing it derives the same namespaces and
    finds the blocks the others wrote; nodes without it never see each other's blocks.
    `username` / `password` authenticate to the cluster (Redis AUTH, or an ACL user); the
    password is a secret as `secret` is ('env:NAME', or a literal of 16+ characters: Redis
    answers about a million AUTH attempts a second, so a short password protects nothing).
    `authenticate` (needs `secret`) writes and accepts only values whose checksums are MACs
    keyed by the secret (`tiers/remote/entry.py`), so that whoever can write to the cluster
    without the secret cannot make a node serve its bytes; every node of a `key_prefix` must
    agree on it (a node deletes the values it cannot verify)."""

    nodes: Annotated[tuple[str, ...], BeforeValidator(_nodes)]
    key_prefix: Annotated[str, matching(_PREFIX, "1 to 64 of A-Z a-z 0-9 _ . -")] = "kvtier"
    secret: SecretRef | None = None
    username: Annotated[
        str | None, matching(_PREFIX, "an ACL user name: 1 to 64 of A-Z a-z 0-9 _ . -", True)
    ] = None
    password: SecretRef | None = None
    tls: RemoteTlsConfig | None = None
    group_blocks: Annotated[int, int_in(1, 4096)] = 16
    timeout_s: Annotated[float, number_in(0, 60, "seconds in (0, 60]")] = 0.5
    max_value_bytes: DiskCapacity = Capacity(nbytes=512 * 2**20)
    max_pending_bytes: DiskCapacity = Capacity(nbytes=256 * 2**20)
    authenticate: Annotated[bool, one_of((True, False))] = False
    allowed_nodes: Annotated[tuple[str, ...] | None, BeforeValidator(_allowed)] = None

    @model_validator(mode="after")
    def _startup_allowed(self) -> RemoteTierConfig:
        if self.allowed_nodes is not None:
            allowed = NodeFilter.parse(self.allowed_nodes)
            for node in self.nodes:
                if not allowed.allows(node.rpartition(":")[0]):
                    expected = "startup nodes inside allowed_nodes (it lists where the cluster is)"
                    raise InvalidValue(node, expected, key="allowed_nodes")
        return self

    @model_validator(mode="after")
    def _keyed(self) -> RemoteTierConfig:
        if self.authenticate and self.secret is None:
            expected = "a secret (tiers.remote.secret) to key the MACs, or authenticate: false"
            raise InvalidValue(True, expected, key="authenticate")
        return self


class TiersConfig(Section):
    """gpu always exists; host unless null; disk and remote only when configured."""

    gpu: GpuTierConfig = GpuTierConfig()
    host: HostTierConfig | None = HostTierConfig()
    disk: DiskTierConfig | None = None
    remote: RemoteTierConfig | None = None

    @model_validator(mode="after")
    def _disk_behind_host(self) -> TiersConfig:
        if self.host is None and self.disk is not None:
            expected = (
                "a host tier when tiers.disk is set (disk blocks are staged through host "
                "memory); give tiers.host a capacity, or set tiers.disk to null too"
            )
            raise InvalidValue(None, expected, key="host")
        return self
