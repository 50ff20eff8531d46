"""The vLLM connector's plain-data side (`integrations/plans.py`), without vLLM: which requests
it plans for at all (`keyed_by_tokens`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.integrations.plans import keyed_by_tokens


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
