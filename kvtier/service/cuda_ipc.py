"""Sharing a CUDA gpu pool with a client process on the same host, through CUDA IPC.

The server exports its pool buffer's CUDA IPC handle (`export_pool`, as torch.multiprocessing
does when it sends a CUDA tensor to another process); the client opens it (`import_pool`) and
gets a tensor over the same device memory: leased pages are read in place, reserved slots
written in place. The server keeps the pool alive for as long as it serves, which CUDA IPC
requires of the exporter. The blob is a pickle of torch's own rebuild arguments, so a client
must trust its sidecar (it is the user's own process, reached over loopback).
Untested without a GPU: on a CPU-only machine there is nothing to export.
"""

from __future__ import annotations

import base64
import pickle

import torch
from torch.multiprocessing import reductions


def export_pool(buffer: torch.Tensor) -> str | None:
    """A CUDA buffer's IPC handle as base64 text, or None for a buffer not on CUDA."""
    if not buffer.is_cuda:
        return None
    _, args = reductions.reduce_tensor(buffer)  # type: ignore[no-untyped-call]
    return base64.b64encode(pickle.dumps(args)).decode()


def import_pool(blob: str) -> torch.Tensor:
    """The buffer that `export_pool` described, mapped into this process."""
    args = pickle.loads(base64.b64decode(blob))  # trusted: the user's own sidecar
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
    return tensor
