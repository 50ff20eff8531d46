"""Audit BI: a config file's YAML is read only as far as `MAX_VALUES` values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.config.loading import MAX_VALUES
from kvtier.errors import ConfigError


def test_a_file_of_too_many_values_is_refused_before_the_rest_is_read(tmp_path: Path) -> None:
    """The count of values was made once the whole file was parsed and built: a 1 MiB list of
    `1,1,...` took 46 s to refuse here (alias-free, so the count was the file's own). Now the
    reading stops at the value past `MAX_VALUES`: a fault after it (an unclosed list) is never
    reached, and the refusal names the limit."""
    path = tmp_path / "many.yaml"
    path.write_text("tiers: [" + "1," * (MAX_VALUES + 10) + "\n")  # never closed
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.field == "<top level>"
    assert refused.value.value == f"more than {MAX_VALUES} values"
    assert f"at most {MAX_VALUES} values (in {path})" in refused.value.expected


def test_a_file_just_within_the_values_is_read_on_to_its_own_fault(tmp_path: Path) -> None:
    path = tmp_path / "few.yaml"
    path.write_text("tiers: [" + "1," * 1000 + "\n")  # the reader's own fault, with its line
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.field == "<yaml>"


def test_a_mappings_keys_are_not_counted_as_values(tmp_path: Path) -> None:
    """The count while reading is the one made after (`_expanded_size`): values, not keys, so
    that a file read whole before is read whole now (50,001 keys and values: over 100,000 nodes)."""
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n" + "".join(f"  t{i}: {{}}\n" for i in range(50_001)))
    assert len(load_config(path).tenants) == 50_001  # (whose shares `preflight` refuses)
