"""Sharing a CUDA gpu pool with a client process on the same host, through CUDA IPC.

The server describes its pool buffer's CUDA storage as plain data (`export_pool`); the client
checks every field of that description (`parse_description`) and opens the memory from it
(`import_pool`): a tensor over the same device memory, so leased pages are read in place and
reserved slots written in place. The server keeps the pool alive for as long as it serves,
which CUDA IPC requires of the exporter.

The description is data only, never code (no pickle: a hostile server must not run anything in
its client). JSON and msgpack carry it alike; bytes travel as base64 text:

    {"device": 0,                          CUDA device index
     "handle": "<base64>",                 the allocation's IPC handle: 64 bytes, or torch's
                                           versioned form, 2 + 64 bytes ('c': cudaMalloc)
     "storage_size": n, "storage_offset": k,   bytes of the storage, and its offset in the
                                               allocation
     "ref_counter": "/torch_<pid>_<n>_<n>",    torch's shared reference-counter file, and the
     "ref_counter_offset": i,                  counter's index in it (< 10000)
     "event": "<base64>", "event_sync_required": bool,   the producer's IPC event (64 bytes)
     "dtype": "bfloat16", "shape": [num_slots, *block_shape]}        contiguous, offset 0

`parse_description` accepts exactly these keys with these types and ranges, a dtype and a
shape equal to what the layout expects, and a storage of exactly shape * itemsize bytes;
anything else is a `ReplyError` naming the field, and nothing is opened. The tuple handed to
torch's own `rebuild_cuda_tensor` is built here from checked values.
Runs only where CUDA is present; `tests/test_cuda_ipc.py` has the CPU checks and a GPU test.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing import reductions

from kvtier.blocks import DTYPES
from kvtier.errors import ReplyError

IPC_HANDLE_BYTES = 64
"""sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)."""
_CUDA_MALLOC = ord("c")  # the type byte of torch's versioned handle for a cudaMalloc block
REF_COUNTER = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
REF_COUNTER_SLOTS = 10_000
"""CUDA_IPC_REF_COUNTER_FILE_SIZE (torch/csrc/CudaIPCTypes.h): counters in one file."""
_MAX_BYTES = 1 << 50
_KEYS = frozenset(
    {
        "device", "handle", "storage_size", "storage_offset", "ref_counter",
        "ref_counter_offset", "event", "event_sync_required", "dtype", "shape",
    }
)  # fmt: skip
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class CudaIpcDescription:
    """A checked description of a CUDA pool buffer (`parse_description`)."""

    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync_required: bool
    dtype: torch.dtype
    shape: tuple[int, ...]


def export_pool(buffer: torch.Tensor) -> dict[str, Any] | None:
    """The description of a CUDA pool buffer (module docstring), or None for one not on CUDA."""
    if not buffer.is_cuda:
        return None
    assert buffer.is_contiguous() and buffer.storage_offset() == 0, "a pool buffer is whole"
    device, handle, size, offset, counter, counter_offset, event, sync = (
        buffer.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
    )
    return {
        "device": device,
        "handle": base64.b64encode(handle).decode(),
        "storage_size": size,
        "storage_offset": offset,
        "ref_counter": counter.decode(),
        "ref_counter_offset": counter_offset,
        "event": base64.b64encode(event).decode(),
        "event_sync_required": sync,
        "dtype": _DTYPE_NAMES[buffer.dtype],
        "shape": list(buffer.shape),
    }


def parse_description(data: object, dtype_name: str, shape: tuple[int, ...]) -> CudaIpcDescription:
    """`data` checked as the description of a pool of `dtype_name` and `shape`; `ReplyError`
    naming the first field that is wrong."""
    if not isinstance(data, dict):
        raise ReplyError(f"cuda_ipc: got {type(data).__name__}, expected a map of {sorted(_KEYS)}")
    if set(data) != _KEYS:
        raise ReplyError(f"cuda_ipc: keys {sorted(map(str, data))}, expected {sorted(_KEYS)}")
    if data["dtype"] != dtype_name:
        raise ReplyError(f"cuda_ipc.dtype: got {data['dtype']!r}, expected {dtype_name!r}")
    if data["shape"] != list(shape):
        raise ReplyError(f"cuda_ipc.shape: got {data['shape']!r}, expected {list(shape)}")
    dtype = DTYPES[dtype_name]
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if _int(data, "storage_size", _MAX_BYTES) != nbytes:
        raise ReplyError(f"cuda_ipc.storage_size: got {data['storage_size']}, expected {nbytes}")
    handle = _bytes(data, "handle")
    versioned = len(handle) == 2 + IPC_HANDLE_BYTES and handle[1] == _CUDA_MALLOC
    if len(handle) != IPC_HANDLE_BYTES and not versioned:
        raise ReplyError(
            f"cuda_ipc.handle: got {len(handle)} bytes, expected {IPC_HANDLE_BYTES} (or "
            f"{2 + IPC_HANDLE_BYTES} in torch's versioned form of a cudaMalloc block)"
        )
    event = _bytes(data, "event")
    if len(event) != IPC_HANDLE_BYTES:
        raise ReplyError(f"cuda_ipc.event: got {len(event)} bytes, expected {IPC_HANDLE_BYTES}")
    counter = data["ref_counter"]
    if not isinstance(counter, str) or REF_COUNTER.fullmatch(counter) is None:
        raise ReplyError(f"cuda_ipc.ref_counter: got {counter!r}, expected '/torch_<pid>_<n>_<n>'")
    if type(data["event_sync_required"]) is not bool:
        raise ReplyError(
            f"cuda_ipc.event_sync_required: got {data['event_sync_required']!r}, expected a bool"
        )
    return CudaIpcDescription(
        device=_int(data, "device", 1 << 16),
        handle=handle,
        storage_size=nbytes,
        storage_offset=_int(data, "storage_offset", _MAX_BYTES),
        ref_counter=counter.encode(),
        ref_counter_offset=_int(data, "ref_counter_offset", REF_COUNTER_SLOTS - 1),
        event=event,
        event_sync_required=data["event_sync_required"],
        dtype=dtype,
        shape=shape,
    )


def import_pool(description: CudaIpcDescription) -> torch.Tensor:
    """The buffer that `description` describes, opened in this process (CUDA only)."""
    count = torch.cuda.device_count()
    if description.device >= count:
        raise ReplyError(
            f"cuda_ipc.device: got {description.device}, expected a device index below {count}"
        )
    strides, step = [], 1
    for size in reversed(description.shape):
        strides.append(step)
        step *= size
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor,
        torch.Size(description.shape),
        tuple(reversed(strides)),
        0,
        torch.UntypedStorage,
        description.dtype,
        description.device,
        description.handle,
        description.storage_size,
        description.storage_offset,
        False,
        description.ref_counter,
        description.ref_counter_offset,
        description.event,
        description.event_sync_required,
    )
    return tensor


def _int(data: dict[str, Any], field: str, maximum: int) -> int:
    value = data[field]
    if type(value) is not int or not 0 <= value <= maximum:
        raise ReplyError(f"cuda_ipc.{field}: got {value!r}, expected an int in [0, {maximum}]")
    return value


def _bytes(data: dict[str, Any], field: str) -> bytes:
    value = data[field]
    if isinstance(value, str) and len(value) <= 4 * IPC_HANDLE_BYTES:
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            pass
    shown = value[:40] if isinstance(value, str | bytes) else value
    raise ReplyError(f"cuda_ipc.{field}: got {shown!r}, expected base64 text of a short handle")
