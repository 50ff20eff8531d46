"""The mover: plans and runs block copies between tiers (see `copy.py` and `handles.py`)."""

from kvtier.transfer.copy import InlineExecutor, Transfer, contiguous_runs
from kvtier.transfer.cuda import CudaExecutor
from kvtier.transfer.handles import Executor, TransferHandle
from kvtier.transfer.threads import ThreadExecutor

__all__ = [
    "CudaExecutor",
    "Executor",
    "InlineExecutor",
    "ThreadExecutor",
    "Transfer",
    "TransferHandle",
    "contiguous_runs",
]
