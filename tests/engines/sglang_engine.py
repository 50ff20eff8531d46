"""One SGLang HiCache controller in one process, for the storage backend tests (issue 15):
SGLang's real `MHATokenToKVPool`, `MHATokenToKVPoolHost` and `HiCacheController` on CPU (a
one-process gloo group, the parallel state stamped to one rank), the backend loaded by SGLang's
`StorageBackendFactory` from `--hicache-storage-backend dynamic`'s extra config.

    PYTHONPATH=.engines/sglang:tests/engines/placeholders \
        python tests/engines/sglang_engine.py '<json>'

prints one JSON line. `mode: "write"`: host pages filled with KV that is a function of (`seed`,
position), backed up by SGLang's own backup thread (`write_storage`, keys from SGLang's
`get_hash_str`). `mode: "read"`: SGLang's prefetch threads ask kvtier for `tokens`
(`batch_exists`, then `batch_get_v1` into host slots the test allocates, as the scheduler
does); the pages that came are compared with what the writer wrote (`bit_exact`). The KV is
written and read slot by slot through SGLang's documented buffer dims for `layout`, code of its
own, not kvtier's copies. `held`: the reader holds the first `held` pages already and asks
for the rest with their keys as prefix keys (`hicache_storage_pass_prefix_keys`), so the
backend loads from past them (`load(start=)`). `dtype`: the pools' dtype (float16 by
default). `pause`: once the backend registered, print `registered` and wait for a line on
stdin before the write or read (the test replaces the sidecar meanwhile). `extra`: more of
the backend's extra config. `mla`: SGLang's MLA pools (`MLATokenToKVPool`,
`MLATokenToKVPoolHost`: one latent of `LATENT` values per token and layer), written and read
through their own documented dims. `dtype` of fp8 (`float8_e4m3fn`): SGLang keeps the KV's
bytes in uint8 pools, and the test writes and compares those bytes. `heads`: KV heads (2 by
default, as many as layers).
`clear`: after the write, the backend's `clear()` as SGLang's controller calls it for "clear
HiCache storage" (`cleared`: None, or its error).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

LAYERS, HEADS, DIM, PAGE = 2, 2, 64, 8  # kvtier's tiny test layout; SGLang pages of 8 tokens
SHAPE = {"heads": HEADS}  # the KV heads (`heads`: another count than the layers')
LATENT = 512 + 64  # an MLA model's value per token and layer: kv_lora_rank + qk_rope_head_dim


def kv_at(seed: int, position: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The KV of the token at `position`: `[2, layers, heads, dim]`."""
    gen = torch.Generator().manual_seed(seed * 100_003 + position)
    return torch.randn((2, LAYERS, SHAPE["heads"], DIM), generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes: compared bit for bit (-0.0 is not 0.0)."""
    return t.contiguous().view(torch.uint8)


def latent_at(seed: int, position: int, dtype: torch.dtype) -> torch.Tensor:
    """An MLA model's latent of the token at `position`: `[layers, LATENT]`."""
    gen = torch.Generator().manual_seed(seed * 100_003 + position)
    return torch.randn((LAYERS, LATENT), generator=gen).to(dtype)


def latent_view(buffer: torch.Tensor, layout: str, layer: int, slot: int) -> torch.Tensor:
    """One slot's latent of `layer` in an MLA host pool, by SGLang's dims."""
    page, at = divmod(slot, PAGE)
    if layout == "layer_first":  # [layers, slots, 1, C]
        return buffer[layer, slot, 0]
    if layout == "page_first":  # [slots, layers, 1, C]
        return buffer[slot, layer, 0]
    if layout == "page_first_direct":  # [pages, layers, page, 1, C]
        return buffer[page, layer, at, 0]
    return buffer[page, layer, at]  # page_unified: [pages, layers, page, C]


def slot_view(buffer: torch.Tensor, layout: str, kv: int, layer: int, slot: int) -> torch.Tensor:
    """One slot's `[heads, dim]` of K (kv 0) or V (kv 1) of `layer`, by SGLang's dims."""
    page, at = divmod(slot, PAGE)
    if layout == "layer_first":  # [2, layers, slots, heads, dim]
        return buffer[kv, layer, slot]
    if layout == "page_first":  # [2, slots, layers, heads, dim]
        return buffer[kv, slot, layer]
    if layout == "page_first_direct":  # [2, pages, layers, page, heads, dim]
        return buffer[kv, page, layer, at]
    return buffer[kv, page, :, at, layer]  # page_head: [2, pages, heads, page, layers, dim]


def controller(args: dict[str, Any]) -> tuple[Any, Any]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = getattr(torch, args.get("dtype", "float16"))
    pool = {"size": 256, "page_size": PAGE, "dtype": dtype, "layer_num": LAYERS, "device": "cpu",
            "enable_memory_saver": False}  # fmt: skip
    device: Any
    if args.get("mla"):  # one latent per token and layer; the host pool also counts layers
        device = MLATokenToKVPool(kv_lora_rank=512, qk_rope_head_dim=64, **pool)
        host_class, more = MLATokenToKVPoolHost, {"target_layer_num": LAYERS}
    else:
        SHAPE["heads"] = int(args.get("heads", HEADS))
        device = MHATokenToKVPool(head_num=SHAPE["heads"], head_dim=DIM, **pool)
        host_class, more = MHATokenToKVPoolHost, {}
    host = host_class(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE,
        args.get("layout", "page_first"), pin_memory=False, device="cpu",
        device_capacity_tokens=device.size, start_layer=device.start_layer,
        end_layer=device.end_layer, **more,
    )  # fmt: skip
    allocator = PagedTokenToKVPoolAllocator(
        size=256, page_size=PAGE, dtype=dtype, device="cpu", kvcache=device,
        need_sort=False,
    )  # fmt: skip
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "kvtier.url": args["url"],
        "kvtier.api_key": args["api_key"],
        **args.get("extra", {}),
    }
    cc = HiCacheController(allocator, host, PAGE, tp_group=dist.group.WORLD,
                           load_cache_event=threading.Event(), io_backend="direct",
                           storage_backend="dynamic", model_name="tiny",
                           storage_backend_extra_config=extra)  # fmt: skip
    return cc, host


def run(args: dict[str, Any]) -> dict[str, Any]:
    cc, host = controller(args)
    from sglang.srt.mem_cache.utils import get_hash_str

    backend = cc.storage_backend
    out: dict[str, Any] = {"backend": type(backend).__name__}
    tokens, seed, layout = list(args["tokens"]), int(args["seed"]), host.layout
    dtype = host.kv_buffer.dtype
    kv_dtype = getattr(torch, args.get("dtype", "float16"))  # the KV's, the pool's store dtype
    if args.get("pause"):
        print("registered", flush=True)
        sys.stdin.readline()
    if args["mode"] == "write":
        slots = host.alloc(len(tokens))
        for position, slot in enumerate(slots.tolist()):
            if args.get("mla"):
                latent = latent_at(seed, position, kv_dtype)
                latent = latent.view(torch.uint8) if dtype == torch.uint8 else latent
                for layer in range(LAYERS):
                    latent_view(host.kv_buffer, layout, layer, slot).copy_(latent[layer])
                continue
            value = kv_at(seed, position, kv_dtype)
            if dtype == torch.uint8:  # an fp8 cache, whose bytes SGLang keeps as uint8
                value = value.view(torch.uint8)
            for kv in (0, 1):
                for layer in range(LAYERS):
                    slot_view(host.kv_buffer, layout, kv, layer, slot).copy_(value[kv, layer])
        hashes = get_hash_str(tokens, None, page_size=PAGE)
        op_id = cc.write_storage(slots, tokens, hash_value=hashes)
        done = cc.ack_backup_queue.get(timeout=60)
        out.update(acked=done.id == op_id, completed_tokens=done.completed_tokens)
        if args.get("clear"):  # HybridCacheController.clear_storage_backend's call
            try:
                backend.clear()
                out["cleared"] = None
            except Exception as e:  # SGLang's storage attachment catches and reports it
                out["cleared"] = f"{type(e).__name__}: {e}"
    else:
        held = int(args.get("held", 0))  # pages this controller holds: passed as prefix keys
        hashes = get_hash_str(tokens, None, page_size=PAGE)
        if held:
            cc.prefetch("r", tokens[held * PAGE :], hashes[held - 1], prefix_keys=hashes[:held])
        else:
            cc.prefetch("r", tokens, last_hash=None)
        hit = cc.prefetch_hit_queue.get(timeout=60)
        out["hit_tokens"] = hit.storage_hit_count
        completed = 0
        if hit.storage_hit_count:
            hit.host_indices = host.alloc(hit.storage_hit_count)
            cc.prefetch_buffer.put(hit)
            while not (ack := cc.ack_prefetch_queue.get(timeout=60)).completed_req:
                completed += ack.completed_tokens
            slots = hit.host_indices[:completed].tolist()
            out["bit_exact"] = all(
                torch.equal(bits(latent_view(host.kv_buffer, layout, layer, slot)),
                            bits(latent_at(seed, held * PAGE + i, kv_dtype)[layer]))
                for i, slot in enumerate(slots) for layer in range(LAYERS)
            ) if args.get("mla") else all(
                torch.equal(bits(slot_view(host.kv_buffer, layout, kv, layer, slot)),
                            bits(kv_at(seed, held * PAGE + i, kv_dtype)[kv, layer]))
                for i, slot in enumerate(slots) for kv in (0, 1) for layer in range(LAYERS)
            )  # fmt: skip
        out["completed_tokens"] = completed
    out["stats"] = backend.stats
    cc.detach_storage_backend()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
