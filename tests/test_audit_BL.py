"""Audit BL of the sidecar's data plane, server side (`kvtier/service/plane.py`, `grants.py`):

- A server whose `service.max_body_bytes` was less than one block (the config allowed it: 1
  KiB at least, whatever the model) loaded `tokens[:start]`: from 0 a 400 `invalid_tokens`
  ("an empty sequence") for a good request, from a later block a 200 reply `truncated` at its
  own start, which the client refuses as a broken server's. Such a config is refused now,
  naming the field (`config/root.py`); the plane's typed 413 stays for a block no msgpack bin
  carries (over 4 GiB).
- A prefetch tries again after a FAILED lease under the same request token (`plane.py`): a
  give-back that came between two attempts withdrew the first lease's id, left no tombstone,
  and the next attempt's lease was granted, held to its ttl though its client had given it back.
  A withdrawal always leaves the tombstone now.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from service_server import BLOCK_BYTES, write_config

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.service.grants import Grants

TINY_BODY = 2048  # less than one block of the tests' layout


def test_a_body_bound_under_one_block_is_refused_naming_it(tmp_path: Path) -> None:
    assert TINY_BODY < BLOCK_BYTES
    config = write_config(tmp_path, service={"max_body_bytes": TINY_BODY})
    with pytest.raises(
        ConfigError, match=r"'service\.max_body_bytes': got 2048, expected at least"
    ):
        load_config(config)
    fits = write_config(tmp_path, service={"max_body_bytes": BLOCK_BYTES}, name="fits.yaml")
    assert load_config(fits).service.max_body_bytes == BLOCK_BYTES


def test_a_grant_after_its_tokens_give_back_grants_nothing() -> None:
    """The retry's sequence on the real table: attempt 1 granted, given back, attempt 2."""
    grants, tenants, token = Grants(), ("a", "b"), "00000000000000b1"
    assert grants.grant("lease", "a", token, 11, tenants)
    assert grants.withdraw("lease", "a", token, tenants) == 11
    grants.check()
    assert not grants.grant("lease", "a", token, 12, tenants)  # ended at once by its caller
    grants.check()
    assert grants.withdraw("lease", "a", token, tenants) is None  # nothing left to give back
    # another tenant's same token is its own, untouched
    assert grants.grant("lease", "b", token, 13, tenants)
    assert grants.withdraw("lease", "b", token, tenants) == 13
    grants.check()
