"""The vLLM connector's plain-data side, without vLLM: which requests it plans for at all
(`plans.keyed_by_tokens`), and how it reads its settings (`settings.ConnectorSettings`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.plans import (
    LoadFence,
    LoadJob,
    Planned,
    Save,
    after_failures,
    keyed_by_tokens,
)
from kvtier.integrations.settings import ConnectorSettings


@pytest.mark.parametrize(
    ("extra", "keyed"),
    [
        ({}, True),
        ({"lora_request": None, "mm_features": [], "prompt_embeds": None}, True),
        ({"lora_request": object()}, False),
        ({"mm_features": [object()]}, False),
        ({"prompt_embeds": object()}, False),
    ],
    ids=["plain", "empty-extras", "lora", "multimodal", "embeds"],
)
def test_only_a_request_keyed_by_its_tokens_alone_is_planned(
    extra: dict[str, object], keyed: bool
) -> None:
    request = SimpleNamespace(prompt_token_ids=[1, 2, 3], **extra)
    assert keyed_by_tokens(request) is keyed


def parse(extra: dict[str, Any] | None = None, tp_size: int = 1) -> ConnectorSettings:
    return ConnectorSettings.parse(extra or {}, tp_size)


def test_the_connector_settings_default_and_parse() -> None:
    default = parse()
    assert default.urls == ("http://127.0.0.1:8750",) and default.key == ""
    assert default.load_async and default.save_decode and not default.trust_tenant_param
    given = ConnectorSettings.parse(
        {"kvtier.urls": ["http://a:1", "http://b:2"], "kvtier.api_key": "k" * 20,
         "kvtier.tenant_keys": {"team": "t" * 20}, "kvtier.save_decode": False,
         "kvtier.load_async": False, "other.connector.key": "left alone"}, 2
    )  # fmt: skip
    assert given.urls == ("http://a:1", "http://b:2") and given.key == "k" * 20
    assert given.tenant_keys == {"team": "t" * 20}
    assert not given.save_decode and not given.load_async


def test_connector_keys_resolve_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_KEY", "e" * 24)
    assert parse({"kvtier.api_key": "env:KVTIER_TEST_KEY"}).key == "e" * 24
    with pytest.raises(ConfigError) as unset:
        parse({"kvtier.tenant_keys": {"x": "env:KVTIER_TEST_UNSET"}})
    assert unset.value.field == "kvtier.tenant_keys.x"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"kvtier.save_decodes": True}, "kvtier.save_decodes"),  # misspelt: never ignored
        ({"kvtier.load_async": "false"}, "kvtier.load_async"),  # a string is not a boolean
        ({"kvtier.save_decode": 0}, "kvtier.save_decode"),
        ({"kvtier.trust_tenant_param": "yes"}, "kvtier.trust_tenant_param"),
        ({"kvtier.urls": "http://a:1"}, "kvtier.urls"),  # one string, not a list
        ({"kvtier.urls": ["http://a:1", 7]}, "kvtier.urls"),
        ({"kvtier.urls": ["a", "b", "c"]}, "kvtier.urls"),  # neither 1 nor tp_size
        ({"kvtier.api_key": 12345}, "kvtier.api_key"),
        ({"kvtier.tenant_keys": ["k"]}, "kvtier.tenant_keys"),
        ({"kvtier.tenant_keys": {"x": 5}}, "kvtier.tenant_keys"),
    ],
)
def test_a_bad_connector_setting_is_a_config_error_naming_it(
    extra: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as error:
        ConnectorSettings.parse(extra, 1)
    assert error.value.field == field


def test_a_misspelt_keys_value_is_never_shown() -> None:
    secret = "alice-secret-api-key-0123456789"  # a misspelt kvtier.api_key holds the key
    for misspelt in ("kvtier_api_key", "KVTIER.api_key", "kvtier.apikey"):
        with pytest.raises(ConfigError) as error:
            ConnectorSettings.parse({misspelt: secret}, 1)
        assert error.value.field == misspelt and secret not in str(error.value)


def test_tensor_parallel_ranks_need_a_sidecar_each() -> None:
    with pytest.raises(ConfigError, match="one sidecar URL per tensor-parallel rank"):
        parse({"kvtier.url": "http://a:1"}, 2)
    assert parse({"kvtier.urls": ["http://a:1", "http://b:2"]}, 2).urls[1] == "http://b:2"


def test_a_tenant_key_never_shows_in_the_error() -> None:
    with pytest.raises(ConfigError) as error:
        parse({"kvtier.tenant_keys": {"x": "secret-key-0123456789", "y": 3}})
    assert "secret-key" not in str(error.value)


def load(*blocks: int) -> LoadJob:
    return LoadJob("R", tuple(range(4 * len(blocks))), 0, blocks, "k")


def test_the_fence_holds_the_blocks_of_this_steps_loads_and_the_last_steps() -> None:
    fence = LoadFence()
    assert fence.blocks([load(1, 2)], {"R": 1}, {}) == {1, 2}
    # the step after: its plan is made before the output
    assert fence.blocks([], {"S": 1}, {}) == {1, 2}
    assert fence.computed_over("S", {2}) and not fence.computed_over("R", {2})
    assert fence.blocks([load(3)], {"S": 1}, {}) == {3} and not fence.computed_over("S", {1, 2})
    assert fence.blocks([load(4)], {}, {}) == {3, 4}


def test_a_failed_load_spoils_a_sharer_a_later_step_computed_and_recomputes_the_rest() -> None:
    fence = LoadFence()
    fence.blocks([load(1, 2)], {"R": 1, "C": 1}, {})  # step 1: R loads blocks 1, 2; C shares them
    # step 2, planned before step 1's output: S computes too
    fence.blocks([], {"R": 1, "S": 1, "D": 1}, {})
    loader = Planned(tuple(range(56)), "k", [1, 2, 3], local=0, found=32, save=Save.SENT)
    same_step = Planned(tuple(range(64)), "k", [1, 2, 4, 5], local=32, found=0)
    later = Planned(tuple(range(64)), "k", [1, 2, 6, 7], local=32, found=0)
    apart = Planned(tuple(range(64)), "k", [8, 9])
    requests = {"R": loader, "C": same_step, "S": later, "D": apart}
    assert after_failures(requests, set(), {1, 2}, fence, 16) == {"R", "C", "S"}
    assert (loader.found, loader.save) == (0, Save.DUE)  # recomputed by vLLM, saved again
    assert same_step.save is Save.DUE  # vLLM takes back what the failed step computed
    assert later.save is Save.SPOILED and not later.due  # it keeps step 2's, over 1 and 2
    assert after_failures(requests, {"S"}, set(), fence, 16) == {"S"}
    assert later.save is Save.SPOILED and apart.save is Save.DUE
