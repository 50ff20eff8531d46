"""The sidecar names its model in `/v1/pools` (`layout.model`), the clients read it
(`Client.layout().model_name`, checked like the rest of the reply), and the vLLM connector
refuses, at start, a sidecar whose model is not the one `kvtier.model` names.

Two models of one geometry (a base model and its fine-tune) have KV of the same shape; the
connector keys vLLM's KV by its tokens under the sidecar's model, so a worker pointed at the
other model's sidecar loaded that model's KV without a word: only the name tells them apart.
Before, the clients named every served layout "served" and the connector had no way to check.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator

import pytest
import torch
from service_server import BT, DIM, HEADS, LAYERS, Server, running, write_config

from kvtier.client import AsyncClient, Client
from kvtier.errors import ConfigError, ReplyError
from kvtier.integrations.settings import ConnectorSettings, check_layout, served_model
from kvtier.service import replies


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("model"))) as live:
        yield live


def vllm_layers(block_size: int = 16) -> list[torch.Tensor]:
    """A vLLM worker's paged KV of the sidecar's geometry: per layer [blocks, heads, size, 2d]."""
    return [torch.zeros(8, HEADS, block_size, 2 * DIM, dtype=torch.float16)] * LAYERS


def test_both_clients_read_the_served_models_name(server: Server) -> None:
    assert server.get("/v1/pools").json()["layout"]["model"] == "tiny"
    with Client(server.url) as client:
        layout = client.layout()
    assert layout.model_name == "tiny" and layout.block_tokens == BT

    async def read() -> str:
        async with AsyncClient(server.url) as client:
            return (await client.layout()).model_name

    assert asyncio.run(read()) == "tiny"


def test_the_connector_refuses_another_models_sidecar_naming_both(server: Server) -> None:
    with Client(server.url) as client:
        served = client.layout()
    extra = {"kvtier.url": server.url, "kvtier.model": "tiny-finetune"}
    ConnectorSettings.parse(extra, 1)  # a known key
    wanted = served_model(extra)
    with pytest.raises(ConfigError) as refused:
        check_layout(vllm_layers(), served, (0, 1), server.url, wanted)
    text = str(refused.value)
    assert "kvtier.model" in text and "'tiny-finetune'" in text and "'tiny'" in text
    check_layout(vllm_layers(), served, (0, 1), server.url, "tiny")  # its own model: started
    check_layout(vllm_layers(), served, (0, 1), server.url, None)  # unset: geometry only


@pytest.mark.parametrize("model", [5, "", " ", ["tiny"], True])
def test_a_model_key_that_is_no_name_is_a_config_error(model: object) -> None:
    with pytest.raises(ConfigError) as refused:
        served_model({"kvtier.model": model})
    assert "kvtier.model" in str(refused.value)


@pytest.mark.parametrize("model", [7, "", "m" * 1025, None, {"a": 1}])
def test_a_reply_whose_model_is_no_name_is_a_reply_error(server: Server, model: object) -> None:
    body = server.get("/v1/pools").json()
    assert replies.pools(copy.deepcopy(body)).layout.model_name == "tiny"
    body["layout"]["model"] = model
    with pytest.raises(ReplyError) as refused:
        replies.pools(body)
    assert "pools.layout.model" in str(refused.value)


def test_a_reply_without_a_model_is_an_older_servers_and_named_served(server: Server) -> None:
    body = server.get("/v1/pools").json()
    del body["layout"]["model"]
    assert replies.pools(body).layout.model_name == "served"
