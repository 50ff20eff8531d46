"""The validated, frozen configuration of one kvtier store (DESIGN.md, "Configuration").

Contract:
- `load_config(path)` and `parse_config(mapping)` return a `KVTierConfig` or raise `ConfigError`
  whose `field` is the dotted path of the bad value (`tiers.gpu.capacity`), whose `value` is the
  bad input and whose `expected` says what would do. No pydantic or YAML exception escapes.
  Building a section in Python (`PolicyConfig(write="x")`) checks the same rules but raises
  pydantic's `ValidationError` (a `ValueError`): input from outside goes through `parse_config`.
- `KVTierConfig()` is the embedded default and equals `configs/default.yaml`.
- Every section is frozen and forbids unknown keys; a misspelled key is an error that lists the
  allowed ones. `model` is all-or-nothing: once given, each of its keys is required, so a new
  model never inherits the default model's geometry. (`tenants` is a plain dict so that configs
  pickle; treat it as read-only.)
- `to_dict()` gives plain values (YAML/JSON-safe) that `parse_config` reads back equal.

Invariants of a `KVTierConfig`:
- model sizes are positive ints and `1 <= block_tokens <= 4096`, so `layout` is a valid layout;
- every capacity is positive; a fraction (gpu and host only) lies in (0, 1]; a capacity in
  bytes holds at least one block of `layout`;
- `0 < low_watermark <= high_watermark <= 1` on gpu and host;
- there is at least one tenant and every tenant id matches `[A-Za-z0-9_.-]{1,64}`.

This module reads no environment variables and measures no memory: a fraction is resolved by
the tier that owns it, through `Capacity.resolve`.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    model_validator,
)

from kvtier.errors import ConfigError
from kvtier.layout import DTYPES, KVLayout
from kvtier.sizes import FRACTION_EXPECTED, Capacity, format_size, parse_size

__all__ = [
    "Capacity",
    "DiskTierConfig",
    "FloorConfig",
    "GpuTierConfig",
    "HashingConfig",
    "HostTierConfig",
    "KVTierConfig",
    "ModelConfig",
    "MoverConfig",
    "PolicyConfig",
    "QuotaConfig",
    "ServiceConfig",
    "TenantConfig",
    "TiersConfig",
    "format_size",
    "load_config",
    "parse_config",
    "parse_size",
]

WriteMode = Literal["write_through", "write_back", "selective"]
HashAlgorithm = Literal["blake2b-128", "blake2b-256", "sha256"]
Compression = Literal["none", "lz4"]
FsyncMode = Literal["batch", "none"]
Pinned = Literal["auto", True, False]

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_TENANT_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DISK_EXPECTED = "a size like '1TiB' (a fraction of free memory is for gpu and host only)"


class _Invalid(ValueError):
    """Raised by validators; `key`, if set, extends pydantic's location down to the bad key."""

    def __init__(self, value: object, expected: str, key: str | None = None) -> None:
        super().__init__(expected)
        self.value, self.expected, self.key = value, expected, key


class _Absent:
    def __repr__(self) -> str:
        return "nothing"


class HiddenKey:
    """Stands in an error for an API key's value: the error names the key's place
    (`tenants.a.api_keys.0`) and what was expected, never the key."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HiddenKey)

    def __hash__(self) -> int:
        return hash(HiddenKey)

    def __repr__(self) -> str:
        return "<a key, not shown>"


def _rule(ok: Callable[[Any], bool], expected: str) -> BeforeValidator:
    def check(value: object) -> object:
        if not ok(value):
            raise _Invalid(value, expected)
        return value

    return BeforeValidator(check)


def _int_in(low: int, high: float = math.inf) -> BeforeValidator:
    expected = f"an integer in [{low}, {high}]" if high < math.inf else f"an integer >= {low}"
    if low == 1 and high == math.inf:
        expected = "a positive integer"
    return _rule(lambda v: type(v) is int and low <= v <= high, expected)


def _number_in(low: float, high: float, expected: str) -> BeforeValidator:
    """A finite int or float in (low, high]."""
    return _rule(lambda v: type(v) in (int, float) and low < v <= high and v < math.inf, expected)


def _one_of(choices: tuple[object, ...]) -> BeforeValidator:
    shown = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
    typed = {(type(c), c) for c in choices}  # so that 1 is not taken for True
    return _rule(lambda v: (type(v), v) in typed, f"one of {shown}")


def _capacity(value: object, expected: str) -> Capacity:
    try:
        return Capacity.parse(value)
    except ConfigError:
        raise _Invalid(value, expected) from None


def _disk_capacity(value: object) -> Capacity:
    capacity = _capacity(value, _DISK_EXPECTED)
    if capacity.fraction is not None:
        raise _Invalid(value, _DISK_EXPECTED)
    return capacity


def _tenant_ids(value: object) -> object:
    if not isinstance(value, Mapping) or not value:
        raise _Invalid(value, "a mapping of at least one tenant id to its settings")
    for key in value:
        if not isinstance(key, str) or not _TENANT_ID.fullmatch(key):
            raise _Invalid(key, "a tenant id matching [A-Za-z0-9_.-]{1,64}")
    return dict(value)


PositiveInt = Annotated[int, _int_in(1)]
Name = Annotated[str, _rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")]
Fraction01 = Annotated[float, _number_in(0.0, 1.0, "a fraction in (0, 1]")]
MemoryCapacity = Annotated[
    Capacity,
    PlainValidator(lambda v: _capacity(v, FRACTION_EXPECTED)),
    PlainSerializer(Capacity.to_config),
]
DiskCapacity = Annotated[
    Capacity, PlainValidator(_disk_capacity), PlainSerializer(Capacity.to_config)
]


class _Section(BaseModel):
    """Frozen and closed to unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: object) -> object:
        if isinstance(data, Mapping):
            for key in data:
                if key not in cls.model_fields:
                    allowed = ", ".join(cls.model_fields) or "none"
                    raise _Invalid(key, f"a known key; allowed: {allowed}", key=str(key))
        return data


class ModelConfig(_Section):
    """The model whose KV is stored; every key feeds `KVLayout` and is required."""

    name: Name
    num_layers: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype: Annotated[str, _one_of(tuple(DTYPES))]


class HashingConfig(_Section):
    """The hash `H` of the block-id chain."""

    algorithm: Annotated[HashAlgorithm, _one_of(get_args(HashAlgorithm))] = "blake2b-128"


class _MemoryTierConfig(_Section):
    """A tier in memory: demotion starts above `high_watermark` and stops at `low_watermark`."""

    capacity: MemoryCapacity
    high_watermark: Fraction01
    low_watermark: Fraction01

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> _MemoryTierConfig:
        if self.low_watermark > self.high_watermark:
            expected = f"at most high_watermark ({self.high_watermark}): 0 < low <= high <= 1"
            raise _Invalid(self.low_watermark, expected, key="low_watermark")
        return self


class GpuTierConfig(_MemoryTierConfig):
    """The fastest tier. A fraction capacity is of the device's free memory."""

    capacity: MemoryCapacity = Capacity(nbytes=256 * 2**20)
    high_watermark: Fraction01 = 0.95
    low_watermark: Fraction01 = 0.85
    device: Annotated[
        str,
        _rule(
            lambda v: isinstance(v, str) and bool(_DEVICE.fullmatch(v)),
            "one of auto, cpu, cuda, cuda:N",
        ),
    ] = "auto"


class HostTierConfig(_MemoryTierConfig):
    """Host RAM. A fraction capacity is of MemAvailable; `pinned: auto` pins when CUDA is up."""

    capacity: MemoryCapacity = Capacity(nbytes=2**30)
    high_watermark: Fraction01 = 0.95  # with a disk tier: write LRU leaves down above this
    low_watermark: Fraction01 = 0.85
    pinned: Annotated[Pinned, _one_of(get_args(Pinned))] = "auto"


class DiskTierConfig(_Section):
    """Files under `path`; validated here, built by the disk tier."""

    capacity: DiskCapacity
    path: Name = "./kvtier-data"
    compression: Annotated[Compression, _one_of(get_args(Compression))] = "none"
    fsync: Annotated[FsyncMode, _one_of(get_args(FsyncMode))] = "batch"


class TiersConfig(_Section):
    """gpu and host always exist; disk only when configured."""

    gpu: GpuTierConfig = GpuTierConfig()
    host: HostTierConfig = HostTierConfig()
    disk: DiskTierConfig | None = None


class PolicyConfig(_Section):
    """When blocks are copied down (DESIGN.md, "Movement policy") and how long leases live."""

    write: Annotated[WriteMode, _one_of(get_args(WriteMode))] = "write_through"
    selective_hits: Annotated[int, _int_in(1)] = 2
    disk_admission_hits: Annotated[int, _int_in(0)] = 1
    lease_ttl_s: Annotated[float, _number_in(0.0, math.inf, "a finite number > 0")] = 60.0
    # an expired reservation's slots stay allocated this long, so that a late writer writes
    # into slots nobody reads (`reservations.py`); a few lease TTLs
    reservation_quarantine_s: Annotated[
        float, _number_in(0.0, 86400.0, "seconds in (0, 86400]")
    ] = 300.0
    # the longest `ttl_s` a prefetch or a reservation may ask for: no one pins a tier for long
    max_ttl_s: Annotated[float, _number_in(0.0, 86400.0, "seconds in (0, 86400]")] = 600.0

    @model_validator(mode="after")
    def _default_ttl_allowed(self) -> PolicyConfig:
        if self.max_ttl_s < self.lease_ttl_s:
            expected = f"at least lease_ttl_s ({self.lease_ttl_s}): the default ttl must be allowed"
            raise _Invalid(self.max_ttl_s, expected, key="max_ttl_s")
        return self


class MoverConfig(_Section):
    """How blocks move between tiers (`transfer/mover.py`).

    `background: true` copies on worker threads (CUDA streams for a CUDA gpu tier): prefetches
    return pending leases, watermark demotion and disk writes run behind the caller, and
    `store()` never waits on the disk. `false` runs every copy in the calling thread, which is
    deterministic (tests, replay)."""

    background: Annotated[bool, _one_of((True, False))] = True
    workers_per_path: Annotated[int, _int_in(1, 64)] = 1
    layer_groups: Annotated[int, _int_in(1, 1024)] = 4
    lift_on_lookup: Annotated[bool, _one_of((True, False))] = False


KeyRef = Annotated[
    str,
    _rule(
        lambda v: isinstance(v, str) and (len(v) >= 16 or v.startswith("env:")),
        "an API key of at least 16 characters, or 'env:NAME' to read it from $NAME",
    ),
]


_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def _host_names(value: object) -> tuple[str, ...]:
    """`service.allowed_hosts`: host names (or IP addresses) that a request's `Host` may name
    besides the bound address and loopback, lower-cased; no ports, no wildcards."""
    expected = "a list of host names or IP addresses (no port, no wildcard)"
    if not isinstance(value, (list, tuple)):
        raise _Invalid(value, expected)
    for i, name in enumerate(value):
        if not (isinstance(name, str) and len(name) <= 253 and _is_host_name(name.lower())):
            raise _Invalid(name, "a host name or an IP address (no port, no wildcard)", key=str(i))
    return tuple(name.lower() for name in value)


def _is_host_name(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return _HOST_NAME.fullmatch(name) is not None
    return True


class ServiceConfig(_Section):
    """The sidecar (`kvtier serve`): where it listens, where it keeps its state, its limits.
    Auth is on when any tenant has an API key; without auth only a loopback address is served."""

    host: Name = "127.0.0.1"
    port: Annotated[int, _int_in(1, 65535)] = 8750
    state_dir: Name = "./kvtier-state"  # the server secret that keys tenant salts (0600)
    shared_memory: Annotated[bool, _one_of((True, False))] = True
    max_tokens: Annotated[int, _int_in(1, 1 << 24)] = 1 << 20
    max_body_bytes: Annotated[int, _int_in(1024)] = 1 << 30
    prefetch_wait_s: Annotated[float, _number_in(0.0, 3600.0, "seconds in (0, 3600]")] = 30.0
    body_timeout_s: Annotated[float, _number_in(0.0, 3600.0, "seconds in (0, 3600]")] = 30.0
    allowed_hosts: Annotated[tuple[str, ...], BeforeValidator(_host_names)] = ()
    admin_key: KeyRef | None = None


class QuotaConfig(_Section):
    """The most a tenant holds at once (`quotas.py`). `gpu`, `host`: blocks that its leases and
    reservation pins lock (counted against gpu) plus the slots its reservations hold, per tier,
    as a size ('64MiB') or a fraction of the tier (0.5); unset: its equal share of the tier when
    several tenants are configured, the whole tier for a single one. `leases`: its live leases."""

    gpu: MemoryCapacity | None = None
    host: MemoryCapacity | None = None
    leases: Annotated[int, _int_in(1, 1 << 20)] = 4096


class FloorConfig(_Section):
    """A tenant's fair-share eviction floor per tier (`index/eviction.py`): while it holds no
    more than this in a tier, no other tenant's call takes its blocks there. A size or a
    fraction of the tier; unset: its equal share when several tenants are configured, none
    for a single one. The floors of a tier must fit in it."""

    gpu: MemoryCapacity | None = None
    host: MemoryCapacity | None = None
    disk: MemoryCapacity | None = None


class TenantConfig(_Section):
    """Per-tenant settings: the API keys that act as this tenant (literal, or 'env:NAME'), its
    quota and its floors."""

    api_keys: Annotated[
        tuple[KeyRef, ...], BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)
    ] = ()
    quota: QuotaConfig = QuotaConfig()
    floor: FloorConfig = FloorConfig()


class KVTierConfig(_Section):
    """The whole configuration; `KVTierConfig()` is `configs/default.yaml`."""

    model: ModelConfig = ModelConfig(
        name="SmolLM2-135M-Instruct", num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16"
    )
    block_tokens: Annotated[int, _int_in(1, 4096)] = 16
    hashing: HashingConfig = HashingConfig()
    tiers: TiersConfig = TiersConfig()
    policy: PolicyConfig = PolicyConfig()
    mover: MoverConfig = MoverConfig()
    service: ServiceConfig = ServiceConfig()
    tenants: Annotated[dict[str, TenantConfig], BeforeValidator(_tenant_ids)] = Field(
        default_factory=lambda: {"default": TenantConfig()}
    )

    @model_validator(mode="after")
    def _capacities_hold_a_block(self) -> KVTierConfig:
        block_bytes = self.layout.block_bytes
        for name in self.tier_names:
            capacity: Capacity = getattr(self.tiers, name).capacity
            if capacity.nbytes is not None and capacity.nbytes < block_bytes:
                expected = f"at least one block ({format_size(block_bytes)})"
                raise _Invalid(capacity.to_config(), expected, key=f"tiers.{name}.capacity")
        return self

    @property
    def layout(self) -> KVLayout:
        m = self.model
        return KVLayout(
            model_name=m.name,
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype_name=m.dtype,
            block_tokens=self.block_tokens,
        )

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Configured tiers, fastest first: `("gpu", "host")` or `("gpu", "host", "disk")`."""
        return ("gpu", "host", "disk") if self.tiers.disk is not None else ("gpu", "host")

    def to_dict(self) -> dict[str, Any]:
        """Plain values that `parse_config` reads back as an equal config."""
        return self.model_dump(mode="python")


_PHRASES = {
    "missing": "a value (this key is required)",
    "model_type": "a mapping of keys",
    "dict_type": "a mapping",
    "string_type": "a string",
}


def _config_error(exc: ValidationError, source: str, keys: set[str]) -> ConfigError:
    """The first error of `exc`, with its dotted path, input and a phrase for what would do.
    The input is hidden when it is (or shows one of) the API keys `keys`, or sits in a key
    field: an error names a key's place, never its value."""
    error = exc.errors()[0]
    path = [str(part) for part in error["loc"]]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, _Invalid):
        path += [cause.key] if cause.key else []
        value, expected = cause.value, cause.expected
    else:
        value = _Absent() if error["type"] == "missing" else error["input"]
        expected = _PHRASES.get(error["type"], error["msg"])
    if _KEY_FIELDS.intersection(path) or any(key in repr(value) for key in keys):
        value = HiddenKey()
    return ConfigError(".".join(path) or "<top level>", value, f"{expected} (in {source})")


_KEY_FIELDS = frozenset({"api_keys", "admin_key"})


def _key_values(data: object) -> set[str]:
    """Every string (or other scalar, as text) given under a key field anywhere in `data`."""
    found: set[str] = set()
    seen: set[int] = set()  # YAML anchors can make a list contain itself
    stack = [data]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Mapping):
            for name, value in item.items():
                if name in _KEY_FIELDS:
                    values = value if isinstance(value, (list, tuple)) else [value]
                    found.update(str(v) for v in values if not isinstance(v, (Mapping, list)))
                stack.append(value)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return {key for key in found if key}


def parse_config(mapping: object, source: str = "<dict>") -> KVTierConfig:
    """Validate a mapping (as read from YAML or JSON). Raises `ConfigError`."""
    if not isinstance(mapping, Mapping):
        raise ConfigError("<top level>", mapping, f"a mapping of config sections (in {source})")
    try:
        return KVTierConfig.model_validate(dict(mapping))
    except ValidationError as exc:
        raise _config_error(exc, source, _key_values(mapping)) from None


_WORD = r"[^\s:,'\"\[\]{}#]"
_LONG_WORD = re.compile(rf"(?<!{_WORD}){_WORD}{{16,}}(?!{_WORD})(?!\s*:)")
"""A value as long as an API key (16 characters or more; a mapping key, followed by `:`, is
not one): masked in the line a YAML error shows, since the file could not be read far enough
to know whether it is a key."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key repeated in one mapping instead of keeping the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                problem = f"repeated key {key!r} (each key once per mapping)"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | os.PathLike[str]) -> KVTierConfig:
    """Read and validate a YAML config file. Raises `ConfigError`, never a YAML or OS error."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("<file>", source, "a readable YAML file") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line if mark is not None else 0
        lines = text.splitlines()
        shown = _LONG_WORD.sub("<not shown>", lines[line].strip()) if line < len(lines) else ""
        expected = f"valid YAML: {exc.problem} at line {line + 1} of {source}"
        raise ConfigError("<yaml>", shown, expected) from exc
    except yaml.YAMLError as exc:
        raise ConfigError("<yaml>", source, f"valid YAML: {exc}") from exc
    return parse_config(data, source)
