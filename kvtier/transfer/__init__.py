"""The mover: plans and runs block copies between tiers (see `copy.py`)."""

from kvtier.transfer.copy import InlineExecutor, Transfer, contiguous_runs

__all__ = ["InlineExecutor", "Transfer", "contiguous_runs"]
