"""`KVTierConfig`, the whole configuration, and the two sections that fix what a block is: the
model whose KV is stored and the hash of the block-id chain.

Contract:
- `KVTierConfig()` is every field's default, without a disk tier: a config that leaves out
  `tiers.disk` (or an engine embedding a store with none) gets no files written in its working
  directory. The embedded default that `kvtier serve` runs without `--config` adds one
  (`loading.default_config()`, equal to `configs/default.yaml`).
- `model` is all-or-nothing: once given, each of its keys is required, so a new model never
  inherits the default model's geometry. Its sizes are positive ints and
  `1 <= block_tokens <= 4096`, so `layout` is a valid `KVLayout`.
- The rule that spans sections lives here: a capacity in bytes holds at least one block of
  `layout` (error at `tiers.<name>.capacity`), and a block is at most a size can be, 1024PiB
  (error at `model`: no capacity could hold it).
- `to_dict()` gives plain values (YAML/JSON-safe) that `parse_config` reads back equal.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, model_validator

from kvtier.blocks import DTYPES, KVLayout
from kvtier.config.events import EventsConfig
from kvtier.config.fields import InvalidValue, Name, PositiveInt, Section, int_in, one_of
from kvtier.config.movement import MoverConfig, PolicyConfig
from kvtier.config.service import ServiceConfig
from kvtier.config.tenants import TenantConfig, Tenants
from kvtier.config.tiers import TiersConfig
from kvtier.sizes import MAX_SIZE, Capacity, format_size

HashAlgorithm = Literal["blake2b-128", "blake2b-256", "sha256"]


class ModelConfig(Section):
    """The model whose KV is stored; every key feeds `KVLayout`. Under tensor parallelism a
    sidecar holds one rank's shard: `num_kv_heads` is per rank, and `tp_rank` / `tp_size`
    name the shard (they key the block ids: ranks never share a block)."""

    name: Name
    num_layers: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype: Annotated[str, one_of(tuple(DTYPES))]
    tp_rank: Annotated[int, int_in(0, 1023)] = 0
    tp_size: Annotated[int, int_in(1, 1024)] = 1

    @model_validator(mode="after")
    def _rank_in_size(self) -> ModelConfig:
        if self.tp_rank >= self.tp_size:
            raise InvalidValue(self.tp_rank, f"a rank below tp_size ({self.tp_size})", "tp_rank")
        return self


class HashingConfig(Section):
    """The hash `H` of the block-id chain."""

    algorithm: Annotated[HashAlgorithm, one_of(get_args(HashAlgorithm))] = "blake2b-128"


class KVTierConfig(Section):
    """The whole configuration; `KVTierConfig()`: every field's default (no disk tier)."""

    model: ModelConfig = ModelConfig(
        name="SmolLM2-135M-Instruct", num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16"
    )
    block_tokens: Annotated[int, int_in(1, 4096)] = 16
    hashing: HashingConfig = HashingConfig()
    tiers: TiersConfig = TiersConfig()
    policy: PolicyConfig = PolicyConfig()
    mover: MoverConfig = MoverConfig()
    service: ServiceConfig = ServiceConfig()
    tenants: Tenants = Field(default_factory=lambda: {"default": TenantConfig()})
    events: EventsConfig | None = None

    @model_validator(mode="after")
    def _capacities_hold_a_block(self) -> KVTierConfig:
        block_bytes = self.layout.block_bytes
        if block_bytes > MAX_SIZE:  # no tier holds one: the model's sizes are wrong, not a tier's
            m = self.model
            shown = (
                f"{m.num_layers} layers x {m.num_kv_heads} KV heads x head_dim {m.head_dim} x "
                f"{self.block_tokens} tokens = {block_bytes} bytes a block"
            )
            raise InvalidValue(shown, "a model whose block is at most 1024PiB", key="model")
        for name in self.tier_names:
            section = getattr(self.tiers, name)
            if section is None:  # no host tier
                continue
            capacity: Capacity = section.capacity
            if capacity.nbytes is not None and capacity.nbytes < block_bytes:
                expected = f"at least one block ({format_size(block_bytes)})"
                raise InvalidValue(capacity.to_config(), expected, key=f"tiers.{name}.capacity")
        if self.service.max_body_bytes < block_bytes:  # no body could carry a block: every
            expected = f"at least one block ({format_size(block_bytes)})"  # load refused 413
            raise InvalidValue(self.service.max_body_bytes, expected, key="service.max_body_bytes")
        return self

    @model_validator(mode="after")
    def _floors_of_tiers_it_has(self) -> KVTierConfig:
        for tenant, settings in self.tenants.items():  # else a floor no tier would keep
            if settings.floor.disk is not None and self.tiers.disk is None:
                expected = "unset: this config has no disk tier (tiers.disk)"
                given = settings.floor.disk.to_config()
                raise InvalidValue(given, expected, key=f"tenants.{tenant}.floor.disk")
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
            tp_rank=m.tp_rank,
            tp_size=m.tp_size,
        )

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The tiers by index, fastest first: `("gpu", "host")` or `("gpu", "host", "disk")`.
        host keeps its place when `tiers.host` is null: the store then has a host tier of no
        slots (`NoHostPool`, `tiers/host.py`), so that tier indices never shift."""
        return ("gpu", "host", "disk") if self.tiers.disk is not None else ("gpu", "host")

    def to_dict(self) -> dict[str, Any]:
        """Plain values that `parse_config` reads back as an equal config."""
        return self.model_dump(mode="python")
