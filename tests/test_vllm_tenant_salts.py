"""Which kvtier tenant a vLLM request uses (`settings.ConnectorSettings.key_for`), without vLLM:
a tenant named in `kv_transfer_params` counts only with a `cache_salt` that keeps vLLM's prefix
cache apart from other tenants' (audit G2; end to end in
`tests/engines/test_vllm_integrity.py`), and what a finished request saves (`plans.output_save`)
when its prompt's save was never planned."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.integrations.plans import Planned, Save, output_save
from kvtier.integrations.settings import REFUSALS, ConnectorSettings

OWN, ALICE, BOB = "o" * 20, "a" * 20, "b" * 20
SETTINGS = ConnectorSettings.parse(
    {"kvtier.api_key": OWN, "kvtier.tenant_keys": {"alice": ALICE, "bob": BOB, "own": OWN,
     "a-salt": ALICE}, "kvtier.trust_tenant_param": True}, 1
)  # fmt: skip


def request(name: str | None = None, salt: str | None = None) -> Any:
    params = {"kvtier_tenant": name} if name is not None else None
    return SimpleNamespace(kv_transfer_params=params, cache_salt=salt)


@pytest.mark.parametrize(
    ("name", "salt", "key", "refused"),
    [
        (None, None, OWN, None),  # the engine's own tenant
        (None, "a-salt", ALICE, None),  # by salt
        (None, "unmapped", None, None),  # a salt without a key: no kvtier
        ("bob", "bob's own salt", BOB, None),
        ("bob", "bob", BOB, None),  # the salt naming the same tenant
        ("bob", None, None, "unsalted_names"),  # shares vLLM's blocks with unsalted requests
        ("bob", "a-salt", None, "unsalted_names"),  # with alice's salted requests
        ("own", None, OWN, None),  # the engine's own tenant, unsalted as its others
        ("nobody", "s", None, None),  # a name without a key: no kvtier
    ],
)
def test_a_named_tenant_needs_a_cache_salt_of_its_own(
    name: str | None, salt: str | None, key: str | None, refused: str | None
) -> None:
    assert SETTINGS.key_for(request(name, salt)) == (key, refused)
    assert refused is None or refused in REFUSALS


def test_a_name_is_refused_untrusted_whatever_its_salt() -> None:
    untrusting = ConnectorSettings.parse({"kvtier.tenant_keys": {"bob": BOB}}, 1)
    assert untrusting.key_for(request("bob", "s")) == (None, "untrusted_names")


def finished(tokens: list[int], computed: int) -> Any:
    status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    return SimpleNamespace(request_id="r", status=status, num_computed_tokens=computed,
                           all_token_ids=tokens, num_in_flight_tokens=0)  # fmt: skip


def test_a_finished_request_whose_prompt_save_waited_saves_its_prompt_too() -> None:
    tokens = list(range(40))  # 32 tokens of whole blocks of 16, one output token
    planned = Planned(tuple(tokens[:39]), ALICE, found=16)
    job = output_save(finished(tokens, 39), planned, [5, 6, 7], 16, decode=False)
    assert job is not None and job.start == 16 and job.tokens == tuple(tokens[:32])
    assert job.blocks == (5, 6) and job.release
    planned.save = Save.SENT  # its save went out: only the output's blocks, of which there are none
    assert output_save(finished(tokens, 39), planned, [5, 6, 7], 16) is None
