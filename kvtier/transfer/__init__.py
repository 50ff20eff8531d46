"""The mover: plans and runs block copies between tiers (see `copy.py` and `shared.py`)."""

from kvtier.kernels.block_copy import contiguous_runs
from kvtier.transfer.copy import InlineExecutor, Transfer
from kvtier.transfer.cuda import CudaExecutor
from kvtier.transfer.planner import BlockCopier, CopyKey, CopyPlanner
from kvtier.transfer.shared import Executor, TransferHandle
from kvtier.transfer.stepped import SteppedExecutor
from kvtier.transfer.threads import ThreadExecutor

__all__ = [
    "BlockCopier",
    "CopyKey",
    "CopyPlanner",
    "CudaExecutor",
    "Executor",
    "InlineExecutor",
    "SteppedExecutor",
    "ThreadExecutor",
    "Transfer",
    "TransferHandle",
    "contiguous_runs",
]
