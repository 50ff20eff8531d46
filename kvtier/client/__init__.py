"""Clients of the sidecar (`kvtier serve`): `Client` (threads) and `AsyncClient` (asyncio).

The embedded `KVStore`'s engine methods, with the same arguments, checks and result types, so
an engine moves between embedded and sidecar by configuration alone (the differences: the
operator's calls are the server's admin routes, `status()` takes no tenant, and with an API
key a call's tenant may only be the key's; README "The sidecar"). A client is its maker
process's: in a forked child every call is a `ClosedError`.

    with Client("http://127.0.0.1:8750", api_key=...) as kv:     # or KVStore(config)
        hit = kv.lookup(tokens)
        lease = kv.prefetch(tokens)            # READY when it returns (waited on the server)
        kv.release(lease)
        kv.store(tokens, kv_tensor)
        out = kv.load(tokens).kv

On the same host (`shared_memory=True`, the default) the client maps the server's memory pools from
/dev/shm: `store` reserves slots, writes the blocks straight into the mapped pool and commits;
`load` leases the prefix, copies the pages asked for (from `start` on) out of the mapped gpu pool
and owes the release, which rides on the next prefetch or reserve (`releases.py`); a copy not
surely within the lease's ttl is kept only once its release, sent at once, is answered, else
the prompt is loaded through the body (`held.py`). No KV byte
crosses the socket. Where the pools cannot be mapped (another host, a CUDA pool) or a call cannot
go that way (new blocks below a disk-only prefix, a prefix larger than the gpu tier), the KV
travels in the body instead. A CUDA gpu pool is opened through its CUDA IPC description
(`service/cuda_ipc.py`). `pool_buffer(tier)` is the mapped buffer, for an engine that reads leased
pages itself. Both clients then also send the small calls (lookup, prefetch, release, reserve,
commit, abort, a wait on a lease) over the server's local lane, a Unix socket past HTTP (`lane.py`;
about a third of an HTTP round trip), and stay on HTTP where they cannot reach it.

The client trusts nothing its server says (`service/replies.py`): every reply is checked before
it is used, and a malformed one is a `ReplyError` naming the field: a `/v1/pools` reply whose
layout, slot counts, shared-memory names or CUDA IPC descriptions are not what a kvtier server
sends fails `Client(url)` itself, and a lease or reservation whose slots fall outside the pools
is refused before anything is read or written, as is a reply of more tokens than were sent
or about another lease than the one waited on (`pools.py`). A well-formed pool that is not
there to map (another host, another user) or whose segment is not exactly the file its server
made (a symlink, another owner or mode, another size: `tiers/shm.py`) stays unmapped, and its
KV travels in the body. A status other than 2xx is never a success: a redirect is a
`ServiceError`, not followed.

Errors come back as the same `kvtier.errors` types the store raises (their message is the
server's), plus `ServiceError` for what has no store equivalent (auth, limits, not ready), and
`TransportError` when the server cannot be reached or its reply read (both clients), and
`WaitTimeoutError` for a lease a server keeps pending past the client's bound on a wait
(`transport.WaitPacer`).

    blocking.py      `Client`: the calls from threads, over `connections.py`'s keep-alive
                     connections (the standard library's http.client)
    asynchronous.py  `AsyncClient`: the same calls as coroutines (httpx)
    loops.py         `EventLoopOf`: the event loop an `AsyncClient` belongs to (another
                     loop's calls refused)
    mapper.py        `Mapper` / `AsyncMapper`: a client's server pools and lane, taken again
                     from a restarted server (its instance id); a failed re-map retried
    pools.py         `MappedPools`: the server's pools mapped here, blocks written and read,
                     only for the slots of replies of the server instance mapped
    lane.py          `LaneConnections` / `AsyncLaneConnections`: the clients' connections to
                     the server's local lane (at most `MOST_CALLS` calls of a client on it)
    lane_slots.py    `Slots`: a client's `MOST_CALLS` slots of the lane, and the short calls
                     in line for one (up to `SLOT_WAIT_S`, then HTTP)
    lane_frames.py   the lane's name and frames as a client reads them (untrusted)
    held.py          `LeaseFrom`: a load's lease, and until when it surely holds its slots
                     (a copy out of the mapped pool is kept only if it did)
    releases.py      `OwedReleases`: the releases of loads, carried by later requests, and
                     the request tokens of prefetches and reserves whose replies were lost
    owing.py         `Owing` / `AsyncOwing`: sending what is owed (a flusher thread or task,
                     before the next prefetch or reserve, at `close()`)
    calls.py         `Calls`: the calls under way that `close()` waits for, and the process
                     that made the client (a fork's calls refused)
    arguments.py     the checks of a call's and a constructor's arguments, before a request
    sending.py       `Sender`: `Client`'s requests (`AsyncSender`: `AsyncClient`'s checks)
    transport.py     request headers, and a response read as its body or the error it reports
                     (`alone_post`: `AsyncClient`'s give-back on a connection of its own)
"""

from kvtier.client.asynchronous import AsyncClient
from kvtier.client.blocking import Client
from kvtier.client.connections import TransportError
from kvtier.client.transport import ServiceError, WaitTimeoutError

__all__ = ["AsyncClient", "Client", "ServiceError", "TransportError", "WaitTimeoutError"]
