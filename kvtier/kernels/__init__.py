"""Kernels over the gpu pool: paged attention (`attention.PagedAttention`, the checked entry;
`paged_attention`, the Triton kernels; `reference`, plain torch) and batched block copies
(`block_copy`). Importing this package does not import Triton; `paged_attention` does, if
it is installed."""
