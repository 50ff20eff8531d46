"""The CUDA IPC description of a gpu pool is data, checked field by field, never unpickled
(issue 11.6).

On every machine: `parse_description` refuses each hostile field with a `ReplyError` naming
it, a description carrying a pickle payload (as the whole description, as a field, or as an
extra key) is refused and nothing runs, a client of a fake server refuses such a `/v1/pools`
reply, and no module of the package imports pickle. With CUDA (`gpu` marker): a pool exported
in this process is opened in a child process, which reads it and writes through it, and a real
`kvtier serve` with its gpu tier on CUDA serves a `Client` that maps that pool.
"""

from __future__ import annotations

import ast
import base64
import json
import math
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from fake_server import fake_servers
from service_server import (
    BLOCK_BYTES,
    BT,
    DIM,
    HEADS,
    LAYERS,
    kv_of,
    running,
    tokens_of,
    write_config,
)

import kvtier
from kvtier.client import Client
from kvtier.errors import ReplyError
from kvtier.service.cuda_ipc import (
    IPC_HANDLE_BYTES,
    REF_COUNTER_SLOTS,
    export_pool,
    parse_description,
)

CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (torch.cuda.is_available() is false)")

SLOTS = 4
SHAPE = (SLOTS, LAYERS, 2, BT, HEADS, DIM)
NBYTES = math.prod(SHAPE) * 2  # float16


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def description(**fields: Any) -> dict[str, Any]:
    """A well-formed description of a float16 pool of `SHAPE` (handles of the right sizes)."""
    good = {
        "device": 0,
        "handle": b64(bytes([2, ord("c")]) + bytes(IPC_HANDLE_BYTES)),
        "storage_size": NBYTES,
        "storage_offset": 0,
        "ref_counter": "/torch_4242_1234567_0",
        "ref_counter_offset": 3,
        "event": b64(bytes(IPC_HANDLE_BYTES)),
        "event_sync_required": True,
        "dtype": "float16",
        "shape": list(SHAPE),
    }
    return {**good, **fields}


class _Payload:
    """Unpickling this creates `marker`: proof that a description ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.fixture
def payload(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A base64 pickle payload and the file that its unpickling would create."""
    marker = tmp_path / "the-payload-ran"
    yield b64(pickle.dumps(_Payload(marker))), marker
    assert not marker.exists(), "a pickle payload was executed"


def test_a_well_formed_description_parses_to_exactly_its_values() -> None:
    parsed = parse_description(description(), "float16", SHAPE)
    assert parsed.handle == bytes([2, ord("c")]) + bytes(IPC_HANDLE_BYTES)
    assert parsed.event == bytes(IPC_HANDLE_BYTES)
    assert (parsed.device, parsed.storage_size, parsed.storage_offset) == (0, NBYTES, 0)
    assert (parsed.ref_counter, parsed.ref_counter_offset) == (b"/torch_4242_1234567_0", 3)
    assert (parsed.dtype, parsed.shape, parsed.event_sync_required) == (
        torch.float16,
        SHAPE,
        True,
    )
    raw = description(handle=b64(bytes(IPC_HANDLE_BYTES)))  # torch's unversioned form
    assert parse_description(raw, "float16", SHAPE).handle == bytes(IPC_HANDLE_BYTES)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("handle", b64(bytes(10))),
        ("handle", b64(bytes(IPC_HANDLE_BYTES + 1))),
        ("handle", b64(bytes([2, ord("e")]) + bytes(IPC_HANDLE_BYTES))),  # not cudaMalloc
        ("handle", "not base64!"),
        ("handle", "A" * 10_000),
        ("handle", ["AAAA"]),
        ("event", b64(bytes(IPC_HANDLE_BYTES - 1))),
        ("event", None),
        ("ref_counter", "/etc/passwd"),
        ("ref_counter", "/torch_1_2_3/../../etc/passwd"),
        ("ref_counter", "torch_1_2_3"),
        ("ref_counter", 7),
        ("ref_counter_offset", REF_COUNTER_SLOTS),
        ("ref_counter_offset", -1),
        ("ref_counter_offset", True),
        ("ref_counter_offset", 1.0),
        ("storage_size", NBYTES - 1),
        ("storage_size", NBYTES + 2),
        ("storage_size", str(NBYTES)),
        ("storage_offset", -1),
        ("storage_offset", 0.5),
        ("device", -1),
        ("device", "0"),
        ("device", False),
        ("device", 1 << 20),
        ("event_sync_required", "yes"),
        ("event_sync_required", 1),
        ("dtype", "float32"),
        ("dtype", ["float16"]),
        ("shape", [SLOTS + 1, *SHAPE[1:]]),
        ("shape", [SLOTS, *SHAPE[1:], 1]),
        ("shape", "SHAPE"),
    ],
)
def test_each_hostile_field_is_a_reply_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ReplyError) as refused:
        parse_description(description(**{field: value}), "float16", SHAPE)
    assert f"cuda_ipc.{field}:" in str(refused.value)


@pytest.mark.parametrize("where", ["whole", "handle", "event", "ref_counter", "extra key"])
def test_a_pickle_payload_anywhere_is_refused_and_nothing_runs(
    payload: tuple[str, Path], where: str
) -> None:
    blob, marker = payload
    data: object = {
        "whole": blob,  # the old form: a base64 pickle of torch's rebuild arguments
        "handle": description(handle=blob),
        "event": description(event=blob),
        "ref_counter": description(ref_counter=blob),
        "extra key": {**description(), "rebuild": blob},
    }[where]
    with pytest.raises(ReplyError, match="cuda_ipc"):
        parse_description(data, "float16", SHAPE)
    assert not marker.exists()


def test_a_client_refuses_a_pools_reply_carrying_a_pickle(payload: tuple[str, Path]) -> None:
    blob, marker = payload
    layout = {
        "dtype": "float16",
        "block_shape": list(SHAPE[1:]),
        "block_bytes": BLOCK_BYTES,
        "block_tokens": BT,
    }
    pool = {"tier": "gpu", "device": "cuda:0", "num_slots": SLOTS, "cuda_ipc": blob}
    with fake_servers() as fake:
        server = fake(pools=(200, {"layout": layout, "pools": [pool]}))
        with pytest.raises(ReplyError, match=r"pools|cuda_ipc"):
            Client(server.url)
    assert not marker.exists()


def test_no_module_of_the_package_can_unpickle() -> None:
    """No import of pickle (or its kin) and no `torch.load` anywhere in the package."""
    forbidden = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    forbidden.add("torch.load")
    found = []
    for path in sorted(Path(kvtier.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                modules = {(node.module or "").split(".")[0]}
            elif isinstance(node, ast.Attribute) and node.attr == "load":
                on_torch = isinstance(node.value, ast.Name) and node.value.id == "torch"
                modules = {"torch.load"} if on_torch else set()
            else:
                continue
            found += [
                f"{path.name}:{node.lineno} {m}" for m in modules & (forbidden | {"torch.load"})
            ]
    assert found == []


# ---- on a GPU ---------------------------------------------------------------------------------

CHILD = """
import json, sys, torch
from kvtier.service.cuda_ipc import import_pool, parse_description
data = json.load(sys.stdin)
pool = import_pool(parse_description(data["description"], "float16", tuple(data["shape"])))
print(json.dumps({"device": str(pool.device), "slot0": float(pool[0].float().sum())}))
pool[1] = 7.0
torch.cuda.synchronize()
"""


@gpu_only
@pytest.mark.gpu
def test_a_pool_exported_here_is_read_and_written_by_a_child_process() -> None:
    buffer = torch.zeros(SHAPE, dtype=torch.float16, device="cuda")
    buffer[0] = 1.0
    torch.cuda.synchronize()
    exported = export_pool(buffer)
    assert exported is not None
    request = json.dumps({"description": exported, "shape": list(SHAPE)})
    child = subprocess.run(
        [sys.executable, "-c", CHILD], input=request, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen == {"device": "cuda:0", "slot0": float(math.prod(SHAPE[1:]))}
    torch.cuda.synchronize()
    assert bool((buffer[1] == 7.0).all()) and bool((buffer[2:] == 0).all())
    assert bool((buffer[0] == 1.0).all())


@gpu_only
@pytest.mark.gpu
def test_a_client_maps_a_cuda_gpu_pool_of_a_real_server(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["tiers"]["gpu"]["device"] = "cuda:0"
    config.write_text(yaml.safe_dump(data))
    tokens, kv = tokens_of(0, 4 * BT), kv_of(4 * BT, 7)
    with running(config) as server:
        with Client(server.url) as client:
            pool = client.pool_buffer("gpu")
            assert pool is not None and pool.is_cuda
            assert client.store(tokens, kv).stored_tokens == 4 * BT
            assert client.load(tokens).kv.equal(kv)
        with Client(server.url, shared_memory=False) as body:
            assert body.load(tokens).kv.equal(kv)  # what was written in place is served
