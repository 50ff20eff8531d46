"""The validated, frozen configuration of one kvtier store (DESIGN.md, "Configuration").

Contract:
- `load_config(path)` and `parse_config(mapping)` return a `KVTierConfig` or raise `ConfigError`
  whose `field` is the dotted path of the bad value (`tiers.gpu.capacity`), whose `value` is the
  bad input and whose `expected` says what would do. No pydantic or YAML exception escapes.
  Building a section in Python (`PolicyConfig(write="x")`) checks the same rules but raises
  pydantic's `ValidationError` (a `ValueError`): input from outside goes through `parse_config`.
- `default_config()` is the embedded default (`kvtier serve` without `--config`) and equals
  `configs/default.yaml`: gpu, host and a disk tier at `./kvtier-data`. `KVTierConfig()` is
  every field's default, the same without a disk tier (nothing written unasked).
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
- every path (`tiers.disk.path`, `service.state_dir`, the TLS files) is one a system call takes:
  no NUL byte, no lone surrogate (`private_files.is_path`).

This package measures no memory (a fraction is resolved by the tier that owns it, through
`Capacity.resolve`) and reads no environment variable while parsing: an `env:NAME` key or
secret is read only when the service resolves it at start (`fields.resolve_key`).

Modules, imports pointing down the list:
- `loading.py`: YAML files and mappings in, `KVTierConfig` or `ConfigError` out; keys hidden,
  and any text that is no field's value.
- `root.py`: `KVTierConfig`, its `model` and `hashing` sections, the rule across sections.
- `tiers.py`, `movement.py` (`policy`, `mover`), `service.py`, `tenants.py`: the sections.
- `fields.py`: the validated field types and the `Section` base they are written with.
"""

from kvtier.config.fields import HiddenText
from kvtier.config.loading import (
    HiddenKey,
    HiddenLine,
    default_config,
    load_config,
    parse_config,
)
from kvtier.config.movement import MoverConfig, PolicyConfig
from kvtier.config.root import HashingConfig, KVTierConfig, ModelConfig
from kvtier.config.service import ServiceConfig
from kvtier.config.tenants import FloorConfig, QuotaConfig, TenantConfig
from kvtier.config.tiers import DiskTierConfig, GpuTierConfig, HostTierConfig, TiersConfig
from kvtier.sizes import Capacity, format_size, parse_size

__all__ = [
    "Capacity",
    "DiskTierConfig",
    "FloorConfig",
    "GpuTierConfig",
    "HashingConfig",
    "HiddenKey",
    "HiddenLine",
    "HiddenText",
    "HostTierConfig",
    "KVTierConfig",
    "ModelConfig",
    "MoverConfig",
    "PolicyConfig",
    "QuotaConfig",
    "ServiceConfig",
    "TenantConfig",
    "TiersConfig",
    "default_config",
    "format_size",
    "load_config",
    "parse_config",
    "parse_size",
]
